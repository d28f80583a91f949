"""Megatron-LM flags that change nothing in this trainer: accepted, so Megatron-LM command lines
run unchanged, and each one given is named at start-up with the reason (`no_effect_lines`).

- Kernel choices that leave the result as it is. The trainer runs megatron-core's unfused paths
  (TransformerConfig's fusion fields keep their default, off), so the `--no-*-fusion` flags ask
  for what is already so; `--cross-entropy-loss-fusion`, `--use-flash-attn` and
  `--attention-backend` ask for kernels it does not choose (on CPU the attention is torch's
  `scaled_dot_product_attention`; on CUDA Transformer Engine picks its own).
- Settings that are always so here: megatron-core models, CPU initialisation (the weights do not
  depend on the parallel layout), the validation perplexity in TensorBoard.
- `--num-workers`: samples are read in the training process (megatron_eopt/training/data/datasets.py), no DataLoader.
- `--attention-softmax-in-fp32` and `--apply-query-key-layer-scaling`: the softmax runs in fp32
  on every attention path here, which makes the second (an fp16 range trick) change nothing.
- `--timing-log-level`, `--timing-log-option`: only whole iterations are timed.
- `--wandb-*`: Weights & Biases logging is not offered (no wandb package, no network).
- Settings whose result is the same here: `--no-create-attention-mask-in-dataloader` (the data
  never carries one),
  `--ckpt-format` (checkpoints are megatron_eopt.checkpointing's resharding format, whatever it
  says), `--tiktoken-pattern` (read by TikTokenizer only, not offered), `--log-timers-to-tensorboard`
  (what it adds at Megatron-LM's default timing level is always written), `--no-position-embedding`
  (deprecated in Megatron-LM, allowed only where --position-embedding-type has none already).
- Checkpoint-format choices of megatron's distributed checkpointing: `--use-dist-ckpt` and
  `--ckpt-fully-parallel-save` (deprecated, no effect in Megatron-LM either),
  `--auto-detect-ckpt-format`, `--async-save`, `--no-ckpt-fully-parallel-save`,
  `--ckpt-fully-parallel-load`, `--ckpt-assume-constant-structure`: megatron_eopt.checkpointing
  has one format, written by every rank in parallel and synchronously; each reason says why.

Flags named only to refuse them (`check_not_offered`): FP8 training, which Megatron-LM runs
through Transformer Engine on Hopper or newer GPUs, the optimizer's precision-aware state,
CPU offload and CUDA graphs (its dtype flags given as fp32, what this trainer keeps, only say so),
and `--use-checkpoint-args` (checkpoints here do not store the command line). A one-line error
says so instead of argparse's "unrecognized arguments".
"""

import argparse

WANDB = "Weights & Biases logging is not offered here (TensorBoard and --metrics-jsonl are)"
ALREADY_OFF = "already off here: this trainer runs megatron-core's unfused code"
NOT_CHOSEN = "a kernel choice this trainer does not make (the result does not depend on it)"
TIMERS = ("this trainer times whole iterations only (Megatron-LM's level 0: iteration time, throughput); finer "
          "timers are not offered")
ASYNC_SAVE = ("saves are synchronous here: every rank writes its part and the checkpoint is committed before "
              "training goes on (Megatron-LM 0.19 also turns --async-save off unless --use-persistent-ckpt-worker)")
ALWAYS_PARALLEL_SAVE = ("every rank writes the shards it holds and each replicated tensor is written once "
                        "(megatron_eopt.checkpointing); there is no save from data-parallel rank 0 only to switch to")
NO_EFFECT: dict[str, tuple[dict, str]] = {  # flag: (argparse keywords, why it changes nothing)
    "--no-masked-softmax-fusion": ({"action": "store_true"}, ALREADY_OFF),
    "--no-bias-gelu-fusion": ({"action": "store_true"}, ALREADY_OFF),
    "--no-bias-swiglu-fusion": ({"action": "store_true"}, ALREADY_OFF),
    "--no-bias-dropout-fusion": ({"action": "store_true"}, ALREADY_OFF),
    "--no-rope-fusion": ({"action": "store_true"}, ALREADY_OFF),
    "--no-gradient-accumulation-fusion": ({"action": "store_true"}, ALREADY_OFF),
    "--cross-entropy-loss-fusion": ({"action": "store_true"}, NOT_CHOSEN),
    "--use-flash-attn": ({"action": "store_true"}, NOT_CHOSEN),
    "--attention-backend": ({"choices": ("auto", "flash", "fused", "unfused", "local")}, NOT_CHOSEN),
    "--use-mcore-models": ({"action": "store_true"}, "the models are always megatron-core's"),
    "--use-cpu-initialization": ({"action": "store_true"}, "always on here (the weights do not depend on the layout)"),
    "--log-validation-ppl-to-tensorboard": ({"action": "store_true"}, "always written here with --tensorboard-dir"),
    "--num-workers": ({"type": int}, "samples are read in the training process, without a DataLoader"),
    "--moe-grouped-gemm": ({"action": "store_true"}, "a kernel choice this trainer does not make (its experts run "
                                                     "one after another, megatron's SequentialMLP: the same result)"),
    "--moe-permute-fusion": ({"action": "store_true"}, "a kernel choice this trainer does not make (megatron-core's "
                                                       "unfused permutation: the same result)"),
    "--moe-router-fusion": ({"action": "store_true"}, "a kernel choice this trainer does not make (megatron-core's "
                                                      "unfused routing: the same result)"),
    "--moe-per-layer-logging": ({"action": "store_true"}, "the MoE losses are logged as the mean over layers only"),
    "--no-create-attention-mask-in-dataloader": ({"action": "store_true"},
                                                 "already so: the data carries no attention mask"),
    "--ckpt-format": ({"choices": ("torch", "torch_dist", "torch_dcp", "fsdp_dtensor")},
                      "checkpoints are megatron_eopt's resharding format (megatron_eopt.checkpointing) whatever "
                      "this says"),
    "--tiktoken-pattern": ({}, "read by TikTokenizer only, which this trainer does not offer"),
    "--log-timers-to-tensorboard": ({"action": "store_true"}, "iteration-time and throughput (Megatron-LM's timers at "
                                   "its default --timing-log-level 0) are always written with --tensorboard-dir"),
    "--attention-softmax-in-fp32": ({"action": "store_true"}, "already so here: the attention's softmax runs in fp32 "
                                   "(torch's SDPA on CPU, Transformer Engine's attention, megatron's local attention "
                                   "with TransformerConfig's default)"),
    "--apply-query-key-layer-scaling": ({"action": "store_true"}, "an fp16 range trick (scores divided by the layer "
                                        "number, multiplied back in an fp32 softmax) that leaves the attention as it is"),
    "--no-persist-layer-norm": ({"action": "store_true"}, NOT_CHOSEN),
    "--apply-residual-connection-post-layernorm": ({"action": "store_true"}, "megatron-core's transformer layers do "
                                                   "not read it (the residual is always the norm's input), so it "
                                                   "changes nothing in Megatron-LM either"),
    "--openai-gelu": ({"action": "store_true"}, "Megatron-LM itself no longer reads it (the activation stays GELU, "
                      "or --swiglu's / --squared-relu's / --quick-geglu's)"),
    "--timing-log-level": ({"type": int, "choices": (0, 1, 2)}, TIMERS),
    "--timing-log-option": ({"choices": ("max", "minmax", "all")}, TIMERS),
    "--wandb-project": ({}, WANDB),
    "--wandb-exp-name": ({}, WANDB),
    "--wandb-save-dir": ({}, WANDB),
    "--wandb-entity": ({}, WANDB),
    "--use-dist-ckpt": ({"action": "store_true"}, "deprecated in Megatron-LM, where it has no effect either; "
                        "checkpoints here are always megatron_eopt's distributed format"),
    "--auto-detect-ckpt-format": ({"action": "store_true"}, "there is one checkpoint format here "
                                  "(megatron_eopt.checkpointing), nothing to detect"),
    "--async-save": ({"action": "store_true"}, ASYNC_SAVE),
    "--ckpt-fully-parallel-save": ({"action": "store_true"}, "deprecated in Megatron-LM, where it has no effect "
                                   "either; saves are always parallel here"),
    "--no-ckpt-fully-parallel-save": ({"action": "store_true"}, ALWAYS_PARALLEL_SAVE),
    "--ckpt-fully-parallel-load": ({"action": "store_true"}, "each rank here reads only the tensors it holds "
                                   "(megatron_eopt.checkpointing), with no read-once-and-exchange mode to choose"),
    "--ckpt-assume-constant-structure": ({"action": "store_true"}, "it lets megatron's distributed checkpointing "
                                         "reuse save plans between saves, which megatron_eopt.checkpointing does "
                                         "not cache; the files are the same"),
    # Refused with --position-embedding-type learned_absolute, as Megatron-LM does (scripts/pretrain_gpt.py).
    "--no-position-embedding": ({"action": "store_true"}, "Megatron-LM's deprecated spelling; the position "
                                "embedding is --position-embedding-type's (rope or none here)"),
}
USE_CHECKPOINT_ARGS = ("checkpoints here do not store the command line (megatron_eopt.checkpointing keeps the "
                       "model, optimizer, lr schedule and RNG states); give the model flags again")
FP8 = ("FP8 training is not offered by this trainer (Megatron-LM runs it through Transformer Engine on Hopper or "
       "newer GPUs); train with --bf16")
NOT_OFFERED: dict[str, tuple[dict, str]] = {  # flag: (argparse keywords, why it is refused)
    "--fp8-format": ({"choices": ("e4m3", "hybrid")}, FP8),
    "--fp8-recipe": ({}, FP8),
    "--fp8-amax-history-len": ({"type": int}, FP8),
    "--fp8-amax-compute-algo": ({"choices": ("most_recent", "max")}, FP8),
    "--fp8-param-gather": ({"action": "store_true"}, FP8),
    "--use-precision-aware-optimizer": ({"action": "store_true"}, "lower-precision optimizer state (Megatron-LM's "
                                        "precision-aware optimizer, through Transformer Engine) is not offered: "
                                        "main parameters, gradients and optimizer states stay fp32"),
    "--optimizer-cpu-offload": ({"action": "store_true"}, "offloading the optimizer to CPU is not offered"),
    "--optimizer-offload-fraction": ({"type": float}, "it applies with --optimizer-cpu-offload, which is not offered"),
    "--optimizer-cuda-graph": ({"action": "store_true"}, "CUDA graphs of the optimizer step are not offered"),
    "--use-checkpoint-args": ({"action": "store_true"}, USE_CHECKPOINT_ARGS),
}
# Megatron-LM's precision-aware optimizer's dtypes: fp32 is what this trainer keeps anyway
# (named at start-up as changing nothing); any other value is refused.
FP32_STATE_FLAGS: dict[str, tuple[str, ...]] = {  # flag: Megatron-LM's choices
    "--main-grads-dtype": ("fp32", "bf16"),
    "--main-params-dtype": ("fp32", "fp16"),
    "--exp-avg-dtype": ("fp32", "fp16", "bf16", "fp8"),
    "--exp-avg-sq-dtype": ("fp32", "fp16", "bf16", "fp8"),
}
FP32_STATE = "main parameters, gradients and optimizer states are fp32 here (the precision-aware optimizer is not offered)"


def add_no_effect_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="accepted from Megatron-LM, no effect here")
    for flag, (keywords, reason) in NO_EFFECT.items():
        group.add_argument(flag, default=None, help=reason, **keywords)
    group = parser.add_argument_group(title="Megatron-LM flags refused with the reason")
    for flag, (keywords, reason) in NOT_OFFERED.items():
        group.add_argument(flag, dest=_refused_dest(flag), default=None, help=reason, **keywords)
    for flag, choices in FP32_STATE_FLAGS.items():
        group.add_argument(flag, dest=_refused_dest(flag), default=None, choices=choices, help=f"fp32 only: {FP32_STATE}")


def _refused_dest(flag: str) -> str:
    """Their own attribute names: several are OptimizerConfig fields, which the trainer copies
    from the namespace by name (arguments.optimizer_config_from_args)."""
    return "refused_" + flag[2:].replace("-", "_")


def check_not_offered(args: argparse.Namespace) -> None:
    """A ValueError naming the first refused flag the command line gave, with the reason."""
    for flag, (_, reason) in NOT_OFFERED.items():
        if _given(args, flag, _refused_dest(flag)) is not None:
            raise ValueError(f"{flag}: {reason}.")
    for flag in FP32_STATE_FLAGS:
        value = _given(args, flag, _refused_dest(flag))
        if value not in (None, "fp32"):
            raise ValueError(f"{flag} {value}: {FP32_STATE}.")


def _given(args: argparse.Namespace, flag: str, dest: str = ""):
    value = getattr(args, dest or flag[2:].replace("-", "_"))
    return None if value is False else value


def no_effect_lines(args: argparse.Namespace) -> list[str]:
    """One line for each of these flags the command line gave."""
    lines = []
    for flag, (_, reason) in NO_EFFECT.items():
        value = _given(args, flag)
        if value is not None:
            shown = flag if value is True else f"{flag} {value}"
            lines.append(f"{shown}: no effect, {reason}")
    lines += [f"{flag} fp32: no effect, {FP32_STATE}" for flag in FP32_STATE_FLAGS
              if _given(args, flag, _refused_dest(flag)) == "fp32"]
    return lines
