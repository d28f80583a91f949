"""`--qk-clip` in Megatron-LM's own loop on CPU, without Transformer Engine (2 gloo ranks, fp32).

With ours installed the clip is our optimizer's (integrations/megatron_lm_qk_clip.py): megatron-core's
local attention records each head's largest logit, our step clips, and Megatron-LM's `clip_qk` only
reads what our step measured. Two references from outside our code:
- the logits themselves: what megatron-core's own softmax (`FusedScaleMaskSoftmax`) is handed in
  each training forward, masked as it masks them; their largest per iteration, over both ranks, is
  the largest logit the loop logs;
- the clip: megatron-core's own QK-clip (`Attention.clip_qk`, called by Megatron-LM's `clip_qk`
  after megatron-core's optimizer steps), given the same records (its Transformer Engine check
  answered as 2.9 would be), gives the same losses and logged logits.
Run without the clip, the largest logit grows past 2.5 tau in 6 steps; with it, the clip acts from
the first step: both runs measure the same first step, and their losses differ from the second on. How far the
logit stays from tau is not asserted (measured here below 2 tau; one update and a new batch come on
top of tau, and a bound measured on one CPU failed on another, issue 84): what the clip guarantees
is checked exactly in test_megatron_lm_deepseek_case.py and test_pretrain_gpt_mla.py. No linear biases: megatron-core's clip leaves the `linear_qkv` bias as
it is (ours scales it too, docs/qk-clip.md), with which the two differ by design.
"""

import pytest

from tests.functional.test_megatron_lm_loop import MODEL, _column
from tests.megatron_lm_in_process import run_megatron_lm

ITERATIONS = 6
THRESHOLD = 0.1  # below the first step's largest logit (0.116): the clip acts from the first step
QK_CLIP = ["--optimizer", "adam", "--clip-grad", "0", "--lr", "1e-2", "--disable-bias-linear", "--log-max-attention-logit"]
CLIPPING = ["--qk-clip", "--qk-clip-threshold", str(THRESHOLD)]


def _softmax_inputs_recorded(maxima: list[float]):
    """megatron-core's softmax, also appending the largest logit it is handed in a training forward."""
    import torch
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.utils import get_default_causal_mask

    original = FusedScaleMaskSoftmax.forward

    def forward(self, input, mask, softmax_offset=None):
        if self.training:
            scores = input.detach().double() * (self.scale or 1.0)
            if mask is None and self.attn_mask_type == AttnMaskType.causal and scores.size(2) > 1:
                mask = get_default_causal_mask(scores.size(2))
            if mask is not None:
                scores = scores.masked_fill(mask.to(torch.bool), float("-inf"))
            maxima.append(scores.max().item())
        return original(self, input, mask, softmax_offset)

    return FusedScaleMaskSoftmax, forward


def _one_wrapper_deeper(model: list, log_max_only: bool = False) -> float:
    """megatron-core 0.19's clip_qk reaches the layers as `chunk.module.module.decoder`, which only a
    model wrapped in Float16Module (--bf16) has; in fp32 each chunk is handed one wrapper deeper."""
    from types import SimpleNamespace

    from megatron.core.optimizer.qk_clip import clip_qk

    return clip_qk([SimpleNamespace(module=chunk) for chunk in model], log_max_only)


def _loop_runs(rank: int, world_size: int) -> dict:
    """Ours with and without the clip, and megatron-core's own clip; each with the largest softmax
    input of every training forward."""
    import contextlib
    from unittest import mock

    import megatron.training.training as training
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_eopt.integrations.megatron_lm_qk_clip import recording_max_logits
    from megatron_eopt.runtime.megatron_lm_cpu import replaced

    runs = {}
    for name, flags in (("ours", CLIPPING), ("ours unclipped", []), ("megatron-core", CLIPPING + ["--megatron-core-optimizer"])):
        maxima: list[float] = []
        owner, forward = _softmax_inputs_recorded(maxima)
        references = [(owner, "forward", forward)]
        if name == "megatron-core":  # its records from our local-attention recorder, as TE's would be
            references += recording_max_logits(DotProductAttention) + [(training, "clip_qk", _one_wrapper_deeper)]
        te_29 = mock.patch("megatron.training.arguments.is_te_min_version", return_value=True)
        with replaced(references), (te_29 if name == "megatron-core" else contextlib.nullcontext()):
            run = run_megatron_lm(rank, world_size, MODEL + QK_CLIP + flags)
        runs[name] = (run, maxima)
    return runs


def _per_iteration(forwards: list[float]) -> list[float]:
    calls = len(forwards) // ITERATIONS  # micro-batches x layers, the same every iteration
    assert calls * ITERATIONS == len(forwards), len(forwards)
    return [max(forwards[calls * i:calls * (i + 1)]) for i in range(ITERATIONS)]


def test_qk_clip_in_megatron_lms_loop_without_transformer_engine(run_distributed) -> None:
    per_rank = run_distributed(_loop_runs, 2, timeout=600)
    every = range(1, ITERATIONS + 1)
    for name in ("ours", "ours unclipped", "megatron-core"):
        runs = [result[name][0] for result in per_rank]
        logged = _column(runs[0], "max attention logit", every)
        forwards = [result[name][1] for result in per_rank]
        per_iteration = [max(values) for values in zip(*(_per_iteration(f) for f in forwards))]  # MAX over ranks
        print(name, "logged", logged, "softmax inputs", per_iteration, "losses", _column(runs[0], "lm loss", every))
        assert logged == pytest.approx(per_iteration, rel=1e-5), (name, logged, per_iteration)
    unclipped = _column(per_rank[0]["ours unclipped"][0], "max attention logit", every)
    assert max(unclipped) > 2.5 * THRESHOLD, unclipped  # the logits grow past the threshold
    ours, theirs = per_rank[0]["ours"][0], per_rank[0]["megatron-core"][0]
    clipped = _column(ours, "max attention logit", every)
    assert clipped[0] > THRESHOLD, clipped  # the first step clips...
    losses = {name: _column(per_rank[0][name][0], "lm loss", every) for name in ("ours", "ours unclipped")}
    assert clipped[0] == unclipped[0] and losses["ours"][0] == losses["ours unclipped"][0]  # ...after its forward:
    assert losses["ours"][1] != losses["ours unclipped"][1]  # the next forward runs another model
    assert [ours.optimizer_package, theirs.optimizer_package] == ["megatron_eopt", "megatron"]
    assert _column(ours, "lm loss", every) == pytest.approx(_column(theirs, "lm loss", every), rel=1e-6)
    assert _column(ours, "max attention logit", every) == pytest.approx(
        _column(theirs, "max attention logit", every), rel=1e-5)
