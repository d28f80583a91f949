"""Megatron-LM's own training loop with megatron_eopt's optimizer.

Megatron-LM's `setup_model_and_optimizer` calls the name `get_megatron_optimizer` of
`megatron.training.training`. `install()` rebinds that name to
`get_megatron_optimizer_for_megatron_lm`, which turns Megatron-LM's arguments and
megatron-core's config into our `OptimizerConfig` and calls `megatron_eopt.get_megatron_optimizer`,
and `megatron.training.arguments.validate_args` to `validate_args_for_megatron_eopt`, which lets
emerging optimizers run on Megatron-FSDP and torch FSDP2. `uninstall()` puts the originals back.

`add_megatron_eopt_args` is the `extra_args_provider` that adds our choices and flags to
Megatron-LM's parser without changing any of its own; `NOT_OFFERED` names the two left out.
This is the only module of megatron_eopt that imports `megatron.training`; docs/megatron-lm.md
describes it.
"""

import argparse
import contextlib
import dataclasses
import datetime
import functools
import inspect
import typing
from typing import Any, Iterator, Optional

import megatron.training.arguments as megatron_lm_arguments
import megatron.training.checkpointing as megatron_lm_checkpointing
import megatron.training.training as megatron_lm_training
import torch
from megatron.training import global_vars
from torch.distributed.checkpoint import FileSystemReader

from arguments.optimizer_args import FLAGS, GIVEN_FLAGS_ATTR, Flag, StoreAndRecord, flag_kwargs
from arguments.validate import check_cpu_offload_args, flag_message, other_optimizers_flags_line
from megatron_eopt.checkpointing.dcp_optimizer_change import load_chain_state
from megatron_eopt.checkpointable.optimizer_change import OPT_IN_FIELD, OPT_IN_FLAG
from megatron_eopt.checkpointing.refusals import refuse_checkpoint_combinations, sharded_engine
from megatron_eopt.megatron_core_formats.layouts import LAYOUT_KEY, MEGATRON_CORE_PING_PONG_LAYOUT
from megatron_eopt.megatron_core_formats.moved_state import (load_moved_fresh, moved_parameters, saved_keys,
                                                             skip_bucket_state)
from megatron_eopt.megatron_core_formats.torch_dcp import load_megatron_core_dcp_state, megatron_core_torch_prefix
from megatron_eopt.megatron_core_formats.dist_checkpointing import (checkpoint_optimizer_layout,
                                                                    plain_state_dict_for_megatron_core)
from megatron_eopt.config.newton_schulz import NEWTON_SCHULZ_FIELDS
from megatron_eopt.config.optimizer_names import DEPRECATED_OPTIMIZER_NAMES
from megatron_eopt.config.optimizer_config import MatmulPrecision, OptimizerConfig, TpMode, megatron_core_default
from megatron_eopt.distributed.reduce_scattered import reduce_scattering_chunks
from megatron_eopt.factory import get_megatron_optimizer
from megatron_eopt.integrations.megatron_lm_qk_clip import (OptimizersOfModels, recording_max_logits,
                                                            validating_qk_clip_as_ours)
from megatron_eopt.integrations.megatron_lm_mla import taking_mla_head_widths
from megatron_eopt.integrations.megatron_lm_swiglu import splitting_every_state
from megatron_eopt.registry import list_optimizers, lookup_optimizer
from megatron_eopt.runtime.rank_exit import is_rank_zero
from megatron_eopt.runtime.cpu_stand_ins import replace_names
from megatron_eopt.runtime.help_text import escape_stray_percent_signs
from megatron_eopt.runtime.torchrun_store import restart_store

# Our flags that Megatron-LM's parser must not get, and why.
NOT_OFFERED = {
    "use_layer_wise_distributed_optimizer": "Megatron-LM's validate_args sets it itself (True for "
    "an emerging optimizer with --use-distributed-optimizer) and overwrites any given value",
    "layer_wise_reduce_grads": "Megatron-LM always wraps the model in its DDP, which has already "
    "all-reduced the gradients the optimizer sees",
}
_PATCHED_NAME = "get_megatron_optimizer"
_original: Optional[Any] = None  # Megatron-LM's function while ours is installed
_original_validate_args: Optional[Any] = None  # Megatron-LM's validate_args while ours is installed
_undo_replacements: list = []  # while installed: undoes the checkpoint-layout, optimizer-config and QK-clip replacements
_optimizers_of_models = OptimizersOfModels()  # what clip_qk reads our step's largest logit from
# What Megatron-LM's validate_args lets run on Megatron-FSDP and FSDP2; it refuses every other optimizer there.
_MEGATRON_FSDP_OPTIMIZERS = ("adam", "sgd")
# The precision-aware optimizer's switch and dtypes, with their values when it is off.
_PRECISION_AWARE_OFF = {"use_precision_aware_optimizer": False, "main_grads_dtype": torch.float32,
                        "main_params_dtype": torch.float32, "exp_avg_dtype": torch.float32,
                        "exp_avg_sq_dtype": torch.float32}


# ---------------------------------------------------------------- command line


def add_megatron_eopt_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`extra_args_provider` for Megatron-LM's `parse_args`/`pretrain`: our choices and flags.

    Megatron-LM's existing actions are extended in place (their option strings, dests and
    other defaults stay as they are); flags it lacks are added with dest == config field. A
    help string of Megatron-LM's that argparse cannot print gets its stray `%` doubled.
    """
    actions = parser._option_string_actions  # argparse has no public lookup by option string
    _extend_choices(actions["--optimizer"], list_optimizers())
    tp_mode = actions["--muon-tp-mode"]
    _extend_choices(tp_mode, typing.get_args(TpMode))
    tp_mode.default = _field_default("muon_tp_mode")
    _restrict_matmul_precision(actions["--muon-fp32-matmul-prec"])
    group = parser.add_argument_group(title="megatron_eopt")
    for flag in FLAGS:
        if flag.option not in actions and flag.dest not in NOT_OFFERED:
            _add_flag(group, flag)
    # Record which optimizer fields the command line gave: given, the Newton-Schulz fields reach every
    # orthogonalizing optimizer, not given they give way to Turbo-Muon's and the optimizers' own
    # (config/newton_schulz.py); and another optimizer's field given is named as without effect, even
    # at its default (flags_without_effect_line). (Not marked values in `args`: Megatron-LM pickles
    # args into its checkpoints and loads them weights-only.) A switch is no store action: given, its
    # value is off its default.
    fields = {field.name for field in dataclasses.fields(OptimizerConfig)}
    for action in parser._actions:
        if type(action) is argparse._StoreAction and (action.dest in fields or action.dest in NEWTON_SCHULZ_FIELDS):
            action.__class__ = StoreAndRecord  # a store action that also records its dest
    escape_stray_percent_signs(parser)  # Megatron-LM 0.19.2's own help has one: --help failed (runtime/help_text.py)
    return parser


def _extend_choices(action: argparse.Action, extra: typing.Iterable[str]) -> None:
    action.choices = list(action.choices) + [c for c in extra if c not in action.choices]


def _restrict_matmul_precision(action: argparse.Action) -> None:
    """Exactly our config's precisions, in place of Megatron-LM's list (which has 'low')."""
    allowed = typing.get_args(MatmulPrecision)

    def precision(value: str) -> str:
        if value not in allowed:
            raise argparse.ArgumentTypeError(
                f"{value!r} is not a float32 matmul precision megatron_eopt accepts (torch's "
                f"set_float32_matmul_precision takes {', '.join(allowed)}; 'medium' already uses "
                f"bf16 matmuls); choose one of {', '.join(allowed)}."
            )
        return value

    action.type = precision
    action.choices = list(allowed)


def _add_flag(group: Any, flag: Flag) -> None:
    group.add_argument(flag.option, **flag_kwargs(flag, _field_default(flag.dest)))


def _field_default(name: str) -> Any:
    return next(f.default for f in dataclasses.fields(OptimizerConfig) if f.name == name)


# ---------------------------------------------------------------- config


def optimizer_config_from_megatron_lm(args: Optional[argparse.Namespace], config: Any,
                                      model_chunks: Optional[list] = None) -> OptimizerConfig:
    """Our OptimizerConfig from megatron-core's `config` plus Megatron-LM's `args`.

    Every field megatron-core's config has is taken from it (Megatron-LM may have changed it
    after parsing, e.g. `config.timers`); our fields it lacks (`muon_match_adamw_rms`,
    `muon_use_syrk`, ...) are read from `args` by name, as Megatron-LM reads its own.
    `model_chunks`: the chunks the optimizer is for; when their DDP reduce-scatters, the
    optimizer is megatron-core's DistributedOptimizer, which writes `--ckpt-format torch`.
    """
    ours = [f.name for f in dataclasses.fields(OptimizerConfig)]
    values = {name: getattr(config, name) for name in ours if hasattr(config, name)}
    if args is not None:
        values.update({n: getattr(args, n) for n in ours if n not in values and hasattr(args, n)})
        given = getattr(args, GIVEN_FLAGS_ATTR, None) or ()
        for name in NEWTON_SCHULZ_FIELDS:  # left at their defaults: marked so (add_megatron_eopt_args)
            if name in values and name not in given and type(values[name]) in (str, int):
                values[name] = megatron_core_default(values[name])
        check_optimizer_args_read(args)
        _check_checkpoint_format(args, _reduce_scatters(model_chunks))
        if getattr(args, "use_megatron_fsdp", False):
            # Megatron-LM sets use_distributed_optimizer for Megatron-FSDP (its DistributedOptimizer
            # over Megatron-FSDP's buffers); ours steps the DTensor shards Megatron-FSDP gives.
            values.update(use_distributed_optimizer=False, use_layer_wise_distributed_optimizer=False)
    ours = OptimizerConfig(**values)
    try:
        lookup_optimizer(ours.optimizer).check_config_fields(ours)
    except ValueError as error:  # in the flags' words: Megatron-LM's user set them on the command line
        raise ValueError(flag_message(str(error))) from None
    return ours


def check_optimizer_args_read(args: argparse.Namespace) -> None:
    """Refuse, in one line naming them, Megatron-LM arguments that set the optimizer but that ours
    does not read: an attribute of `args` one of whose words is an optimizer's first word (`muon`,
    `soap`, `adaptive`, `psgd`, ...: the names Megatron-LM's `--optimizer` and our registry list,
    deprecated spellings aside), which is no `OptimizerConfig` field, and whose value is not
    Megatron-LM's parser default (False or None where its parser lacks it)."""
    defaults, names = _megatron_lm_parser_facts()
    words = {name.split("_")[0] for name in set(names) | set(list_optimizers())
             if name not in DEPRECATED_OPTIMIZER_NAMES}
    read = {field.name for field in dataclasses.fields(OptimizerConfig)} | {GIVEN_FLAGS_ATTR}
    unread = [f"args.{name}={value!r}" for name, value in sorted(vars(args).items())
              if name not in read and words & set(name.split("_")) and not _is_default(value, name, defaults)]
    if unread:
        raise ValueError(
            f"megatron_eopt's optimizer does not read {', '.join(unread)}: it would train as if "
            f"{'they were' if len(unread) > 1 else 'it were'} not given. Leave "
            f"{'them' if len(unread) > 1 else 'it'} at Megatron-LM's default, or train with Megatron-LM's "
            f"own optimizer (without megatron_lm.install())."
        )


def _is_default(value: Any, name: str, defaults: dict[str, Any]) -> bool:
    return value == defaults[name] if name in defaults else value in (None, False)


@functools.cache
def _megatron_lm_parser_facts() -> tuple[dict[str, Any], tuple[str, ...]]:
    """(every dest's default, the `--optimizer` choices) of the installed Megatron-LM's parser."""
    parser = megatron_lm_arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    defaults = {action.dest: action.default for action in parser._actions}
    return defaults, tuple(parser._option_string_actions["--optimizer"].choices or ())


def flags_without_effect_line(args: argparse.Namespace, config: OptimizerConfig) -> Optional[str]:
    """The line naming every flag given that sets another optimizer than `config.optimizer`; None when
    there is none. A warning, not a refusal: megatron-core accepts them. Given: recorded by the parser
    (add_megatron_eopt_args), or off the parser's default."""
    defaults = _parser_defaults_with_ours()
    recorded = getattr(args, GIVEN_FLAGS_ATTR, None) or ()
    given = [name for name, value in vars(args).items()
             if name in recorded or (name in defaults and value != defaults[name])]
    return other_optimizers_flags_line(args, config, given)


@functools.cache
def _parser_defaults_with_ours() -> dict[str, Any]:
    """Every dest's default in Megatron-LM's parser with our flags (add_megatron_eopt_args)."""
    parser = add_megatron_eopt_args(
        megatron_lm_arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
    return {action.dest: action.default for action in parser._actions}


def _reduce_scatters(model_chunks: Any) -> bool:
    if model_chunks is None:
        return False
    chunks = [model_chunks] if isinstance(model_chunks, torch.nn.Module) else list(model_chunks)
    return bool(chunks) and bool(reduce_scattering_chunks(chunks))


def _check_checkpoint_format(args: argparse.Namespace, byte_sharded: bool = False) -> None:
    """The arguments' refusals (checkpointing/refusals.py), and one the model decides: whether its
    DDP reduce-scatters (`byte_sharded`: megatron-core's DistributedOptimizer steps, which writes
    every format)."""
    refuse_checkpoint_combinations(args, "megatron_lm")
    if getattr(args, OPT_IN_FIELD, False):
        _check_optimizer_change_format(args, byte_sharded)
    if byte_sharded or sharded_engine(args):
        return
    if getattr(args, "use_distributed_optimizer", False) and getattr(args, "ckpt_format", None) == "torch":
        raise ValueError(
            "--use-distributed-optimizer with --ckpt-format torch makes Megatron-LM save "
            "megatron-core's DistributedOptimizer parameter-state files "
            "(optimizer.save_parameter_state), which megatron_eopt's layer-wise optimizer does "
            "not write; use --ckpt-format torch_dist (the default)."
        )


def _check_optimizer_change_format(args: argparse.Namespace, byte_sharded: bool) -> None:
    """--allow-optimizer-change-on-load applies to our optimizer's torch_dcp and torch_dist loads."""
    ckpt_format = getattr(args, "ckpt_format", None)
    if ckpt_format not in ("torch_dcp", "torch_dist"):
        raise ValueError(
            f"{OPT_IN_FLAG} applies to --ckpt-format torch_dist and torch_dcp loads in Megatron-LM's loop (and to "
            f"scripts/pretrain_gpt.py's); Megatron-LM's --ckpt-format {ckpt_format} load does not apply it. Load "
            f"with --no-load-optim to start all optimizer state fresh, or drop the flag.")
    if ckpt_format == "torch_dist" and byte_sharded:
        raise ValueError(
            f"{OPT_IN_FLAG}: megatron-core's DistributedOptimizer steps this run (--optimizer adam "
            f"--use-distributed-optimizer over a reduce-scattering DDP), and its --ckpt-format torch_dist load does "
            f"not apply it. Load with --no-load-optim to start all optimizer state fresh, or drop the flag.")


def get_megatron_optimizer_for_megatron_lm(
    config: Any,
    model_chunks: Any,
    config_overrides: Optional[Any] = None,
    use_gloo_process_groups: bool = True,
    pg_collection: Any = None,
    dump_param_to_param_group_map: Optional[str] = None,
) -> Any:
    """What `install()` puts in Megatron-LM's place: megatron-core's signature, our optimizer.

    Reads Megatron-LM's global args (when they are set) for our fields megatron-core's config
    lacks, then calls `megatron_eopt.get_megatron_optimizer`.
    """
    args = global_vars._GLOBAL_ARGS  # get_args() asserts when unset; None: no Megatron-LM run
    ours = optimizer_config_from_megatron_lm(args, config, model_chunks)
    line = None if args is None else flags_without_effect_line(args, ours)
    if line and is_rank_zero():
        print(f"megatron_eopt: {line}", flush=True)
    optimizer = get_megatron_optimizer(
        ours,
        model_chunks,
        config_overrides=config_overrides,
        use_gloo_process_groups=use_gloo_process_groups,
        pg_collection=pg_collection,
        dump_param_to_param_group_map=dump_param_to_param_group_map,
    )
    if hasattr(optimizer, "state_dict_by_child_name"):  # Megatron-LM's checkpoints hold our layout by name
        optimizer.state_dict_by_child_name = True
    return _optimizers_of_models.remember(model_chunks, optimizer)


# ---------------------------------------------------------------- validate_args


def validate_args_for_megatron_eopt(args: argparse.Namespace, defaults: Optional[dict] = None) -> argparse.Namespace:
    """Megatron-LM's validate_args, which `install()` puts in its place: the same, except that an
    emerging optimizer (`--optimizer muon`, ...) with `--use-megatron-fsdp` or `--use-torch-fsdp2`
    is not refused.

    Megatron-LM refuses them (asserts in its FSDP blocks and in its emerging-optimizer block,
    which also allows only the torch and torch_dist formats), and the latter would turn
    `--use-distributed-optimizer`, which it sets for Megatron-FSDP itself, into the layer-wise
    optimizer. So the checks run as for `--optimizer adam`, and the optimizer is put back after them.

    With the layer-wise optimizer (`--optimizer muon --use-distributed-optimizer`), Megatron-LM's
    default parameter layout makes its DDP reduce-scatter, into shards laid out for megatron-core's
    own layer-wise optimizer; ours owns whole parameters by its own balance and needs each whole
    gradient. So the layout is Megatron-LM's other one, `--no-use-layer-wise-param-layout` (DDP
    all-reduces; the same steps), said in one line on rank 0.

    Megatron-LM's argument dump, which its validate_args prints at its end, is printed after all
    that (_printing_arguments_after), so that it shows the values that run: inside, --qk-clip and
    --log-max-attention-logit are off and an emerging optimizer on an FSDP engine reads adam.
    """
    with _printing_arguments_after() as printed:
        validated = _validated_for_megatron_eopt(args, defaults)
    refuse_checkpoint_combinations(validated, "megatron_lm")  # before any work: not at the first save
    printed(validated)
    return validated


@contextlib.contextmanager
def _printing_arguments_after() -> Iterator[Any]:
    """Megatron-LM's `_print_args` (the argument dump) held back inside; yields a function that prints
    each dump held back, with the arguments it is given."""
    print_args = megatron_lm_arguments._print_args
    titles: list[str] = []
    megatron_lm_arguments._print_args = lambda title, args: titles.append(title)

    def print_held_back(final: argparse.Namespace) -> None:
        for title in titles:
            print_args(title, final)

    try:
        yield print_held_back
    finally:
        megatron_lm_arguments._print_args = print_args


def _validated_for_megatron_eopt(args: argparse.Namespace, defaults: Optional[dict]) -> argparse.Namespace:
    check_optimizer_args_read(args)
    if getattr(args, "use_precision_aware_optimizer", False):  # without it Megatron-LM's own check says so
        check_cpu_offload_args(args)
        _check_precision_aware_adam(args)
    validate = validating_qk_clip_as_ours(_original_validate_args or megatron_lm_arguments.validate_args)
    defaults = {} if defaults is None else defaults
    optimizer = getattr(args, "optimizer", "adam")
    engine = ("Megatron-FSDP" if getattr(args, "use_megatron_fsdp", False)
              else "torch FSDP2" if getattr(args, "use_torch_fsdp2", False) else None)
    if engine is None or optimizer in _MEGATRON_FSDP_OPTIMIZERS:
        return _with_whole_gradients(validate(args, defaults))
    if optimizer.startswith("dist_"):
        raise ValueError(f"--optimizer {optimizer} is the layer-wise distributed optimizer, which has nothing to "
                         f"shard on {engine}; use --optimizer {optimizer.removeprefix('dist_')}.")
    args.optimizer = "adam"
    try:
        validated = validate(args, defaults)
    finally:
        args.optimizer = optimizer
    validated.optimizer = optimizer
    validated.use_layer_wise_distributed_optimizer = False
    return validated


def _check_precision_aware_adam(args: argparse.Namespace) -> None:
    """Where megatron-core's DistributedOptimizer steps (`_megatron_core_steps`) the precision-aware
    optimizer is its own, which needs Transformer Engine's FusedAdam, except with host offload (its
    HybridDeviceOptimizer). Without it megatron-core's config raises on every rank, after the
    model is built: refused here, in one line, before any work. Ours does not step in its place:
    its reduced-precision Adam is not TE's FusedAdam, whose rounding a run here would then differ from."""
    if not _megatron_core_steps(args) or getattr(args, "optimizer_cpu_offload", False):
        return
    try:
        from transformer_engine.pytorch.optimizers import FusedAdam  # noqa: F401 (megatron-core's import)
    except ImportError:
        raise ValueError(
            "--use-precision-aware-optimizer with --optimizer adam --use-distributed-optimizer is megatron-core's "
            "precision-aware DistributedOptimizer, which needs Transformer Engine's FusedAdam (not installed): "
            "install transformer-engine, or add --optimizer-cpu-offload (megatron-core's host optimizer, no "
            "Transformer Engine needed), or drop --use-distributed-optimizer (megatron_eopt's Adam keeps these "
            "dtypes), or drop --use-precision-aware-optimizer.") from None


def _with_whole_gradients(args: argparse.Namespace) -> argparse.Namespace:
    """Megatron-LM's all-reducing DDP layout for our layer-wise optimizer (validate_args_for_megatron_eopt)."""
    if getattr(args, "use_layer_wise_distributed_optimizer", False) and getattr(args, "use_layer_wise_param_layout", True):
        args.use_layer_wise_param_layout = False
        if getattr(args, "rank", 0) == 0:
            print("megatron_eopt: --optimizer " + str(args.optimizer) + " --use-distributed-optimizer runs "
                  "megatron_eopt's layer-wise optimizer, which needs whole gradients: Megatron-LM's DDP "
                  "all-reduces (--no-use-layer-wise-param-layout).", flush=True)
    return args


# ---------------------------------------------------------------- install


def install() -> None:
    """Make Megatron-LM's `setup_model_and_optimizer` build megatron_eopt's optimizer.

    Rebinds `megatron.training.training.get_megatron_optimizer` (the name that function calls),
    `megatron.training.arguments.validate_args` (validate_args_for_megatron_eopt), the names of
    `megatron.training.checkpointing` that carry a checkpoint's optimizer layout and split SwiGLU
    state (_checkpoint_layout_replacements), `get_megatron_optimizer_config`
    (_optimizer_config_replacement), the model builder's DDP wrap (_model_placement_replacement) and
    the initialization's store under torchrun (store_per_restart). Calling it again while installed
    changes nothing.
    """
    global _original, _original_validate_args
    if _original is None:
        _original = getattr(megatron_lm_training, _PATCHED_NAME)
        setattr(megatron_lm_training, _PATCHED_NAME, get_megatron_optimizer_for_megatron_lm)
    if _original_validate_args is None:
        _original_validate_args = megatron_lm_arguments.validate_args
        megatron_lm_arguments.validate_args = validate_args_for_megatron_eopt
    if not _undo_replacements:  # MLA's core attention first: the QK-clip recorder wraps its __init__
        _undo_replacements.extend(replace_names(local_attention_for_mla()))
        _undo_replacements.extend(replace_names(_checkpoint_layout_replacements() + _optimizer_config_replacement()
                                                + _qk_clip_replacements() + _parser_replacement()
                                                + _model_placement_replacement() + store_per_restart()))


def store_per_restart() -> list[tuple[Any, str, Any]]:
    """Under torchrun, Megatron-LM's `initialize_megatron` meets in a key space of this attempt's own
    (runtime/torchrun_store.py) when its caller gave `pretrain` no store: after torchrun restarted a
    killed worker, every rank waited in megatron-core's first `new_group`, among the keys of the dead
    attempt (measured: 6 minutes, then killed). Outside torchrun, or given a store, nothing changes.
    The loop script applies it with `--megatron-core-optimizer` too."""
    import megatron.training.initialize as megatron_lm_initialize

    initialize_distributed = megatron_lm_initialize._initialize_distributed

    def initialize_distributed_per_attempt(get_embedding_ranks: Any, get_position_embedding_ranks: Any,
                                           store: Any, *args: Any, **kwargs: Any) -> Any:
        if store is None and not torch.distributed.is_initialized():
            given = global_vars.get_args()
            store = restart_store(given.rank, given.world_size,
                                  datetime.timedelta(minutes=given.distributed_timeout_minutes))
        return initialize_distributed(get_embedding_ranks, get_position_embedding_ranks, store, *args, **kwargs)

    return [(megatron_lm_initialize, "_initialize_distributed", initialize_distributed_per_attempt)]


def local_attention_for_mla() -> list[tuple[Any, str, Any]]:
    """megatron-core's local attention taking MLA's head widths (integrations/megatron_lm_mla.py), so that
    `--multi-latent-attention --transformer-impl local` builds; the loop script applies it with
    `--megatron-core-optimizer` too."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return taking_mla_head_widths(DotProductAttention)


def _parser_replacement() -> list[tuple[Any, str, Any]]:
    """Megatron-LM parses the command line again with no `extra_args_provider` before its main parse
    (`ft_integration.setup`, `inprocess_restart`): there our choices (`--optimizer laprop`,
    `--muon-tp-mode sharded`, ...) are invalid and end the run. While installed, a parse given no
    provider adds ours; one given a provider is left as it is."""
    parse_args = megatron_lm_arguments.parse_args

    def parse_args_with_ours(extra_args_provider: Optional[Any] = None, ignore_unknown_args: bool = False) -> Any:
        return parse_args(extra_args_provider or add_megatron_eopt_args, ignore_unknown_args)

    return [(megatron_lm_arguments, "parse_args", parse_args_with_ours)]


def _model_placement_replacement() -> list[tuple[Any, str, Any]]:
    """Megatron-LM's model builder (megatron/training/models/dist_utils.py, which pretrain_gpt.py
    uses) leaves a `--use-cpu-initialization` model on the CPU and lets DDP move it: megatron-core's
    DistributedOptimizer re-maps every parameter into DDP's CUDA buffers. Our layer-wise optimizer
    runs over an all-reducing DDP (_with_whole_gradients), which re-maps only the gradients, so the
    parameters stayed on the CPU and the first forward failed on a GPU. Before a DDP wrap on a
    machine with CUDA the chunks move to the current device, as Megatron-LM's `get_model` moves them
    (Megatron-FSDP and FSDP2 place the parameters themselves)."""
    from megatron.training.models import dist_utils

    ddp_wrap = dist_utils._ddp_wrap
    signature = inspect.signature(ddp_wrap)

    def ddp_wrap_on_the_current_device(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        sharded = bound.arguments["use_megatron_fsdp"] or bound.arguments["use_torch_fsdp2"]
        if torch.cuda.is_available() and not sharded:
            for chunk in bound.arguments["model"]:
                chunk.cuda(torch.cuda.current_device())
        return ddp_wrap(*args, **kwargs)

    return [(dist_utils, "_ddp_wrap", ddp_wrap_on_the_current_device)]


def _qk_clip_replacements() -> list[tuple[Any, str, Any]]:
    """QK-clip is our optimizer's (integrations/megatron_lm_qk_clip.py): megatron-core's local attention
    records the largest logits, and Megatron-LM's `clip_qk` after the step only reads what ours measured."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return recording_max_logits(DotProductAttention) + [
        (megatron_lm_training, "clip_qk", _optimizers_of_models.max_attention_logit_of_our_step)]


def _optimizer_config_replacement() -> list[tuple[Any, str, Any]]:
    """megatron-core's OptimizerConfig checks the precision-aware optimizer (`--use-precision-aware-
    optimizer`, `--exp-avg-dtype`, ...) as its own implementation needs it: Adam only, with its
    DistributedOptimizer, and Transformer Engine's FusedAdam installed. Ours keeps reduced-precision
    state for every optimizer itself and checks the fields in our OptimizerConfig (config/precision.py).
    So where ours steps, megatron-core's config is built with the fields off and then given the
    values asked for; where megatron-core's DistributedOptimizer steps (`--optimizer adam
    --use-distributed-optimizer` over Megatron-LM's DDP), its checks run as they are."""
    build = megatron_lm_training.get_megatron_optimizer_config

    def get_megatron_optimizer_config(args: Any) -> tuple:
        if not getattr(args, "use_precision_aware_optimizer", False) or _megatron_core_steps(args):
            return build(args)
        asked = {name: getattr(args, name) for name in _PRECISION_AWARE_OFF if hasattr(args, name)}
        vars(args).update({name: _PRECISION_AWARE_OFF[name] for name in asked})
        try:
            config, overrides = build(args)
        finally:
            vars(args).update(asked)
        for name, value in asked.items():
            setattr(config, name, value)
        return config, overrides

    return [(megatron_lm_training, "get_megatron_optimizer_config", get_megatron_optimizer_config)]


def _megatron_core_steps(args: Any) -> bool:
    """Whether get_megatron_optimizer_for_megatron_lm hands the step to megatron-core's
    DistributedOptimizer: Adam over Megatron-LM's reduce-scattering DDP."""
    sharded = getattr(args, "use_megatron_fsdp", False) or getattr(args, "use_torch_fsdp2", False)
    return args.optimizer == "adam" and getattr(args, "use_distributed_optimizer", False) and not sharded


def _checkpoint_layout_replacements() -> list[tuple[Any, str, Any]]:
    """Megatron-LM's pretrain_gpt.py builds megatron-core's layer-wise optimizer (`--optimizer
    <emerging> --use-distributed-optimizer`) over a DDP that all-reduces (its model builder,
    megatron/training/models/dist_utils.py, gives the DDP no layer-wise parameter layout), so that
    optimizer writes every child keyed by parameter under the distributed sharding type. Ours
    writes that layout there too (MEGATRON_CORE_PING_PONG_LAYOUT, asked for in the save's
    metadata), and a load reads the layout the checkpoint holds, named from its keys when
    megatron-core wrote it (checkpoint_optimizer_layout) into the metadata Megatron-LM hands
    the optimizer. `--ckpt-format torch` saves megatron-core's plain `state_dict()` layout
    (plain_state_dict_for_megatron_core), which megatron-core's optimizer and ours both load. A
    torch_dist load first names the parameters whose optimizer changed since the save
    (megatron_core_formats/moved_state.py): refused in one line, or with --allow-optimizer-change-on-load
    read around, their state fresh."""
    from megatron.core.dist_checkpointing import load_content_metadata

    build_metadata = megatron_lm_checkpointing._build_sharded_state_dict_metadata
    load_base = megatron_lm_checkpointing._load_global_dist_base_checkpoint
    generate = megatron_lm_checkpointing.generate_state_dict

    def generate_state_dict(args, model, optimizer, *rest, **kwargs) -> dict:
        state_dict = generate(args, model, optimizer, *rest, **kwargs)
        if args.ckpt_format == "torch" and "optimizer" in state_dict:
            state_dict["optimizer"] = plain_state_dict_for_megatron_core(optimizer, state_dict["optimizer"])
        return state_dict

    def sharded_state_dict_metadata(args, *rest, **kwargs) -> dict:
        metadata = build_metadata(args, *rest, **kwargs)
        if getattr(args, "use_layer_wise_distributed_optimizer", False) and metadata.get(
                "distrib_optim_sharding_type") not in (None, "fsdp_dtensor"):
            metadata[LAYOUT_KEY] = MEGATRON_CORE_PING_PONG_LAYOUT
        return metadata

    def load_global_dist_base_checkpoint(load_dir, args, rank0, *rest, **kwargs):
        moved = set()
        if not rank0 and len(rest) >= 3 and isinstance(rest[0], dict) and "optimizer" in rest[0]:
            sharded_state_dict, iteration, release = rest[:3]  # a parameter moved: one line, not a missing key
            name = megatron_lm_checkpointing.get_checkpoint_name(load_dir, iteration, release, return_base_dir=True)
            allowed, keys = bool(getattr(args, OPT_IN_FIELD, False)), saved_keys(name)  # one metadata read
            if skip_bucket_state(sharded_state_dict["optimizer"], name, allowed, keys):
                del sharded_state_dict["optimizer"]
                args.no_load_optim = True  # Megatron-LM's load then remakes the main copies from the model
            else:
                moved = moved_parameters(sharded_state_dict["optimizer"], name, allowed, keys)
        if moved:  # --allow-optimizer-change-on-load: their state starts fresh, the rest loads
            loaded = load_moved_fresh(lambda: load_base(load_dir, args, rank0, *rest, **kwargs), rest[0], moved)
        else:
            loaded = load_base(load_dir, args, rank0, *rest, **kwargs)
        state_dict, checkpoint_name = loaded[0], loaded[1]
        metadata = load_content_metadata(preloaded_state_dict=state_dict) if rank0 and state_dict else None
        if metadata is not None and LAYOUT_KEY not in metadata:
            layout = checkpoint_optimizer_layout(checkpoint_name, metadata)
            if layout is not None:
                metadata[LAYOUT_KEY] = layout
        return loaded

    return [(megatron_lm_checkpointing, "_build_sharded_state_dict_metadata", sharded_state_dict_metadata),
            (megatron_lm_checkpointing, "generate_state_dict", generate_state_dict),
            (megatron_lm_checkpointing, "_load_base_checkpoint",
             loading_our_dcp_optimizer_state(megatron_lm_checkpointing._load_base_checkpoint)),
            (megatron_lm_checkpointing, "_load_global_dist_base_checkpoint", load_global_dist_base_checkpoint),
            (megatron_lm_checkpointing, "handle_swiglu_in_state_dict",
             splitting_every_state(megatron_lm_checkpointing.handle_swiglu_in_state_dict))]


def loading_our_dcp_optimizer_state(load_base: Any) -> Any:
    """Megatron-LM's `_load_base_checkpoint`, with ours' `--ckpt-format torch_dcp` optimizer state read
    apart (checkpointing/dcp_optimizer_change.py): a parameter whose optimizer changed since the save
    is named in a ValueError, or with --allow-optimizer-change-on-load starts fresh, instead of DCP's
    missing-key traceback; with --no-load-optim or --finetune, which Megatron-LM's load then ignores, it is not read;
    megatron-core's optimizer's state (torch's layout) is read into ours (megatron_core_formats/torch_dcp.py)."""

    def load_base_checkpoint(load_dir, args, rank0=False, sharded_state_dict=None, **kwargs):
        target = (sharded_state_dict or {}).get("optimizer")
        if rank0 or getattr(args, "ckpt_format", None) != "torch_dcp" or not (
                isinstance(target, dict) and "optimizers" in target):
            return load_base(load_dir, args, rank0, sharded_state_dict, **kwargs)
        del sharded_state_dict["optimizer"]
        try:
            loaded = load_base(load_dir, args, rank0, sharded_state_dict, **kwargs)
        finally:
            sharded_state_dict["optimizer"] = target
        state_dict, checkpoint_name = loaded[0], loaded[1]
        if state_dict is not None:
            if not (getattr(args, "no_load_optim", False) or getattr(args, "finetune", False)):
                _read_our_dcp_optimizer_state(target, checkpoint_name, bool(getattr(args, OPT_IN_FIELD, False)))
            state_dict["optimizer"] = target
        return loaded

    return load_base_checkpoint


def _read_our_dcp_optimizer_state(target: dict, checkpoint_name: str, allowed: bool) -> None:
    """Into our chain's load target: what megatron-core's optimizer saved (torch's layout), or ours."""
    saved_keys = set(FileSystemReader(checkpoint_name).read_metadata().state_dict_metadata)
    if megatron_core_torch_prefix(saved_keys):
        load_megatron_core_dcp_state(target, checkpoint_name)
    else:
        load_chain_state(target, checkpoint_name, allowed)


def uninstall() -> None:
    """Put Megatron-LM's own `get_megatron_optimizer` back (no-op when not installed)."""
    global _original, _original_validate_args
    if _original is not None:
        setattr(megatron_lm_training, _PATCHED_NAME, _original)
        _original = None
    if _original_validate_args is not None:
        megatron_lm_arguments.validate_args = _original_validate_args
        _original_validate_args = None
    while _undo_replacements:
        _undo_replacements.pop()()


def is_installed() -> bool:
    return getattr(megatron_lm_training, _PATCHED_NAME) is get_megatron_optimizer_for_megatron_lm


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """`with installed(): pretrain(...)`: installed inside, the previous state restored after."""
    was_installed = is_installed()
    install()
    try:
        yield
    finally:
        if not was_installed:
            uninstall()
