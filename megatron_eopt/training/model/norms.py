"""megatron-core's local layer norm (`WrappedTorchNorm`) for the two settings it refuses.

megatron's local spec (CPU, or CUDA without Transformer Engine) builds its norms with
`WrappedTorchNorm`, a plain `torch.nn.LayerNorm` / `torch.nn.RMSNorm` that asserts two
TransformerConfig fields off; :class:`LocalTorchNorm` takes its place (same constructor
arguments) when either is on:
- `sequence_parallel`: the norm's weights see only this tensor-parallel rank's tokens, so they
  carry megatron's `sequence_parallel` tag, which its fused and Transformer Engine norms set and
  `finalize_model_grads` (here: megatron_eopt/training/parallel/grad_reduction.py) reads to sum their gradients over TP;
- `layernorm_zero_centered_gamma` (Megatron-LM's `--apply-layernorm-1p`): the weight is stored
  as gamma - 1, initialised to 0, and the norm scales by weight + 1, as megatron's fused and
  Transformer Engine norms do (small stored values keep more precision in bf16/fp16, and weight
  decay, where a parameter group applies it to norms, pulls gamma towards 1 instead of 0).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig


class ZeroCenteredLayerNorm(torch.nn.LayerNorm):
    """LayerNorm whose weight is gamma - 1 (initialised to 0)."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


class ZeroCenteredRMSNorm(torch.nn.RMSNorm):
    """RMSNorm whose weight is gamma - 1 (initialised to 0)."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, self.weight + 1, self.eps)


class LocalTorchNorm:
    """Spec module with `WrappedTorchNorm`'s arguments. Built through `__new__`, like megatron's,
    so the model holds the torch module itself."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **unused) -> torch.nn.Module:
        zero_centered = config.layernorm_zero_centered_gamma
        norms = {"LayerNorm": ZeroCenteredLayerNorm if zero_centered else torch.nn.LayerNorm,
                 "RMSNorm": ZeroCenteredRMSNorm if zero_centered else torch.nn.RMSNorm}
        if config.normalization not in norms:
            raise ValueError(f"normalization must be LayerNorm or RMSNorm, not {config.normalization!r}")
        norm = norms[config.normalization](hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm
