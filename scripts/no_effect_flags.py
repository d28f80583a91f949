"""Megatron-LM flags that change nothing in this trainer: accepted, so Megatron-LM command lines
run unchanged, and each one given is named at start-up with the reason (`no_effect_lines`).

- Kernel choices that leave the result as it is. The trainer runs megatron-core's unfused paths
  (TransformerConfig's fusion fields keep their default, off), so the `--no-*-fusion` flags ask
  for what is already so; `--cross-entropy-loss-fusion`, `--use-flash-attn` and
  `--attention-backend` ask for kernels it does not choose (on CPU the attention is torch's
  `scaled_dot_product_attention`; on CUDA Transformer Engine picks its own).
- Settings that are always so here: megatron-core models, CPU initialisation (the weights do not
  depend on the parallel layout), the validation perplexity in TensorBoard.
- `--num-workers`: samples are read in the training process (scripts/data.py), no DataLoader.
"""

import argparse

ALREADY_OFF = "already off here: this trainer runs megatron-core's unfused code"
NOT_CHOSEN = "a kernel choice this trainer does not make (the result does not depend on it)"
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
}


def add_no_effect_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="accepted from Megatron-LM, no effect here")
    for flag, (keywords, reason) in NO_EFFECT.items():
        group.add_argument(flag, default=None, help=reason, **keywords)


def no_effect_lines(args: argparse.Namespace) -> list[str]:
    """One line for each of these flags the command line gave."""
    lines = []
    for flag, (_, reason) in NO_EFFECT.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if value not in (None, False):
            shown = flag if value is True else f"{flag} {value}"
            lines.append(f"{shown}: no effect, {reason}")
    return lines
