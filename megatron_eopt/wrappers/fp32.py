"""FP32Optimizer: a torch optimizer stepping fp32 model parameters in place.

Gradients are read from `param.main_grad` when megatron-core's DDP created it (its fp32
gradient buffer), else from `param.grad`. The gradient norm counts a parameter that every
tensor-parallel rank holds in full (not `tensor_model_parallel`) on one rank only, skips the
second copy of tied parameters (`shared`), and is summed over the model-parallel group.
"""

import contextlib
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from megatron_eopt.params.groups import ParamRecord
from megatron_eopt.registry import init_torch_state
from megatron_eopt.runtime.process_groups import ProcessGroup, group_rank
from megatron_eopt.checkpointable.child import ChildParam
from megatron_eopt.wrappers.base import (
    MegatronOptimizer,
    SteppableChild,
    StepResult,
    counts_in_norm,
    default_device,
    take_step,
    timed,
)
from megatron_eopt.wrappers.flat_state import (
    canonical_state_layout,
    flat_state_dict,
    load_flat_state_dict,
    torch_state_dict_from_flat,
)
from megatron_eopt.wrappers.grad_stats import (
    check_grad_norm_group,
    LocalStats,
    grad_norm_group_of,
    local_grad_stats,
)
from megatron_eopt.megatron_core_formats.fsdp_dtensor import (
    asks_for_fsdp_dtensor,
    flat_from_fsdp_dtensor,
    fsdp_dtensor_state_dict,
    is_fsdp_dtensor_state,
    live_scalar_types,
    local_values,
    renamed,
)
from megatron_eopt.megatron_core_formats.layouts import core_format_in
from megatron_eopt.megatron_core_formats.dist_checkpointing import (
    chain_sharded_state_dict,
    expand_v1_sharded_state_dict,
    unpack_core_state_dict,
)
from megatron_eopt.offload.offload_to_cpu import HostCopies, tensors_in
from megatron_eopt.offload.host_resident import HostResidentState, offloaded_indices
from megatron_eopt.wrappers.qk_clip import QKClip
from megatron_eopt.wrappers.state_precision import StatePrecision
from megatron_eopt.wrappers.step_phases import StepPhases

MakeOptimizer = Callable[[list[dict]], torch.optim.Optimizer]


@contextlib.contextmanager
def narrowed_param_groups(optimizer: torch.optim.Optimizer, params: Optional[list]) -> Iterator[None]:
    """Inside: `optimizer`'s param groups hold only `params` (None: all), in their order."""
    if params is None:
        yield
        return
    kept = {id(p) for p in params}
    saved = [group["params"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) in kept]
    try:
        yield
    finally:
        for group, params_of_group in zip(optimizer.param_groups, saved):
            group["params"] = params_of_group


def model_grad(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """The gradient megatron-core's DDP accumulated (`main_grad`), else the autograd one."""
    if hasattr(param, "main_grad"):
        return param.main_grad
    return param.grad


class FP32Optimizer(StepPhases, MegatronOptimizer, SteppableChild):
    """Wraps a torch optimizer over fp32 parameters with megatron-core's optimizer contract.

    Args:
        param_groups: groups of model parameters (from `build_param_groups`).
        make_optimizer: builds the torch optimizer from groups of the parameters it steps.
        config: the OptimizerConfig (clipping, skipping, zero counting).
        records: the ParamRecord of every parameter in `param_groups`.
        tp_group: tensor-parallel group of these parameters (expert TP for experts).
        norm_groups: groups over which the squared gradient norm is summed, one after the
            other (model-parallel; data-parallel owners first for the layer-wise optimizer).
        name: this optimizer's name inside a chain (and in checkpoints).
        grad_scaler: loss scaler (fp16 only), or None.
        state_precision: the stored dtypes of reduced-precision state (wrappers/state_precision.py),
            or None for fp32 state.
        qk_clip: QK-clip (wrappers/qk_clip.py), which scales the main copies after each update,
            or None. The chain measures the maxima in its step; every child of it gets the same.

    Checkpoints read it through CheckpointableChild's methods (checkpointable/child.py) only.
    """

    def __init__(
        self,
        param_groups: list[dict],
        make_optimizer: MakeOptimizer,
        config: Any,
        records: list[ParamRecord],
        tp_group: Optional[ProcessGroup],
        norm_groups: Sequence[Optional[ProcessGroup]],
        name: str = "dense",
        grad_scaler: Any = None,
        state_precision: Optional[StatePrecision] = None,
        qk_clip: Optional[QKClip] = None,
    ) -> None:
        self.config = config
        self.state_precision = state_precision
        self.name = name
        self.grad_scaler = grad_scaler
        self._norm_groups = tuple(norm_groups)
        self.model_params = [p for group in param_groups for p in group["params"]]
        self.main_params = [self._make_main_param(p) for p in self.model_params]
        main_of = {id(model): main for model, main in zip(self.model_params, self.main_params)}
        self.optimizer = make_optimizer(
            [{**group, "params": [main_of[id(p)] for p in group["params"]]} for group in param_groups]
        )
        record_of = {id(r.param): r for r in records}
        missing = [p for p in self.model_params if id(p) not in record_of]
        if missing:
            raise ValueError(f"{len(missing)} parameters in param_groups have no ParamRecord.")
        ordered = [record_of[id(p)] for p in self.model_params]
        self.records = ordered  # parallel to model_params and main_params
        self.tp_group = tp_group
        self.fqn_of_main = {id(main): r.fqn for main, r in zip(self.main_params, ordered)}  # id(main) -> fqn
        tp_rank = group_rank(tp_group)
        self._counts_for_norm = [
            not r.is_shared and (r.tensor_model_parallel or tp_rank == 0) for r in ordered
        ]
        # Separate gradient-norm group of each parameter (None: the main norm), read from the model
        # parameter (an fp32 main copy has no attributes); an unregistered name raises here.
        self._grad_norm_groups = [grad_norm_group_of(p, r.fqn) for p, r in zip(self.model_params, ordered)]
        self._index_of_main = {id(main): i for i, main in enumerate(self.main_params)}
        self._device = self.model_params[0].device if self.model_params else default_device()
        self.qk_clip = qk_clip
        self._one = torch.ones(1, dtype=torch.float32, device=self._device)
        self._host_copies = HostCopies()
        self.host_state = self._host_resident_state()
        self._store_state()

    def _host_resident_state(self) -> Optional[HostResidentState]:
        """Where `optimizer_cpu_offload` puts this child's state (offload/host_resident.py), or None."""
        if not getattr(self.config, "optimizer_cpu_offload", False):
            return None
        indices = offloaded_indices([p.numel() for p in self.model_params], self.config.optimizer_offload_fraction)
        return HostResidentState(indices, len(self.model_params), self._device, pin=self.config.pin_cpu_params,
                                 overlap=self.config.overlap_cpu_optimizer_d2h_h2d)

    def _offloaded_states(self) -> list[dict]:
        return [self.optimizer.state[self.main_params[i]] for i in self.host_state.indices]

    def _store_state(self) -> None:
        """Reduced-precision state in its stored dtype (and the canonical layout, flat_state.py),
        the offloaded parameters' on the host."""
        if self.state_precision is not None:
            self.state_precision.store(self.optimizer)
        canonical_state_layout(self.optimizer)
        if self.host_state is not None:
            self.host_state.to_host(self._offloaded_states())

    # Main parameters: the model's own here; fp32 copies in MixedPrecisionOptimizer.
    def _make_main_param(self, param: torch.nn.Parameter) -> torch.nn.Parameter:
        if param.dtype != torch.float32:
            raise TypeError(
                f"FP32Optimizer steps float32 parameters; got {param.dtype}. Set "
                f"OptimizerConfig.bf16/fp16 for 16-bit models (mixed precision)."
            )
        return param

    def fp32_main_params(self) -> list[torch.Tensor]:
        """The fp32 main weights, parallel to main_params (MixedPrecisionOptimizer may hold them
        in another form between steps and rebuild them here)."""
        return [main.detach() for main in self.main_params]

    def set_main_params(self, values: dict[int, torch.Tensor]) -> None:
        """Set main weights from fp32 `values` by id(model parameter); here the model's own."""

    def _load_main_params(self, saved: dict[int, torch.Tensor]) -> None:
        """After a load: the main weights the checkpoint holds, by id(model parameter)."""
        self.set_main_params(saved)

    # What checkpoints read (CheckpointableChild, checkpointable/child.py).
    def checkpoint_params(self) -> list[ChildParam]:
        """Every parameter this child steps, in its order (parallel to fp32_main_params())."""
        state = self.optimizer.state
        return [ChildParam(r.fqn, model, main, state.get(main, {}), r.checkpoint_name, bool(r.stored_name))
                for r, model, main in zip(self.records, self.model_params, self.main_params)]

    def hyperparameter_names(self) -> tuple[str, ...]:
        """The inner optimizer's hyperparameters (its `defaults`: lr, betas, ...)."""
        return tuple(self.optimizer.defaults)

    def inner_class_name(self) -> str:
        """The inner torch optimizer's class name (checkpoints refuse another optimizer's state)."""
        return type(self.optimizer).__name__

    def init_state(self) -> None:
        """Create state that torch's optimizers create lazily, as targets for a sharded load."""
        init_torch_state(self.optimizer)

    def tp_modes(self) -> dict[str, str]:
        """fqn -> TP mode of each matrix a Muon-family inner optimizer steps ({} for others)."""
        return dict(getattr(self.optimizer, "tp_modes", None) or {})

    def main_param_bytes(self) -> int:
        """Bytes this optimizer holds for main weights beyond the model's parameters."""
        return 0

    def _prepare_main_grads(self) -> None:
        """DDP's fp32 `main_grad` becomes the gradient of the parameters stepped in place (a
        16-bit parameter cannot take an fp32 `.grad`; its fp32 main copy gets it instead)."""
        for param, main in zip(self.model_params, self.main_params):
            if param is main and hasattr(param, "main_grad"):
                param.grad = param.main_grad

    def _materialize_main_params(self, indices: Sequence[int]) -> None:
        """fp32 main weights of the parameters at `indices` for the update (the model's own here)."""

    def _copy_main_params_to_model(self, indices: Sequence[int]) -> None:
        pass

    # The step recipe's phases.
    def grad_stats(self, count_zeros: bool) -> LocalStats:
        self._prepare_main_grads()
        return self._local_stats(count_zeros, self.grad_scaler.inv_scale if self.grad_scaler is not None else None)

    def current_grad_stats(self, count_zeros: bool) -> LocalStats:
        return self._local_stats(count_zeros, inv_scale=None)

    def _local_stats(self, count_zeros: bool, inv_scale: Optional[torch.Tensor]) -> LocalStats:
        facts = zip(self.model_params, self.main_params, self._counts_for_norm, self._grad_norm_groups)
        counted = [(m.grad, group, p) for p, m, counts, group in facts if counts and m.grad is not None]
        other_grads = [m.grad for m, counts in zip(self.main_params, self._counts_for_norm)
                       if not counts and m.grad is not None]
        group_grads = {name: [g for g, group, _ in counted if group == name]
                       for name in set(self._grad_norm_groups) - {None}}
        local = local_grad_stats([g for g, group, _ in counted if group is None], other_grads, inv_scale,
                                 count_zeros, self._device, self._norm_groups, group_grads)
        # The parameters of the norms, as local_grad_stats keeps them (gradients with elements).
        local.params = {name: [p for g, group, p in counted if group == name and g.numel() > 0] for name in local.norms}
        return local

    def main_grads(self, grad_norm_group: Optional[str] = None) -> list[torch.Tensor]:
        return [m.grad for m, group in zip(self.main_params, self._grad_norm_groups)
                if m.grad is not None and group == grad_norm_group]

    def get_grads_for_grad_norm(self, grad_norm_group: Optional[str] = None) -> list[torch.Tensor]:
        """As the base's, each parameter judged by its model parameter's attributes (an fp32
        main copy has none)."""
        if grad_norm_group is not None:
            check_grad_norm_group(grad_norm_group)
        facts = zip(self.main_params, self._counts_for_norm, self._grad_norm_groups)
        return [m.grad for m, counts, group in facts if counts and group == grad_norm_group and m.grad is not None]

    def _filter_grads_for_norm(self, params: list[torch.nn.Parameter],
                               param_filter: Optional[Callable[[torch.nn.Parameter], bool]] = None,
                               ) -> list[torch.Tensor]:
        """As the base's, the main parameters it steps judged by their model parameters."""
        def counts(param: torch.nn.Parameter) -> bool:
            index = self._index_of_main.get(id(param))
            return counts_in_norm(param, self.tp_group) if index is None else self._counts_for_norm[index]

        return [p.grad for p in params if (param_filter is None or param_filter(p)) and p.grad is not None and counts(p)]

    def step_with_ready_grads(self) -> bool:
        if self.is_offloaded:
            raise ValueError(f"optimizer {self.name!r}'s state is on the host (offload_to_cpu()); call "
                             f"restore_from_cpu() before stepping.")
        if self.host_state is None:
            self._step_window(range(len(self.main_params)), narrowed=False)
            return True
        host_state = self.host_state  # offloaded state streams through the device (offload/host_resident.py)
        host_state.to_host(self._offloaded_states())  # what a load left on the device
        for window in host_state.windows():
            streamed = [self.optimizer.state[self.main_params[i]] for i in window if host_state.is_offloaded(i)]
            with host_state.on_device(streamed):
                self._step_window(window, narrowed=True)
        host_state.finish()
        return True

    def _step_window(self, indices: Sequence[int], narrowed: bool) -> None:
        """The update of the parameters at `indices` (all of them unless `narrowed`)."""
        mains = [self.main_params[i] for i in indices] if narrowed else None
        self._materialize_main_params(indices)
        with timed(self.config, "optimizer-inner-step"):
            precision = self.state_precision
            with precision.working(self.optimizer, mains) if precision else contextlib.nullcontext():
                with narrowed_param_groups(self.optimizer, mains):
                    self.optimizer.step()  # the update in fp32, stored state rounded after it
            canonical_state_layout(self.optimizer, mains)
        if self.qk_clip is not None:  # QK-clip scales the updated main copies (wrappers/qk_clip.py)
            self.qk_clip.clip_main_params((self.records[i].fqn, self.main_params[i]) for i in indices)
        with timed(self.config, "optimizer-copy-main-to-model-params"):
            self._copy_main_params_to_model(indices)

    def _phase_children(self) -> list[SteppableChild]:
        return [self]

    def prepare_model_params_for_param_sync(self) -> None:
        """megatron-core's hook before a forced all-gather: the model parameters are up to date."""

    # The contract.
    def step(self) -> StepResult:
        self.grad_norms_by_group = {}
        return take_step([self], self.config, self.grad_norms_by_group)

    # megatron-core's RL helpers (offload/offload_to_cpu.py).
    def offload_to_cpu(self) -> None:
        """This optimizer's state and the main weights it owns to the host; the model's weights stay."""
        self._host_copies.offload(self._owned_tensors(), keep=tensors_in(self.model_params))

    def restore_from_cpu(self) -> None:
        """Everything `offload_to_cpu` moved back where it was; the next step is the one it would have been."""
        self._host_copies.restore()

    @property
    def shard_fp32_from_float16_groups(self) -> list[list[torch.Tensor]]:
        """megatron-core's Float16 optimizers' name for their fp32 main shards, which verl's Megatron-side
        offload (`offload_megatron_optimizer`) moves tensor by tensor (`tensor.data = tensor.data.to(...)`):
        here every tensor this child owns, its state (Muon's momentum too) and its fp32 main weights, never
        the model's own weights (docs/memory.md)."""
        model = {tensor.untyped_storage().data_ptr() for tensor in tensors_in(self.model_params)}
        return [[tensor for tensor in self._owned_tensors() if tensor.untyped_storage().data_ptr() not in model]]

    @property
    def is_offloaded(self) -> bool:
        return self._host_copies.offloaded

    def _owned_tensors(self) -> Iterator[torch.Tensor]:
        yield from tensors_in(list(self.optimizer.state.values()))
        yield from tensors_in(self.main_params)

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in {id(p): p for p in self.model_params + self.main_params}.values():
            if param.grad is None:
                continue
            if set_to_none:
                param.grad = None
            else:
                param.grad.detach_().zero_()

    def get_loss_scale(self) -> torch.Tensor:
        return self.grad_scaler.scale if self.grad_scaler is not None else self._one

    def reload_model_params(self, state_dict: Optional[dict] = None) -> None:
        pass  # the model's parameters are the main parameters

    def state_dict(self, is_loading: bool = False) -> dict:
        """`local_state_dict()`, with the state torch's optimizers make at their first step made
        first: a fresh optimizer's dict is a complete target to load into (`is_loading` changes
        nothing here)."""
        self.init_state()
        return self.local_state_dict()

    def local_state_dict(self) -> dict:
        """This rank's state by parameter name, every tensor a plain one (wrappers/flat_state.py)."""
        state = flat_state_dict(self.optimizer, self.fqn_of_main)
        state["grad_scaler"] = self.grad_scaler.state_dict() if self.grad_scaler else None
        return state

    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool = False,
                           metadata: Optional[dict] = None) -> dict:
        """megatron-core's format for dist_checkpointing (see megatron_core_formats/dist_checkpointing.py), or
        its fsdp_dtensor layout for torch DCP when `metadata` asks for it (megatron_core_formats/fsdp_dtensor.py)."""
        if asks_for_fsdp_dtensor(metadata):
            return fsdp_dtensor_state_dict(self, is_loading)
        return chain_sharded_state_dict([self.name], [self], model_sharded_state_dict, is_loading,
                                        owner_is_main_replica=False, metadata=metadata)

    def check_state_dict(self, state_dict: dict) -> None:
        """Raise ValueError if `state_dict` does not fit this optimizer; changes nothing."""
        if core_format_in(state_dict) is not None:
            self._from_megatron_core(state_dict)
            return
        state_dict = self._as_flat(state_dict)
        torch_state_dict_from_flat(self.optimizer, state_dict, self.fqn_of_main)

    def _from_megatron_core(self, state_dict: dict) -> tuple[dict, dict[int, torch.Tensor], Optional[dict]]:
        """megatron-core's state dict (megatron_core_formats/dist_checkpointing.py) in our torch optimizer's
        terms, with the fp32 main copies by id(model parameter) and the loss scaler's state: param
        groups matched as megatron-core matches them, hyperparameters from the checkpoint, the
        groups' own metadata (group_key, max_lr, ...) as the live config built it."""
        params = self.checkpoint_params()
        state, saved_groups, mains, scaler = unpack_core_state_dict(state_dict, params, self.config)
        live_groups = self.optimizer.param_groups
        groups = [{**{k: v for k, v in live.items() if k != "params"},
                   **{k: group[k] for k in self.optimizer.defaults if k in group}, "params": group["params"]}
                  for live, group in zip(live_groups, self._filter_and_reorder_param_groups(live_groups, saved_groups))]
        return ({"state": state, "param_groups": groups},
                {id(params[index].model): main for index, main in mains.items()}, scaler)

    def _as_flat(self, state_dict: dict) -> dict:
        """Our flat `local_state_dict()` from what a sharded load returned in our other layouts, or
        from `state_dict()` with DTensor state (a DTensor-sharded model's)."""
        fqn_of_stored = {r.checkpoint_name: r.fqn for r in self.records}  # DTensor state's names (fsdp_dtensor.py)
        if is_fsdp_dtensor_state(state_dict):
            stored = {r.fqn: r.checkpoint_name for r in self.records}
            live_groups = {group["group_key"]: ([stored[self.fqn_of_main[id(p)]] for p in group["params"]], group)
                           for group in self.optimizer.param_groups}
            flat = flat_from_fsdp_dtensor(state_dict, live_groups, self.inner_class_name())
        else:
            flat = local_values(expand_v1_sharded_state_dict(state_dict))
        flat = renamed(flat, fqn_of_stored)
        live_state = {self.fqn_of_main[id(param)]: state for param, state in self.optimizer.state.items()}
        return {**flat, "state": live_scalar_types(flat["state"], live_state)}

    def load_state_dict(self, state_dict: dict) -> None:
        if core_format_in(state_dict) is not None:
            torch_state, mains, scaler = self._from_megatron_core(state_dict)
            self.optimizer.load_state_dict(torch_state)
        else:
            state_dict = self._as_flat(state_dict)
            load_flat_state_dict(self.optimizer, state_dict, self.fqn_of_main)
            scaler = state_dict.get("grad_scaler")
            saved = state_dict.get("main_params") or {}
            mains = {id(p.model): saved[p.fqn] for p in self.checkpoint_params() if p.fqn in saved}
        if self.grad_scaler is not None and scaler is not None:
            self.grad_scaler.load_state_dict(scaler)
        self._load_main_params(mains)
        self._store_state()  # torch loads state in the parameters' dtype; as a live step leaves it
