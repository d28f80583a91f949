"""MixedPrecisionOptimizer: bf16/fp16 model parameters stepped through fp32 main weights.

Each 16-bit parameter gets an fp32 main parameter that the torch optimizer steps; its gradient
is the model gradient (DDP's fp32 `main_grad`, or the 16-bit `.grad`) as fp32. After a
successful step the main weights are rounded back into the model. fp32 parameters of the same
model are stepped in place, as in FP32Optimizer. Between steps the main weights are held as
`storage` says (wrappers/main_param_storage.py): fp32 copies, or with the precision-aware
optimizer the bf16 parameter plus a 16-bit remainder, or the 16-bit parameter alone.
"""

from typing import Any, Iterator, Optional, Sequence

import torch

from megatron_eopt.wrappers.fp32 import FP32Optimizer, model_grad
from megatron_eopt.offload.offload_to_cpu import tensors_in
from megatron_eopt.wrappers.main_param_storage import Fp32Copies, OnHost, main_param_storage_for

HALF_DTYPES = (torch.float16, torch.bfloat16)


class MixedPrecisionOptimizer(FP32Optimizer):
    """FP32Optimizer for models whose parameters are bf16 or fp16 (same arguments)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.storage = main_param_storage_for(self.config) or Fp32Copies()
        if self.host_state is not None:  # the offloaded parameters' main weights on the host
            offloaded = {id(self.model_params[i]) for i in self.host_state.indices}
            self.storage = OnHost(self.storage, offloaded, pin=self.config.pin_cpu_params)
        for model, main in self._half_pairs():  # the inner optimizer was built over fp32 copies
            self.storage.set(self._weights(model), main, main.detach())

    def _make_main_param(self, param: torch.nn.Parameter) -> torch.nn.Parameter:
        if param.dtype == torch.float32:
            return param
        if param.dtype not in HALF_DTYPES:
            raise TypeError(
                f"MixedPrecisionOptimizer steps float32, bfloat16 or float16 parameters; got "
                f"{param.dtype}."
            )
        return torch.nn.Parameter(param.detach().clone().float())

    def _owned_tensors(self) -> Iterator[torch.Tensor]:
        yield from super()._owned_tensors()
        yield from tensors_in(vars(self.storage))  # what it keeps between steps (Remainders' int16 remainders)

    def _half_pairs(self) -> list[tuple[torch.nn.Parameter, torch.nn.Parameter]]:
        """(16-bit model parameter, its fp32 main parameter) pairs; fp32 parameters are stepped in place."""
        return self._half_pairs_at(range(len(self.model_params)))

    def _weights(self, model: torch.nn.Parameter) -> torch.Tensor:
        """The tensor holding `model`'s 16-bit values, which `storage` reads and writes: the parameter
        itself here; its local shard for a DTensor-sharded model (distributed/fsdp2.py)."""
        return model

    def _prepare_main_grads(self) -> None:
        super()._prepare_main_grads()  # fp32 parameters: main_grad -> grad
        for model, main in self._half_pairs():
            grad = model_grad(model)
            main.grad = None if grad is None else grad.float()
            if not hasattr(model, "main_grad"):
                model.grad = None  # the fp32 copy replaces it; free the 16-bit one

    def _half_pairs_at(self, indices: Sequence[int]) -> list[tuple[torch.nn.Parameter, torch.nn.Parameter]]:
        """`_half_pairs()` of the parameters at `indices` (a window of the offloaded step)."""
        pairs = [(self.model_params[i], self.main_params[i]) for i in indices]
        return [(model, main) for model, main in pairs if model.dtype in HALF_DTYPES]

    def _materialize_main_params(self, indices: Sequence[int]) -> None:
        for model, main in self._half_pairs_at(indices):  # fp32 main weights for the update
            self.storage.materialize(self._weights(model), main)

    def _copy_main_params_to_model(self, indices: Sequence[int]) -> None:
        for model, main in self._half_pairs_at(indices):
            self.storage.store(self._weights(model), main)

    def fp32_main_params(self) -> list[torch.Tensor]:
        return [self.storage.value(self._weights(model), main) if model.dtype in HALF_DTYPES else main.detach()
                for model, main in zip(self.model_params, self.main_params)]

    def set_main_params(self, values: dict[int, torch.Tensor]) -> None:
        for model, main in self._half_pairs():
            if id(model) in values:
                self.storage.set(self._weights(model), main, values[id(model)])

    def main_param_bytes(self) -> int:
        return sum(self.storage.nbytes(self._weights(model), main) for model, main in self._half_pairs())

    def reload_model_params(self, state_dict: Optional[dict] = None) -> None:
        for model, main in self._half_pairs():
            weights = self._weights(model)
            self.storage.set(weights, main, weights.detach().float())

    def local_state_dict(self) -> dict:
        state = super().local_state_dict()
        # fp32 main weights whatever the storage, so checkpoints stay interchangeable.
        state["main_params"] = {self.fqn_of_main[id(main)]: self.storage.value(self._weights(model), main)
                                for model, main in self._half_pairs()}
        return state

    def _load_main_params(self, saved: dict[int, torch.Tensor]) -> None:
        # A checkpoint without fp32 main weights (saved by an fp32 run) keeps the main weights
        # made from the model parameters (remainders: the model parameters exactly).
        with torch.no_grad():
            for model, main in self._half_pairs():
                weights = self._weights(model)
                if id(model) in saved:
                    self.storage.set(weights, main, saved[id(model)])
                elif not self.storage.holds_fp32:
                    self.storage.set(weights, main, weights.detach().float())
