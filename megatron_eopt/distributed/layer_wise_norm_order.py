"""The layer-wise optimizer's gradient norm summed in megatron-core's order, to the last bit.

megatron-core's LayerWiseDistributedOptimizer, as Megatron-LM's pretrain_gpt.py builds it (its DDP
all-reduces: no parameter layout), deals whole parameters to the data-parallel ranks ping-pong
(`_shard_params_ping_pong`): all its optimizers' parameters in order, stably sorted by element
count, dealt to ranks 0, 1, ..., n-1, n-1, ..., 0, 0, 1, ... (experts apart, over their group); each
param group keeps its own in that sorted order. A rank's norm is that of the vector of its
parameters' gradient norms, in that order; the squares are summed over the ranks. Ours owns by
Newton-Schulz cost (ops/ownership.py): each rank's part would hold other parameters and round
otherwise, and a clipping factor from it moves every later step. So the owners' per-parameter norms
are exchanged (one all-reduce of a float per parameter over each data-parallel group: the owner's
norm, 0 elsewhere, an exact sum) and each rank takes megatron-core's rank's part, in its order. The
owners stay ours. It is megatron-core's bit for bit where every counted parameter has a gradient
(megatron-core DDP's buffers give one); one without counts as 0, with no host decision needed.
"""

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from megatron_eopt.runtime.process_groups import ProcessGroup, all_reduce_sum, group_rank, group_size
from megatron_eopt.wrappers.grad_stats import LocalStats


@dataclass(frozen=True)
class ChildNormParams:
    """One chained optimizer's parameters on every owner, in its order, and its data-parallel group."""

    groups: list[list[torch.Tensor]]  # each param group's parameters, all of them: megatron-core deals every one
    counted: dict[int, Optional[str]]  # id() of those its norm counts -> the norm group (None: the main norm)
    group: Optional[ProcessGroup]  # the data-parallel group its parameters are owned over
    is_expert: bool = False  # megatron-core deals experts apart (over the expert data-parallel group)

    @property
    def params(self) -> list[torch.Tensor]:
        return [p for group in self.groups for p in group]

    def counted_params(self) -> list[torch.Tensor]:
        return [p for p in self.params if id(p) in self.counted]

    def held(self, held_here: set[int]) -> list[tuple[torch.Tensor, Optional[str]]]:
        """The counted parameters megatron-core's rank holds (`held_here`), each with its norm group, in
        its order: group by group, each group's in the dealt order (stably by element count)."""
        ordered = [p for group in self.groups for p in sorted(group, key=lambda q: q.numel())]
        return [(p, self.counted[id(p)]) for p in ordered if id(p) in held_here and id(p) in self.counted]


def ping_pong_ranks(numels: Sequence[int], size: int) -> list[int]:
    """megatron-core's rank of each parameter: stably sorted by element count, dealt 0 .. size-1,
    then size-1 .. 0, and again."""
    deal = list(range(size)) + list(reversed(range(size)))
    ranks = [0] * len(numels)
    for turn, index in enumerate(sorted(range(len(numels)), key=lambda i: numels[i])):
        ranks[index] = deal[turn % len(deal)]
    return ranks


class MegatronCoreNormOrder:
    """Rearranges the layer-wise children's statistics (wrappers/base.py's ArrangeStats): each
    child's norms become those of the parameters megatron-core's rank holds, in its order.

    `children` is one ChildNormParams per chained optimizer, in the chain's order; the statistics
    it arranges start with theirs (what follows, e.g. the non-owned inf/NaN check, is kept). With
    `whole` (a group of every rank the children's groups span) and `chain` (megatron-core's param
    groups, each a list of parameters, in its optimizers' order), dense and expert children become
    one vector in that order, summed once over `whole`, as megatron-core sums experts with the rest."""

    def __init__(self, children: Sequence[ChildNormParams], device: torch.device,
                 whole: Optional[ProcessGroup] = None, chain: Sequence[Sequence[torch.Tensor]] = ()) -> None:
        self.children, self.device = list(children), device
        self.whole, self.chain = whole, [list(group) for group in chain]
        self.by_kind = {}  # is_expert -> (its group, the counted parameters of its children, in order)
        for child in self.children:
            if group_size(child.group) > 1:
                entry = self.by_kind.setdefault(child.is_expert, (child.group, []))
                entry[1].extend(child.counted_params())
        self.held_here = self._held_here()
        self.held = [child.held(self.held_here) for child in self.children]  # each child's, in megatron-core's order
        self.counted = {key: value for child in self.children for key, value in child.counted.items()}
        self.in_chain = self._held_in_chain() if self.chain and self.by_kind else None

    def _held_here(self) -> set[int]:
        """id() of the parameters megatron-core's rank (this rank's place in each group) holds."""
        held = set()
        for is_expert, (group, _) in self.by_kind.items():
            params = [p for child in self.children if child.is_expert == is_expert for p in child.params]
            ranks = ping_pong_ranks([p.numel() for p in params], group_size(group))
            held |= {id(p) for p, rank in zip(params, ranks) if rank == group_rank(group)}
        return held

    def __call__(self, stats: list[LocalStats]) -> list[LocalStats]:
        if self.in_chain is not None:
            return [self._as_one(stats[:len(self.children)])] + stats[len(self.children):]
        if not self.by_kind:
            return stats  # every data-parallel group of size 1: each rank already holds megatron-core's part
        norms = self._exchanged(stats[:len(self.children)])
        arranged = list(stats)
        for index, child in enumerate(self.children):
            if group_size(child.group) == 1:
                continue
            local = stats[index]
            keys = dict.fromkeys([*(local.norms or {}), *child.counted.values()])
            held = self.held[index]
            arranged[index] = LocalStats(local.stats, {key: [norms[id(p)] for p, k in held if k == key] for key in keys},
                                         local.groups)
        return arranged

    def _held_in_chain(self) -> list[torch.Tensor]:
        """The counted parameters megatron-core's rank holds, in its chain's order: each group's by
        element count (the deal's order; a group of one rank holds all of its kind)."""
        alone = {id(p) for child in self.children if group_size(child.group) == 1 for p in child.params}
        return [p for group in self.chain for p in sorted(group, key=lambda q: q.numel())
                if id(p) in self.counted and (id(p) in self.held_here or id(p) in alone)]

    def _as_one(self, stats: list[LocalStats]) -> LocalStats:
        """The children's statistics as one, its norms `in_chain`'s, to be summed over `whole`."""
        norms = self._exchanged(stats)
        keys = dict.fromkeys([key for local in stats for key in (local.norms or {})] + list(self.counted.values()))
        total = stats[0].stats.clone()
        for local in stats[1:]:
            total += local.stats.to(total.device)
        return LocalStats(total, {key: [norms[id(p)] for p in self.in_chain if self.counted[id(p)] == key]
                                  for key in keys}, (self.whole,))

    def _exchanged(self, stats: list[LocalStats]) -> dict[int, torch.Tensor]:
        """id(parameter) -> its gradient's norm, for every counted parameter of a group of size > 1
        (and, for `_as_one`, this rank's own of a group of one)."""
        owned = {}
        for local in stats:
            for key, params in (local.params or {}).items():
                owned.update({id(p): norm for p, norm in zip(params, local.norms[key])})
        zero = torch.zeros((), dtype=torch.float32, device=self.device)
        norms = {key: norm.to(self.device) for key, norm in owned.items()}
        for child in self.children:  # a group of one: a parameter without a gradient counts as 0
            if group_size(child.group) == 1:
                norms.update({id(p): norms.get(id(p), zero) for p in child.counted_params()})
        for group, params in self.by_kind.values():
            if not params:
                continue
            vector = torch.stack([owned.get(id(p), zero).to(self.device) for p in params])
            all_reduce_sum(vector, group)
            norms.update({id(p): value for p, value in zip(params, vector.unbind())})
        return norms
