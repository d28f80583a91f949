"""megatron-core 0.19's DistributedOptimizer with torch's Adam, which megatron-core falls back to
without Transformer Engine or Apex (always on CPU; on a GPU without them too): its load, its
`state_dict()` and its `fsdp_dtensor` state fail, drift or hang there, and TE's FusedAdam meets none of
these. `replacements()` lists the fixes; megatron_lm_cpu.py applies them without CUDA, and `install()`
with CUDA where megatron-core's Adam is torch's (Megatron-LM's loop script calls both). Each fix says
what it mends; nothing is edited in the installed package.
"""

from typing import Any, Callable

import torch

from megatron_eopt.runtime.cpu_stand_ins import replace_names

_undo: list[Callable[[], None]] = []  # set while installed


def replacements(optimizer_class: type) -> list[tuple[Any, str, Any]]:
    """(owner, name, replacement) for every fix, on megatron-core's DistributedOptimizer class."""
    return distributed_optimizer_loads_with_torch_adam(optimizer_class) + fsdp_dtensor_state_for_every_parameter(
        optimizer_class)


def uses_torch_adam() -> bool:
    import megatron.core.optimizer as optimizer

    return optimizer.Adam is torch.optim.AdamW


def install() -> bool:
    """Apply the fixes with CUDA where megatron-core's Adam is torch's; idempotent. Without CUDA
    megatron_lm_cpu.install() applies them with the rest of its replacements. Returns whether they
    are in place from here."""
    if _undo:
        return True
    if not torch.cuda.is_available() or not uses_torch_adam():
        return False
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    _undo.extend(replace_names(replacements(DistributedOptimizer)))
    return True


def distributed_optimizer_loads_with_torch_adam(optimizer_class: type) -> list[tuple[Any, str, Any]]:
    """megatron-core 0.19's DistributedOptimizer load with torch's Adam (no TE or Apex, as on CPU),
    which keeps a `step` tensor per parameter in its state, fails or drifts:
    - it copies a loaded fp32 `param` into a view of the parameter itself: torch allows that
      under no_grad only (the load runs under no_grad here);
    - it copies every tensor the live state has into a parameter's state, `step` included: its
      fully_reshardable load passes no `step` (KeyError), its dp_reshardable load passes the live
      one from before the load (a non-persistent object), which reset the loaded step to 0. The
      step is left as the load set it from the param groups, as megatron-core means to ("handled
      separately");
    - it gives every parameter one shared `step` tensor, which torch's Adam then advances once per
      parameter per step: each parameter gets its own copy of the loaded step afterwards;
    - its `state_dict()` asserts one step among the parameters' states, and a run about to load
      has none yet (torch's Adam makes its state at the first step): the load asks for that state
      dict's layout, whose step the load then replaces; it gets step 0 there, as torch's would be.
    TE's FusedAdam on GPU keeps the step in the param groups and meets none of these.
    With Megatron-FSDP a parameter whose local shard is empty has state only in the checkpoint
    (fsdp_dtensor_state_for_every_parameter): the load drops it again, as torch's Adam has none.
    Returns (owner, name, replacement) triples, for `replaced`."""
    original_load = optimizer_class.load_state_dict
    original_set = optimizer_class._set_main_param_and_optimizer_states
    original_state_dict = optimizer_class.state_dict

    def state_dict(self) -> dict:
        states = self.optimizer.state
        first = next((p for group in self.optimizer.param_groups for p in group["params"]), None)
        if first is None or any("step" in state for state in states.values()):
            return original_state_dict(self)
        had_state = first in states
        states[first]["step"] = torch.zeros(())
        try:
            return original_state_dict(self)
        finally:
            del states[first]["step"]
            if not had_state:
                del states[first]

    def set_states(self, model_param, tensors) -> None:
        original_set(self, model_param, {**tensors, "step": None})  # a non-tensor is skipped

    def load_state_dict(self, state_dict) -> None:
        with torch.no_grad():
            original_load(self, state_dict)
        if self.ddp_config.use_megatron_fsdp:
            for param, _ in _empty_shards(self.optimizer):
                self.optimizer.state.pop(param, None)
        for state in self.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()

    return [(optimizer_class, "load_state_dict", load_state_dict),
            (optimizer_class, "_set_main_param_and_optimizer_states", set_states),
            (optimizer_class, "state_dict", state_dict)]


def fsdp_dtensor_state_for_every_parameter(optimizer_class: type) -> list[tuple[Any, str, Any]]:
    """megatron-core 0.19's DistributedOptimizer with Megatron-FSDP and torch's Adam (no TE or Apex,
    as on CPU) hung in every `--ckpt-format fsdp_dtensor` save and load on 2 ranks or more:
    - Megatron-FSDP hands a parameter whose local shard is empty a gradient of None
      (param_and_grad_buffer.py, `update_main_grads`), and torch's Adam makes state only for a
      parameter with a gradient: such a parameter has no state on that rank, and has it on the
      rank that holds its rows. TE's FusedAdam (on GPUs) makes state for every parameter before it
      looks at the gradient, empty shards included;
    - `sharded_param_state_fsdp_dtensor` hands that state, keyed by parameter name, to the save and
      the load, which for each DTensor in it, in sorted order, run collectives with the other
      ranks (uneven_dtensor.py, `preprocess_state_dict_for_uneven_dtensor`; with --swiglu also
      fsdp_dtensor_checkpoint.py, `handle_swiglu_in_state_dict`). A rank with fewer DTensors
      pairs its collectives with other tensors' and, under gloo, waits for the rest forever.
    Here the state handed over gives each parameter with an empty local shard Adam's moments as
    TE's would have them (zeros like that shard: nothing); the optimizer's own state is left as
    torch's Adam has it (the load drops them again: distributed_optimizer_loads_with_torch_adam).
    Their `step` is left out of a save, so that the checkpoint's step is the one of the rank that
    stepped the parameter, and is a placeholder in a load (torch's Adam loads no state without
    one). Returns (owner, name, replacement) triples."""
    original = optimizer_class.sharded_param_state_fsdp_dtensor

    def sharded_param_state_fsdp_dtensor(self, is_loading: bool = False):
        if not isinstance(self.optimizer, torch.optim.Adam | torch.optim.AdamW):
            return original(self, is_loading)
        states = self.optimizer.state
        empty = [(param, group) for param, group in _empty_shards(self.optimizer) if not states.get(param)]
        for param, group in empty:
            self.optimizer.state[param] = _adam_state_of_empty_shard(param, group, with_step=is_loading)
        try:
            return _in_param_group_order(self, original(self, is_loading))  # its state dict holds their state
        finally:
            for param, _ in empty:
                del self.optimizer.state[param]

    return [(optimizer_class, "sharded_param_state_fsdp_dtensor", sharded_param_state_fsdp_dtensor)]


def _in_param_group_order(optimizer: Any, state_dict: dict) -> dict:
    """`state_dict` with its state in the order of the param groups, the same on every rank. It
    comes in the order the state was made, which differs between ranks once some have an empty
    shard (state made here, after Adam's), and the SwiGLU split that follows runs collectives per
    state entry in that order (at TP > 1 it hung or failed its boundary check on CPU)."""
    state = state_dict["state"]
    names = [optimizer._param_name(p) for group in optimizer.optimizer.param_groups for p in group["params"]]
    ordered = {name: state[name] for name in names if name in state}
    ordered.update((name, entries) for name, entries in state.items() if name not in ordered)
    return {**state_dict, "state": ordered}


def _empty_shards(optimizer: torch.optim.Optimizer) -> list[tuple[torch.Tensor, dict]]:
    """(parameter, its param group) for each parameter whose local shard is empty."""
    return [(param, group) for group in optimizer.param_groups for param in group["params"]
            if (param.to_local() if hasattr(param, "to_local") else param).numel() == 0]


def _adam_state_of_empty_shard(param: torch.Tensor, group: dict, with_step: bool) -> dict:
    """torch's Adam's moments for `param`, zeros like it (a DTensor stays one, on its mesh: an empty
    shard), and a step of 0 `with_step`."""
    names = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group.get("amsgrad") else ())
    state = {name: torch.zeros_like(param, memory_format=torch.preserve_format) for name in names}
    return {**state, "step": torch.tensor(0.0)} if with_step else state
