"""Multi-latent attention (`--multi-latent-attention`) in Megatron-LM's loop without Transformer Engine.

megatron-core 0.19's local layer spec (`--transformer-impl local`) gives `MLASelfAttention` its
local `DotProductAttention` as the core attention, and MLA builds it with its own head widths,
`k_channels` (query/key: qk_head_dim + qk_pos_emb_head_dim) and `v_channels` (v_head_dim), which
only Transformer Engine's attention takes: the model does not build, on CPU or GPU. Its forward
already takes any widths from the tensors it is handed; only its output's width
(`hidden_size_per_partition`, kv_channels x heads) and its default softmax scale come from
`kv_channels`. `taking_mla_head_widths` gives its `__init__` the two arguments: with them the
output is v_channels x heads on this TP rank and the default scale 1/sqrt(k_channels) (MLA passes
its own scale, with YaRN's mscale). Without them it builds as before.
"""

import math
from typing import Any, Optional


def taking_mla_head_widths(attention_class: type) -> list[tuple[Any, str, Any]]:
    """(owner, name, replacement) for megatron-core's local `DotProductAttention.__init__`."""
    original_init = attention_class.__init__

    def __init__(self, config: Any, *args: Any, k_channels: Optional[int] = None,
                 v_channels: Optional[int] = None, **kwargs: Any) -> None:
        original_init(self, config, *args, **kwargs)
        if v_channels is not None:
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition
        if k_channels is not None and kwargs.get("softmax_scale") is None:  # MLA passes its scale by name
            self.softmax_scale = 1.0 / math.sqrt(k_channels)
            if config.apply_query_key_layer_scaling:
                self.softmax_scale /= self.layer_number

    return [(attention_class, "__init__", __init__)]
