"""Newton-Schulz orthogonalization of tensor-parallel shards, in four TP modes.

The iteration is emerging_optimizers'; this module decides who orthogonalizes what, and moves shards:
- blockwise:   each rank its local shard; no communication; the update depends on the TP degree.
- duplicated:  one all-gather for all blocks of a step; every TP rank orthogonalizes the full
               matrix and keeps its slice.
- distributed: the shards stay put; each iteration all-reduces the small Gram matrix.
- sharded:     one TP rank per matrix, cost-balanced; one all-to-all there, one back.
All but blockwise equal the TP=1 update to fp32 round-off; each parameter may have its own mode
('auto': ops/muon_cost.py chooses). Scales use the global block shape. Per-head blocks
(MatrixLayout.per_head) are whole on their rank: done there, in every mode (docs/tp-muon.md).
`orthogonalize_batched`: one batched call per shape; a result never depends on the other matrices'
values, and on their number only where the BLAS splits a lone product over threads (docs/testing.md).
`gram=True`: Gram Newton-Schulz where it costs fewer FLOPs (ops/gram_newton_schulz.py; through the `package`
if given, except 'distributed' shards: `block_paths`); `aol=True`: Turbo-Muon's preconditioner (ops/aol.py).
"""

import functools
import typing
from dataclasses import dataclass, field
from typing import Literal, Optional, Sequence, Union

import torch
import torch.distributed as dist
from emerging_optimizers.orthogonalized_optimizers import muon_utils
from emerging_optimizers.orthogonalized_optimizers.muon import get_muon_scale_factor

from megatron_eopt.ops.aol import aol_newton_schulz, check_sign_preserving
from megatron_eopt.ops.gram_newton_schulz import gram_newton_schulz, gram_pays, gram_stable, restart_steps
from megatron_eopt.ops.gram_newton_schulz_package import PACKAGE_PATH, GramPackage
from megatron_eopt.ops.ownership import assign_owner_ranks
from megatron_eopt.ops.splits import MatrixLayout, merge_blocks, newton_schulz_cost, split_blocks
from megatron_eopt.ops.whole_matrix import gather_cut_matrices, keep_local_rows
from megatron_eopt.runtime.once import warn_once
from megatron_eopt.runtime.process_groups import group_rank, group_size

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
    gram: bool = False  # Gram Newton-Schulz on the blocks where it costs fewer FLOPs
    aol: bool = False  # the AOL preconditioner (Turbo-Muon, ops/aol.py) on every path but the package's
    # The gram-newton-schulz package runs those blocks where they are whole here (no tp_group).
    package: Optional[GramPackage] = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.package is not None and not self.gram:
            raise ValueError("NewtonSchulzSettings: a gram-newton-schulz package backend needs gram=True.")
        if self.num_steps < 1:
            raise ValueError(f"num_ns_steps must be >= 1; got {self.num_steps}.")
        valid = coefficient_types()
        if self.coefficient_type not in valid:
            raise ValueError(
                f"coefficient_type must be one of {', '.join(map(repr, valid))} (from the installed "
                f"emerging_optimizers); got {self.coefficient_type!r}."
            )
        if self.aol and self.package is not None:
            raise ValueError("The gram-newton-schulz package does not run the AOL preconditioner: turn one of "
                             "muon_gram_newton_schulz_package and muon_aol_preconditioner off (our Gram "
                             "Newton-Schulz runs it).")
        if self.aol and self.use_syrk:
            raise ValueError("emerging_optimizers' syrk kernel does not run the AOL preconditioner: turn one of "
                             "muon_use_syrk and muon_aol_preconditioner off.")
        if self.aol:
            check_sign_preserving(self.coefficient_type, self.num_steps)
        elif self.coefficient_type == "aol":
            warn_once("aol_coefficients_without_aol",
                      "Newton-Schulz coefficient type 'aol' without the AOL preconditioner runs coefficients "
                      "meant for a preconditioned input on a Frobenius-normalized one (as megatron-core does); "
                      "muon_aol_preconditioner=True (--muon-aol-preconditioner) gives Turbo-Muon.")
        if self.scale_mode not in ("spectral", "unit_rms_norm", "shape_scaling"):
            raise ValueError(
                f"scale_mode must be one of 'spectral', 'unit_rms_norm', 'shape_scaling'; got "
                f"{self.scale_mode!r}."
            )

    def orthogonalize(self, x: torch.Tensor, transpose: Optional[bool] = None,
                      tp_group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
        """Unscaled orthogonalization of a matrix (or a batch of equal-shape matrices); with
        `tp_group`, x is this rank's shard along the dimension that is not transposed away."""
        precision = torch.get_float32_matmul_precision()
        if self.takes_gram_path(x.size(-2), x.size(-1), precision, transpose):
            if self.package is not None and tp_group is None and transpose in (None, x.size(-2) > x.size(-1)):
                return self.package(x)
            return gram_newton_schulz(x, self.num_steps, self.coefficient_type, transpose=transpose, tp_group=tp_group,
                                      aol=self.aol)
        if self.aol:
            return aol_newton_schulz(x, self.num_steps, self.coefficient_type, transpose=transpose, tp_group=tp_group)
        return muon_utils.newton_schulz(x, steps=self.num_steps, coefficient_type=self.coefficient_type,
                                        use_syrk=self.use_syrk, transpose=transpose, tp_group=tp_group)

    def takes_gram_path(self, rows: int, cols: int, precision: str, transpose: Optional[bool] = None) -> bool:
        """Whether a rows x cols matrix (as `orthogonalize` sees it) takes Gram Newton-Schulz: with
        `gram`, where that is stable at `precision` and costs fewer FLOPs."""
        if not self.gram:
            return False
        transpose = rows > cols if transpose is None else transpose
        m, n = (cols, rows) if transpose else (rows, cols)
        return (gram_stable(self.coefficient_type, self.num_steps, precision)
                and gram_pays(m, n, self.num_steps, restart_steps(self.num_steps)))

    def scale(self, rows: int, cols: int) -> float:
        if not self.scaled:
            return 1.0
        return get_muon_scale_factor(rows, cols, mode=self.scale_mode) * self.extra_scale_factor


# One block of one parameter's update: (index of the parameter, the block, the parameter's layout).
Piece = tuple[int, torch.Tensor, MatrixLayout]


def orthogonalize_updates(
    updates: list[torch.Tensor],
    layouts: list[MatrixLayout],
    tp_mode: Union[str, Sequence[str]],
    tp_group: Optional[dist.ProcessGroup],
    settings: NewtonSchulzSettings,
) -> list[torch.Tensor]:
    """Scaled orthogonalized update of every parameter, each split into its blocks first.

    tp_mode: one mode for all, or one per parameter (as 'auto' resolves them); the modes run one
    after another in TP_MODES order. Every rank of `tp_group` must call this with the same
    parameters and modes in the same order.
    """
    modes = [tp_mode] * len(layouts) if isinstance(tp_mode, str) else list(tp_mode)
    if len(modes) != len(layouts) or any(mode not in TP_MODES for mode in modes):
        raise ValueError(f"tp_mode must be one of {', '.join(map(repr, TP_MODES))} (or one per parameter); "
                         f"got {tp_mode!r} for {len(layouts)} parameters.")
    updates, layouts, cut = gather_cut_matrices(updates, layouts, modes, tp_group)  # MLA's kv_down_proj
    pieces = [(i, block, layout) for i, (u, layout) in enumerate(zip(updates, layouts))
              for block in split_blocks(u.float(), layout)]
    block_shapes = [s for layout in layouts for s in layout.global_block_shapes()]
    # Without TP, and per-head blocks (whole on this rank) in every mode: here, no communication.
    here = [group_size(tp_group) == 1 or layout.per_head for _, _, layout in pieces]
    own = [k for k, local in enumerate(here) if local]
    results: list[torch.Tensor] = [torch.empty(0)] * len(pieces)
    for k, result in zip(own, orthogonalize_batched([pieces[k][1] for k in own],
                                                    [settings.scale(*block_shapes[k]) for k in own], settings)):
        results[k] = result
    for mode in TP_MODES:  # the same subsets on every TP rank
        subset = [k for k, (i, _, _) in enumerate(pieces) if modes[i] == mode and not here[k]]
        if subset:
            done = _IN_MODE[mode]([pieces[k] for k in subset], [block_shapes[k] for k in subset], tp_group, settings)
            for k, result in zip(subset, done):
                results[k] = result
    merged, start = [], 0
    for update, layout in zip(updates, layouts):
        count = len(layout.global_block_shapes())
        merged.append(merge_blocks(results[start:start + count], layout).to(update.dtype))
        start += count
    return keep_local_rows(merged, cut, tp_group)


def block_paths(layout: MatrixLayout, tp_mode: str, tp_size: int, settings: NewtonSchulzSettings,
                precision: str) -> tuple[str, ...]:
    """'gram', PACKAGE_PATH or 'standard' for each block of `layout`, as `orthogonalize_updates`
    will run it: the global block in 'duplicated'/'sharded' (and at TP=1), the local shard in
    'blockwise', the local shard iterated on its Gram matrix over the TP ranks in 'distributed'
    (ours even with a package: it has no TP group)."""
    sharded = tp_size > 1 and layout.partition_dim >= 0 and not (layout.per_head or layout.tp_contiguous)
    shapes = layout.global_block_shapes()
    if sharded and tp_mode in ("blockwise", "distributed"):
        shapes = [(layout.num_row_groups * block, layout.local_shape[1]) for block in layout.blocks]
    transpose = (layout.partition_dim == 0) if sharded and tp_mode == "distributed" else None
    gram = PACKAGE_PATH if settings.package is not None and not (sharded and tp_mode == "distributed") else "gram"
    return tuple(gram if settings.takes_gram_path(rows, cols, precision, transpose) else "standard"
                 for rows, cols in shapes)


def orthogonalize_batched(matrices: list[torch.Tensor], scales: list[float],
                          settings: NewtonSchulzSettings) -> list[torch.Tensor]:
    """`scales[i]` times the orthogonalized `matrices[i]`; equal shapes go through one batched call.

    In bf16 a result may depend on the batch's size: native bf16 kernels (AMX, GPUs) choose their
    summation order by batch count.

    The results are views of new batch tensors, never of the inputs.
    """
    groups: dict[tuple, list[int]] = {}
    for i, matrix in enumerate(matrices):
        groups.setdefault((tuple(matrix.shape), matrix.dtype, matrix.device), []).append(i)
    results: list[torch.Tensor] = [torch.empty(0)] * len(matrices)
    for indices in groups.values():
        group = [matrices[i] for i in indices]
        # Tall matrices are stacked tall, not pre-transposed: newton_schulz then transposes the batch
        # as a view, exactly as it does a single matrix, so the round-off is the 2-D path's.
        # emerging_optimizers' syrk kernel takes 2-D input only.
        orthogonal = (torch.stack([settings.orthogonalize(m) for m in group]) if settings.use_syrk
                      else settings.orthogonalize(torch.stack(group)))
        group_scales = [scales[i] for i in indices]
        if len(set(group_scales)) == 1:  # the usual case: a Python scalar, no host-to-device copy
            orthogonal.mul_(group_scales[0])
        else:
            orthogonal.mul_(torch.tensor(group_scales, dtype=orthogonal.dtype,
                                         device=orthogonal.device).view(-1, 1, 1))
        for k, i in enumerate(indices):
            results[i] = orthogonal[k]
    return results


def _local(
    pieces: list[Piece],
    block_shapes: list[tuple[int, int]],
    tp_group: dist.ProcessGroup,
    settings: NewtonSchulzSettings,
    tp_mode: str,
) -> list[torch.Tensor]:
    """'blockwise' (each shard alone) and 'duplicated' (each rank the all-gathered matrix)."""
    size, rank = group_size(tp_group), group_rank(tp_group)
    gather = [k for k, (_, _, layout) in enumerate(pieces) if tp_mode == "duplicated" and layout.partition_dim >= 0]
    full = dict(zip(gather, _all_gather_blocks([pieces[k][1] for k in gather],
                                               [pieces[k][2].partition_dim for k in gather], tp_group)))
    matrices, scales = [], []
    for k, ((_, block, layout), shape) in enumerate(zip(pieces, block_shapes)):
        if tp_mode == "blockwise" and layout.partition_dim >= 0:
            matrices.append(block)
            scales.append(settings.scale(*block.shape))
        else:
            matrices.append(full.get(k, block))
            scales.append(settings.scale(*shape))
    results = orthogonalize_batched(matrices, scales, settings)
    return [result.chunk(size, dim=layout.partition_dim)[rank] if k in full else result
            for k, (result, (_, _, layout)) in enumerate(zip(results, pieces))]


def _all_gather_blocks(shards: list[torch.Tensor], dims: list[int], group: dist.ProcessGroup) -> list[torch.Tensor]:
    """The full blocks of `shards` (each concatenated over the TP ranks along `dims[i]`).

    One all_gather of one flat buffer for all of them, instead of one collective per block:
    every rank holds shards of the same shapes (equal TP splits), so rank r's buffer has the
    same layout as ours. Pure data movement: the blocks are bitwise those of per-block gathers.
    """
    if not shards:
        return []
    flat = torch.cat([s.reshape(-1) for s in shards])
    buffers = [torch.empty_like(flat) for _ in range(group_size(group))]
    dist.all_gather(buffers, flat, group=group)
    fulls, offset = [], 0
    for shard, dim in zip(shards, dims):
        pieces = [buffer[offset:offset + shard.numel()].view(shard.shape) for buffer in buffers]
        fulls.append(torch.cat(pieces, dim=dim))
        offset += shard.numel()
    return fulls


def _distributed(pieces: list[Piece], block_shapes: list[tuple[int, int]], tp_group: dist.ProcessGroup,
                 settings: NewtonSchulzSettings) -> list[torch.Tensor]:
    """Sharded blocks one by one (the all-reduced norm and Gram matrix are per matrix); replicated ones batched."""
    replicated = [k for k, (_, _, layout) in enumerate(pieces) if layout.partition_dim < 0]
    results: list[torch.Tensor] = [torch.empty(0)] * len(pieces)
    batched = orthogonalize_batched([pieces[k][1] for k in replicated],
                                    [settings.scale(*block_shapes[k]) for k in replicated], settings)
    for k, result in zip(replicated, batched):
        results[k] = result
    for k, ((_, block, layout), shape) in enumerate(zip(pieces, block_shapes)):
        if layout.partition_dim >= 0:
            # Rows sharded: iterate on X^T so the all-reduced Gram matrix is over the full dimension.
            orthogonal = settings.orthogonalize(block, transpose=(layout.partition_dim == 0), tp_group=tp_group)
            results[k] = orthogonal.mul_(settings.scale(*shape))
    return results


def _sharded(pieces: list[Piece], block_shapes: list[tuple[int, int]], tp_group: dist.ProcessGroup,
             settings: NewtonSchulzSettings) -> list[torch.Tensor]:
    """Each block orthogonalized once, by its owner; two all-to-alls move shards and results."""
    size, rank = group_size(tp_group), group_rank(tp_group)
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
    sharded_mine = [i for i in mine if dims[i] >= 0]
    fulls = {i: torch.cat([gathered[src][k] for src in range(size)], dim=dims[i]) for k, i in enumerate(sharded_mine)}
    orthogonal = orthogonalize_batched([fulls.get(i, blocks[i]) for i in mine],
                                       [settings.scale(*block_shapes[i]) for i in mine], settings)
    results = dict(zip(mine, orthogonal))

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


# How the shards of a block meet, by TP mode: (pieces, global block shapes, tp_group, settings) -> results.
_IN_MODE = {
    "blockwise": functools.partial(_local, tp_mode="blockwise"),
    "duplicated": functools.partial(_local, tp_mode="duplicated"),
    "distributed": _distributed,
    "sharded": _sharded,
}
