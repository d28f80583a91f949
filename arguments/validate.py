"""`validate_args`: Megatron-LM's optimizer checks and rewrites on a parsed namespace.

- `--optimizer dist_muon` (deprecated) becomes `--optimizer muon` with the layer-wise
  distributed optimizer, with a DeprecationWarning saying what to write instead.
- `--use-distributed-optimizer` means the layer-wise distributed optimizer, for every optimizer
  (Megatron-LM does this for emerging optimizers; megatron_eopt has no byte-sharded one, and
  the layer-wise one shards Adam's and SGD's state as well).
- A combination the optimizer does not support (the registry's support facts, the README's
  table: `--tensor-model-parallel-size` > 1, `--fp16`, `--bf16`, `--use-torch-fsdp2`), and any
  value OptimizerConfig rejects, raise ValueError with a one-line message naming the flags;
  `parse_and_validate` turns that into `parser.error`-style output (exit code 2, one line on
  stderr). All before any process group or model exists.
- `--muon-tp-mode` given without tensor parallelism, or with an optimizer that is not Muon's,
  warns that it has no effect.
"""

import argparse
import re
import warnings
from typing import Optional, Sequence

from arguments.optimizer_args import FLAGS, GIVEN_FLAGS_ATTR, OPTION_OF, add_optimizer_args
from megatron_eopt.config.optimizer_names import (BUILTIN_OPTIMIZERS, EMERGING_OPTIMIZERS, FP16_NEEDS_LOSS_SCALING,
                                                  optimizer_names)
from megatron_eopt.config.precision import FLAG_VALUE_OF


def validate_args(
    args: argparse.Namespace, tensor_model_parallel_size: Optional[int] = None, *, wraps_fully_shard: bool = False
) -> argparse.Namespace:
    """Rewrite and check the optimizer flags of `args` in place; return `args`.

    `tensor_model_parallel_size`: None reads `args.tensor_model_parallel_size` (Megatron-LM's
    namespace has it), else 1. `wraps_fully_shard`: the calling trainer wraps its model with
    torch FSDP2's `fully_shard` under `--use-torch-fsdp2` (scripts/pretrain_gpt.py does);
    otherwise that flag is refused, since it would do nothing. Raises ValueError naming the
    offending flag.
    """
    if tensor_model_parallel_size is None:
        tensor_model_parallel_size = getattr(args, "tensor_model_parallel_size", None) or 1
    _rewrite_dist_muon(args)
    _check_support(args, tensor_model_parallel_size, wraps_fully_shard)
    check_cpu_offload_args(args)
    _use_layer_wise_distributed_optimizer(args)
    _warn_tp_mode_without_tp(args, tensor_model_parallel_size)
    from arguments.to_config import optimizer_config_from_args  # imports torch

    from megatron_eopt.registry import lookup_optimizer

    try:
        config = optimizer_config_from_args(args)
        lookup_optimizer(config.optimizer).check_config_fields(config)
    except (ValueError, TypeError) as error:
        raise ValueError(flag_message(str(error))) from None
    return args


def parse_and_validate(
    argv: Optional[Sequence[str]] = None,
    parser: Optional[argparse.ArgumentParser] = None,
    tensor_model_parallel_size: Optional[int] = None,
) -> argparse.Namespace:
    """Parse `argv` (default: sys.argv[1:]) and validate it; errors exit like argparse's.

    `parser`: one that already has `add_optimizer_args` (default: a fresh one with only those
    flags). A ValueError from `validate_args` prints `prog: error: message` (one line) to
    stderr and exits with code 2; argparse's own errors (bad choice, bad type) exit as usual.
    """
    if parser is None:
        parser = add_optimizer_args(argparse.ArgumentParser(description="Optimizer flags."))
    args = parser.parse_args(argv)
    try:
        return validate_args(args, tensor_model_parallel_size)
    except ValueError as error:
        parser.exit(2, f"{parser.prog}: error: {' '.join(str(error).split())}\n")


def refuse_flags_without(given: list[str], needed: str) -> None:
    """Refuse flags that mean something only with another setting, in one line:
    `--a and --b only apply with --needed ...` (nothing when `given` is empty)."""
    if given:
        verb = "only apply" if len(given) > 1 else "only applies"
        raise ValueError(f"{' and '.join(given)} {verb} with {needed}.")


def flag_message(message: str) -> str:
    """`message` about OptimizerConfig fields, with each field spelled as its flag and each dtype
    as the flags take it (torch.bfloat16 -> bf16), one line."""
    # A switch set the way its flag sets it is the flag alone: `bf16=True` -> `--bf16`,
    # `store_param_remainders=False` -> `--no-store-param-remainders`.
    switches = "|".join(sorted(SWITCH_VALUE, key=len, reverse=True))
    message = re.sub(r"(?:\bOptimizerConfig\.|(?<![\w.-]))(" + switches + r")=(True|False)\b", _switch, message)
    # One pass, so a flag already written is never rewritten. Bare field names ("must not exceed
    # lr") too, but 'optimizer' only after 'OptimizerConfig.': the word also appears in prose.
    bare = sorted((name for name in OPTION_OF if "_" in name or name == "lr"), key=len, reverse=True)
    pattern = r"\bOptimizerConfig\.(\w+)|(?<![\w-])(" + "|".join(bare) + r")(?![\w-])"
    message = re.sub(pattern, _option_for_field, message)
    message = re.sub(r"\btorch\.(float32|bfloat16|float16)\b", lambda m: FLAG_VALUE_OF[m.group(0)], message)
    return " ".join(message.replace("OptimizerConfig needs", "needs").split())


# Each switch's field -> the value its flag sets (True; False for the `--no-...` spellings).
SWITCH_VALUE: dict[str, str] = {flag.dest: str(not flag.negative) for flag in FLAGS if flag.type is None}


def _switch(match: re.Match) -> str:
    name, value = match.groups()
    return OPTION_OF[name] if SWITCH_VALUE[name] == value else match.group(0)


def _option_for_field(match: re.Match) -> str:
    name = match.group(1) or match.group(2)
    return OPTION_OF.get(name, f"OptimizerConfig.{name}")  # a field without a flag keeps its name


def _rewrite_dist_muon(args: argparse.Namespace) -> None:
    if args.optimizer != "dist_muon":
        return
    warnings.warn(
        "--optimizer dist_muon is deprecated; write --optimizer muon --use-distributed-optimizer "
        "instead (the layer-wise distributed optimizer).",
        DeprecationWarning,
        stacklevel=3,
    )
    args.optimizer = "muon"
    args.use_layer_wise_distributed_optimizer = True
    args.use_distributed_optimizer = False


def _check_support(args: argparse.Namespace, tensor_model_parallel_size: int, wraps_fully_shard: bool) -> None:
    """Refuse what the optimizer does not support (the registry's facts), naming the flags."""
    # Lazy, as in optimizer_args: which optimizers exist and what they support is installed state.
    from megatron_eopt.registry import lookup_optimizer, optimizers_supporting

    optimizer = args.optimizer
    wanted = {
        "tensor_parallel": (tensor_model_parallel_size > 1, f"--tensor-model-parallel-size {tensor_model_parallel_size}"),
        "fp16": (getattr(args, "fp16", False), "--fp16"),
        "bf16": (getattr(args, "bf16", False), "--bf16"),
        "fsdp2": (getattr(args, "use_torch_fsdp2", False) or getattr(args, "use_megatron_fsdp", False),
                  "--use-megatron-fsdp" if getattr(args, "use_megatron_fsdp", False) else "--use-torch-fsdp2"),
        "layer_wise": (_wants_layer_wise(args), "--use-distributed-optimizer"),
    }
    support = lookup_optimizer(optimizer).support
    for feature, (requested, flag) in wanted.items():
        if requested and not getattr(support, feature):
            raise ValueError(unsupported_line(flag, optimizer, support.why_not(feature), optimizers_supporting(feature)))
    if wanted["fsdp2"][0] and not wraps_fully_shard:
        # The library takes fully_shard models (get_megatron_optimizer); the trainer does not
        # wrap its model with fully_shard yet, so the flag would silently do nothing.
        raise ValueError(
            f"--use-torch-fsdp2 is not supported by this trainer yet (it does not wrap the model with "
            f"fully_shard); with --optimizer {optimizer}, get_megatron_optimizer accepts a model sharded "
            f"with torch.distributed.fsdp.fully_shard directly."
        )


def unsupported_line(flag: str, optimizer: str, why: str, supporting: Sequence[str]) -> str:
    """The refusal of `flag` with `optimizer`, naming the optimizers that support it."""
    alternatives = f"optimizers that do: {', '.join(supporting)}" if supporting else "no optimizer does yet"
    return f"{flag} is not supported with --optimizer {optimizer} ({why}; {alternatives})."


def check_before_import(args: argparse.Namespace) -> None:
    """The refusals of `validate_args` that the torch-free lists can decide, for a trainer's checks before
    torch is imported (flags not given are None): Megatron-LM's offload check, and --fp16 with an optimizer
    config/optimizer_names.py lists as emerging (none has loss scaling), in validate_args' words. With
    optimizers from other packages installed, whether one takes fp16 is known after the import."""
    optimizer = (getattr(args, "optimizer", None) or "adam").removeprefix("dist_")  # dist_muon: muon
    if getattr(args, "fp16", False) and _listed_as_emerging(optimizer):
        raise ValueError(unsupported_line("--fp16", optimizer, FP16_NEEDS_LOSS_SCALING, BUILTIN_OPTIMIZERS))
    check_cpu_offload_args(args)  # in validate_args' order


def _listed_as_emerging(optimizer: str) -> bool:
    """Whether the torch-free lists name `optimizer` an emerging one, when they name every installed
    optimizer (no other package registers one, which might take fp16: then the registry says)."""
    names = optimizer_names()
    return names is not None and set(names) == {*BUILTIN_OPTIMIZERS, *EMERGING_OPTIMIZERS} and (
        optimizer in EMERGING_OPTIMIZERS)


def check_cpu_offload_args(args: argparse.Namespace) -> None:
    """Megatron-LM's own check (its validate_args: offload runs on the precision-aware optimizer's
    path), and the fraction's range, before anything is built."""
    if not getattr(args, "optimizer_cpu_offload", False):
        return
    if not getattr(args, "use_precision_aware_optimizer", False):
        raise ValueError("--optimizer-cpu-offload needs --use-precision-aware-optimizer, as in Megatron-LM (whose "
                         "offloaded optimizer reuses that flag's code path); add it.")
    fraction = getattr(args, "optimizer_offload_fraction", None)
    if fraction is not None and not 0.0 <= fraction <= 1.0:
        raise ValueError(f"--optimizer-offload-fraction must be in [0, 1] (the fraction of the optimizer's elements "
                         f"whose state is on the host); got {fraction}.")


def _wants_layer_wise(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "use_distributed_optimizer", False)
                or getattr(args, "use_layer_wise_distributed_optimizer", False))


def _use_layer_wise_distributed_optimizer(args: argparse.Namespace) -> None:
    if getattr(args, "use_distributed_optimizer", False):
        args.use_layer_wise_distributed_optimizer = True
        args.use_distributed_optimizer = False


def _warn_tp_mode_without_tp(args: argparse.Namespace, tensor_model_parallel_size: int) -> None:
    given = getattr(args, GIVEN_FLAGS_ATTR, None) or ()
    if "muon_tp_mode" not in given:
        return
    readers = muon_tp_mode_readers()
    if args.optimizer not in readers:
        message = (f"--muon-tp-mode {args.muon_tp_mode} has no effect with --optimizer {args.optimizer}, which "
                   f"does not use Muon's tensor-parallel modes (those that do: {', '.join(readers)}).")
    elif tensor_model_parallel_size == 1:
        message = (f"--muon-tp-mode {args.muon_tp_mode} has no effect with tensor-model-parallel size 1 "
                   f"(every rank holds whole matrices).")
    else:
        return
    warnings.warn(message, UserWarning, stacklevel=3)


def muon_tp_mode_readers() -> list[str]:
    """Registered optimizers whose constructor takes `OptimizerConfig.muon_tp_mode` (muon, adaptive_muon)."""
    from megatron_eopt.config.optimizer_config import OptimizerConfig
    from megatron_eopt.registry import EmergingOptimizerEntry, list_optimizers, lookup_optimizer, optimizer_kwargs

    readers = []
    for name in list_optimizers():
        entry = lookup_optimizer(name).entry
        if isinstance(entry, EmergingOptimizerEntry):
            _, sources = optimizer_kwargs(name, entry, OptimizerConfig(optimizer=name, lr=1e-3))
            if sources.get("tp_mode") == "OptimizerConfig.muon_tp_mode":
                readers.append(name)
    return readers


def other_optimizers_flags_line(args: argparse.Namespace, config, given: Sequence[str]) -> Optional[str]:
    """The line naming each of the `given` flags that sets another optimizer than `config.optimizer`
    (registry/fields_read.py), as the command line gave it; None when there is none. Both entries print
    it as a warning, not a refusal: megatron-core accepts such flags."""
    from megatron_eopt.registry.fields_read import fields_without_effect

    unread = fields_without_effect(config, given)
    if not unread:
        return None
    shown = ", ".join(_flag_as_given(name, getattr(args, name)) for name in unread)
    them = "them (they set" if len(unread) > 1 else "it (it sets"
    return f"{shown}: no effect with --optimizer {config.optimizer}, which does not read {them} other optimizers)"


def _flag_as_given(name: str, value) -> str:
    """`--muon-momentum 0.8`; a switch as its flag alone (`--muon-nesterov`, `--soap-no-kl-shampoo`)."""
    option = OPTION_OF.get(name, "--" + name.replace("_", "-"))
    return option if isinstance(value, bool) else f"{option} {value}"
