"""MixedPrecisionOptimizer: bf16/fp16 model parameters stepped through fp32 main copies.

Each 16-bit parameter gets an fp32 main copy that the torch optimizer steps; its gradient is
the model gradient (DDP's fp32 `main_grad`, or the 16-bit `.grad`) as fp32. After a
successful step the main copies are rounded back into the model. fp32 parameters of the same
model are stepped in place, as in FP32Optimizer.
"""

from typing import Optional

import torch

from megatron_eopt.wrappers.fp32 import FP32Optimizer, model_grad

HALF_DTYPES = (torch.float16, torch.bfloat16)


class MixedPrecisionOptimizer(FP32Optimizer):
    """FP32Optimizer for models whose parameters are bf16 or fp16 (same arguments)."""

    def _make_main_param(self, param: torch.nn.Parameter) -> torch.nn.Parameter:
        if param.dtype == torch.float32:
            return param
        if param.dtype not in HALF_DTYPES:
            raise TypeError(
                f"MixedPrecisionOptimizer steps float32, bfloat16 or float16 parameters; got "
                f"{param.dtype}."
            )
        return torch.nn.Parameter(param.detach().clone().float())

    def _half_pairs(self) -> list[tuple[torch.nn.Parameter, torch.nn.Parameter]]:
        return [(model, main) for model, main in zip(self.model_params, self.main_params) if model is not main]

    def _prepare_main_grads(self) -> None:
        super()._prepare_main_grads()  # fp32 parameters: main_grad -> grad
        for model, main in self._half_pairs():
            grad = model_grad(model)
            main.grad = None if grad is None else grad.float()
            if not hasattr(model, "main_grad"):
                model.grad = None  # the fp32 copy replaces it; free the 16-bit one

    def _copy_main_params_to_model(self) -> None:
        with torch.no_grad():
            for model, main in self._half_pairs():
                model.copy_(main)

    def reload_model_params(self, state_dict: Optional[dict] = None) -> None:
        with torch.no_grad():
            for model, main in self._half_pairs():
                main.copy_(model)

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["main_params"] = {self.fqn_of_main[id(main)]: main.detach() for _, main in self._half_pairs()}
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        # A checkpoint without fp32 main copies (saved by an fp32 run) keeps the copies made
        # from the model parameters, which then hold the same values.
        saved = state_dict.get("main_params") or {}
        with torch.no_grad():
            for _, main in self._half_pairs():
                fqn = self.fqn_of_main[id(main)]
                if fqn in saved:
                    main.copy_(saved[fqn])
