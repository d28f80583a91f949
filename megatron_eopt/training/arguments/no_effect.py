"""Megatron-LM flags that change nothing in this trainer, and flags refused in one line.

Accepted flags are named at start-up with the reason (`no_effect_lines`), so Megatron-LM command
lines run unchanged: kernel and fusion choices that leave the result as it is, settings that are
always so here (megatron-core models, CPU initialisation), `--num-workers` (no DataLoader),
timing and Weights & Biases options, and the checkpoint-format choices of megatron's distributed
checkpointing (megatron_eopt.checkpointing has one format). Each row says why.

Refused flags (`check_not_offered`): FP8 training,
optimizer CUDA graphs, and `--use-checkpoint-args`: one line instead of argparse's
"unrecognized arguments". docs/trainer.md lists both kinds.
"""

import argparse

from arguments.optimizer_args import GIVEN_FLAGS_ATTR, OPTION_OF
from megatron_eopt.training.arguments.flags.table import NO_EFFECT as CHANGES_NOTHING
from megatron_eopt.training.arguments.flags.table import REFUSED, Flag

def _ignored(option: str, value: bool = False, **fields) -> Flag:
    """A row that changes nothing here: a switch, or (`value`) a flag taking a value; None unless given."""
    return Flag(option, default=None, action=None if value else "store_true", status=CHANGES_NOTHING, **fields)


def _refused(option: str, value: bool = False, **fields) -> Flag:
    """A row that is refused with its reason; its own dest (`_refused_dest`)."""
    return Flag(option, default=None, action=None if value else "store_true", status=REFUSED,
                dest=_refused_dest(option), **fields)


def _refused_dest(flag: str) -> str:
    """Their own attribute names: several are OptimizerConfig fields, which the trainer copies
    from the namespace by name (arguments.optimizer_config_from_args)."""
    return "refused_" + flag[2:].replace("-", "_")



WANDB = "Weights & Biases logging is not offered here (TensorBoard and --metrics-jsonl are)"
ALREADY_OFF = "already off here: this trainer runs megatron-core's unfused code"
NOT_CHOSEN = "a kernel choice this trainer does not make (the result does not depend on it)"
TIMERS = ("this trainer times whole iterations only (Megatron-LM's level 0: iteration time, throughput); finer "
          "timers are not offered")
ALWAYS_PARALLEL_SAVE = ("every rank writes the shards it holds and each replicated tensor is written once "
                        "(megatron_eopt.checkpointing); there is no save from data-parallel rank 0 only to switch to")
NO_EFFECT_ROWS: tuple[Flag, ...] = (
    _ignored("--no-masked-softmax-fusion", reason=ALREADY_OFF),
    _ignored("--no-bias-gelu-fusion", reason=ALREADY_OFF),
    _ignored("--no-bias-swiglu-fusion", reason=ALREADY_OFF),
    _ignored("--no-bias-dropout-fusion", reason=ALREADY_OFF),
    _ignored("--no-rope-fusion", reason=ALREADY_OFF),
    _ignored("--no-gradient-accumulation-fusion", reason=ALREADY_OFF),
    _ignored("--cross-entropy-loss-fusion", reason=NOT_CHOSEN),
    _ignored("--use-flash-attn", reason=NOT_CHOSEN),
    _ignored("--attention-backend", choices=("auto", "flash", "fused", "unfused", "local"), value=True,
         reason=NOT_CHOSEN),
    _ignored("--use-mcore-models", reason=("the models are always megatron-core's")),
    _ignored("--use-cpu-initialization", reason=("always on here (the weights do not depend on the layout)")),
    _ignored("--log-validation-ppl-to-tensorboard", reason=("always written here with --tensorboard-dir")),
    _ignored("--num-workers", type=int, value=True,
         reason="samples are read in the training process, without a DataLoader"),
    _ignored("--moe-grouped-gemm",
         reason=("a kernel choice this trainer does not make (its experts run one after another, megatron's "
                 "SequentialMLP: the same result)")),
    _ignored("--moe-permute-fusion",
         reason="a kernel choice this trainer does not make (megatron-core's unfused permutation: the same result)"),
    _ignored("--moe-router-fusion",
         reason="a kernel choice this trainer does not make (megatron-core's unfused routing: the same result)"),
    _ignored("--moe-per-layer-logging", reason=("the MoE losses are logged as the mean over layers only")),
    _ignored("--no-create-attention-mask-in-dataloader", reason=("already so: the data carries no attention mask")),
    _ignored("--ckpt-format", choices=("torch", "torch_dist", "torch_dcp", "fsdp_dtensor"), value=True,
         reason="checkpoints are megatron_eopt's resharding format (megatron_eopt.checkpointing) whatever this says"),
    _ignored("--tiktoken-pattern", value=True, reason=("read by TikTokenizer only, which this trainer does not offer")),
    _ignored("--log-timers-to-tensorboard",
         reason=("iteration-time and throughput (Megatron-LM's timers at its default --timing-log-level 0) are always "
                 "written with --tensorboard-dir")),
    _ignored("--attention-softmax-in-fp32",
         reason=("already so here: the attention's softmax runs in fp32 (torch's SDPA on CPU, Transformer Engine's "
                 "attention, megatron's local attention with TransformerConfig's default)")),
    _ignored("--apply-query-key-layer-scaling",
         reason=("an fp16 range trick (scores divided by the layer number, multiplied back in an fp32 softmax) that "
                 "leaves the attention as it is")),
    _ignored("--no-persist-layer-norm", reason=NOT_CHOSEN),
    _ignored("--apply-residual-connection-post-layernorm",
         reason=("megatron-core's transformer layers do not read it (the residual is always the norm's input), so it "
                 "changes nothing in Megatron-LM either")),
    _ignored("--openai-gelu",
         reason=("Megatron-LM itself no longer reads it (the activation stays GELU, or --swiglu's / --squared-relu's /"
                 " --quick-geglu's)")),
    _ignored("--timing-log-level", type=int, choices=(0, 1, 2), value=True, reason=TIMERS),
    _ignored("--timing-log-option", choices=("max", "minmax", "all"), value=True, reason=TIMERS),
    _ignored("--wandb-project", value=True, reason=WANDB),
    _ignored("--wandb-exp-name", value=True, reason=WANDB),
    _ignored("--wandb-save-dir", value=True, reason=WANDB),
    _ignored("--wandb-entity", value=True, reason=WANDB),
    _ignored("--use-dist-ckpt",
         reason=("deprecated in Megatron-LM, where it has no effect either; checkpoints here are always "
                 "megatron_eopt's distributed format")),
    _ignored("--auto-detect-ckpt-format",
         reason="there is one checkpoint format here (megatron_eopt.checkpointing), nothing to detect"),
    _ignored("--ckpt-fully-parallel-save",
         reason="deprecated in Megatron-LM, where it has no effect either; saves are always parallel here"),
    _ignored("--no-ckpt-fully-parallel-save", reason=ALWAYS_PARALLEL_SAVE),
    _ignored("--ckpt-fully-parallel-load",
         reason=("each rank here reads only the tensors it holds (megatron_eopt.checkpointing), with no read-once-and-"
                 "exchange mode to choose")),
    _ignored("--ckpt-assume-constant-structure",
         reason=("it lets megatron's distributed checkpointing reuse save plans between saves, which "
                 "megatron_eopt.checkpointing does not cache; the files are the same")),
    # Refused with --position-embedding-type learned_absolute, as Megatron-LM does (scripts/pretrain_gpt.py).
    _ignored("--no-position-embedding",
         reason=("Megatron-LM's deprecated spelling; the position embedding is --position-embedding-type's (rope or "
                 "none here)")),
)
USE_CHECKPOINT_ARGS = ("checkpoints here do not store the command line (megatron_eopt.checkpointing keeps the "
                       "model, optimizer, lr schedule and RNG states); give the model flags again")
FP8 = ("FP8 training is not offered by this trainer (Megatron-LM runs it through Transformer Engine on Hopper or "
       "newer GPUs); train with --bf16")
NOT_OFFERED_ROWS: tuple[Flag, ...] = (
    _refused("--fp8-format", choices=("e4m3", "hybrid"), value=True, reason=FP8),
    _refused("--fp8-recipe", value=True, reason=FP8),
    _refused("--fp8-amax-history-len", type=int, value=True, reason=FP8),
    _refused("--fp8-amax-compute-algo", choices=("most_recent", "max"), value=True, reason=FP8),
    _refused("--fp8-param-gather", reason=FP8),
    _refused("--optimizer-cuda-graph", reason=("CUDA graphs of the optimizer step are not offered")),
    _refused("--use-checkpoint-args", reason=USE_CHECKPOINT_ARGS),
)
REFUSED_ROWS: tuple[Flag, ...] = NOT_OFFERED_ROWS
NO_EFFECT: dict[str, Flag] = {row.option: row for row in NO_EFFECT_ROWS}
NO_EFFECT_TITLE = "accepted from Megatron-LM, no effect here"
REFUSED_TITLE = "Megatron-LM flags refused with the reason"


def check_not_offered(args: argparse.Namespace) -> None:
    """A ValueError naming the first refused flag the command line gave, with the reason."""
    for row in REFUSED_ROWS:
        value = _given(args, row.option, row.name)
        if value is not None:
            raise ValueError(f"{row.option}: {row.reason}.")


def _given(args: argparse.Namespace, flag: str, dest: str = ""):
    value = getattr(args, dest or flag[2:].replace("-", "_"))
    return None if value is False else value


def no_effect_lines(args: argparse.Namespace) -> list[str]:
    """One line for each of these flags the command line gave, then for each flag (or default)
    that the other flags leave without effect (`combination_lines`)."""
    lines = []
    for flag, row in NO_EFFECT.items():
        value = _given(args, flag)
        if value is not None:
            shown = flag if value is True else f"{flag} {value}"
            lines.append(f"{shown}: no effect, {row.reason}")
    return lines + combination_lines(args)


def combination_lines(args: argparse.Namespace) -> list[str]:
    """Flags that change nothing with the others given: QK-clip's settings without --qk-clip,
    the parameter remainders without a bf16 model, YaRN's mscale flags at scaling factor 1."""
    return _qk_clip_lines(args) + _remainder_lines(args) + _mscale_lines(args)


def _qk_clip_lines(args: argparse.Namespace) -> list[str]:
    given = getattr(args, GIVEN_FLAGS_ATTR, None) or ()
    settings = [f"{OPTION_OF[name]} {getattr(args, name):g}" for name in ("qk_clip_threshold", "qk_clip_alpha")
                if name in given]
    if not settings or args.qk_clip:
        return []
    logging = " (--log-max-attention-logit only records the logits)" if args.log_max_attention_logit else ""
    return [f"{' and '.join(settings)}: no effect without --qk-clip, the clip they set{logging}"]


def _remainder_lines(args: argparse.Namespace) -> list[str]:
    # megatron-core keeps remainders for bf16 parameters under the precision-aware optimizer only.
    if "store_param_remainders" in (getattr(args, GIVEN_FLAGS_ATTR, None) or ()):
        if args.use_precision_aware_optimizer and args.bf16:
            return []
        missing = " and ".join(flag for flag, on in (("--bf16", args.bf16), ("--use-precision-aware-optimizer",
                                                                             args.use_precision_aware_optimizer))
                               if not on)
        return [f"--no-store-param-remainders: no effect without {missing}: only bf16 parameters of the "
                f"precision-aware optimizer keep their fp32 main weights as remainders"]
    if args.use_precision_aware_optimizer and args.fp16 and args.store_param_remainders:
        return ["--use-precision-aware-optimizer with --fp16: parameter remainders (on by default) have no effect, "
                "they apply to bf16 parameters only; the main weights are --main-params-dtype "
                f"{args.main_params_dtype}"]
    return []


def _mscale_lines(args: argparse.Namespace) -> list[str]:
    # megatron-core's YaRN factors are 0.1 * mscale * ln(factor) + 1: 1 for any mscale unless the
    # factor exceeds 1 (its concentration factor and MLA's softmax scale alike).
    if not args.multi_latent_attention:
        return []
    given = [f"--{name.replace('_', '-')} {getattr(args, name):g}" for name in ("mscale", "mscale_all_dim")
             if getattr(args, name) is not None]
    factor = 1.0 if args.rotary_scaling_factor is None else args.rotary_scaling_factor
    if given and factor <= 1.0:
        return [f"{' and '.join(given)}: no effect with --rotary-scaling-factor {factor:g} (YaRN's mscale factors, "
                f"0.1 * mscale * ln(factor) + 1, are 1 unless the factor exceeds 1, as in megatron-core)"]
    if args.rope_type == "rope" and args.rotary_scaling_factor is not None and not args.mscale_all_dim:
        return [f"--rotary-scaling-factor {factor:g}: no effect with --rope-type rope without --mscale-all-dim "
                f"(it scales YaRN's frequencies, and MLA's softmax only through --mscale-all-dim)"]
    return []
