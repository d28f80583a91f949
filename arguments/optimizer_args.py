"""Megatron-LM-compatible optimizer flags: `add_optimizer_args(parser)`.

Every flag's `dest` is the `OptimizerConfig` field of the same name, and every default is read
from `dataclasses.fields(OptimizerConfig)`, so trainers that copy argparse attributes onto the
config by name get the config that `OptimizerConfig()` gives, except: `--muon-fp32-matmul-prec`
(None: chosen for the hardware by `optimizer_config_from_args`) and MEGATRON_LM_PARSER_DEFAULTS'
flags (Megatron-LM's parser's defaults: `--muon-momentum` 0.9, not megatron-core's 0.95).

Flags are spelled as Megatron-LM spells them: `store_true` booleans, except its negative
spellings `--muon-no-split-qkv` and `--soap-no-kl-shampoo`. Importing this module imports no
torch: the defaults and the installed choices (`list_optimizers`, `coefficient_types`) are read
inside `add_optimizer_args`; with `deferred=True` not at all (defaults None; the installed
choices from the torch-free lists of optimizer_names.py where they describe the installed
emerging_optimizers), and `resolve_optimizer_flags` fills and checks them later, so a trainer
parses before torch.
"""

import argparse
import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from arguments.close_match import did_you_mean
from megatron_eopt.config.choices import (
    AdaptiveMoment2Method,
    HardwareProfileName,
    MatmulPrecision,
    ScalarOptimizer,
    ScaleMode,
    TpMode,
    is_megatron_core_default,
)
from megatron_eopt.config.optimizer_names import DEPRECATED_OPTIMIZER_NAMES, coefficient_types, optimizer_names

GIVEN_FLAGS_ATTR = "optimizer_flags_given"  # Namespace attribute: dests set on the command line


@dataclass(frozen=True)
class Flag:
    """One command-line flag: `option` sets `OptimizerConfig.<dest>`."""

    option: str
    dest: str
    help: str
    type: Optional[Callable[[str], Any]] = None  # None: a boolean switch
    choices: Optional[Callable[[], tuple[str, ...]]] = None  # read when the parser is built
    negative: bool = False  # a `--no-...` switch: store_false
    hardware_default: bool = False  # default None: optimizer_config_from_args chooses for the device
    installed: bool = False  # choices read from the installed packages (imports torch)
    listed: Optional[Callable[[], Optional[tuple[str, ...]]]] = None  # the same, torch-free (None: unknown)


# Megatron-LM's names of the precision-aware dtypes (fp8 state is not implemented here).
DTYPE_NAMES: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # flag value: torch name
DTYPE_CHOICES: tuple[str, ...] = tuple(DTYPE_NAMES)


def _optimizer_choices() -> tuple[str, ...]:
    from megatron_eopt.registry import list_optimizers  # lazy: installed optimizers only

    return tuple(list_optimizers()) + DEPRECATED_OPTIMIZER_NAMES


def _listed_optimizer_choices() -> Optional[tuple[str, ...]]:
    names = optimizer_names()
    return None if names is None else names + DEPRECATED_OPTIMIZER_NAMES


def _coefficient_choices() -> tuple[str, ...]:
    from megatron_eopt.ops.newton_schulz import coefficient_types  # lazy: installed sets only

    return coefficient_types()


def _literal(alias: Any) -> Callable[[], tuple[str, ...]]:
    return lambda: typing.get_args(alias)


FLAGS: tuple[Flag, ...] = (
    # General.
    Flag("--optimizer", "optimizer", "Optimizer (dist_muon is deprecated: use --optimizer muon "
         "--use-distributed-optimizer).", str, _optimizer_choices, installed=True,
         listed=_listed_optimizer_choices),
    Flag("--lr", "lr", "Peak learning rate (scripts/pretrain_gpt.py needs it).", float),
    Flag("--min-lr", "min_lr", "Minimum learning rate of the schedule (none: 0, Megatron-LM's default).",
         float),
    Flag("--decoupled-lr", "decoupled_lr", "Learning rate of the embedding and output layer (none: "
         "--lr's).", float),
    Flag("--decoupled-min-lr", "decoupled_min_lr", "Minimum learning rate of the embedding and "
         "output layer (none: --min-lr's).", float),
    Flag("--weight-decay", "weight_decay", "Weight decay coefficient.", float),
    Flag("--apply-wd-to-qk-layernorm", "apply_wd_to_qk_layernorm", "Apply weight decay to the "
         "QK-layernorm weights too."),
    Flag("--clip-grad", "clip_grad", "Clip gradients to this global L2 norm (0 disables).", float),
    Flag("--grad-norm-skip-threshold", "grad_norm_skip_threshold", "Skip the step when the "
         "gradient norm exceeds this.", float),
    Flag("--log-num-zeros-in-grad", "log_num_zeros_in_grad", "Count zeros in the gradients."),
    # Adam and SGD.
    Flag("--adam-beta1", "adam_beta1", "Adam beta1.", float),
    Flag("--adam-beta2", "adam_beta2", "Adam beta2.", float),
    Flag("--adam-eps", "adam_eps", "Adam epsilon.", float),
    Flag("--sgd-momentum", "sgd_momentum", "SGD momentum.", float),
    # Muon.
    Flag("--muon-momentum", "muon_momentum", "Muon momentum. The command lines default to Megatron-LM's "
         "0.9, OptimizerConfig to megatron-core's 0.95 (docs/library.md).", float),
    Flag("--muon-nesterov", "muon_nesterov", "Nesterov momentum in Muon."),
    Flag("--muon-no-split-qkv", "muon_split_qkv", "Orthogonalize linear_qkv as one matrix instead "
         "of q, k, v separately.", negative=True),
    Flag("--muon-split-qkv-per-head", "muon_split_qkv_per_head", "Orthogonalize every q, k and v "
         "head of linear_qkv as its own matrix (muon, adaptive_muon)."),
    Flag("--muon-scale-mode", "muon_scale_mode", "Scale of Muon's update.", str, _literal(ScaleMode)),
    Flag("--muon-fp32-matmul-prec", "muon_fp32_matmul_prec", "FP32 matmul precision of the "
         "Newton-Schulz iteration ('medium': bf16). Default: chosen from the hardware, 'medium' "
         "where bf16 matrix products are native (GPUs, CPUs with AVX512-BF16/AMX/Arm BF16), "
         "else 'highest'.", str, _literal(MatmulPrecision), hardware_default=True),
    Flag("--muon-coefficient-type", "muon_coefficient_type", "Newton-Schulz coefficient set (those "
         "of the installed emerging_optimizers).", str, _coefficient_choices, installed=True,
         listed=coefficient_types),
    Flag("--muon-num-ns-steps", "muon_num_ns_steps", "Newton-Schulz steps (4 with --muon-aol-preconditioner, "
         "unless given).", int),
    Flag("--muon-tp-mode", "muon_tp_mode", "How tensor-parallel matrices are orthogonalized (no "
         "effect without tensor parallelism); 'auto': per matrix, the exact mode predicted cheapest.",
         str, _literal(TpMode)),
    Flag("--muon-expert-tp-mode", "muon_expert_tp_mode", "TP mode of expert (MoE) matrices over the "
         "expert TP group. Default: --muon-tp-mode.", str, _literal(TpMode)),
    Flag("--muon-tp-hardware-profile", "muon_tp_hardware_profile", "What --muon-tp-mode auto predicts "
         "with: 'h100' (measured GPU figures) or 'cpu'. Default: rates calibrated on this machine.",
         str, _literal(HardwareProfileName)),
    Flag("--muon-extra-scale-factor", "muon_extra_scale_factor", "Extra factor on Muon's update.",
         float),
    Flag("--muon-match-adamw-rms", "muon_match_adamw_rms", "Scale Muon's update to AdamW's RMS "
         "(0.2 * sqrt(max(m, n)); needs --muon-scale-mode spectral)."),
    Flag("--muon-scalar-optimizer", "muon_scalar_optimizer", "Optimizer of the parameters Muon "
         "does not step.", str, _literal(ScalarOptimizer)),
    Flag("--muon-use-syrk", "muon_use_syrk", "Use SYRK in the Newton-Schulz iteration."),
    Flag("--muon-gram-newton-schulz", "muon_gram_newton_schulz", "Gram Newton-Schulz (iterate on the "
         "small Gram matrix) on the blocks where it costs fewer FLOPs (muon, adaptive_muon)."),
    Flag("--muon-gram-newton-schulz-package", "muon_gram_newton_schulz_package", "Run those Gram blocks, "
         "where whole on their rank, through the gram-newton-schulz package (float16; needs "
         "--muon-gram-newton-schulz and --muon-fp32-matmul-prec medium)."),
    Flag("--muon-aol-preconditioner", "muon_aol_preconditioner", "Turbo-Muon: start every Newton-Schulz from "
         "the AOL-preconditioned matrix, with quintic coefficients and 4 steps unless --muon-coefficient-type "
         "or --muon-num-ns-steps is given (muon, adaptive_muon)."),
    # Other emerging optimizers.
    Flag("--lion-beta1", "lion_beta1", "Lion beta1 (sign update).", float),
    Flag("--lion-beta2", "lion_beta2", "Lion beta2 (momentum EMA).", float),
    Flag("--soap-shampoo-beta", "soap_shampoo_beta", "SOAP Shampoo beta.", float),
    Flag("--soap-precondition-frequency", "soap_precondition_frequency", "SOAP preconditioner "
         "update interval (steps).", int),
    Flag("--soap-no-kl-shampoo", "soap_use_kl_shampoo", "Use plain Shampoo factors in SOAP "
         "instead of KL-Shampoo.", negative=True),
    Flag("--adaptive-muon-moment2-method", "adaptive_muon_moment2_method", "Second moment of "
         "adaptive Muon.", str, _literal(AdaptiveMoment2Method)),
    Flag("--adaptive-muon-beta2", "adaptive_muon_beta2", "Adaptive Muon beta2.", float),
    Flag("--adaptive-muon-eps", "adaptive_muon_eps", "Adaptive Muon epsilon.", float),
    Flag("--no-emerging-optimizers-compile", "emerging_optimizers_compile", "Run emerging_optimizers' "
         "torch.compile'd updates (lion, laprop, soap, rekls, psgd_pro) uncompiled: no first-step "
         "compilation.", negative=True),
    # QK-clip (MuonClip).
    Flag("--qk-clip", "qk_clip", "After each step, scale W_q/W_k of attention heads whose largest "
         "logit exceeded --qk-clip-threshold (MuonClip)."),
    Flag("--qk-clip-threshold", "qk_clip_threshold", "QK-clip threshold tau on the largest "
         "attention logit.", float),
    Flag("--qk-clip-alpha", "qk_clip_alpha", "QK-clip balance: W_q scaled by eta^alpha, W_k by "
         "eta^(1-alpha).", float),
    Flag("--log-max-attention-logit", "log_max_attention_logit", "Record and log the largest "
         "attention logit (implied by --qk-clip)."),
    # Distribution.
    Flag("--use-distributed-optimizer", "use_distributed_optimizer", "Shard optimizer state over "
         "data-parallel ranks (layer-wise for emerging optimizers)."),
    Flag("--use-layer-wise-distributed-optimizer", "use_layer_wise_distributed_optimizer", "Give "
         "each parameter's optimizer state to one data-parallel rank."),
    Flag("--layer-wise-reduce-grads", "layer_wise_reduce_grads", "With the layer-wise optimizer: "
         "gradients are each rank's own and are reduced onto their owners."),
    Flag("--overlap-param-gather", "overlap_param_gather", "Overlap the parameter all-gather with "
         "the forward pass."),
    Flag("--overlap-param-gather-with-optimizer-step", "overlap_param_gather_with_optimizer_step",
         "Overlap the parameter all-gather with the optimizer step."),
    # Mixed precision and loss scaling.
    Flag("--fp16", "fp16", "fp16 mixed precision (adam/sgd only)."),
    Flag("--bf16", "bf16", "bf16 mixed precision."),
    Flag("--loss-scale", "loss_scale", "Static loss scale (fp16; none: dynamic).", float),
    Flag("--initial-loss-scale", "initial_loss_scale", "Initial dynamic loss scale.", float),
    Flag("--min-loss-scale", "min_loss_scale", "Minimum dynamic loss scale.", float),
    Flag("--loss-scale-window", "loss_scale_window", "Steps between loss-scale increases.", float),
    Flag("--hysteresis", "hysteresis", "Overflows tolerated before the loss scale drops.", int),
    # The precision-aware optimizer (docs/memory.md): megatron-core's fields, Megatron-LM's flags.
    Flag("--use-precision-aware-optimizer", "use_precision_aware_optimizer", "Allow 16-bit main "
         "weights and optimizer state (the dtype flags below), for every optimizer."),
    Flag("--no-store-param-remainders", "store_param_remainders", "With --bf16 and "
         "--use-precision-aware-optimizer: keep fp32 main weights instead of the bf16 parameter plus a "
         "16-bit remainder.", negative=True),
    Flag("--main-params-dtype", "main_params_dtype", "Dtype of the main weights with "
         "--use-precision-aware-optimizer and --no-store-param-remainders.", str, lambda: DTYPE_CHOICES),
    Flag("--main-grads-dtype", "main_grads_dtype", "Dtype of the gradient buffer with "
         "--use-precision-aware-optimizer (bf16: like --grad-reduce-in-bf16).", str, lambda: ("fp32", "bf16")),
    Flag("--exp-avg-dtype", "exp_avg_dtype", "Dtype of the first moment (Adam's exp_avg, Muon's "
         "momentum) with --use-precision-aware-optimizer.", str, lambda: DTYPE_CHOICES),
    Flag("--exp-avg-sq-dtype", "exp_avg_sq_dtype", "Dtype of the second moment (Adam's exp_avg_sq) with "
         "--use-precision-aware-optimizer.", str, lambda: DTYPE_CHOICES),
    # Optimizer state on the host (docs/memory.md): megatron-core's fields, Megatron-LM's flags.
    Flag("--optimizer-cpu-offload", "optimizer_cpu_offload", "Keep the optimizer state and main weights of "
         "--optimizer-offload-fraction of the parameters on the host, streamed to the device for the step "
         "(needs --use-precision-aware-optimizer, as in Megatron-LM)."),
    Flag("--optimizer-offload-fraction", "optimizer_offload_fraction", "Fraction of each optimizer's elements "
         "whose state is on the host with --optimizer-cpu-offload (whole parameters, in order). The command lines "
         "default to Megatron-LM's 1.0, OptimizerConfig to megatron-core's 0.0 (docs/library.md).", float),
    Flag("--use-torch-optimizer-for-cpu-offload", "use_torch_optimizer_for_cpu_offload", "megatron-core: step "
         "the on-device part with torch's optimizer; no effect here (the inner optimizer is the same)."),
    Flag("--overlap-cpu-optimizer-d2h-h2d", "overlap_cpu_optimizer_d2h_h2d", "With --optimizer-cpu-offload "
         "on CUDA: copy state to and from the host on a side stream, overlapping the step."),
    Flag("--no-pin-cpu-grads", "pin_cpu_grads", "megatron-core: unpinned host gradients; no effect here (the "
         "step runs where the gradients are).", negative=True),
    Flag("--no-pin-cpu-params", "pin_cpu_params", "With --optimizer-cpu-offload: unpinned host state and main "
         "weights.", negative=True),
    # Checkpoints (docs/checkpoints.md).
    Flag("--allow-optimizer-change-on-load", "allow_optimizer_change_on_load", "Load a checkpoint saved under "
         "another optimizer routing: the parameters whose optimizer changed start with fresh optimizer state, "
         "everything else loads exactly (without it such a load is refused, naming them)."),
)

OPTION_OF: dict[str, str] = {flag.dest: flag.option for flag in FLAGS}  # field -> flag string


class StoreAndRecord(argparse.Action):
    """`store`, also recording the dest in `namespace.optimizer_flags_given`."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        given = set(getattr(namespace, GIVEN_FLAGS_ATTR, None) or ())
        setattr(namespace, GIVEN_FLAGS_ATTR, given | {self.dest})


def add_optimizer_args(parser: argparse.ArgumentParser, *, deferred: bool = False) -> argparse.ArgumentParser:
    """Add the 'optimizer' argument group to `parser` and return it.

    `deferred`: every default None and the installed choices from optimizer_names.py (unchecked
    where it does not know them), with no import of torch;
    `resolve_optimizer_flags` then gives the namespace with OptimizerConfig's defaults.
    """
    defaults = {} if deferred else _config_defaults()
    group = parser.add_argument_group(title="optimizer")
    for flag in FLAGS:
        kwargs = flag_kwargs(flag, None if flag.hardware_default else defaults.get(flag.dest),
                             with_choices=not (deferred and flag.installed))
        if flag.dest == "muon_tp_mode":  # validate_args warns when it is given with TP=1
            kwargs["action"] = StoreAndRecord
        listed = flag.listed() if deferred and flag.listed is not None else None
        if listed is not None:  # the installed choices, known without torch (optimizer_names.py)
            kwargs["choices"] = listed
        elif deferred and flag.installed:
            kwargs["help"] += f" Choices: those installed ({flag.option} checks them after start-up)."
        group.add_argument(flag.option, **kwargs)
    return parser


# Megatron-LM's parser defaults where they differ from OptimizerConfig's (megatron-core's): one command line
# resolves as in Megatron-LM's loop (tests/unit/training/test_megatron_lm_parity.py compares every setting).
MEGATRON_LM_PARSER_DEFAULTS: dict[str, Any] = {"muon_momentum": 0.9, "optimizer_offload_fraction": 1.0}
# Every value flag's default as a command line resolves it (OptimizerConfig's, or MEGATRON_LM_PARSER_DEFAULTS'),
# written out so that `--help` shows it without importing torch, as OptimizerConfig does;
# tests/unit/arguments/test_arguments.py checks it against them. A switch is off unless given, and
# --muon-fp32-matmul-prec's default comes from the hardware (its help says so); None means what the help says.
SHOWN_DEFAULTS: dict[str, Any] = {
    "optimizer": "adam", "lr": None, "min_lr": None, "decoupled_lr": None, "decoupled_min_lr": None,
    "weight_decay": 0.01, "clip_grad": 1.0, "grad_norm_skip_threshold": float("inf"),
    "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_eps": 1e-08, "sgd_momentum": 0.9,
    "muon_momentum": 0.9, "muon_scale_mode": "spectral", "muon_coefficient_type": "quintic", "muon_num_ns_steps": 5,
    "muon_tp_mode": "duplicated", "muon_expert_tp_mode": None, "muon_tp_hardware_profile": None,
    "muon_extra_scale_factor": 1.0, "muon_scalar_optimizer": "adam",
    "lion_beta1": 0.95, "lion_beta2": 0.98, "soap_shampoo_beta": 0.95, "soap_precondition_frequency": 1,
    "adaptive_muon_moment2_method": "adamuon", "adaptive_muon_beta2": 0.95, "adaptive_muon_eps": 1e-08,
    "qk_clip_threshold": 100.0, "qk_clip_alpha": 0.5,
    "loss_scale": None, "initial_loss_scale": 2**32, "min_loss_scale": 1.0, "loss_scale_window": 1000, "hysteresis": 2,
    "main_params_dtype": "fp32", "main_grads_dtype": "fp32", "exp_avg_dtype": "fp32", "exp_avg_sq_dtype": "fp32",
    "optimizer_offload_fraction": 1.0,
}


def _config_defaults() -> dict[str, Any]:
    from megatron_eopt.config.optimizer_config import OptimizerConfig  # imports torch

    defaults = {field.name: _flag_value(field.default) for field in dataclasses.fields(OptimizerConfig)}
    return {**defaults, **MEGATRON_LM_PARSER_DEFAULTS}


def _flag_value(default: Any) -> Any:
    """A dtype default as its flag's name (torch.float32 -> 'fp32'); anything else as it is."""
    names = {torch_name: name for name, torch_name in DTYPE_NAMES.items()}
    return names.get(str(default).removeprefix("torch."), default) if type(default).__name__ == "dtype" else default


def resolve_optimizer_flags(args: argparse.Namespace) -> argparse.Namespace:
    """A new namespace: `args` from a deferred parser with OptimizerConfig's defaults for the
    flags not given, after checking the installed choices (ValueError in argparse's words). Its
    `optimizer_flags_given` names every optimizer flag's dest the command line gave."""
    for flag in FLAGS:
        value = getattr(args, flag.dest, None)
        if flag.installed and value is not None and value not in flag.choices():
            raise ValueError(invalid_choice_message(flag.option, value, flag.choices()))
    defaults = _config_defaults()
    not_given = {flag.dest for flag in FLAGS if getattr(args, flag.dest, None) is None}
    filled = {flag.dest: defaults[flag.dest] for flag in FLAGS if flag.dest in not_given and not flag.hardware_default}
    given = set(getattr(args, GIVEN_FLAGS_ATTR, None) or ()) | {flag.dest for flag in FLAGS} - not_given
    return argparse.Namespace(**{**vars(args), **filled, GIVEN_FLAGS_ATTR: given})


def invalid_choice_message(option: str, value: Any, choices: Sequence[Any]) -> str:
    """argparse's words for a bad choice, plus the closest choice."""
    message = f"argument {option}: invalid choice: {value!r} (choose from {', '.join(map(repr, choices))})"
    return message + did_you_mean(str(value), [str(choice) for choice in choices])


def keeping_megatron_core_defaults(convert: Callable[[str], Any]) -> Callable[[Any], Any]:
    """`convert` for what the command line gives; a default marked as megatron-core's passes as it is
    (argparse runs `type` on a string default, which would make it look given: config/newton_schulz.py)."""

    def converted(value: Any) -> Any:
        return value if is_megatron_core_default(value) else convert(value)

    converted.__name__ = getattr(convert, "__name__", "value")  # argparse names it in "invalid <name> value"
    return converted


def flag_kwargs(flag: Flag, default: Any, with_choices: bool = True) -> dict[str, Any]:
    """`add_argument` keyword arguments for `flag` (also used to extend Megatron-LM's parser)."""
    kwargs: dict[str, Any] = {"dest": flag.dest, "default": default, "help": help_with_default(flag)}
    if flag.type is None:
        kwargs["action"] = "store_false" if flag.negative else "store_true"
    else:
        kwargs["type"] = keeping_megatron_core_defaults(flag.type)
        if flag.choices is not None and with_choices:
            kwargs["choices"] = flag.choices()
    return kwargs


def help_with_default(flag: Flag) -> str:
    """`flag`'s help and its default as a command line resolves it (SHOWN_DEFAULTS): what `--help` shows."""
    if "Default:" in flag.help:  # the help says how the default is chosen
        return flag.help
    if flag.type is None:
        return f"{flag.help} Default: off."
    default = SHOWN_DEFAULTS[flag.dest]
    return f"{flag.help} Default: {'none' if default is None else default}."
