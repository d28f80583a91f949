"""``CPUGPTModel``: megatron-core's ``GPTModel`` without the pieces that call CUDA.

With tied embeddings and a pipeline, megatron-core moves the shared weight with ``.cuda()``
before all-reducing it over the embedding group; RoPE moves its inverse frequencies to
``torch.cuda.current_device()`` at the first forward. Here both stay where the model is, and
sequence-parallel linears use ``parallel/sequence_parallel.py``'s CPU collectives. On CUDA
``gpt.py`` builds megatron's own ``GPTModel``.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt import GPTModel

from megatron_eopt.training.parallel.sequence_parallel import use_cpu_sequence_parallel_linears

__all__ = ["CPUGPTModel"]


class _CPURotaryEmbedding(RotaryEmbedding):
    """megatron's RotaryEmbedding without the move of its inverse frequencies to
    ``torch.cuda.current_device()`` at the first forward (``get_emb``): the same angles,
    position x inverse frequency, each used by two components (the two halves of a head, or
    neighbouring pairs with ``rotary_interleaved``), ``[seq, 1, 1, head_dim]``."""

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        angles = self.get_freqs_non_repeated(max_seq_len, offset)
        if self.rotary_interleaved:
            emb = angles.repeat_interleave(2, dim=-1)
        else:
            emb = torch.cat((angles, angles), dim=-1)
        return emb[:, None, None, :]


class CPUGPTModel(GPTModel):
    """GPTModel whose tied-embedding set-up and rotary embedding also run on CPU.

    With tied embeddings and a pipeline, megatron-core zeroes the last stage's output-layer
    copy and all-reduces it with the first stage's embedding over the embedding group, but
    first moves the weight with ``.cuda()`` (language_module.py). This substitution does the
    same all-reduce where the weight is; on one stage it changes nothing. RoPE's frequencies
    stay where the model is (:class:`_CPURotaryEmbedding`).
    """

    _syncing_embeddings_here = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if type(getattr(self, "rotary_pos_emb", None)) is RotaryEmbedding:
            self.rotary_pos_emb.__class__ = _CPURotaryEmbedding
        if self.config.sequence_parallel:
            use_cpu_sequence_parallel_linears(self)

    def setup_embeddings_and_output_layer(self) -> None:
        self._syncing_embeddings_here = True  # hides the embedding group from megatron's CUDA copy
        try:
            super().setup_embeddings_and_output_layer()
        finally:
            self._syncing_embeddings_here = False
        if torch.distributed.is_initialized() and self._is_in_embd_group():
            weight = self.shared_embedding_or_output_weight()
            torch.distributed.all_reduce(weight.data, group=self.embd_group)

    def _is_in_embd_group(self) -> bool:
        return not self._syncing_embeddings_here and super()._is_in_embd_group()

