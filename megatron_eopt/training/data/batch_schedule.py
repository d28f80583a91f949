"""Megatron-LM's growing global batch: the batch size as a function of the samples consumed.

- `--rampup-batch-size START INCREMENT SAMPLES`: the batch starts at START and grows by INCREMENT
  in equal steps spread over the first SAMPLES samples, up to --global-batch-size.
- `--step-batch-size-schedule "THRESHOLD:BATCH ..."`: BATCH from THRESHOLD consumed tokens on
  (suffixes K, M, B, T; the first threshold 0). The last BATCH is the global batch size, so
  --global-batch-size is not given with it.

Both need --train-samples, as Megatron-LM's ramp-up does, and every batch size must divide by
--micro-batch-size x data-parallel size. Evaluation keeps the full global batch.
megatron-core's StepBatchsizeNumMicroBatchesCalculator maps consumed samples to the batch size;
this module checks the flags with errors naming them and lists every iteration's batch. It reads
--step-batch-size-schedule itself (`parse_step_schedule`, torch-free, the calculator's grammar),
so the flags are checked before torch and megatron-core are imported.
"""

import argparse
import itertools
import math
from typing import Optional


FLAGS = ("--rampup-batch-size", "--step-batch-size-schedule")


def check_batch_schedule_flags(args: argparse.Namespace) -> Optional[int]:
    """Before the layout is known: the flags' own rules. Returns --global-batch-size, which a
    step schedule sets (its last batch)."""
    given = [flag for flag in FLAGS if getattr(args, flag[2:].replace("-", "_")) is not None]
    if len(given) == 2:
        raise ValueError("--rampup-batch-size and --step-batch-size-schedule exclude each other; give one.")
    if not given:
        return args.global_batch_size
    if args.train_samples is None:
        raise ValueError(f"{given[0]} needs --train-samples (Megatron-LM: no batch-size ramp-up for "
                         f"iteration-based training; the lr schedule then counts samples).")
    if args.rampup_batch_size is not None:
        _check_rampup(args)
        return args.global_batch_size
    else:
        if args.global_batch_size is not None:
            raise ValueError("--step-batch-size-schedule sets the global batch size (its last batch); "
                             "--global-batch-size excludes it (as in Megatron-LM).")
        return step_schedule(args.step_batch_size_schedule, args.seq_length)[-1][1]


def _check_rampup(args: argparse.Namespace) -> None:
    start, increment, samples = args.rampup_batch_size
    final = args.global_batch_size
    if final is None:
        raise ValueError("--rampup-batch-size needs --global-batch-size (the batch it grows to).")
    if start < 1 or increment < 1 or samples < 0:
        raise ValueError(f"--rampup-batch-size {start} {increment} {samples}: START and INCREMENT must be >= 1 "
                         f"and SAMPLES >= 0.")
    if start > final or (final - start) % increment:
        raise ValueError(f"--rampup-batch-size {start} {increment} {samples}: --global-batch-size {final} must be "
                         f"START plus a whole number of INCREMENTs.")


def step_schedule(text: str, seq_length: int) -> list[tuple[int, int]]:
    """--step-batch-size-schedule as (threshold in samples, batch size), ascending; thresholds
    count tokens, as Megatron-LM's flag does (divided by --seq-length)."""
    try:
        schedule = parse_step_schedule(text, seq_length)
    except ValueError as error:
        raise ValueError(f"--step-batch-size-schedule {text!r}: {error}.") from None
    thresholds = [threshold for threshold, _ in schedule]
    if not schedule or thresholds[0] != 0 or len(set(thresholds)) != len(thresholds):
        raise ValueError(f"--step-batch-size-schedule {text!r}: the first threshold must be 0 and each one larger "
                         f"than the last (in samples: {thresholds}).")
    if any(size < 1 for _, size in schedule):
        raise ValueError(f"--step-batch-size-schedule {text!r}: batch sizes must be >= 1.")
    return schedule


SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def parse_step_schedule(text: str, seq_length: Optional[int]) -> list[tuple[int, int]]:
    """megatron-core's reading of a step schedule: "THRESHOLD:BATCH" entries split by spaces or
    commas, each number with an optional suffix K, M, B or T (any case, fractions allowed, then
    truncated), thresholds divided by `seq_length` (tokens to samples) unless it is None; sorted
    by threshold. ValueError names a malformed entry."""
    schedule = []
    for entry in text.replace(",", " ").split():
        if ":" not in entry:
            raise ValueError(f'Invalid schedule entry "{entry}" (expected THRESHOLD:BATCH_SIZE)')
        threshold, batch_size = (_schedule_number(value, entry) for value in entry.split(":", 1))
        schedule.append((threshold if seq_length is None else threshold // seq_length, batch_size))
    return sorted(schedule, key=lambda step: step[0])


def _schedule_number(value: str, entry: str) -> int:
    value = value.strip().upper()
    multiplier = SUFFIXES.get(value[-1:], 1)
    digits = value[:-1] if value[-1:] in SUFFIXES else value
    try:
        number = float(digits)
    except ValueError:
        raise ValueError(f'Invalid number "{value}" in schedule entry "{entry}" (a number with an optional '
                         f'suffix K, M, B or T)') from None
    if not math.isfinite(number):
        raise ValueError(f'Invalid number "{value}" in schedule entry "{entry}" (not finite)')
    return int(number * multiplier)


def rampup_schedule(start: int, increment: int, samples: int, final: int) -> list[tuple[int, int]]:
    """--rampup-batch-size as (threshold in samples, batch size) steps (see the module docstring)."""
    steps = (final - start) // increment
    if steps == 0 or samples == 0:
        return [(0, final)]
    per_step = samples / steps
    by_threshold = {math.ceil(k * per_step): start + k * increment for k in range(steps + 1)}  # later steps win
    return sorted(by_threshold.items())


class BatchSchedule:
    """The global batch size of every training iteration (1-based) and the samples consumed
    before it. Without a schedule flag: --global-batch-size at every iteration."""

    def __init__(self, args: argparse.Namespace, samples_per_micro_step: int) -> None:
        self.global_batch_size = args.global_batch_size
        self.steps = schedule_steps(args)
        self.sizes: Optional[list[int]] = None
        if self.steps is None:
            return
        check_batch_sizes(args, self.steps, samples_per_micro_step)
        self.sizes = self._sizes_until(args.train_samples, samples_per_micro_step)
        self.first_samples = [0, *itertools.accumulate(self.sizes)]

    def _sizes_until(self, train_samples: int, samples_per_micro_step: int) -> list[int]:
        """Megatron-LM's update_train_iters: iterations until train_samples are consumed. The
        batch size at each consumed-sample count is megatron-core's calculator's."""
        from megatron.core.num_microbatches_calculator import (
            StepBatchsizeNumMicroBatchesCalculator,
        )

        calculator = StepBatchsizeNumMicroBatchesCalculator(
            micro_batch_size=1, data_parallel_size=samples_per_micro_step, decrease_batch_size_if_needed=False,
            rank=-1, schedule=" ".join(f"{threshold}:{size}" for threshold, size in self.steps))
        sizes, consumed = [], 0
        while consumed < train_samples:
            calculator.update(consumed, consistency_check=True)
            sizes.append(calculator.get_current_global_batch_size())
            consumed += sizes[-1]
        return sizes

    @property
    def train_iters(self) -> Optional[int]:
        return None if self.sizes is None else len(self.sizes)

    @property
    def train_samples(self) -> Optional[int]:
        return None if self.sizes is None else self.first_samples[-1]

    def size(self, iteration: int) -> int:
        return self.global_batch_size if self.sizes is None else self.sizes[iteration - 1]

    def first_sample(self, iteration: int) -> int:
        """Samples consumed before `iteration` (also the index of its first sample)."""
        if self.sizes is None:
            return (iteration - 1) * self.global_batch_size
        return self.first_samples[iteration - 1]

    def describe(self) -> Optional[str]:
        if self.sizes is None:
            return None
        grows = " -> ".join(f"{size} from sample {threshold}" for threshold, size in self.steps)
        return (f"global batch size grows: {grows}; {self.train_iters} iterations for "
                f"{self.train_samples} samples")


def check_batch_sizes(args: argparse.Namespace, steps: Optional[list[tuple[int, int]]],
                      samples_per_micro_step: int) -> None:
    """Every batch of the schedule `steps` (None: none) a multiple of one micro step's samples."""
    for _, size in steps or ():
        if size % samples_per_micro_step:
            flag = "--rampup-batch-size" if args.rampup_batch_size else "--step-batch-size-schedule"
            raise ValueError(f"{flag}: batch size {size} is not a multiple of --micro-batch-size * "
                             f"data-parallel size = {samples_per_micro_step}.")


def schedule_steps(args: argparse.Namespace) -> Optional[list[tuple[int, int]]]:
    """The schedule flag's (threshold in samples, batch size) steps, torch-free; None without one."""
    if args.rampup_batch_size is not None:
        return rampup_schedule(*args.rampup_batch_size, args.global_batch_size)
    if args.step_batch_size_schedule is not None:
        return step_schedule(args.step_batch_size_schedule, args.seq_length)
    return None
