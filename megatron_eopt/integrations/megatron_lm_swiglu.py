"""Megatron-LM's `--ckpt-format fsdp_dtensor --swiglu` with `--use-megatron-fsdp`, made to work.

Megatron-LM's checkpointing splits each SwiGLU `linear_fc1` into `_w` and `_v` halves before a
save and a load (megatron-core's `handle_swiglu_in_state_dict`). Two defects there, met with
megatron-core's optimizer and ours alike:
- it is handed the Megatron-FSDP module, whose parameters are named `module.<name>` as the model
  state's keys are, but it looks each model key up as `module.<key>` (one `module.` too many)
  and each optimizer key (`module.module.<name>`) less one `module.`: no model key resolves
  (`AttributeError: GPTModel has no attribute module`);
- it splits only Adam's `exp_avg`/`exp_avg_sq` (another optimizer's state fails with KeyError):
  here every state tensor shaped like its parameter is split (Muon's `momentum_buffer`).
`install()` (integrations/megatron_lm.py) replaces the name in Megatron-LM's checkpointing with
`handle_swiglu_in_state_dict` below, which calls megatron-core's own splitting.
"""

from typing import Any, Callable

import torch

_PREFIX = "module."


class _ModuleAtAnyDepth(torch.nn.Module):
    """The model, whose `get_parameter` drops leading `module.`s until a name resolves."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.module = model

    def get_parameter(self, target: str) -> torch.nn.Parameter:
        while True:
            try:
                return self.module.get_parameter(target)
            except AttributeError:
                if not target.startswith(_PREFIX):
                    raise
                target = target[len(_PREFIX):]


def splitting_every_state(split: Callable) -> Callable:
    """megatron-core's `handle_swiglu_in_state_dict` (`split`), with both defects handled."""

    def handle_swiglu_in_state_dict(model, model_state_dict, optimizer_state_dict):
        model = _ModuleAtAnyDepth(model)
        model_state_dict, _ = split(model, model_state_dict, None)
        if optimizer_state_dict is None:
            return model_state_dict, None
        return model_state_dict, _split_optimizer_state(split, model, optimizer_state_dict)

    return handle_swiglu_in_state_dict


def _split_optimizer_state(split: Callable, model: torch.nn.Module, optimizer_state_dict: dict) -> dict:
    """Each state tensor through `split`, two at a time in the places of the two it splits
    (`exp_avg`, `exp_avg_sq`): each split is a round of collectives per tensor, so Adam's state
    takes one call, not two. A tensor left over goes in both places."""
    state = optimizer_state_dict["state"]
    names = {key: sorted(name for name, value in entries.items() if _is_split_candidate(value))
             for key, entries in state.items()}
    new_state: dict = {}
    for start in range(0, max(map(len, names.values()), default=0), 2):
        pairs = {key: (own[start:start + 2] * 2)[:2] for key, own in names.items() if len(own) > start}
        carrying = {key: {"exp_avg": state[key][first], "exp_avg_sq": state[key][second]}
                    for key, (first, second) in pairs.items()}
        _, done = split(model, {}, {"state": carrying})
        for key, entries in done["state"].items():
            first, second = pairs[key if key in pairs else key[:-len("_w")]]  # a half: `<key>_w`, `<key>_v`
            new_state.setdefault(key, {}).update({first: entries["exp_avg"], second: entries["exp_avg_sq"]})
    for key, entries in state.items():  # the rest (scalars) as it was, with each half
        rest = {name: value for name, value in entries.items() if name not in names[key]}
        for target in [k for k in (f"{key}_w", f"{key}_v") if k in new_state] or [key]:
            new_state[target] = {**rest, **new_state.get(target, {})}
    return {**optimizer_state_dict, "state": new_state}


def _is_split_candidate(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0
