"""`--qk-clip` and `--log-max-attention-logit` in Megatron-LM's loop with megatron_eopt's optimizer,
with or without Transformer Engine.

Megatron-LM measures the largest attention logits in Transformer Engine's attention (>= 2.9) and
clips after the optimizer's step (`clip_qk`); its validate_args refuses both flags without that
Transformer Engine. With ours installed the clip is part of our optimizer's step
(wrappers/qk_clip.py), which needs only an attention that records `current_max_attn_logits`.
`install()` (integrations/megatron_lm.py) puts in Megatron-LM's place:
- `validate_args` checking the two flags as ours: alpha in (0, 1), a threshold > 0, no
  Transformer Engine version (`validating_qk_clip_as_ours`);
- megatron-core's local attention (`--transformer-impl local`, `DotProductAttention`) recording
  each head's largest logit in training forwards, as Transformer Engine's does
  (`recording_max_logits`); with Transformer Engine's attention its own record stays;
- `clip_qk` in Megatron-LM's training step returning the largest logit our step measured, for
  its log (`max_attention_logit_of_our_step`): our step has clipped and reset the records already.
"""

import argparse
import weakref
from typing import Any, Callable, Optional

import torch

from arguments.validate import flag_message
from megatron_eopt.ops.qk_clip import max_attention_logits
from megatron_eopt.wrappers.qk_clip import QKClipSettings

# Megatron-LM's flags that its validate_args ties to Transformer Engine >= 2.9.
_FLAGS = ("qk_clip", "log_max_attention_logit")


def validating_qk_clip_as_ours(validate: Callable[..., argparse.Namespace]) -> Callable[..., argparse.Namespace]:
    """`validate` (Megatron-LM's validate_args) with the two flags checked as our QKClipSettings
    does (a ValueError in one line) instead of asserting Transformer Engine >= 2.9."""

    def validate_args(args: argparse.Namespace, defaults: Optional[dict] = None) -> argparse.Namespace:
        given = {name: getattr(args, name, False) for name in _FLAGS}
        if given["qk_clip"]:
            try:
                QKClipSettings(qk_clip=True, qk_clip_threshold=args.qk_clip_threshold, qk_clip_alpha=args.qk_clip_alpha)
            except ValueError as error:
                raise ValueError(flag_message(str(error))) from None
        vars(args).update(dict.fromkeys(given, False))
        try:
            validated = validate(args, {} if defaults is None else defaults)
        finally:
            vars(args).update(given)
        vars(validated).update(given)
        return validated

    return validate_args


def recording_max_logits(attention_class: type) -> list[tuple[Any, str, Any]]:
    """(owner, name, replacement) for megatron-core's local `DotProductAttention`: built with
    qk_clip or log_max_attention_logit in its config, it records (the optimizer may switch it on
    too), and each training forward folds its heads' largest logits into
    `current_max_attn_logits` ([heads on this TP rank], megatron-core's attribute)."""
    original_init, original_forward = attention_class.__init__, attention_class.forward

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, config, *args, **kwargs)
        self.record_max_attn_logits = bool(config.qk_clip or config.log_max_attention_logit)
        self.current_max_attn_logits = None
        if self.record_max_attn_logits and self.scale_mask_softmax.window_size is not None:
            raise ValueError("--qk-clip and --log-max-attention-logit with megatron-core's local attention do not "
                             "support sliding-window attention (--window-size); train without a window.")

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                *args: Any, **kwargs: Any) -> torch.Tensor:
        if getattr(self, "record_max_attn_logits", False) and self.training:
            _record(self, query, key, attention_mask)
        return original_forward(self, query, key, value, attention_mask, *args, **kwargs)

    return [(attention_class, "__init__", __init__), (attention_class, "forward", forward)]


@torch.no_grad()
def _record(attention: Any, query: torch.Tensor, key: torch.Tensor, attention_mask: Optional[torch.Tensor]) -> None:
    """The logits DotProductAttention's softmax takes: q.k times its softmax scale (and the layer
    number it divided out with apply_query_key_layer_scaling, which its softmax multiplies back),
    masked as its softmax masks them: by the given mask (True: masked out), else causally."""
    from megatron.core.transformer.enums import AttnMaskType

    repeats = attention.num_attention_heads_per_partition // attention.num_query_groups_per_partition
    if repeats > 1:
        key = key.repeat_interleave(repeats, dim=2)
    scale = attention.softmax_scale * (attention.layer_number if attention.config.apply_query_key_layer_scaling else 1)
    causal = attention_mask is None and attention.attn_mask_type == AttnMaskType.causal and query.size(0) > 1
    allowed = None if attention_mask is None else ~attention_mask.to(torch.bool)
    q, k = (t.permute(1, 2, 0, 3) for t in (query, key))  # [s, b, heads, d] -> [b, heads, s, d]
    batch_max = max_attention_logits(q, k, scale, allowed, causal)
    previous = attention.current_max_attn_logits
    attention.current_max_attn_logits = batch_max if previous is None else torch.maximum(previous, batch_max)


class OptimizersOfModels:
    """Our optimizer of each model chunk Megatron-LM's loop built one for (weakly held), so that
    `clip_qk`, which Megatron-LM hands only the model, can read what the step measured."""

    def __init__(self) -> None:
        # Both weak: the optimizer holds its chunks, so a strong value would keep its key alive.
        self._by_chunk: "weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()

    def remember(self, model_chunks: Any, optimizer: Any) -> Any:
        chunks = [model_chunks] if isinstance(model_chunks, torch.nn.Module) else list(model_chunks or ())
        for chunk in chunks:
            self._by_chunk[chunk] = weakref.ref(optimizer)
        return optimizer

    def _optimizer_of(self, chunk: torch.nn.Module) -> Any:
        reference = self._by_chunk.get(chunk)
        return None if reference is None else reference()

    def max_attention_logit_of_our_step(self, model: Any, log_max_only: bool = False) -> float:
        """What Megatron-LM's `clip_qk(model, log_max_only)` returns for its log: the model's
        largest logit at the last step (0.0 before any, as Megatron-LM starts from 0)."""
        chunks = [model] if isinstance(model, torch.nn.Module) else list(model)
        largest = [getattr(self._optimizer_of(chunk), "max_attention_logit", None) for chunk in chunks]
        return max([value for value in largest if value is not None], default=0.0)
