"""Evaluation: `--eval-interval`, `--eval-iters`, the final validation and test, Megatron-LM's line.

An evaluation runs `--eval-iters` global batches of a split forward (no gradients, the model in
eval mode, no RNG drawn) and averages the per-token loss over all of them and all data-parallel
ranks. Validation batches move on through the validation split from one evaluation to the next
(the periodic evaluations, then the final one), as Megatron-LM's validation iterator does; the
test split is read once, at the end. With `--final-eval-iters N` the final validation reads the
split's first N batches instead: a fixed held-out set, the same for every run on the data, whose
per-batch losses (`batch_losses`) go to the metrics file, so a reader can measure its noise.
Rank 0 prints Megatron-LM's line between dashes:

     validation loss at iteration 100 | lm loss value: 3.895367E+00 | lm loss PPL: 4.916442E+01 |
"""

import argparse
import contextlib
import math
from dataclasses import dataclass
from typing import Callable, ContextManager, Optional

import torch
import torch.distributed as dist

from megatron_eopt.training.arguments.loop import check_eval_flags  # noqa: F401 (re-exported)

# Megatron-LM caps the exponent so a diverged loss prints a number, not inf.
PPL_EXPONENT_CAP = 20.0


@dataclass(frozen=True)
class EvalResult:
    split: str  # 'valid' or 'test'
    iteration: int
    loss: float
    final: bool = False  # the evaluation after training, not an --eval-interval one
    batch_losses: Optional[tuple[float, ...]] = None  # each global batch's mean loss (--final-eval-iters)

    @property
    def ppl(self) -> float:
        return math.exp(min(PPL_EXPONENT_CAP, self.loss))


def validation_line(label: str, loss: float) -> str:
    """Megatron-LM's evaluate_and_print_results string for the 'lm loss' key."""
    ppl = math.exp(min(PPL_EXPONENT_CAP, loss))
    return f" validation loss at {label} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} | "


def validation_block(label: str, loss: float) -> str:
    """The line between two rows of dashes as long as it (+1), as Megatron-LM prints it."""
    line = validation_line(label, loss)
    rule = "-" * (len(line) + 1)
    return f"{rule}\n{line}\n{rule}"


class Evaluator:
    """Runs evaluations of `model` on a data source's 'valid' and 'test' splits.

    `rank_samples(split, batch_index)` gives this data-parallel rank's micro-batches of that
    split's global batch; `loss_fn(model, tokens)` a micro-batch's (summed loss, count) of the
    tokens that count.
    `on_result(result)` sees every evaluation (split, iteration, loss), e.g. for TensorBoard's
    'lm loss validation'. Each evaluation runs inside `around_each()` (e.g. the garbage
    collections of --manual-gc, megatron_eopt/training/loop/housekeeping.py).
    """

    def __init__(self, args: argparse.Namespace, splits: tuple, rank_samples: Callable, loss_fn: Callable,
                 dp_group, is_first_rank: bool, print_line: Callable[[str], None] = print,
                 on_result: Optional[Callable[["EvalResult"], None]] = None,
                 around_each: Callable[[], ContextManager] = contextlib.nullcontext) -> None:
        self.args, self.splits, self.rank_samples, self.loss_fn = args, splits, rank_samples, loss_fn
        self.dp_group, self.is_first_rank, self.print_line = dp_group, is_first_rank, print_line
        self.on_result, self.around_each = on_result, around_each

    def periodic(self, model, iteration: int) -> Optional[EvalResult]:
        """Validation at every --eval-interval-th iteration."""
        args = self.args
        if not args.eval_iters or "valid" not in self.splits or iteration % args.eval_interval:
            return None
        slot = iteration // args.eval_interval - 1
        return self._run(model, "valid", slot, iteration, f"iteration {iteration}", final=False)

    def final(self, model, iteration: int) -> list[EvalResult]:
        """After training (or, with --skip-train, at the loaded iteration): validation (the
        validation batches after those the periodic evaluations up to `iteration` read, as
        Megatron-LM's iterator continues), then test if the split has one."""
        args, results = self.args, []
        if not args.eval_iters:
            return results
        if "valid" in self.splits and getattr(args, "final_eval_iters", None):
            results.append(self._run(model, "valid", 0, iteration, f"iteration {iteration} on validation set",
                                     final=True, batches=args.final_eval_iters))
        elif "valid" in self.splits:
            slot = iteration // args.eval_interval
            results.append(self._run(model, "valid", slot, iteration, f"iteration {iteration} on validation set",
                                     final=True))
        if "test" in self.splits:
            results.append(self._run(model, "test", 0, iteration, f"iteration {iteration} on test set", final=True))
        return results

    def _run(self, model, split: str, slot: int, iteration: int, label: str, final: bool,
             batches: Optional[int] = None) -> EvalResult:
        """`batches` given: that many batches from the split's start, each one's loss kept."""
        per_batch = None
        with self.around_each():
            if batches:
                sums = evaluate_batches(model, self.loss_fn, self.rank_samples, split, slot, batches, self.dp_group)
                loss = (sums[:, 0].sum() / sums[:, 1].sum()).item()
                per_batch = tuple((sums[:, 0] / sums[:, 1]).tolist())
            else:
                loss = evaluate(model, self.loss_fn, self.rank_samples, split, slot, self.args.eval_iters, self.dp_group)
        result = EvalResult(split, iteration, loss, final, per_batch)
        if self.is_first_rank:
            self.print_line(validation_block(label, loss))
        if self.on_result is not None:
            self.on_result(result)
        return result


@torch.no_grad()
def evaluate(model, loss_fn: Callable, rank_samples: Callable, split: str, slot: int, eval_iters: int,
             dp_group) -> float:
    """Mean per-token loss over eval_iters global batches (slot * eval_iters onwards), all DP
    ranks: `loss_fn(model, tokens)` gives a micro-batch's (summed loss, count) of the tokens that
    count (megatron_eopt/training/loop/token_loss.py)."""
    sums = evaluate_batches(model, loss_fn, rank_samples, split, slot, eval_iters, dp_group)
    return (sums[:, 0].sum() / sums[:, 1].sum()).item()


@torch.no_grad()
def evaluate_batches(model, loss_fn: Callable, rank_samples: Callable, split: str, slot: int, eval_iters: int,
                     dp_group) -> torch.Tensor:
    """Each global batch's (summed loss, tokens counted) over all DP ranks, float64 [eval_iters, 2]:
    batches slot * eval_iters onwards, the model in eval mode."""
    was_training = model.training
    model.eval()
    try:
        sums = torch.zeros((eval_iters, 2), dtype=torch.float64)
        for row, batch_index in enumerate(range(slot * eval_iters, (slot + 1) * eval_iters)):
            for tokens in rank_samples(split, batch_index):
                loss_sum, tokens_counted = loss_fn(model, tokens)
                sums[row, 0] += loss_sum.double().cpu()
                sums[row, 1] += tokens_counted
    finally:
        model.train(was_training)
    sums = sums.to(next(model.parameters()).device)
    dist.all_reduce(sums, group=dp_group)
    return sums.cpu()
