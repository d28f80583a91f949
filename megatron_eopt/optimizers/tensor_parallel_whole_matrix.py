"""Tensor parallelism for orthogonalized optimizers whose only whole-matrix step is `orthogonalize`.

emerging_optimizers' OrthogonalizedOptimizer steps each 2-D parameter as
    p <- weight decay(p);  m <- lerp(m, g, 1 - beta);  u <- m (or Nesterov's lerp(g, m, beta))
    p <- p - lr * orthogonalize(u)
Everything but `orthogonalize` is elementwise, so on a TP shard it is the TP=1 step restricted
to the shard. `with_tensor_parallelism(cls)` makes a subclass whose `orthogonalize` all-gathers
u's shards into the whole matrix, calls the class's own `orthogonalize` on it (every TP rank
the same computation), and keeps this rank's part: the TP=1 update, to round-off ('duplicated'
in Muon's terms). Right for PolarGrad (nuclear-norm scale), MOP (SVD polar factor) and Scion
(Newton-Schulz, width factor of the whole shape), whose `orthogonalize` is a function of u alone.
Not for classes with other whole-matrix steps: Spel and SinkhornMuon project the weights after
the update, MuonHyperball keeps the weight norm.
"""

from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist

from megatron_eopt.ops.splits import MatrixLayout
from megatron_eopt.ops.whole_matrix import gather_whole_matrix, local_part
from megatron_eopt.optimizers.tensor_parallel_muon import layouts_by_param


class _WholeMatrixOverTensorParallel:
    """The overriding part; mixed in before an OrthogonalizedOptimizer subclass."""

    tp_group: Optional[dist.ProcessGroup]
    _layout_of: dict[int, MatrixLayout]

    def orthogonalize(self, p: torch.Tensor, grad: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        layout = self._layout_of[id(p)]
        whole = gather_whole_matrix(grad, layout, self.tp_group)
        return local_part(super().orthogonalize(p, whole, **kwargs), layout, self.tp_group)


def with_tensor_parallelism(optimizer_cls: type) -> type:
    """`TensorParallel<Name>`: `optimizer_cls` plus `tp_group` and `layouts` arguments.

    layouts: fqn -> MatrixLayout (built without a q/k/v split); param groups name their
    parameters in 'param_fqns'. tp_group None: size 1 (the class's own step).
    """

    def __init__(
        self: Any,
        params: Any,
        *,
        tp_group: Optional[dist.ProcessGroup] = None,
        layouts: Optional[Mapping[str, MatrixLayout]] = None,
        **kwargs: Any,
    ) -> None:
        optimizer_cls.__init__(self, params, **kwargs)
        self.tp_group = tp_group
        self._layout_of = layouts_by_param(self.param_groups, dict(layouts or {}))

    name = f"TensorParallel{optimizer_cls.__name__}"
    return type(name, (_WholeMatrixOverTensorParallel, optimizer_cls), {
        "__init__": __init__, "__module__": __name__, "__qualname__": name,
        "__doc__": f"{optimizer_cls.__name__} over tensor-parallel shards (see {__name__}).",
    })
