"""Tensor parallelism and FSDP2 for orthogonalized optimizers whose only whole-matrix step is
`orthogonalize`.

emerging_optimizers' OrthogonalizedOptimizer steps each 2-D parameter as
    p <- weight decay(p);  m <- lerp(m, g, 1 - beta);  u <- m (or Nesterov's lerp(g, m, beta))
    p <- p - lr * orthogonalize(u)
Everything but `orthogonalize` is elementwise. `with_tensor_parallelism(cls)` makes a subclass
whose `orthogonalize` all-gathers u's TP shards, calls the class's own `orthogonalize` on the
whole matrix and keeps this rank's part: the TP=1 update to round-off. That fits PolarGrad, MOP
and Scion, whose `orthogonalize` depends on u alone; not Spel, SinkhornMuon or MuonHyperball,
which have other whole-matrix steps. With FSDP2 (`fsdp_shards`) each matrix has one owner, which
receives every u's rows in one exchange, orthogonalizes the whole matrix and sends the rows
back (ops/row_shards.py).
"""

from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist

from megatron_eopt.ops.placed_matrices import PlacedMatrix, map_placed
from megatron_eopt.ops.row_shards import RowShards, map_row_shards
from megatron_eopt.ops.splits import MatrixLayout
from megatron_eopt.ops.whole_matrix import gather_whole_matrix, local_part
from megatron_eopt.optimizers.muon.shards import layouts_by_param, row_shards_by_param
from megatron_eopt.optimizers.muon.step import OrthogonalizeTogether


class _WholeMatrixOverTensorParallel:
    """The overriding part; mixed in before an OrthogonalizedOptimizer subclass."""

    # Borrowed rather than inherited, so that the class's bases stay (this, the wrapped class).
    _step_orthogonalizing_together = OrthogonalizeTogether.step

    tp_group: Optional[dist.ProcessGroup]
    fsdp_group: Optional[dist.ProcessGroup]
    _layout_of: dict[int, MatrixLayout]
    _row_shards_of: Optional[dict[int, RowShards]]

    def orthogonalize(self, p: torch.Tensor, grad: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if self._row_shards_of is not None:  # a row shard alone has no whole-matrix update
            return self.orthogonalize_all_fn([p], [grad])[0]
        return self._orthogonalize_tp_shard(p, grad, self._layout_of[id(p)], kwargs)

    def _orthogonalize_tp_shard(self, p: torch.Tensor, grad: torch.Tensor, layout: MatrixLayout,
                                kwargs: Mapping[str, Any]) -> torch.Tensor:
        """The class's own `orthogonalize` of the TP=1 matrix, restricted to this TP shard."""
        whole = gather_whole_matrix(grad, layout, self.tp_group)
        return local_part(super().orthogonalize(p, whole, **kwargs), layout, self.tp_group)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        if self._row_shards_of is None:
            return super().step(closure)
        return self._step_orthogonalizing_together(closure)  # every matrix's rows to its owner in one exchange

    def orthogonalize_all_fn(self, params: list[torch.Tensor], updates: list[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's rows of every update, each matrix orthogonalized on its owner (FSDP2)."""
        shards = [self._row_shards_of[id(p)] for p in params]
        group_of = {id(p): group for group in self.param_groups for p in group["params"]}
        placed = [i for i, s in enumerate(shards) if isinstance(s, PlacedMatrix)]  # ops/placed_matrices.py
        rows = [i for i in range(len(shards)) if i not in placed]

        def orthogonalize(indices: list[int], wholes: list[torch.Tensor]) -> list[torch.Tensor]:
            results = []
            for i, whole in zip(indices, wholes):
                kwargs = {k: v for k, v in group_of[id(params[i])].items() if k != "params"}
                results.append(self._orthogonalize_tp_shard(params[i], whole, shards[i].layout, kwargs))
            return results

        results: list[torch.Tensor] = [torch.empty(0)] * len(params)
        exchanged = map_row_shards([updates[i] for i in rows], [shards[i] for i in rows], self.fsdp_group,
                                   lambda owned, wholes: orthogonalize([rows[k] for k in owned], wholes))
        kept = map_placed([updates[i] for i in placed], [shards[i] for i in placed],
                          lambda wholes: orthogonalize(placed, wholes))
        for i, result in (*zip(rows, exchanged), *zip(placed, kept)):
            results[i] = result
        return results


def with_tensor_parallelism(optimizer_cls: type) -> type:
    """`TensorParallel<Name>`: `optimizer_cls` plus `tp_group`, `layouts`, `fsdp_group` and
    `fsdp_shards` arguments.

    layouts: fqn -> MatrixLayout (built without a q/k/v split); param groups name their
    parameters in 'param_fqns'. tp_group None: size 1 (the class's own step). fsdp_shards:
    fqn -> RowShards of every parameter, each a row shard over fsdp_group (torch FSDP2; the
    layouts are then inside them, and `layouts` must be empty).
    """

    def __init__(
        self: Any,
        params: Any,
        *,
        tp_group: Optional[dist.ProcessGroup] = None,
        layouts: Optional[Mapping[str, MatrixLayout]] = None,
        fsdp_group: Optional[dist.ProcessGroup] = None,
        fsdp_shards: Optional[Mapping[str, RowShards]] = None,
        **kwargs: Any,
    ) -> None:
        optimizer_cls.__init__(self, params, **kwargs)
        self.tp_group = tp_group
        self.fsdp_group = fsdp_group
        self._row_shards_of = row_shards_by_param(self.param_groups, fsdp_shards, fsdp_group, tp_group, layouts)
        if self._row_shards_of is None:
            self._layout_of = layouts_by_param(self.param_groups, dict(layouts or {}))

    name = f"TensorParallel{optimizer_cls.__name__}"
    return type(name, (_WholeMatrixOverTensorParallel, optimizer_cls), {
        "__init__": __init__, "__module__": __name__, "__qualname__": name,
        "__doc__": f"{optimizer_cls.__name__} over tensor-parallel shards or FSDP2 row shards (see {__name__}).",
    })
