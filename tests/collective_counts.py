"""`counting_collectives(rank, size)`: the calls and the bytes this rank sends in the collectives
made inside it (all_gather, all_reduce as a ring, all_to_all_single), for tests of the cost model
(megatron_eopt/ops/muon_cost.py). The functions are restored on exit."""

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist


@contextmanager
def counting_collectives(rank: int, size: int) -> Iterator[dict]:
    counts = {"calls": 0, "bytes_sent": 0.0}
    originals = {name: getattr(dist, name) for name in ("all_gather", "all_reduce", "all_to_all_single")}

    def all_gather(tensors, tensor, *args, **kwargs):
        counts["calls"] += 1
        counts["bytes_sent"] += (size - 1) * tensor.numel() * tensor.element_size()
        return originals["all_gather"](tensors, tensor, *args, **kwargs)

    def all_reduce(tensor, *args, **kwargs):
        counts["calls"] += 1
        counts["bytes_sent"] += 2 * (size - 1) / size * tensor.numel() * tensor.element_size()
        return originals["all_reduce"](tensor, *args, **kwargs)

    def all_to_all_single(output, input, output_splits=None, input_splits=None, *args, **kwargs):
        counts["calls"] += 1
        sent = sum(input_splits) - input_splits[rank] if input_splits is not None else input.numel() * (size - 1) / size
        counts["bytes_sent"] += sent * input.element_size()
        return originals["all_to_all_single"](output, input, output_splits, input_splits, *args, **kwargs)

    for name, wrapper in (("all_gather", all_gather), ("all_reduce", all_reduce),
                          ("all_to_all_single", all_to_all_single)):
        setattr(dist, name, wrapper)
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
