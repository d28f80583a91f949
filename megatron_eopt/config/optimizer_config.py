"""OptimizerConfig: one dataclass with megatron-core's field names and defaults.

Downstream trainers copy fields by name (`dataclasses.fields`, `hasattr`, argparse dests), so
every megatron-core field is kept, spelled the same, with the same default, except
`muon_tp_mode`, which defaults to 'duplicated' so that tensor parallelism never changes the
update. Consumers construct the config and mutate it later, so validation lives in
`finalize()`, which `__post_init__` calls and which can be called again at any time.
"""

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional

import torch

from megatron_eopt.config.choices import (  # noqa: F401 (re-exported)
    AdaptiveMoment2Method,
    HardwareProfileName,
    MatmulPrecision,
    MegatronCoreDefault,
    ScalarOptimizer,
    ScaleMode,
    TpMode,
    is_megatron_core_default,
    megatron_core_default,
)

from megatron_eopt.config.rules import GRAM_NEWTON_SCHULZ_OPTIMIZERS, check_values  # noqa: F401 (re-exported)

# Re-exported: arguments/to_config.py and the benchmarks read them from the config module.
from megatron_eopt.runtime.hardware import fp32_matmul_prec_for, native_bf16_matmul  # noqa: F401
from megatron_eopt.runtime.once import warn_once


@dataclass
class OptimizerConfig:
    """Configuration of the optimizer returned by `get_megatron_optimizer`.

    Field names and defaults follow megatron-core's `OptimizerConfig`; megatron_eopt adds
    `muon_use_syrk` (from newer Megatron-LM) and defaults `muon_tp_mode` to 'duplicated'.
    """

    # General.
    optimizer: str = "adam"
    lr: Optional[float] = None
    min_lr: Optional[float] = None
    decoupled_lr: Optional[float] = None
    decoupled_min_lr: Optional[float] = None
    weight_decay: float = 0.01
    apply_wd_to_qk_layernorm: bool = False

    # Precision.
    fp8_recipe: Optional[str] = None
    fp16: bool = False
    bf16: bool = False
    reuse_grad_buf_for_mxfp8_param_ag: bool = False
    params_dtype: torch.dtype = torch.float32
    use_precision_aware_optimizer: bool = False
    store_param_remainders: bool = True
    main_grads_dtype: torch.dtype = torch.float32
    main_params_dtype: torch.dtype = torch.float32
    exp_avg_dtype: torch.dtype = torch.float32
    exp_avg_sq_dtype: torch.dtype = torch.float32

    # Loss scaling (fp16 only).
    loss_scale: Optional[float] = None
    initial_loss_scale: float = 2**32
    min_loss_scale: float = 1.0
    loss_scale_window: float = 1000
    hysteresis: int = 2

    # Adam and SGD.
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-08
    decoupled_weight_decay: bool = True
    sgd_momentum: float = 0.9

    # Muon.
    muon_momentum: float = 0.95
    muon_split_qkv: bool = True
    muon_nesterov: bool = False
    muon_scale_mode: str = "spectral"
    # These three reach every orthogonalizing optimizer once set; left at megatron-core's default
    # (`MegatronCoreDefault`), they give way to Turbo-Muon's coefficients and steps
    # (muon_aol_preconditioner) and to an emerging optimizer's own precision (PolarGrad's 'highest').
    muon_fp32_matmul_prec: str = megatron_core_default("medium")  # 'highest', 'high', 'medium'; on every device
    muon_coefficient_type: str = megatron_core_default("quintic")
    muon_num_ns_steps: int = megatron_core_default(5)
    muon_tp_mode: str = "duplicated"
    muon_extra_scale_factor: float = 1.0
    muon_scalar_optimizer: str = "adam"
    muon_use_syrk: bool = False
    # megatron_eopt: scale Muon's update to AdamW's RMS, 0.2 * sqrt(max(m, n)) (Moonlight), on top
    # of muon_extra_scale_factor, so nobody has to hand-set 0.2. Needs muon_scale_mode='spectral'.
    muon_match_adamw_rms: bool = False
    # megatron_eopt: Gram Newton-Schulz (iterate on the m x m Gram matrix) on the blocks where it
    # costs fewer FLOPs than the standard iteration (ops/gram_newton_schulz.py). Muon and
    # adaptive_muon only.
    muon_gram_newton_schulz: bool = False
    # megatron_eopt: run those blocks, where whole on their rank, through the gram-newton-schulz
    # package (Dao AI Lab; its CUDA kernels on CUDA, its torch path elsewhere). It computes in
    # float16: needs muon_gram_newton_schulz=True and muon_fp32_matmul_prec='medium'.
    muon_gram_newton_schulz_package: bool = False
    # megatron_eopt: Turbo-Muon (arXiv 2512.04632): every Newton-Schulz starts from the
    # AOL-preconditioned matrix (ops/aol.py), with quintic coefficients and 4 steps unless
    # muon_coefficient_type / muon_num_ns_steps are set. Muon and adaptive_muon only.
    muon_aol_preconditioner: bool = False
    # megatron_eopt (Megatron-LM PR #6326's name): orthogonalize every q, gate, k and v head of
    # linear_qkv as its own kv_channels x hidden matrix, scaled by that shape, instead of the q,
    # k and v of all query groups together. Needs muon_split_qkv. Muon and adaptive_muon only.
    muon_split_qkv_per_head: bool = False
    # Newer Megatron-LM (PR #6761): the TP mode of expert matrices (MoE, over the expert TP group);
    # None follows muon_tp_mode.
    muon_expert_tp_mode: Optional[str] = None
    # megatron_eopt: what muon_tp_mode='auto' predicts step times with (ops/muon_cost.py): 'h100'
    # (measured GPU figures) or 'cpu'; None calibrates on the parameters' device over the TP group.
    muon_tp_hardware_profile: Optional[str] = None
    # megatron_eopt: move parameters into or out of Muon by name, as megatron-core's `use_muon`
    # attribute does (True / False), for models whose attributes do not reach the optimizer (torch
    # FSDP2's fully_shard drops them). Comma-separated fnmatch globs of parameter names as
    # `named_parameters()` gives them (e.g. 'lm_head.weight,*.mlp.gate.weight'). Routing
    # optimizers only (muon, adaptive_muon, ...).
    muon_include_params: str = ""
    muon_exclude_params: str = ""
    # megatron_eopt: refuse, in one ValueError, parameters that routing optimizers (muon, ...) route
    # by a fallback: an N-D tensor of no known layout (else: to the scalar optimizer, named in one
    # warning on rank 0), or a 2-D weight named like a fused one that params/fused_layouts.py does
    # not describe (else: orthogonalized whole, named in that warning). docs/fsdp2.md.
    muon_strict_layouts: bool = False

    # Other emerging optimizers.
    lion_beta1: float = 0.95
    lion_beta2: float = 0.98
    soap_shampoo_beta: float = 0.95
    soap_precondition_frequency: int = 1
    soap_use_kl_shampoo: bool = True
    adaptive_muon_moment2_method: str = "adamuon"
    adaptive_muon_beta2: float = 0.95
    adaptive_muon_eps: float = 1e-8
    # megatron_eopt: False runs emerging_optimizers' torch.compile'd updates (lion, laprop, soap,
    # rekls, psgd_pro) uncompiled: no first-step compilation (optimizers/compiled_step.py).
    emerging_optimizers_compile: bool = True

    # Distribution.
    use_distributed_optimizer: bool = False
    use_layer_wise_distributed_optimizer: bool = False
    # megatron_eopt: with the layer-wise optimizer, True means gradients are each rank's own and
    # the optimizer averages them onto their owners by reduce (no DDP needed); False means they
    # were already all-reduced (torch DDP, megatron-core DDP).
    layer_wise_reduce_grads: bool = False
    # The layer-wise optimizer's parameter broadcast: step() launches it and each module's
    # forward pre-hook waits for its own buckets; with_optimizer_step launches each chained
    # optimizer's buckets as soon as it has stepped (distributed/layer_wise.py).
    overlap_param_gather: bool = False
    overlap_param_gather_with_optimizer_step: bool = False

    # Optimizer state on the host, streamed to the device for the step (offload/host_resident.py).
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = 0.0
    use_torch_optimizer_for_cpu_offload: bool = False
    overlap_cpu_optimizer_d2h_h2d: bool = False
    pin_cpu_grads: bool = True
    pin_cpu_params: bool = True

    # megatron_eopt: loading a checkpoint whose parameters were saved under another optimizer (the
    # routing, muon_include_params / muon_exclude_params, muon_scalar_optimizer or the optimizer
    # changed) is refused naming them; True starts their state fresh and loads everything else
    # (checkpointable/optimizer_change.py, docs/checkpoints.md).
    allow_optimizer_change_on_load: bool = False

    # Gradients.
    clip_grad: float = 1.0
    grad_norm_skip_threshold: float = float("inf")
    log_num_zeros_in_grad: bool = False

    # QK-clip (MuonClip): megatron-core's TransformerConfig names and defaults. The model's
    # TransformerConfig may set them instead; disagreeing values are refused (wrappers/qk_clip.py).
    qk_clip: bool = False
    qk_clip_threshold: float = 100.0
    qk_clip_alpha: float = 0.5
    log_max_attention_logit: bool = False

    # Miscellaneous.
    barrier_with_L1_time: bool = False
    timers: Optional[Callable] = None
    config_logger_dir: str = ""
    optimizer_cuda_graph: bool = False

    def __post_init__(self) -> None:
        self.finalize()

    def finalize(self) -> "OptimizerConfig":
        """Validate every field; call again after mutating fields. Returns self."""
        _check_field_types(self)
        _check_values(self)
        return self

    def provide(
        self,
        model_chunks: Any,
        config_overrides: Optional[Any] = None,
        use_gloo_process_groups: bool = True,
        pg_collection: Any = None,
    ) -> Any:
        """`get_megatron_optimizer(self, model_chunks, ...)`: the custom-optimizer hook that
        Megatron-Bridge's `setup_optimizer` calls on a config object that has it."""
        # The one upward import of this module, inside the hook that needs it: the factory
        # (never the Bridge layer). Not at module level, so importing the config never imports
        # the layers above it; tests/unit/library/test_imports.py lists it as the single exception.
        from megatron_eopt.factory import get_megatron_optimizer

        return get_megatron_optimizer(
            self,
            model_chunks,
            config_overrides=config_overrides,
            use_gloo_process_groups=use_gloo_process_groups,
            pg_collection=pg_collection,
        )


# ------------------------------------------------------------------------------------------------
# What each megatron-core field does here
# ------------------------------------------------------------------------------------------------

FieldKind = Literal["used", "inert", "warns", "refused"]


@dataclass(frozen=True)
class FieldUse:
    """How megatron_eopt treats one of megatron-core's OptimizerConfig fields.

    used:    does what it does in megatron-core.
    inert:   no effect here, and none is lost (`why` says why); no message.
    warns:   no effect here; a non-default value warns once per process (`why` is the warning).
    refused: not implemented; a non-default value is a ValueError (`why` is the message).
    """

    kind: FieldKind
    why: str = ""


_USED = FieldUse("used")
_NOT_IMPLEMENTED = FieldUse("refused", "is a megatron-core feature that megatron_eopt does not implement; leave it False")

# Every field of megatron-core's OptimizerConfig (tests/unit/library/config/test_optimizer_config.py checks the list
# against the installed megatron-core; the README lists the inert ones).
MEGATRON_CORE_FIELDS: dict[str, FieldUse] = {
    **dict.fromkeys(
        ["optimizer", "lr", "min_lr", "decoupled_lr", "decoupled_min_lr", "weight_decay",
         "apply_wd_to_qk_layernorm", "fp16", "bf16", "loss_scale", "initial_loss_scale",
         "min_loss_scale", "loss_scale_window", "hysteresis", "adam_beta1", "adam_beta2",
         "adam_eps", "decoupled_weight_decay", "sgd_momentum", "muon_momentum", "muon_split_qkv",
         "muon_nesterov", "muon_scale_mode", "muon_fp32_matmul_prec", "muon_coefficient_type",
         "muon_num_ns_steps", "muon_tp_mode", "muon_extra_scale_factor", "muon_scalar_optimizer",
         "lion_beta1", "lion_beta2", "soap_shampoo_beta", "soap_precondition_frequency",
         "soap_use_kl_shampoo", "adaptive_muon_moment2_method", "adaptive_muon_beta2",
         "adaptive_muon_eps", "use_distributed_optimizer", "use_layer_wise_distributed_optimizer",
         "overlap_param_gather", "overlap_param_gather_with_optimizer_step",
         "clip_grad", "grad_norm_skip_threshold", "log_num_zeros_in_grad", "timers",
         "barrier_with_L1_time"],
        _USED,
    ),
    "fp8_recipe": FieldUse(
        "inert", "megatron-core's optimizer reads it only for fp8 parameters in its byte-sharded "
        "distributed optimizer; fp8 is the model's concern, and megatron_eopt's wrappers refuse "
        "fp8 parameters by dtype"),
    "params_dtype": FieldUse("inert", "megatron-core's optimizer does not read it either (the model's dtype)"),
    # The precision-aware optimizer (config/precision.py, docs/memory.md).
    **dict.fromkeys(["use_precision_aware_optimizer", "store_param_remainders", "main_params_dtype",
                     "exp_avg_dtype", "exp_avg_sq_dtype"], _USED),
    "main_grads_dtype": FieldUse(
        "inert", "megatron-core's optimizer does not read it either: Megatron-LM turns it into its DDP's gradient "
        "buffer dtype (grad_reduce_in_fp32); megatron_eopt steps with whatever gradient the model holds, as fp32"),
    "reuse_grad_buf_for_mxfp8_param_ag": _NOT_IMPLEMENTED,
    "optimizer_cuda_graph": _NOT_IMPLEMENTED,
    # Host-resident state (offload/host_resident.py, docs/memory.md).
    **dict.fromkeys(["optimizer_cpu_offload", "optimizer_offload_fraction", "overlap_cpu_optimizer_d2h_h2d",
                     "pin_cpu_params"], _USED),
    "use_torch_optimizer_for_cpu_offload": FieldUse(
        "warns", "megatron-core steps its on-device part with torch's optimizer instead of Transformer Engine's "
        "fused one; megatron_eopt's inner optimizers are the same with and without offload"),
    "pin_cpu_grads": FieldUse(
        "warns", "megatron-core copies the offloaded part's gradients to the host; megatron_eopt steps on the "
        "device, where the gradients are"),
    "config_logger_dir": FieldUse(
        "warns", "megatron-core dumps its optimizer constructors' arguments there for debugging; "
        "megatron_eopt writes nothing there (dump_param_to_param_group_map shows where each "
        "parameter went)"),
}
# megatron_eopt's own fields: muon_use_syrk and muon_expert_tp_mode (newer Megatron-LM),
# muon_match_adamw_rms, muon_gram_newton_schulz, muon_gram_newton_schulz_package, muon_aol_preconditioner,
# muon_split_qkv_per_head, muon_tp_hardware_profile, muon_include_params, muon_exclude_params,
# muon_strict_layouts,
# layer_wise_reduce_grads, emerging_optimizers_compile, allow_optimizer_change_on_load;
# all used.

def warn_about_inert_fields(config: "OptimizerConfig") -> None:
    """One warning per process for each 'warns' field set away from its default, and for offload
    asked for with a fraction that offloads nothing."""
    defaults = {f.name: f.default for f in dataclasses.fields(OptimizerConfig)}
    for name, use in MEGATRON_CORE_FIELDS.items():
        value = getattr(config, name)
        if use.kind == "warns" and value != defaults[name]:
            warn_once(f"inert field {name}", f"OptimizerConfig.{name}={value!r} has no effect in megatron_eopt: "
                      f"{use.why}.", stacklevel=3)
    if config.optimizer_cpu_offload and config.optimizer_offload_fraction == 0.0:
        warn_once("offload fraction 0", "OptimizerConfig.optimizer_cpu_offload=True with optimizer_offload_fraction="
                  "0.0 (megatron-core's default) offloads nothing: every parameter's state stays on the device. Set "
                  "optimizer_offload_fraction to the fraction of the state to keep on the host (the command lines' "
                  "--optimizer-offload-fraction defaults to 1.0, all of it).", stacklevel=3)


def as_optimizer_config(config: Any) -> OptimizerConfig:
    """Return `config` as a validated `OptimizerConfig`.

    Accepts ours (re-validated, since it may have been mutated) or any object with the same
    field names, such as megatron-core's own `OptimizerConfig`, whose fields are read by name.
    """
    if isinstance(config, OptimizerConfig):
        return config.finalize()
    if config is None:
        raise TypeError("config must be an OptimizerConfig (or megatron-core's); got None.")
    known = {f.name for f in dataclasses.fields(OptimizerConfig)}
    values = {name: getattr(config, name) for name in known if hasattr(config, name)}
    if "optimizer" not in values:
        raise TypeError(
            f"config must be an OptimizerConfig or an object with its fields (at least "
            f"'optimizer'); got {type(config).__name__}."
        )
    return OptimizerConfig(**values)


_TYPE_NAMES = {bool: "a bool", int: "an int", float: "a number", str: "a string"}


def _check_field_types(config: OptimizerConfig) -> None:
    hints = typing.get_type_hints(OptimizerConfig)
    for field in dataclasses.fields(config):
        if field.name not in hints:
            continue  # a field added by a downstream subclass: its own business
        expected = hints[field.name]
        value = getattr(config, field.name)
        optional = typing.get_origin(expected) is typing.Union
        if optional:
            if value is None:
                continue
            expected = next(t for t in typing.get_args(expected) if t is not type(None))
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            continue  # ints are fine where floats are expected (lr=1 means 1.0)
        if expected in _TYPE_NAMES and not (
            isinstance(value, expected) and (expected is bool or not isinstance(value, bool))
        ):
            allowed = _TYPE_NAMES[expected] + (" or None" if optional else "")
            raise TypeError(
                f"OptimizerConfig.{field.name} must be {allowed}; got "
                f"{type(value).__name__} {value!r}."
            )
        if expected is torch.dtype and not isinstance(value, torch.dtype):
            raise TypeError(
                f"OptimizerConfig.{field.name} must be a torch.dtype; got {value!r}."
            )


def _check_values(config: OptimizerConfig) -> None:
    check_values(config)  # the rules on values alone, the precision-aware ones too, torch-free (config/rules.py)
    _check_unsupported(config)


def _check_unsupported(config: OptimizerConfig) -> None:
    """megatron-core features kept for field compatibility but not implemented here (the
    'refused' fields of MEGATRON_CORE_FIELDS): only their default values are accepted."""
    defaults = {f.name: f.default for f in dataclasses.fields(OptimizerConfig)}
    for name, use in MEGATRON_CORE_FIELDS.items():
        value = getattr(config, name)
        if use.kind == "refused" and value != defaults[name]:
            raise ValueError(f"OptimizerConfig.{name} {use.why}; got {value}.")


# Aliases still imported by old code.
AdamOptimizerConfig = OptimizerConfig
SGDOptimizerConfig = OptimizerConfig
