"""megatron-core's fused projections, built on CPU, for the fused-layout tests and benchmark.

- MLA and MoE: the trainer's GPT (`build_gpt_model`) with megatron-core's MLASelfAttention and
  SequentialMLP experts (layer 0 dense, layer 1 MoE).
- Mamba: megatron-core's own `MambaMixer`. It allocates on `torch.cuda.current_device()` and
  refuses to build without mamba_ssm and einops, which its constructor does not use: built with
  those patched (the device -> CPU, the import flags -> True, the CUDA RNG tracker -> a no-op
  context; `reset_parameters` then draws from torch's CPU generator). Its parameters are
  megatron-core's: names, shapes, TP attributes and `partition_sizes`.
- Gated delta net: megatron-core's own `GatedDeltaNet`, patched the same way (the flash-linear-
  attention flag and kernel, the device, the RNG tracker).
`HybridChunk` holds all three as one model chunk. The constants give each part's global rows.
"""

from __future__ import annotations

import contextlib
from typing import Iterator
from unittest import mock

import torch

from megatron_eopt.training.model.gpt import GPTModelSettings, build_gpt_model

HIDDEN = 32
# MLA: 4 heads; the key/value latent (10) + shared rotary key (6) = 16 rows, which TP=2 and TP=4
# shards cut inside a part; value heads narrower than the key heads.
HEADS, Q_LORA, KV_LORA, QK, POS, V = 4, 16, 10, 8, 6, 4
GPT = GPTModelSettings(num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=None,
                       ffn_hidden_size=24, swiglu=True, vocab_size=64, seq_length=8, normalization="RMSNorm",
                       position_embedding_type="rope", multi_latent_attention=True, q_lora_rank=Q_LORA,
                       kv_lora_rank=KV_LORA, qk_head_dim=QK, qk_pos_emb_head_dim=POS, v_head_dim=V, rope_type="rope",
                       num_moe_experts=2, moe_layer_freq=(0, 1))
# Mamba: 8 heads of 8 (d_inner 64), 4 groups of state 8: in_proj rows [z, x, B, C, dt].
MAMBA_HEADS, MAMBA_HEAD_DIM, MAMBA_GROUPS, MAMBA_STATE = 8, 8, 4, 8
MAMBA_PARTS = (MAMBA_HEADS * MAMBA_HEAD_DIM,) * 2 + (MAMBA_GROUPS * MAMBA_STATE,) * 2 + (MAMBA_HEADS,)
# Gated delta net: 4 key heads of 8, 8 value heads of 4: in_proj rows [q, k, v, z, beta, alpha].
GDN_KEY_HEADS, GDN_KEY_DIM, GDN_VALUE_HEADS, GDN_VALUE_DIM = 4, 8, 8, 4
GDN_PARTS = ((GDN_KEY_HEADS * GDN_KEY_DIM,) * 2 + (GDN_VALUE_HEADS * GDN_VALUE_DIM,) * 2
             + (GDN_VALUE_HEADS,) * 2)


def ssm_config():
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, use_cpu_initialization=True,
                             mamba_state_dim=MAMBA_STATE, mamba_head_dim=MAMBA_HEAD_DIM,
                             mamba_num_groups=MAMBA_GROUPS, mamba_num_heads=MAMBA_HEADS, linear_conv_kernel_dim=4,
                             linear_key_head_dim=GDN_KEY_DIM, linear_value_head_dim=GDN_VALUE_DIM,
                             linear_num_key_heads=GDN_KEY_HEADS, linear_num_value_heads=GDN_VALUE_HEADS)


@contextlib.contextmanager
def _on_cpu() -> Iterator[None]:
    from megatron.core.ssm import mamba_context_parallel, mamba_mixer
    from megatron.core.ssm.gated_delta_net import common, gdn

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(torch.cuda, "current_device", lambda: torch.device("cpu")))
        for module, flag in ((mamba_mixer, "HAVE_MAMBA_SSM"), (mamba_mixer, "HAVE_EINOPS"),
                             (mamba_context_parallel, "HAVE_EINOPS"), (common, "HAVE_FLA")):
            stack.enter_context(mock.patch.object(module, flag, True))
        for module in (mamba_mixer, common):
            stack.enter_context(mock.patch.object(module, "get_cuda_rng_tracker", lambda: mock.MagicMock()))
        stack.enter_context(mock.patch.object(gdn, "chunk_gated_delta_rule", lambda *args, **kwargs: None))
        yield


def build_mamba_mixer(config, pg_collection) -> torch.nn.Module:
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    with _on_cpu():
        return MambaMixer(config, MambaMixerSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear),
                          d_model=HIDDEN, pg_collection=pg_collection, layer_number=1, rmsnorm=False)


def build_gated_delta_net(config, pg_collection) -> torch.nn.Module:
    from megatron.core.ssm.gated_delta_net.common import GatedDeltaNetSubmodules
    from megatron.core.ssm.gated_delta_net.gdn import GatedDeltaNet
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    with _on_cpu():
        return GatedDeltaNet(config, GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=WrappedTorchNorm,
                                                             out_proj=RowParallelLinear),
                             layer_number=1, pg_collection=pg_collection)


class HybridChunk(torch.nn.Module):
    """One model chunk: the MLA + MoE GPT (`experts=False`: dense), a Mamba mixer and a gated
    delta net (at the TP size of megatron's parallel_state)."""

    def __init__(self, experts: bool = True) -> None:
        import dataclasses

        from megatron.core import parallel_state
        from megatron.core.process_groups_config import ProcessGroupCollection

        super().__init__()
        tp = parallel_state.get_tensor_model_parallel_world_size()
        settings = GPT if experts else dataclasses.replace(GPT, num_moe_experts=None, moe_layer_freq=1)
        self.gpt = build_gpt_model(dataclasses.replace(settings, sequence_parallel=experts and tp > 1))  # MoE at TP > 1 needs it
        self.config = self.gpt.config
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        self.mamba = build_mamba_mixer(ssm_config(), pg_collection)
        self.gdn = build_gated_delta_net(ssm_config(), pg_collection)
