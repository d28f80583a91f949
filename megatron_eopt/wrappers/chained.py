"""ChainedOptimizer: several optimizers that step together under one gradient norm.

The chain clips every child by the norm over all children's gradients and skips all of them
when any gradient is inf/NaN. It is a `torch.optim.Optimizer` too, for the engines that hold
one (the Hugging Face Trainer, verl, AReaL, torchtitan; docs/engines.md): its `param_groups` are
the children's, in order, holding the model's parameters (checkpointable/torch_views.py), and may be
replaced as a whole; `state` is the children's live state by model parameter; `state_dict()` is
torch's layout (checkpointable/torch_state_dict.py). `step()` returns megatron-core's
`(update_successful, grad_norm, num_zeros_in_grad)`, not a closure's loss.
"""

from collections import OrderedDict
from typing import Any, Callable, Optional

import torch

from megatron_eopt.megatron_core_formats.fsdp_dtensor import check_names, is_fsdp_dtensor_state
from megatron_eopt.megatron_core_formats.dist_checkpointing import chain_sharded_state_dict, core_chain_states
from megatron_eopt.megatron_core_formats.layer_wise_optimizer import split_merged
from megatron_eopt.wrappers.base import MegatronOptimizer, SteppableChild, StepResult, default_device, take_step
from megatron_eopt.wrappers.megatron_core_chain import MegatronCoreChildren, step_megatron_core_children
from megatron_eopt.wrappers.step_phases import StepPhases
from megatron_eopt.wrappers.qk_clip import QKClip, qk_clip_step
from megatron_eopt.checkpointable.torch_views import ModelParamState, inner_groups, param_group_views
from megatron_eopt.checkpointable.torch_state_dict import chain_state_dict, is_torch_layout, load_chain_state_dict


class NotAChainOfOneError(ValueError, AttributeError):
    """`.optimizer` of a chain of several children. An AttributeError too, so that `hasattr(optimizer,
    "optimizer")` is False: accelerate's AcceleratedOptimizer.train()/eval() (the Hugging Face
    Trainer's every step) ask it of the optimizer they wrap."""


class ChainedOptimizer(StepPhases, MegatronOptimizer, torch.optim.Optimizer):
    """Steps `chained_optimizers` as one.

    Children are ours (FP32Optimizer, MixedPrecisionOptimizer: one gradient norm over all of
    them, wrappers/base.py), or, as megatron-core accepts, any objects with megatron-core's
    optimizer interface (megatron_core_chain.py; a torch optimizer can be chained but not
    stepped), not both kinds in one chain. No children, or only stubs, make a stub
    (`is_stub_optimizer`): a rank without trainable parameters, whose step changes nothing and
    returns (True, 0.0, None) (0 zeros with `log_num_zeros_in_grad`), as megatron-core's stub does.
    """

    # Megatron-LM skips optimizer calls on a rank whose optimizer is a stub: only a chain whose
    # children are all stubs (none: a rank without trainable parameters) is one.
    is_stub_optimizer: bool = False
    # In megatron-core's sharded format a state's main replica is data-parallel rank 0, which
    # holds every state; the layer-wise optimizer sets this: there the owner writes it.
    owner_is_main_replica = False
    # What state_dict() writes: torch's layout (checkpointable/torch_state_dict.py), or, in Megatron-LM's
    # loop (integrations/megatron_lm.py sets it), each child's state by name, `{"optimizers": {name: ...}}`,
    # keyed by parameter name: the layout its torch and torch_dcp checkpoints have always held.
    state_dict_by_child_name: bool = False

    def __init__(self, chained_optimizers: list[Any], config: Any = None, qk_clip: Optional[QKClip] = None) -> None:
        children = list(chained_optimizers)
        ours = [isinstance(child, SteppableChild) for child in children]
        if any(ours) and not all(ours):
            raise TypeError(
                f"ChainedOptimizer children are either all megatron_eopt's (FP32Optimizer/MixedPrecisionOptimizer) "
                f"or all others with megatron-core's optimizer interface; got "
                f"{[type(child).__name__ for child in children]}."
            )
        for child in children:
            if not hasattr(child, "param_groups"):
                raise TypeError(f"ChainedOptimizer children need param_groups (an optimizer interface); got "
                                f"{type(child).__name__}.")
        names = [getattr(child, "name", f"chained_{index}") for index, child in enumerate(children)]
        if len(set(names)) != len(names):
            raise ValueError(f"ChainedOptimizer children need distinct names; got {names}.")
        self.chained_optimizers = children
        # QK-clip or max-logit logging: measured here in step(), the children clip (they get the same).
        self.qk_clip = qk_clip
        self._names = names
        self._ours = all(ours)
        self.is_stub_optimizer = all(getattr(child, "is_stub_optimizer", False) for child in children)
        self.config = config if config is not None else next(
            (child.config for child in children if getattr(child, "config", None) is not None), None)
        self.grad_norms_by_group = {}
        # megatron-core's DDP bucket layout for the model (megatron_core_formats/distributed_optimizer.py), set by
        # get_megatron_optimizer: reading its DistributedOptimizer's dp_reshardable checkpoints needs it.
        self.core_buckets = None
        # The MegatronFSDP modules whose shards the children step, set by get_megatron_optimizer: a
        # successful step copies the shards into their compute weights, as megatron-core's does.
        self.megatron_fsdp_wrappers = []
        self._init_torch_optimizer()

    def _init_torch_optimizer(self) -> None:
        """What torch.optim.Optimizer.__init__ sets up, but the groups and state, which the children hold:
        the hook registries and the step wrapper that runs the step hooks; `defaults` are the
        children's inner optimizers' (the first child's value where two differ)."""
        self.defaults = {}
        for child in reversed(self.chained_optimizers):
            self.defaults.update(getattr(getattr(child, "optimizer", child), "defaults", None) or {})
        for hooks in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
                      "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
                      "_optimizer_load_state_dict_post_hooks"):
            setattr(self, hooks, OrderedDict())
        self._patch_step_function()
        # Built at first use: the parameters' places are fixed at build, and the views read the live
        # groups and state at each access (engines read `state[p]` for every parameter in turn).
        self._group_views: Optional[list[dict]] = None
        self._model_param_state: Optional[ModelParamState] = None

    def add_param_group(self, param_group: dict) -> None:
        raise TypeError("add_param_group is not supported: get_megatron_optimizer routes every parameter of "
                        "model_chunks to its optimizer and group; build a new optimizer over the model instead.")

    def step(self, closure: Optional[Callable[[], Any]] = None) -> StepResult:
        """One step of every child. `closure` (torch's) recomputes the loss and gradients first; the
        result is megatron-core's tuple either way."""
        if closure is not None:
            with torch.enable_grad():
                closure()
        self.grad_norms_by_group = {}
        if self.is_stub_optimizer:
            log_zeros = self.config is not None and self.config.log_num_zeros_in_grad
            return True, 0.0, (0 if log_zeros else None)
        if not self._ours:
            return step_megatron_core_children(self.chained_optimizers, self.config, self.grad_norms_by_group)
        with qk_clip_step(self.qk_clip):
            result = take_step(self.chained_optimizers, self.config, self.grad_norms_by_group, self.arrange_stats)
        if result[0]:
            for wrapper in self.megatron_fsdp_wrappers:
                wrapper.install_optimized_model_weights()
        return result

    # megatron-core's step in phases (wrappers/step_phases.py); a chain of megatron-core's kind of
    # children runs them as megatron-core's chain does (megatron_core_chain.py).
    def _phase_children(self) -> list[SteppableChild]:
        return list(self.chained_optimizers)

    def prepare_grads(self) -> bool:
        return self._phase("prepare_grads", False)

    def get_grad_norm(self) -> float:
        return self._phase("get_grad_norm", 0.0)

    def clip_grad_norm(self, clip_grad: float) -> float:
        return self._phase("clip_grad_norm", 0.0, clip_grad)

    def count_zeros(self) -> int:
        return self._phase("count_zeros", 0)

    def _phase(self, name: str, stub_value: Any, *args: Any) -> Any:
        if self.is_stub_optimizer:
            return stub_value
        if self._ours:
            return getattr(StepPhases, name)(self, *args)
        children = MegatronCoreChildren(self.chained_optimizers)
        result = getattr(children, name)(*args)
        self.grad_norms_by_group = children.norms_by_group if name == "clip_grad_norm" else self.grad_norms_by_group
        return result

    def step_with_ready_grads(self) -> bool:
        """Every child steps; a successful step puts Megatron-FSDP's shards into its compute weights."""
        if self.is_stub_optimizer:
            return True
        if not self._ours:
            return MegatronCoreChildren(self.chained_optimizers).step_with_ready_grads()
        with qk_clip_step(self.qk_clip):
            for child in self.chained_optimizers:
                child.step_with_ready_grads()
        for wrapper in self.megatron_fsdp_wrappers:
            wrapper.install_optimized_model_weights()
        return True

    @property
    def optimizer(self) -> Any:
        """megatron-core's: the one child's torch optimizer (for code written for a single optimizer)."""
        if len(self.chained_optimizers) != 1:
            raise NotAChainOfOneError(f"ChainedOptimizer.optimizer is the torch optimizer of a chain of one; this chain has "
                             f"{len(self.chained_optimizers)} children: use chained_optimizers[i].optimizer.")
        return self.chained_optimizers[0].optimizer

    def get_parameters(self) -> list[torch.nn.Parameter]:
        return [p for child in self.chained_optimizers for p in _parameters_of(child)]

    def get_grads_for_grad_norm(self, grad_norm_group: Optional[str] = None) -> list[torch.Tensor]:
        return [g for child in self.chained_optimizers for g in child.get_grads_for_grad_norm(grad_norm_group)]

    @property
    def max_attention_logit(self) -> Optional[float]:
        """The largest attention logit of the last step (qk_clip/log_max_attention_logit), else None."""
        return self.qk_clip.max_attention_logit if self.qk_clip is not None else None

    @property
    def param_groups(self) -> list[dict]:
        """The children's groups, in order, each with the model's parameters and the inner group's
        live values (checkpointable/torch_views.py)."""
        if self._group_views is None:
            self._group_views = param_group_views(self.chained_optimizers)
        return list(self._group_views)

    @param_groups.setter
    def param_groups(self, value: list[dict]) -> None:
        sizes = [len(child.param_groups) for child in self.chained_optimizers]
        if len(value) != sum(sizes):
            raise ValueError(
                f"ChainedOptimizer.param_groups must keep its {sum(sizes)} groups (children hold "
                f"{sizes}); got {len(value)}."
            )
        start, value = 0, inner_groups(self.chained_optimizers, list(value))
        for child, size in zip(self.chained_optimizers, sizes):
            child.param_groups = list(value[start : start + size])
            start += size

    @property
    def state(self) -> ModelParamState:
        """The children's live state by model parameter; the state torch's Adam and SGD make at their
        first step is made first, as torch's DCP helpers and the engines' offload walks expect it."""
        if self._model_param_state is None:
            if self._ours:
                for child in self.chained_optimizers:
                    child.init_state()
            self._model_param_state = ModelParamState(self.chained_optimizers)
        return self._model_param_state

    def zero_grad(self, set_to_none: bool = True) -> None:
        for child in self.chained_optimizers:
            child.zero_grad(set_to_none)

    def get_loss_scale(self) -> torch.Tensor:
        if not self.chained_optimizers:
            return torch.ones(1, dtype=torch.float32, device=default_device())
        return self.chained_optimizers[0].get_loss_scale()

    def reload_model_params(self, state_dict: Optional[dict] = None) -> None:
        for child in self.chained_optimizers:
            child.reload_model_params(state_dict)

    def offload_to_cpu(self) -> None:
        """megatron-core's: every child's state and owned main weights to the host (offload/offload_to_cpu.py)."""
        for child in self.chained_optimizers:
            if hasattr(child, "offload_to_cpu"):  # a chained torch optimizer has none
                child.offload_to_cpu()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def restore_from_cpu(self) -> None:
        for child in self.chained_optimizers:
            if hasattr(child, "restore_from_cpu"):
                child.restore_from_cpu()

    def prepare_model_params_for_param_sync(self) -> None:
        """Megatron-LM calls this before it forces a parameter all-gather. Nothing to stage:
        step() leaves every model parameter up to date (children copy their main params back,
        the layer-wise optimizer broadcasts from the owners)."""

    def state_dict(self, is_loading: bool = False) -> dict:
        """torch's layout (checkpointable/torch_state_dict.py), running torch's state-dict hooks.
        `is_loading`: Megatron-LM's torch_dcp load asks for a dict to load into; a DTensor-sharded
        model's children give new DTensors then (distributed/fsdp2.py). A chain of megatron-core's
        kind of children, and one in Megatron-LM's loop (`state_dict_by_child_name`), give each child's
        state by name."""
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        if self._ours and not self.state_dict_by_child_name:
            state_dict = chain_state_dict(self.chained_optimizers, is_loading)
        else:
            loading = is_loading and self._ours  # megatron-core's children take no flag
            state_dict = {"optimizers": {name: child.state_dict(is_loading=True) if loading else child.state_dict()
                                         for name, child in zip(self._names, self.chained_optimizers)}}
        for hook in self._optimizer_state_dict_post_hooks.values():
            state_dict = hook(self, state_dict) or state_dict
        return state_dict

    def save_state_dict_to_file(self, filename: str) -> None:
        """This rank's state_dict() to `filename` (Megatron-LM's --ckpt-format torch with the
        layer-wise optimizer: one file per data-parallel rank, each holding its owned state)."""
        torch.save(self.state_dict(), filename)

    def load_state_dict_from_file(self, filename: str) -> None:
        """Load what save_state_dict_to_file wrote on this rank."""
        self.load_state_dict(torch.load(filename, weights_only=True))

    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool = False,
                           metadata: Optional[dict] = None) -> dict:
        """megatron-core's format for dist_checkpointing (see megatron_core_formats/dist_checkpointing.py)."""
        return chain_sharded_state_dict(self._names, self.chained_optimizers, model_sharded_state_dict, is_loading,
                                        self.owner_is_main_replica, metadata, self.core_buckets)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's layout (`state_dict()`), ours before it (each child's by name), megatron-core's,
        or its fsdp_dtensor layout; running torch's load hooks. Nothing changes unless every child's
        part fits."""
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            state_dict = hook(self, state_dict) or state_dict
        self._load(state_dict)
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def _load(self, state_dict: Any) -> None:
        if self.is_stub_optimizer and not self.chained_optimizers and (
                not state_dict or (is_torch_layout(state_dict, []) and not state_dict["param_groups"])):
            return  # a stub's state: nothing (torch's layout with no groups, ours before {"optimizers": {}}, [])
        if self._ours and is_torch_layout(state_dict, self.chained_optimizers):
            load_chain_state_dict(self.chained_optimizers, state_dict, _check_then_load)
            return
        if is_fsdp_dtensor_state(state_dict):  # one dict for the chain, keyed by parameter name
            check_names(state_dict, [param.stored_name for child in self.chained_optimizers
                                     for param in child.checkpoint_params()])
            _check_then_load([(child, state_dict) for child in self.chained_optimizers])
            return
        core_states = core_chain_states(state_dict)
        if core_states is not None:
            self._load_megatron_core(core_states)
            return
        saved = state_dict.get("optimizers") if isinstance(state_dict, dict) else None
        if saved is None:
            raise ValueError(
                "not a ChainedOptimizer state dict (no 'optimizers' entry); it was not written "
                "by megatron_eopt's ChainedOptimizer.state_dict()."
            )
        _check_then_load(list(zip(self.chained_optimizers, self._by_our_names(saved))))

    def _by_our_names(self, saved: dict) -> list:
        """The states saved under our children's names, in chain order; refuses other names."""
        if sorted(saved) != sorted(self._names):
            raise ValueError(
                f"the checkpoint holds optimizers {sorted(saved)} but this chain has {self._names}; "
                f"the optimizer or the parameter routing changed since it was saved."
            )
        return [saved[name] for name in self._names]

    def _load_megatron_core(self, states: list) -> None:
        """megatron-core's ChainedOptimizer format: its children's state dicts, in chain order (its
        layer-wise chain's merged ones cut back into ours: megatron_core_formats/layer_wise_optimizer.py)."""
        split = split_merged(states, self._names)
        if any(name is not None for name, _ in split):
            states = self._by_our_names(dict(split))
        if len(states) != len(self.chained_optimizers):
            raise ValueError(f"the state dict holds {len(states)} optimizer(s) (megatron-core's format) but this "
                             f"chain has {len(self.chained_optimizers)}: {self._names}.")
        _check_then_load(list(zip(self.chained_optimizers, states)))


def _check_then_load(children_and_states: list[tuple[Any, Any]]) -> None:
    """Check every child's state before loading any: a mismatch never half-loads the chain."""
    for child, state in children_and_states:
        if hasattr(child, "check_state_dict"):
            child.check_state_dict(state)
    for child, state in children_and_states:
        child.load_state_dict(state)


def _parameters_of(child: Any) -> list[torch.nn.Parameter]:
    if hasattr(child, "get_parameters"):
        return list(child.get_parameters())
    return [p for group in child.param_groups for p in group["params"]]
