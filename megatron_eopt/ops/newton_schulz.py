"""Newton-Schulz orthogonalization of tensor-parallel shards, in four TP modes.

The iteration itself is emerging_optimizers' `newton_schulz`; this module decides which
matrix each rank orthogonalizes and moves shards accordingly:
- blockwise:   each rank orthogonalizes its local shard; no communication; the result (and
               the scale, from the local shape) depends on the TP degree.
- duplicated:  all-gather the shards, every TP rank orthogonalizes the full matrix, keeps its slice.
- distributed: the shards stay put; each iteration all-reduces the small Gram matrix.
- sharded:     each matrix is orthogonalized by exactly one TP rank (cost-balanced); shards go
               to it with one all-to-all and the results come back with another.
All but blockwise equal the TP=1 update to fp32 round-off. Scales use the global block shape.
"""

import typing
from dataclasses import dataclass
from typing import Literal, Optional

import torch
import torch.distributed as dist
from emerging_optimizers.orthogonalized_optimizers import muon_utils
from emerging_optimizers.orthogonalized_optimizers.muon import get_muon_scale_factor

from megatron_eopt.ops.ownership import assign_owner_ranks
from megatron_eopt.ops.splits import MatrixLayout, merge_blocks, newton_schulz_cost, split_blocks

TpMode = Literal["blockwise", "duplicated", "distributed", "sharded"]
TP_MODES: tuple[str, ...] = typing.get_args(TpMode)


def coefficient_types() -> tuple[str, ...]:
    """Coefficient sets of the installed emerging_optimizers ('custom' needs sets of its own)."""
    return tuple(t for t in typing.get_args(muon_utils.NSCoeffT) if t != "custom")


@dataclass(frozen=True)
class NewtonSchulzSettings:
    """How to orthogonalize and scale one matrix."""

    num_steps: int = 5
    coefficient_type: str = "quintic"
    scale_mode: str = "spectral"
    extra_scale_factor: float = 1.0
    use_syrk: bool = False
    scaled: bool = True  # False: raw orthogonalization (AdaptiveMuon scales after its moment2)

    def __post_init__(self) -> None:
        if self.num_steps < 1:
            raise ValueError(f"num_ns_steps must be >= 1; got {self.num_steps}.")
        valid = coefficient_types()
        if self.coefficient_type not in valid:
            raise ValueError(
                f"coefficient_type must be one of {', '.join(map(repr, valid))} (from the installed "
                f"emerging_optimizers); got {self.coefficient_type!r}."
            )
        if self.scale_mode not in ("spectral", "unit_rms_norm", "shape_scaling"):
            raise ValueError(
                f"scale_mode must be one of 'spectral', 'unit_rms_norm', 'shape_scaling'; got "
                f"{self.scale_mode!r}."
            )

    def orthogonalize(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        """Unscaled orthogonalization of a matrix (or a batch of equal-shape matrices)."""
        return muon_utils.newton_schulz(
            x, steps=self.num_steps, coefficient_type=self.coefficient_type, use_syrk=self.use_syrk, **kwargs
        )

    def scale(self, rows: int, cols: int) -> float:
        if not self.scaled:
            return 1.0
        return get_muon_scale_factor(rows, cols, mode=self.scale_mode) * self.extra_scale_factor


def orthogonalize_updates(
    updates: list[torch.Tensor],
    layouts: list[MatrixLayout],
    tp_mode: str,
    tp_group: Optional[dist.ProcessGroup],
    settings: NewtonSchulzSettings,
) -> list[torch.Tensor]:
    """Scaled orthogonalized update of every parameter, each split into its blocks first.

    Every rank of `tp_group` must call this with the same parameters in the same order.
    """
    if tp_mode not in TP_MODES:
        raise ValueError(f"tp_mode must be one of {', '.join(map(repr, TP_MODES))}; got {tp_mode!r}.")
    pieces = [(i, block, layout) for i, (u, layout) in enumerate(zip(updates, layouts))
              for block in split_blocks(u.float(), layout)]
    block_shapes = [s for layout in layouts for s in layout.global_block_shapes()]
    if tp_mode == "sharded" and _size(tp_group) > 1:
        results = _sharded(pieces, block_shapes, tp_group, settings)
    else:
        results = [
            _one_block(block, layout, shape, tp_mode, tp_group, settings)
            for (_, block, layout), shape in zip(pieces, block_shapes)
        ]
    merged, start = [], 0
    for update, layout in zip(updates, layouts):
        count = len(layout.blocks)
        merged.append(merge_blocks(results[start:start + count], layout).to(update.dtype))
        start += count
    return merged


def _size(group: Optional[dist.ProcessGroup]) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _one_block(
    block: torch.Tensor,
    layout: MatrixLayout,
    global_shape: tuple[int, int],
    tp_mode: str,
    tp_group: Optional[dist.ProcessGroup],
    settings: NewtonSchulzSettings,
) -> torch.Tensor:
    dim = layout.partition_dim
    if dim < 0 or _size(tp_group) == 1:
        return settings.orthogonalize(block) * settings.scale(*global_shape)
    if tp_mode == "blockwise":
        return settings.orthogonalize(block) * settings.scale(*block.shape)
    if tp_mode == "distributed":
        # Rows sharded: iterate on X^T so the all-reduced Gram matrix is over the full dimension.
        orthogonal = settings.orthogonalize(block, transpose=(dim == 0), tp_group=tp_group)
        return orthogonal * settings.scale(*global_shape)
    shards = [torch.empty_like(block) for _ in range(_size(tp_group))]
    dist.all_gather(shards, block.contiguous(), group=tp_group)
    full = settings.orthogonalize(torch.cat(shards, dim=dim)) * settings.scale(*global_shape)
    return full.chunk(len(shards), dim=dim)[dist.get_rank(tp_group)].contiguous()


def _sharded(
    pieces: list[tuple[int, torch.Tensor, MatrixLayout]],
    block_shapes: list[tuple[int, int]],
    tp_group: dist.ProcessGroup,
    settings: NewtonSchulzSettings,
) -> list[torch.Tensor]:
    """Each block orthogonalized once, by its owner; two all-to-alls move shards and results."""
    size, rank = _size(tp_group), dist.get_rank(tp_group)
    owners = assign_owner_ranks([newton_schulz_cost(*s) for s in block_shapes], size)
    blocks = [block.contiguous() for _, block, _ in pieces]
    dims = [layout.partition_dim for _, _, layout in pieces]

    # 1. Every rank sends its shard of each sharded block to the block's owner.
    gathered = _all_to_all(
        [[b for b, d, o in zip(blocks, dims, owners) if o == dest and d >= 0] for dest in range(size)],
        [[b for b, d, o in zip(blocks, dims, owners) if o == rank and d >= 0] for _ in range(size)],
        tp_group,
    )
    # 2. Owners orthogonalize whole blocks (replicated blocks are whole already).
    mine = [i for i, o in enumerate(owners) if o == rank]
    results: dict[int, torch.Tensor] = {}
    sharded_mine = [i for i in mine if dims[i] >= 0]
    for k, i in enumerate(sharded_mine):
        full = torch.cat([gathered[src][k] for src in range(size)], dim=dims[i])
        results[i] = settings.orthogonalize(full) * settings.scale(*block_shapes[i])
    for i in mine:
        if dims[i] < 0:
            results[i] = settings.orthogonalize(blocks[i]) * settings.scale(*block_shapes[i])

    # 3. Owners send each rank its slice (or all of a replicated block) back.
    def piece_for(i: int, dest: int) -> torch.Tensor:
        return results[i] if dims[i] < 0 else results[i].chunk(size, dim=dims[i])[dest].contiguous()

    back = _all_to_all(
        [[piece_for(i, dest) for i in mine] for dest in range(size)],
        [[blocks[i] for i, o in enumerate(owners) if o == src] for src in range(size)],
        tp_group,
    )
    outputs: list[torch.Tensor] = [torch.empty(0)] * len(pieces)
    for src in range(size):
        for i, tensor in zip([i for i, o in enumerate(owners) if o == src], back[src]):
            outputs[i] = tensor
    return outputs


def _all_to_all(
    send: list[list[torch.Tensor]], receive_like: list[list[torch.Tensor]], group: dist.ProcessGroup
) -> list[list[torch.Tensor]]:
    """Send `send[r]` (a list of tensors) to rank r; receive lists shaped like `receive_like[r]`.

    One all_to_all_single over flat fp32 buffers; the received buffer is kept alive by the
    returned views until the caller drops them.
    """
    reference = next((t for row in send + receive_like for t in row), None)
    device = reference.device if reference is not None else torch.device("cpu")
    send_buffer = torch.cat([t.reshape(-1).float() for row in send for t in row] or [torch.empty(0, device=device)])
    send_splits = [sum(t.numel() for t in row) for row in send]
    receive_splits = [sum(t.numel() for t in row) for row in receive_like]
    receive_buffer = torch.empty(sum(receive_splits), dtype=torch.float32, device=device)
    dist.all_to_all_single(receive_buffer, send_buffer, receive_splits, send_splits, group=group)
    received, offset = [], 0
    for row in receive_like:
        tensors = []
        for like in row:
            tensors.append(receive_buffer[offset:offset + like.numel()].view(like.shape))
            offset += like.numel()
        received.append(tensors)
    return received
