"""``SDPACoreAttention``: megatron's core attention on any device.

megatron's ``DotProductAttention`` allocates a CUDA buffer in forward, so on CPU (and wherever
the attention must record its maximum logits for QK-clip without a Transformer Engine that does)
the layer specs of ``layer_specs.py`` put this module in its place. It is built on
``torch.nn.functional.scaled_dot_product_attention`` and takes megatron's arguments and layouts.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_eopt.ops.qk_clip import max_attention_logits

__all__ = ["SDPACoreAttention"]


class SDPACoreAttention(MegatronModule):
    """Drop-in for megatron's ``DotProductAttention`` that runs on any device.

    Takes the keywords megatron's ``Attention`` passes to ``core_attention``.
    Layouts follow megatron: query ``[sq, b, heads, head_dim]``, key/value
    ``[sk, b, query_groups, head_dim]`` (per tensor-parallel partition; values may be narrower,
    as in multi-latent attention), output ``[sq, b, heads * value_head_dim]``. Options it does not implement raise
    ``ValueError`` instead of silently computing different attention.

    QK-clip: while ``record_max_attn_logits`` is True (from the config's ``qk_clip`` /
    ``log_max_attention_logit``, or set by the optimizer), each training-mode forward folds
    the per-head maximum of the masked pre-softmax logits q.k * softmax_scale over the
    batch into ``current_max_attn_logits`` ([heads on this rank], megatron-core's
    attribute); the optimizer reads and resets it every step. Evaluation forwards do not
    count. The logits are materialised once more for this ([b, heads, sq, sk] fp32).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ) -> None:
        super().__init__(config=config)
        unsupported = {
            "context parallelism": config.context_parallel_size != 1,
            f"softmax_type={config.softmax_type!r}": config.softmax_type != "vanilla",
            "sliding-window attention": config.window_size is not None,
        }
        for option, used in unsupported.items():
            if used:
                raise ValueError(f"SDPACoreAttention does not support {option}")
        self._check_mask_type(attn_mask_type)
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        # Multi-latent attention passes its query/key width (k_channels) and its value width
        # (v_channels, may differ) with its own softmax_scale; the widths come from the tensors.
        head_dim = config.kv_channels if k_channels is None else k_channels
        # apply_query_key_layer_scaling divides the scale by layer_number and multiplies the
        # scores back inside megatron's softmax: a numerical-range trick for fp16 with no effect
        # on the result, so it is ignored here.
        self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
        if attention_dropout is None:
            attention_dropout = config.attention_dropout
        self.dropout_p = attention_dropout
        self.record_max_attn_logits = bool(
            getattr(config, "qk_clip", False) or getattr(config, "log_max_attention_logit", False)
        )
        self.current_max_attn_logits: torch.Tensor | None = None
        # cp_comm_type and pg_collection are accepted for megatron's builder signature; context
        # parallelism is rejected above and the per-partition head counts come from the tensors.

    @staticmethod
    def _check_mask_type(mask_type: AttnMaskType) -> None:
        if mask_type not in (AttnMaskType.causal, AttnMaskType.padding, AttnMaskType.no_mask):
            raise ValueError(
                f"SDPACoreAttention supports causal, padding and no_mask masks, not {mask_type}"
            )

    def _sdpa(self, q, k, v, mask, causal: bool, dropout_p: float) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal, scale=self.softmax_scale
        )

    @torch.no_grad()
    def _record_max_logits(self, q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor | None,
                           causal: bool) -> None:
        """Fold this batch's per-head max logit into ``current_max_attn_logits``."""
        batch_max = max_attention_logits(q, k, self.softmax_scale, allowed, causal)
        previous = self.current_max_attn_logits
        self.current_max_attn_logits = batch_max if previous is None else torch.maximum(previous, batch_max)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        """Attention over ``[s, b, n, d]`` inputs; returns ``[sq, b, n * d]``.

        ``attention_mask`` follows megatron: boolean, ``True`` marks positions that are
        masked out, broadcastable to ``[b, heads, sq, sk]``. With a causal mask type an
        explicit mask is applied on top of causality (e.g. per-document masks).
        """
        if packed_seq_params is not None:
            raise ValueError("SDPACoreAttention does not support packed sequences (THD format)")
        if attention_bias is not None:
            raise ValueError("SDPACoreAttention does not support attention_bias")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        self._check_mask_type(mask_type)

        sq, b, heads, head_dim = query.shape
        sk, groups = key.size(0), key.size(2)
        if heads % groups != 0:
            raise ValueError(f"{heads} query heads do not divide into {groups} key/value groups")
        if heads != groups:  # grouped-query attention: each group serves heads // groups heads
            key = key.repeat_interleave(heads // groups, dim=2)
            value = value.repeat_interleave(heads // groups, dim=2)

        causal = mask_type == AttnMaskType.causal
        if causal and sq != sk:
            raise ValueError(f"causal attention needs sq == sk, got sq={sq}, sk={sk}")
        if mask_type == AttnMaskType.padding and attention_mask is None:
            raise ValueError("padding mask type needs an attention_mask")
        allowed = None  # SDPA boolean masks mark positions to *keep*, the inverse of megatron's
        if attention_mask is not None and mask_type != AttnMaskType.no_mask:
            allowed = ~attention_mask.to(torch.bool)
            if causal:  # SDPA takes is_causal or a mask, not both
                allowed = allowed & torch.ones(sq, sk, dtype=torch.bool, device=query.device).tril()
                causal = False

        # [s, b, n, d] -> [b, n, s, d], the layout SDPA expects.
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if self.record_max_attn_logits and self.training:
            self._record_max_logits(q, k, allowed, causal)
        dropout_p = self.dropout_p if self.training else 0.0
        if dropout_p > 0.0 and not self.config.sequence_parallel:
            # Heads differ across tensor-parallel ranks, so their dropout must use the
            # model-parallel RNG stream, as megatron's DotProductAttention does (on CPU the
            # tracker's streams are CPU generator states, megatron_eopt/training/parallel/cpu_rng.py). Under
            # sequence parallelism the transformer block runs inside that stream already.
            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = self._sdpa(q, k, v, allowed, causal, dropout_p)
        else:
            out = self._sdpa(q, k, v, allowed, causal, dropout_p)
        # [b, n, sq, d_v] -> [sq, b, n * d_v] (d_v: the value width, MLA's may differ from the query's)
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * value.size(-1))
