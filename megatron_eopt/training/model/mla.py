"""megatron-core's multi-latent attention (DeepSeek-V2/V3, Kimi-K2) in the trainer's GPT model.

The attention is megatron-core's own ``MLASelfAttention`` from its layer specs: down-projections
column-parallel with their outputs gathered over TP, up-projections column-parallel,
``linear_proj`` row-parallel; ``--qk-layernorm`` puts megatron's norms on the latents.
On CPU three things change, nothing else:
- the core attention is training/model/sdpa_attention.py's ``SDPACoreAttention`` (megatron's allocates a
  CUDA buffer), with MLA's query/key width and its own value width;
- :class:`CPUMLASelfAttention` builds CPU subclasses of MLA's rotary embeddings (RoPE or YaRN),
  which compute the same angles and mscale where they are;
- :func:`install_cpu_last_dim_gather` replaces megatron's last-dimension gather helper, which
  allocates on CUDA, by one that allocates where the input is (the same collective).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from megatron.core.models.common.embeddings import yarn_rotary_pos_embedding as yarn
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.tensor_parallel import mappings
from megatron.core.transformer import multi_latent_attention
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_eopt.ops.collectives import all_gather_single

__all__ = ["CPUMLASelfAttention", "MLA_CONFIG_FIELDS", "mla_config_fields", "with_cpu_mla"]

# GPTModelSettings fields handed to megatron-core's MLATransformerConfig unchanged (same names).
MLA_CONFIG_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
                     "rope_type", "rotary_scaling_factor", "mscale", "mscale_all_dim")


def mla_config_fields(settings: Any) -> dict[str, Any]:
    """MLATransformerConfig's MLA fields from the settings ({} without MLA). MLA's rotary
    embedding reads its base and percent from the config, not from GPTModel's arguments."""
    if not settings.multi_latent_attention:
        return {}
    fields = {name: getattr(settings, name) for name in MLA_CONFIG_FIELDS}
    return dict(multi_latent_attention=True, rotary_base=settings.rotary_base,
                rotary_percent=settings.rotary_percent, **fields)


class CPUYarnRotaryEmbedding(yarn.YarnRotaryEmbedding):
    """megatron's YaRN embedding with its frequencies kept on CPU: built with
    ``use_cpu_initialization`` and without the move to CUDA in ``get_emb``; the same angles
    (a ramp between the interpolated and the original frequencies over the correction range)
    and the same concentration factor (mscale)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{**kwargs, "use_cpu_initialization": True})

    def get_emb(self, max_seq_len: int, offset: int = 0) -> tuple[torch.Tensor, float]:
        low, high = yarn._yarn_find_correction_range(self.beta_fast, self.beta_slow, self.dim, self.rotary_base,
                                                     self.original_max_position_embeddings,
                                                     self.correction_range_round_to_int)
        extra_weight = 1.0 - yarn._yarn_linear_ramp_mask(low, high, self.dim // 2, device=self.inv_freq_extra.device)
        inv_freq = self.inv_freq_inter * (1 - extra_weight) + self.inv_freq_extra * extra_weight
        positions = torch.arange(max_seq_len, device=inv_freq.device, dtype=inv_freq.dtype) + offset
        angles = torch.outer(positions, inv_freq)
        mscale = yarn._yarn_get_concentration_factor(self.scaling_factor, self.mscale, self.mscale_all_dim)
        return torch.cat((angles, angles), dim=-1)[:, None, None, :], mscale


class CPUMLARotaryEmbedding(RotaryEmbedding):
    """megatron's RotaryEmbedding as MLA builds it (``--rope-type rope``: not interleaved),
    with its frequencies kept on CPU (built there, not moved to CUDA in ``get_emb``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{**kwargs, "use_cpu_initialization": True})

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        angles = self.get_freqs_non_repeated(max_seq_len, offset)
        return torch.cat((angles, angles), dim=-1)[:, None, None, :]


class CPUMLASelfAttention(MLASelfAttention):
    """megatron's MLASelfAttention whose rotary embedding is built on CPU, and whose RoPE key
    gradient is summed over TP.

    MultiLatentAttention's constructor names the embedding classes itself (no spec slot for
    them), so they are swapped in its module for the duration of this constructor only.

    The gradient: with the local spec, ``linear_kv_down_proj`` is column-parallel and megatron
    all-gathers its output, whose backward keeps this rank's slice of the output gradient,
    assuming every rank computed the same one. That holds for the latent (the up-projection
    all-reduces its input gradient) but not for the RoPE key part, which every rank uses only
    with its own heads: at TP=2 its gradient (and so the gradients of ``linear_kv_down_proj``
    and of everything below) is one rank's heads' share (measured against TP=1 in
    tests/unit/training/model/test_pretrain_gpt_mla.py). :meth:`_qkv_down_projection` hands megatron the
    gathered output in the layout of its replicated (Transformer Engine) down-projection
    instead, where megatron sums that gradient itself: under sequence parallelism this rank's
    tokens (megatron then all-gathers the RoPE key over the sequence, reduce-scattering its
    gradient), else the full output with the RoPE key part marked to all-reduce its gradient.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        install_cpu_last_dim_gather()
        with _cpu_rotary_classes():
            super().__init__(*args, **kwargs)

    def _qkv_down_projection(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q_compressed, kv_combined = super()._qkv_down_projection(hidden_states)
        latent_width = self.config.kv_lora_rank
        if kv_combined.size(-1) == latent_width + self.config.qk_pos_emb_head_dim:
            return q_compressed, kv_combined  # one TP rank: nothing gathered
        kv_combined = mappings.gather_from_tensor_model_parallel_region(kv_combined)
        if self.config.sequence_parallel:
            return q_compressed, mappings.scatter_to_sequence_parallel_region(kv_combined)
        latent, rope_key = kv_combined.split([latent_width, kv_combined.size(-1) - latent_width], dim=-1)
        rope_key = mappings.copy_to_tensor_model_parallel_region(rope_key)  # backward: sum over TP
        return q_compressed, torch.cat([latent, rope_key], dim=-1)


@contextlib.contextmanager
def _cpu_rotary_classes() -> Iterator[None]:
    saved = multi_latent_attention.RotaryEmbedding, multi_latent_attention.YarnRotaryEmbedding
    multi_latent_attention.RotaryEmbedding = CPUMLARotaryEmbedding
    multi_latent_attention.YarnRotaryEmbedding = CPUYarnRotaryEmbedding
    try:
        yield
    finally:
        multi_latent_attention.RotaryEmbedding, multi_latent_attention.YarnRotaryEmbedding = saved


def with_cpu_mla(attention: ModuleSpec) -> ModuleSpec:
    """megatron's MLA attention spec with :class:`CPUMLASelfAttention` (a copy; other specs unchanged)."""
    if attention.module is not MLASelfAttention:
        raise ValueError(f"expected megatron's MLASelfAttention spec, got {attention.module}")
    return dataclasses.replace(attention, module=CPUMLASelfAttention)


def _gather_along_last_dim(input_: torch.Tensor, group) -> torch.Tensor:
    """megatron's `_gather_along_last_dim` with its output where the input is."""
    world_size = group.size()
    if world_size == 1:
        return input_
    output = input_.new_empty((input_.size(0) * world_size, *input_.shape[1:]))
    all_gather_single(output, input_.contiguous(), group=group)
    return torch.cat(output.chunk(world_size, dim=0), dim=-1).contiguous()


def install_cpu_last_dim_gather() -> None:
    """Make megatron's last-dimension gather allocate where its input is (idempotent; its
    autograd function looks the helper up by module name at call time)."""
    mappings._gather_along_last_dim = _gather_along_last_dim
