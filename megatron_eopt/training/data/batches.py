"""Global batches of a data source, split into this data-parallel rank's micro-batches."""

import argparse

import torch

from megatron_eopt.training.data.datasets import (
    SampleCounts,
    build_data_source,
)
from megatron_eopt.training.parallel.layout import Layout


class BatchSource:
    """Global batches of a data source (megatron_eopt/training/data/datasets.py), this DP rank's rows in micro-batches.
    Training iteration i reads train batch i - 1 (the generated task: seed stream i), of the
    size args.batch_schedule gives it (megatron_eopt/training/data/batch_schedule.py), from the samples consumed
    before it on; evaluation batches have the global batch size."""

    def __init__(self, args: argparse.Namespace, layout: Layout, dp_rank: int) -> None:
        self.args, self.dp, self.dp_rank, self.schedule = args, layout.dp, dp_rank, args.batch_schedule
        self.data = build_data_source(args, SampleCounts.for_run(
            args.train_iters, args.global_batch_size, args.eval_interval, args.eval_iters,
            train_samples=self.schedule.first_sample(args.train_iters + 1),
            final_eval_iters=getattr(args, "final_eval_iters", None)))

    def micro_batches(self, iteration: int) -> list[torch.Tensor]:
        size = self.schedule.size(iteration)
        mine = self.data.samples("train", iteration - 1, size, self._rows(size),
                                 first_sample=self.schedule.first_sample(iteration))
        return list(mine.split(self.args.micro_batch_size))

    def split_batches(self, split: str, batch_index: int) -> list[torch.Tensor]:
        size = self.args.global_batch_size
        return list(self.data.samples(split, batch_index, size, self._rows(size)).split(self.args.micro_batch_size))

    def _rows(self, global_batch_size: int) -> slice:
        per_rank = global_batch_size // self.dp
        return slice(self.dp_rank * per_rank, (self.dp_rank + 1) * per_rank)
