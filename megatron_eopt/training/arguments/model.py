"""The model the flags describe (GPTModelSettings), with Megatron-LM's defaults and rules.

Torch-free: the checks that need to know the machine read `Device` (arguments/device.py) and
skip what it does not know yet (before the import); they run again after it.
"""

import argparse
import dataclasses
from typing import Any, Optional

from arguments import (
    refuse_flags_without,
)
from megatron_eopt.training.arguments.data import model_vocab_size
from megatron_eopt.training.arguments.device import Device
from megatron_eopt.training.arguments.flags.model import MLA
from megatron_eopt.training.arguments.flags.moe import MOE
from megatron_eopt.training.arguments.flags.table import option_of, replaced, settings_from_flags
from megatron_eopt.training.arguments.flags.training import RECOMPUTE_MODULES  # noqa: F401 (re-exported)
from megatron_eopt.training.arguments.mla import mla_settings
from megatron_eopt.training.arguments.moe import (
    check_moe_flags,
    moe_settings,
    resolve_moe_flags,
)
from megatron_eopt.training.errors import is_rank_zero
from megatron_eopt.training.model.settings import GPTModelSettings, SettingsError
from megatron_eopt.training.parallel.layout import Layout


def check_device_flags(args: argparse.Namespace, device: Device) -> None:
    if args.distributed_backend == "nccl" and device.cuda_available is False:
        raise ValueError("--distributed-backend nccl needs CUDA, and none is available (gloo runs on CPU).")
    if device.backend is not None and args.distributed_backend not in (None, device.backend):
        raise ValueError(f"--distributed-backend {args.distributed_backend}: the process group this runs in "
                         f"is {device.backend}.")
    if args.transformer_impl == "transformer_engine" and device.te_on_cuda is False:
        raise ValueError("--transformer-impl transformer_engine needs CUDA and Transformer Engine installed "
                         "(--transformer-impl local runs everywhere).")


def with_experts(args: argparse.Namespace, layout: Layout, settings: GPTModelSettings, device: Device
                  ) -> tuple[argparse.Namespace, Layout, GPTModelSettings]:
    """The MoE flags (megatron_eopt/training/model/moe.py) resolved, in the layout and the model settings."""
    args = replaced(args, **resolve_moe_flags(args))
    ep = check_moe_flags(args, layout.tp, layout.dp, use_cuda=device.on_cuda, num_layers=settings.num_layers)
    return args, dataclasses.replace(layout, ep=ep), dataclasses.replace(settings, **moe_settings(args))


def model_defaults(args: argparse.Namespace, tp: int, say: bool = True) -> dict[str, Any]:
    """The model flags' resolved values: the padded vocabulary, --sequence-parallel (off at TP 1,
    said on rank 0 when `say`) and Megatron-LM's legacy --use-rotary-position-embeddings."""
    sequence_parallel = args.sequence_parallel
    if sequence_parallel and tp == 1:
        if say and is_rank_zero():
            print("> --sequence-parallel is off: it needs --tensor-model-parallel-size > 1 (as in Megatron-LM)",
                  flush=True)
        sequence_parallel = False
    rope = args.use_rotary_position_embeddings
    return dict(padded_vocab_size=model_vocab_size(args, tp), sequence_parallel=sequence_parallel,
                position_embedding_type="rope" if rope else args.position_embedding_type)


def model_settings(args: argparse.Namespace, tp: int, device: Device) -> GPTModelSettings:
    """The model `args` (with `model_defaults` resolved) describe; its errors name the flags
    (`--seq-length`, not `seq_length`)."""
    try:
        settings = settings_from_flags(args, GPTModelSettings, _model_fields(args, device), RENAMED, _OWN_RESOLUTION)
        settings.check_tensor_parallel(tp)
    except SettingsError as error:
        # Every setting and tensor_model_parallel_size is the destination of the flag of that name.
        flags = {name: f"--{name.replace('_', '-')}" for name in vars(args)}
        flags.update({field: option_of(dest) for field, dest in RENAMED.items()})
        raise ValueError(f"{error.message_for(flags)}.") from None
    return settings


def _query_groups(args: argparse.Namespace) -> Optional[int]:
    """Megatron-LM: key/value groups only with --group-query-attention (then default 1)."""
    if not args.group_query_attention:
        if args.num_query_groups is not None:
            raise ValueError(f"--num-query-groups {args.num_query_groups} needs --group-query-attention "
                             f"(without it every head has its own key/value group).")
        return None
    return 1 if args.num_query_groups is None else args.num_query_groups


def _ffn_hidden_size(args: argparse.Namespace) -> int:
    """Megatron-LM's default: 4h, or with SwiGLU 2/3 of that rounded down to a multiple of 64
    (the same parameter count as a 4h GELU MLP)."""
    if args.ffn_hidden_size is not None:
        return args.ffn_hidden_size
    if args.swiglu:
        size = int((4 * args.hidden_size * 2 / 3) / 64) * 64
        if size < 1:
            raise ValueError(f"--swiglu's default FFN size int(8 * --hidden-size {args.hidden_size} / 3 / 64) * 64 "
                             f"is 0 (hidden size below 24); give --ffn-hidden-size.")
        return size
    return 4 * args.hidden_size


def _activation(args: argparse.Namespace) -> str:
    given = [flag for flag, on in (("--swiglu", args.swiglu), ("--squared-relu", args.squared_relu),
                                   ("--quick-geglu", args.quick_geglu)) if on]
    if len(given) > 1:
        raise ValueError(f"{' and '.join(given)} exclude each other (one activation).")
    return "squared_relu" if args.squared_relu else "quick_geglu" if args.quick_geglu else "gelu"


def _qk_layernorm(args: argparse.Namespace) -> bool:
    # MLA's norms act on the latents, before the up-projections that the clip scales.
    if args.qk_layernorm and args.qk_clip and not getattr(args, "multi_latent_attention", False):
        raise ValueError("--qk-clip is not offered with --qk-layernorm: the clip rescales W_q and W_k, which the "
                         "norm after the projection undoes (--log-max-attention-logit works).")
    return args.qk_layernorm


def _rotary_settings(args: argparse.Namespace) -> None:
    if args.no_position_embedding and args.position_embedding_type == "learned_absolute":
        raise ValueError("--no-position-embedding is deprecated (as in Megatron-LM): use --position-embedding-type "
                         "none or rope.")
    if args.rope_scaling_factor is not None and not args.use_rope_scaling:
        raise ValueError("--rope-scaling-factor only applies with --use-rope-scaling.")
    flags = {"rotary_base": "rotary_base", "rotary_percent": "rotary_percent",  # setting: its flag's dest
             "rotary_interleaved": "rotary_interleaved", "rope_scaling": "use_rope_scaling",
             "rotary_seq_len_interpolation_factor": "rotary_seq_len_interpolation_factor",
             "rope_scaling_factor": "rope_scaling_factor"}
    given = {name: getattr(args, dest) for name, dest in flags.items()
             if getattr(args, dest) is not None and getattr(args, dest) is not False}
    # MLA's own RoPE reads --rotary-base and --rotary-percent (megatron_eopt/training/arguments/mla.py checks the rest).
    mla_rotary = ("rotary_base", "rotary_percent") if args.multi_latent_attention else ()
    if args.position_embedding_type != "rope":
        refuse_flags_without([f"--{flags[name].replace('_', '-')}" for name in given if name not in mla_rotary],
                             f"--position-embedding-type rope (got {args.position_embedding_type})")


def _recompute_settings(args: argparse.Namespace, device: Device) -> dict[str, Any]:
    """Megatron-LM's rules: --recompute-activations is --recompute-granularity selective; full
    recompute needs a method and a layer count, selective neither."""
    granularity = args.recompute_granularity
    if args.recompute_activations:
        if granularity == "full":
            raise ValueError("--recompute-activations (selective recompute) and --recompute-granularity full "
                             "exclude each other; give one.")
        granularity = "selective"
    given = [flag for flag, value in (("--recompute-method", args.recompute_method),
                                      ("--recompute-num-layers", args.recompute_num_layers)) if value is not None]
    if args.distribute_saved_activations:
        given.append("--distribute-saved-activations")
    if args.recompute_modules is not None and granularity != "selective":
        raise ValueError("--recompute-modules only applies with selective recompute (--recompute-activations or "
                         "--recompute-granularity selective).")
    if args.recompute_modules is not None and "moe" in args.recompute_modules and args.num_experts is None:
        raise ValueError("--recompute-modules moe needs --num-experts (a mixture-of-experts model).")
    if args.recompute_modules is not None and "mlp" in args.recompute_modules and not args.disable_bias_linear:
        raise ValueError("--recompute-modules mlp needs --disable-bias-linear (megatron-core's checkpoint hands the "
                         "MLP's output bias, a parameter, back through itself, and its backward then recurses "
                         "without end).")
    if args.recompute_modules is not None and "layernorm" in args.recompute_modules and device.te_on_cuda is False:
        raise ValueError("--recompute-modules layernorm needs CUDA and Transformer Engine (megatron-core's "
                         "output-discarding checkpoint calls Transformer Engine's FP8 state).")
    if granularity != "full":
        refuse_flags_without(given, "--recompute-granularity full" + (f" (got {granularity})" if granularity else ""))
    elif len(given) < 2:
        raise ValueError("--recompute-granularity full needs --recompute-method (uniform or block) and "
                         "--recompute-num-layers.")
    elif not 1 <= args.recompute_num_layers <= args.num_layers:
        raise ValueError(f"--recompute-num-layers {args.recompute_num_layers} must be in [1, --num-layers "
                         f"{args.num_layers}].")
    if args.distribute_saved_activations:
        _check_distributed_saved_activations(args, device)
    modules = None if args.recompute_modules is None else tuple(args.recompute_modules)
    return dict(recompute_granularity=granularity, recompute_method=args.recompute_method,
                recompute_num_layers=args.recompute_num_layers, recompute_modules=modules,
                distribute_saved_activations=args.distribute_saved_activations)


def _check_distributed_saved_activations(args: argparse.Namespace, device: Device) -> None:
    """megatron-core's rules (TransformerConfig), plus CUDA: its checkpoint gathers the split
    input into a buffer on torch.cuda.current_device()."""
    if args.tensor_model_parallel_size == 1:
        raise ValueError("--distribute-saved-activations needs --tensor-model-parallel-size > 1 (it splits "
                         "activations over the tensor-parallel ranks).")
    if args.sequence_parallel:
        raise ValueError("--distribute-saved-activations and --sequence-parallel exclude each other (as in "
                         "megatron-core: the activations are split over TP already).")
    if device.on_cuda is False:
        raise ValueError("--distribute-saved-activations needs CUDA (megatron-core gathers the saved activations "
                         "into a CUDA buffer).")


# GPTModelSettings field: the flag (dest) that sets it, where the names differ.
RENAMED = {"vocab_size": "padded_vocab_size", "layernorm_epsilon": "norm_epsilon",
           "layernorm_zero_centered_gamma": "apply_layernorm_1p", "rope_scaling": "use_rope_scaling",
           "num_layers_in_first_pipeline_stage": "decoder_first_pipeline_num_layers",
           "num_layers_in_last_pipeline_stage": "decoder_last_pipeline_num_layers"}
# Set through mla_settings / moe_settings (their flags are None unless given with the feature).
_OWN_RESOLUTION = {row.name for row in MLA + MOE}


def _model_fields(args: argparse.Namespace, device: Device) -> dict[str, Any]:
    """The GPTModelSettings fields that are not a flag's value as given (each checked here)."""
    fields = dict(num_query_groups=_query_groups(args), ffn_hidden_size=_ffn_hidden_size(args),
                  activation=_activation(args), qk_layernorm=_qk_layernorm(args))
    _rotary_settings(args)  # checks; the given RoPE flags are copied by name
    return dict(
        fields,
        bf16=args.bf16 and not args.use_torch_fsdp2,  # FSDP2: fp32 shards, bf16 compute (fully_shard_gpt)
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        add_bias_linear=not args.disable_bias_linear,
        transformer_impl=args.transformer_impl or "auto",
        **mla_settings(args, local_spec=device.local_spec(args)),
        **_recompute_settings(args, device),
    )
