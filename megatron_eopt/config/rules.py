"""OptimizerConfig's rules on its values, importable without torch.

`check_values(config)` raises ValueError, in OptimizerConfig's words, for the first rule that
`config` breaks: an `OptimizerConfig` (which calls it from `finalize`) or any object with its
field names, such as a parsed command line. A rule whose fields are None is skipped (None: not
given yet), except where None is a value of the field (`lr`, `loss_scale`). Command-line parsers
run the rules on the flags given before torch is imported, so their errors come at once and in
the words the config would use (validate.py's `flag_message` spells the fields as flags).
"""

import math
import typing
from typing import Any

from megatron_eopt.config.choices import (
    AdaptiveMoment2Method,
    HardwareProfileName,
    MatmulPrecision,
    ScalarOptimizer,
    ScaleMode,
    TpMode,
)
from megatron_eopt.config.precision import check_precision_fields

# The optimizers whose Newton-Schulz can take the Gram path (dist_muon: deprecated spelling of muon).
GRAM_NEWTON_SCHULZ_OPTIMIZERS = ("muon", "dist_muon", "adaptive_muon")
# The optimizers whose Newton-Schulz is ours (ops/newton_schulz.py), and so can take the AOL preconditioner.
AOL_OPTIMIZERS = GRAM_NEWTON_SCHULZ_OPTIMIZERS
# The optimizers that split linear_qkv into q/k/v blocks, and so per head on request.
PER_HEAD_QKV_OPTIMIZERS = GRAM_NEWTON_SCHULZ_OPTIMIZERS


def check_values(config: Any) -> None:
    """Every rule below, in this order; the first broken one raises ValueError."""
    _check_optimizer_name(config)
    _check_learning_rates(config)
    _check_precision(config)
    _check_loss_scaling(config)
    _check_unit_interval(config, "adam_beta1", "adam_beta2", "muon_momentum", "lion_beta1", "lion_beta2",
                         "soap_shampoo_beta", "adaptive_muon_beta2")
    for name, low in (("adam_eps", 0.0), ("adaptive_muon_eps", 0.0), ("sgd_momentum", 0.0)):
        value = _value(config, name)
        _require(value is None or value >= low, f"OptimizerConfig.{name} must be >= 0; got {value}.")
    _check_muon(config)
    _check_gradients(config)
    _check_qk_clip(config)
    _check_distribution(config)
    _check_cpu_offload(config)


def _value(config: Any, name: str) -> Any:
    return getattr(config, name, None)


def _boolean(config: Any, name: str) -> Any:
    """The field's value (None: not given yet), after checking that it is True or False."""
    value = _value(config, name)
    _require(value is None or isinstance(value, bool), f"OptimizerConfig.{name} must be True or False; got {value!r}.")
    return value


def _known(config: Any, *names: str) -> bool:
    return all(_value(config, name) is not None for name in names)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _check_choice(config: Any, name: str, choices: tuple[str, ...]) -> None:
    value = _value(config, name)
    _require(value is None or value in choices,
             f"OptimizerConfig.{name} must be one of {', '.join(repr(c) for c in choices)}; got {value!r}.")


def _check_unit_interval(config: Any, *names: str) -> None:
    for name in names:
        value = _value(config, name)
        _require(value is None or 0.0 <= value < 1.0, f"OptimizerConfig.{name} must be in [0, 1); got {value}.")


def _check_optimizer_name(config: Any) -> None:
    # Which names exist is the registry's business (it lists them); here only the spelling.
    _require(_value(config, "optimizer") is None or config.optimizer.strip() != "",
             "OptimizerConfig.optimizer must name an optimizer (for example 'adam' or 'muon'); got ''.")


def _check_learning_rates(config: Any) -> None:
    for name in ("lr", "min_lr", "decoupled_lr", "decoupled_min_lr"):
        value = _value(config, name)
        _require(value is None or (math.isfinite(value) and value >= 0.0),
                 f"OptimizerConfig.{name} must be a finite number >= 0 or None; got {value}.")
    for low, high in (("min_lr", "lr"), ("decoupled_min_lr", "decoupled_lr")):
        low_value, high_value = _value(config, low), _value(config, high)
        _require(low_value is None or high_value is None or low_value <= high_value,
                 f"OptimizerConfig.{low} ({low_value}) must not exceed {high} ({high_value}).")
    decay = _value(config, "weight_decay")
    _require(decay is None or (math.isfinite(decay) and decay >= 0.0),
             f"OptimizerConfig.weight_decay must be a finite number >= 0; got {decay}.")


def _check_precision(config: Any) -> None:
    _require(not (_value(config, "fp16") and _value(config, "bf16")),
             "OptimizerConfig.fp16 and OptimizerConfig.bf16 are both True; choose at most one.")
    check_precision_fields(config)  # the precision-aware optimizer's dtypes (config/precision.py)


def _check_loss_scaling(config: Any) -> None:
    loss_scale = _value(config, "loss_scale")
    _require(loss_scale is None or loss_scale > 0.0, f"OptimizerConfig.loss_scale must be > 0 or None; got {loss_scale}.")
    if _known(config, "min_loss_scale", "initial_loss_scale"):
        _require(0.0 < config.min_loss_scale <= config.initial_loss_scale,
                 f"OptimizerConfig needs 0 < min_loss_scale <= initial_loss_scale; got "
                 f"min_loss_scale={config.min_loss_scale}, initial_loss_scale={config.initial_loss_scale}.")
    for name in ("loss_scale_window", "hysteresis"):
        value = _value(config, name)
        _require(value is None or value >= 1, f"OptimizerConfig.{name} must be >= 1; got {value}.")


def _check_muon(config: Any) -> None:
    for name, choices in (("muon_scale_mode", ScaleMode), ("muon_tp_mode", TpMode),
                          ("muon_fp32_matmul_prec", MatmulPrecision), ("muon_scalar_optimizer", ScalarOptimizer),
                          ("adaptive_muon_moment2_method", AdaptiveMoment2Method),
                          ("muon_expert_tp_mode", TpMode), ("muon_tp_hardware_profile", HardwareProfileName)):
        _check_choice(config, name, typing.get_args(choices))
    if _value(config, "muon_match_adamw_rms") and _known(config, "muon_scale_mode"):
        _require(config.muon_scale_mode == "spectral",
                 f"OptimizerConfig.muon_match_adamw_rms needs muon_scale_mode='spectral' (the rule is "
                 f"0.2 * sqrt(max(m, n))); got muon_scale_mode={config.muon_scale_mode!r}.")
    gram = _boolean(config, "muon_gram_newton_schulz")
    if gram and _known(config, "optimizer"):
        _require(config.optimizer in GRAM_NEWTON_SCHULZ_OPTIMIZERS,
                 f"OptimizerConfig.muon_gram_newton_schulz=True is implemented for optimizer "
                 f"{', '.join(map(repr, GRAM_NEWTON_SCHULZ_OPTIMIZERS))}; got optimizer={config.optimizer!r}. "
                 f"Set muon_gram_newton_schulz=False (command line: drop --muon-gram-newton-schulz).")
    _check_gram_package(config)
    _check_aol_preconditioner(config)
    _check_per_head_qkv(config)
    steps, scale, frequency = (_value(config, name) for name in (
        "muon_num_ns_steps", "muon_extra_scale_factor", "soap_precondition_frequency"))
    _require(steps is None or steps >= 1, f"OptimizerConfig.muon_num_ns_steps must be >= 1; got {steps}.")
    _require(scale is None or (math.isfinite(scale) and scale > 0.0),
             f"OptimizerConfig.muon_extra_scale_factor must be a finite number > 0; got {scale}.")
    _require(frequency is None or frequency >= 1,
             f"OptimizerConfig.soap_precondition_frequency must be >= 1; got {frequency}.")


def _check_gram_package(config: Any) -> None:
    if not _boolean(config, "muon_gram_newton_schulz_package"):
        return
    _require(_value(config, "muon_gram_newton_schulz") is not False,
             "OptimizerConfig.muon_gram_newton_schulz_package=True needs muon_gram_newton_schulz=True (the "
             "package runs the blocks that take the Gram path); set both or neither.")
    precision = _value(config, "muon_fp32_matmul_prec")
    _require(precision is None or precision == "medium",
             f"OptimizerConfig.muon_gram_newton_schulz_package=True needs muon_fp32_matmul_prec='medium': the "
             f"gram-newton-schulz package computes in float16 only; got muon_fp32_matmul_prec={precision!r}.")


def _check_aol_preconditioner(config: Any) -> None:
    if not _boolean(config, "muon_aol_preconditioner"):
        return
    if _known(config, "optimizer"):
        _require(config.optimizer in AOL_OPTIMIZERS,
                 f"OptimizerConfig.muon_aol_preconditioner=True is implemented for optimizer "
                 f"{', '.join(map(repr, AOL_OPTIMIZERS))}, whose Newton-Schulz is megatron_eopt's; "
                 f"optimizer={config.optimizer!r} calls emerging_optimizers' newton_schulz, which has no "
                 f"preconditioner. Turn muon_aol_preconditioner off (command line: drop --muon-aol-preconditioner).")
    for other in ("muon_gram_newton_schulz_package", "muon_use_syrk"):
        _require(not _value(config, other),
                 f"OptimizerConfig.muon_aol_preconditioner=True and {other}=True: that kernel does not run the "
                 f"AOL preconditioner; turn one of the two off.")


def _check_per_head_qkv(config: Any) -> None:
    # Worded so that it also reads right with the fields spelled as flags (--muon-no-split-qkv).
    if not _value(config, "muon_split_qkv_per_head"):
        return
    if _known(config, "optimizer"):
        _require(config.optimizer in PER_HEAD_QKV_OPTIMIZERS,
                 f"OptimizerConfig.muon_split_qkv_per_head=True is implemented for optimizer "
                 f"{', '.join(map(repr, PER_HEAD_QKV_OPTIMIZERS))}; got optimizer={config.optimizer!r}. "
                 f"Turn muon_split_qkv_per_head off or choose one of those.")
    _require(_value(config, "muon_split_qkv") is not False,
             "OptimizerConfig.muon_split_qkv_per_head=True needs linear_qkv split into q, k and v first, and "
             "muon_split_qkv says not to split it; change one of the two.")


def _check_gradients(config: Any) -> None:
    clip, skip = _value(config, "clip_grad"), _value(config, "grad_norm_skip_threshold")
    _require(clip is None or (math.isfinite(clip) and clip >= 0.0),
             f"OptimizerConfig.clip_grad must be a finite number >= 0 (0 disables clipping); got {clip}.")
    _require(skip is None or skip > 0.0,
             f"OptimizerConfig.grad_norm_skip_threshold must be > 0 (inf disables it); got {skip}.")


def _check_qk_clip(config: Any) -> None:
    threshold, alpha = _value(config, "qk_clip_threshold"), _value(config, "qk_clip_alpha")
    _require(threshold is None or (math.isfinite(threshold) and threshold > 0.0),
             f"OptimizerConfig.qk_clip_threshold must be a finite number > 0; got {threshold}.")
    _require(alpha is None or 0.0 < alpha < 1.0,
             f"OptimizerConfig.qk_clip_alpha must be in (0, 1) (as Megatron-LM requires); got {alpha}.")


def _check_distribution(config: Any) -> None:
    # As Megatron-LM's argument checks: only a distributed optimizer has a parameter sync to
    # overlap, and the optimizer-step overlap extends the forward overlap.
    distributed = _value(config, "use_distributed_optimizer") or _value(config, "use_layer_wise_distributed_optimizer")
    _require(distributed or not _value(config, "overlap_param_gather"),
             "OptimizerConfig.overlap_param_gather=True needs the distributed optimizer "
             "(use_distributed_optimizer or use_layer_wise_distributed_optimizer; command line: "
             "--use-distributed-optimizer): without it every rank updates every parameter and there is "
             "no parameter sync to overlap.")
    _require(_value(config, "overlap_param_gather") or not _value(config, "overlap_param_gather_with_optimizer_step"),
             "OptimizerConfig.overlap_param_gather_with_optimizer_step=True needs overlap_param_gather=True "
             "(command line: --overlap-param-gather), as in Megatron-LM.")


def _check_cpu_offload(config: Any) -> None:
    """megatron-core's meaning (offload/host_resident.py): the fraction is of the elements each
    optimizer steps; its factory asserts AdamW mode for offloaded Adam and SGD."""
    fraction = _value(config, "optimizer_offload_fraction")
    _require(fraction is None or 0.0 <= fraction <= 1.0,
             f"OptimizerConfig.optimizer_offload_fraction must be in [0, 1] (the fraction of the optimizer's "
             f"elements whose state is on the host); got {fraction}.")
    if not _value(config, "optimizer_cpu_offload") or _value(config, "optimizer") not in ("adam", "sgd"):
        return
    _require(_value(config, "decoupled_weight_decay") is not False,
             "OptimizerConfig.optimizer_cpu_offload=True with optimizer 'adam' or 'sgd' needs "
             "decoupled_weight_decay=True (AdamW mode), as megatron-core's offloaded optimizer does; got False.")
