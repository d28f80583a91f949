"""The settings one command line resolves to in Megatron-LM's loop (its parser with install()'s flags and
validate_args, as `pretrain_gpt.py` runs them) and in our trainer (megatron_eopt/training/arguments/parser.py), in-process
and without a process group: `resolved_by_megatron_lm(argv, world_size)` and `resolved_by_ours(argv,
world_size)` give {setting: value} over four kinds, keyed 'OptimizerConfig.<field>', 'TransformerConfig.<field>',
'scheduler.<argument>' (megatron-core's OptimizerParamScheduler, as each builds it), 'GPTModelSettings.<field>'
(our model's settings; Megatron-LM's arguments of that name, or MEGATRON_LM_MODEL_ARGS) and 'args.<name>' (the
namespace attributes both have that neither config holds). tests/unit/training/test_megatron_lm_parity.py
compares them.
"""

import argparse
import contextlib
import dataclasses
import enum
import io
import os
import sys
from typing import Any, Iterator
from unittest import mock

# Kinds of setting, and what the comparison of each covers.
OPTIMIZER, MODEL, SCHEDULER, ARGS = "OptimizerConfig", "TransformerConfig", "scheduler", "args"
GPT = "GPTModelSettings"  # our model's settings, against the arguments Megatron-LM's model provider reads
# Our GPTModelSettings fields that Megatron-LM's namespace holds under another name or form.
MEGATRON_LM_MODEL_ARGS = {
    "vocab_size": lambda args: args.padded_vocab_size,  # the model's vocabulary, padded
    "share_embeddings_and_output_weights": lambda args: not args.untie_embeddings_and_output_weights,
    "rope_scaling": lambda args: args.use_rope_scaling,
    "cpu_initialization": lambda args: args.use_cpu_initialization,
}


@contextlib.contextmanager
def _world(world_size: int) -> Iterator[None]:
    """WORLD_SIZE/RANK as torchrun sets them; CUDA_DEVICE_MAX_CONNECTIONS as Megatron-LM's TP users do."""
    with mock.patch.dict(os.environ, WORLD_SIZE=str(world_size), RANK="0", LOCAL_RANK="0",
                         CUDA_DEVICE_MAX_CONNECTIONS="1"):
        yield


def resolved_by_megatron_lm(argv: list[str], world_size: int) -> dict[str, Any]:
    import megatron.training.arguments as megatron_lm_arguments
    import megatron.training.training as megatron_lm_training
    from megatron.training import global_vars
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.training.argument_utils import core_transformer_config_from_args

    from megatron_eopt.integrations import megatron_lm

    with megatron_lm.installed(), _world(world_size), mock.patch.object(sys, "argv", ["pretrain_gpt.py", *argv]), \
            contextlib.redirect_stdout(io.StringIO()), \
            mock.patch("megatron.training.arguments.get_device_arch_version", return_value=9):
        # (validate_args prints every argument, and asks the GPU's architecture at TP > 1: a Hopper's)
        args = megatron_lm_arguments.parse_args(extra_args_provider=megatron_lm.add_megatron_eopt_args)
        args = megatron_lm_arguments.validate_args(args, {})
        core_config, _ = megatron_lm_training.get_megatron_optimizer_config(args)
        optimizer = megatron_lm.optimizer_config_from_megatron_lm(args, core_config)
        model = core_transformer_config_from_args(args)
        build_tokenizer(args)  # as set_global_variables does: sets args.padded_vocab_size
        global_vars.set_args(args)
        try:
            scheduler = _scheduler_arguments(megatron_lm_training, "OptimizerParamScheduler",
                                             lambda: megatron_lm_training.get_optimizer_param_scheduler(_NoGroups()))
        finally:
            global_vars.set_args(None)
    return {**_settings(optimizer, model, set(), scheduler, args), **_model_arguments(args)}


def resolved_by_ours(argv: list[str], world_size: int) -> dict[str, Any]:
    import torch
    from megatron.core import optimizer_param_scheduler, parallel_state

    from arguments import optimizer_config_from_args
    from megatron_eopt.training.arguments.parser import parse_args
    from megatron_eopt.training.arguments.training import scheduler_config
    from megatron_eopt.integrations.megatron_bridge import get_scheduler
    from megatron_eopt.training.model import transformer_config as transformer_config_module

    device = torch.device("cpu")
    with _world(world_size), contextlib.redirect_stdout(io.StringIO()):
        args, settings, layout = parse_args(argv)
    optimizer = optimizer_config_from_args(args, device)
    given: set[str] = set()  # the TransformerConfig fields our trainer sets; the others are megatron-core's defaults
    with _parallel_state(parallel_state, layout), _recording_fields(transformer_config_module, given):
        model = transformer_config_module.transformer_config(settings, device)
    scheduler = _scheduler_arguments(optimizer_param_scheduler, "OptimizerParamScheduler",
                                     lambda: get_scheduler(optimizer, scheduler_config(args), _NoGroups()))
    gpt = {f"{GPT}.{f.name}": _comparable(getattr(settings, f.name)) for f in dataclasses.fields(settings)
           if f.name not in given | _unused_without_mla(model)}  # the given ones: compared as the config has them
    return {**_settings(optimizer, model, given, scheduler, args), **gpt}


def _unused_without_mla(model: Any) -> set[str]:
    """Multi-latent attention's own settings (`rope_type`, ...) when the model has none: unread there."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    if isinstance(model, MLATransformerConfig):
        return set()
    return {f.name for f in dataclasses.fields(MLATransformerConfig)} - {f.name for f in dataclasses.fields(TransformerConfig)}


def _model_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """Megatron-LM's arguments under our GPTModelSettings' field names (those it holds)."""
    from megatron_eopt.training.model.settings import GPTModelSettings

    found = {}
    for field in dataclasses.fields(GPTModelSettings):
        if field.name in MEGATRON_LM_MODEL_ARGS:
            found[f"{GPT}.{field.name}"] = MEGATRON_LM_MODEL_ARGS[field.name](args)
        elif hasattr(args, field.name):
            found[f"{GPT}.{field.name}"] = _comparable(getattr(args, field.name))
    return found


class _NoGroups:
    param_groups: list = []


def _scheduler_arguments(module: Any, name: str, build: Any) -> dict[str, Any]:
    """The keyword arguments `build()` hands megatron-core's OptimizerParamScheduler (recorded, not built)."""
    recorded: dict[str, Any] = {}
    with mock.patch.object(module, name, lambda optimizer, **kwargs: recorded.update(kwargs)):
        build()
    return recorded


@contextlib.contextmanager
def _parallel_state(parallel_state: Any, layout: Any) -> Iterator[None]:
    """megatron-core's model-parallel sizes as `layout` would set them up, without a process group."""
    sizes = {"get_tensor_model_parallel_world_size": layout.tp, "get_pipeline_model_parallel_world_size": layout.pp,
             "get_virtual_pipeline_model_parallel_world_size": layout.vpp,
             "get_expert_model_parallel_world_size": getattr(layout, "ep", 1)}
    with contextlib.ExitStack() as stack:
        for getter, size in sizes.items():
            stack.enter_context(mock.patch.object(parallel_state, getter, lambda size=size: size))
        yield


@contextlib.contextmanager
def _recording_fields(module: Any, given: set[str]) -> Iterator[None]:
    """The config classes of `module`, recording the fields they are given into `given`."""
    def recording(cls: type) -> Any:
        def build(**kwargs: Any) -> Any:
            given.update(kwargs)
            return cls(**kwargs)
        return build

    with mock.patch.object(module, "TransformerConfig", recording(module.TransformerConfig)), \
            mock.patch.object(module, "MLATransformerConfig", recording(module.MLATransformerConfig)):
        yield


def _settings(optimizer: Any, model: Any, model_given: set[str], scheduler: dict, args: argparse.Namespace
              ) -> dict[str, Any]:
    settings = {f"{OPTIMIZER}.{f.name}": getattr(optimizer, f.name) for f in dataclasses.fields(optimizer)}
    settings.update({f"{MODEL}.{f.name}": _comparable(getattr(model, f.name)) for f in dataclasses.fields(model)
                     if f.name in model_given or not model_given})
    settings.update({f"{SCHEDULER}.{name}": value for name, value in scheduler.items()})
    in_configs = {key.split(".", 1)[1] for key in settings}
    settings.update({f"{ARGS}.{name}": _comparable(value) for name, value in vars(args).items()
                     if name not in in_configs})
    return settings


def _comparable(value: Any) -> Any:
    """Functions by name (activation and init functions are module-level ones in both), enums by name
    (`--exit-signal SIGTERM`: Megatron-LM's namespace holds signal.SIGTERM, ours the name)."""
    if isinstance(value, enum.Enum):
        return value.name
    if callable(value) and hasattr(value, "__name__"):
        return value.__name__
    return value


def differences(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{setting: (ours, Megatron-LM's)} for every setting both resolve to different values. A setting
    ours leaves None on the namespace is resolved later, into a config compared above; None and False
    are the same "off" there."""
    found = {}
    for key in sorted(set(ours) & set(theirs)):
        mine, reference = ours[key], theirs[key]
        if (key.startswith(ARGS + ".") and mine is None) or (mine in (None, False) and reference in (None, False)):
            continue
        if mine != reference:
            found[key] = (mine, reference)
    return found
