"""Megatron-LM's run-control and checkpoint-loading flags beyond --save/--load.

- `--exit-signal-handler` (with `--exit-signal`, default SIGTERM): the signal, when it reaches any
  rank, makes the run save a checkpoint (with `--save`) at the end of the current iteration and
  stop there, every rank at the same iteration. As in Megatron-LM, megatron's
  `DistributedSignalHandler` records the signal and each iteration all-gathers the ranks' flags.
- `--finetune`: load the model weights only; the iteration count, the consumed samples, the
  optimizer, the lr schedule and the RNG states start fresh (Megatron-LM's `load_checkpoint`
  with `args.finetune`).
- `--exit-on-missing-checkpoint`: a `--load` that finds no checkpoint stops the run instead of
  training from scratch.
- `--dist-ckpt-strictness`: megatron_eopt.checkpointing refuses any difference between a
  checkpoint's keys and the model's (megatron's `raise_all`); that value is accepted, the others
  are refused.
"""

import argparse
import signal
from typing import Optional

# Signals a process can catch (SIGKILL and SIGSTOP cannot be).
CATCHABLE_SIGNALS = tuple(sorted(s.name for s in signal.Signals if s not in (signal.SIGKILL, signal.SIGSTOP)))
STRICTNESS_CHOICES = ("assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected", "raise_all",
                      "return_unexpected", "return_all", "ignore_all")  # megatron's StrictHandling values


def check_run_control_flags(args: argparse.Namespace) -> dict:
    """Checks; returns --exit-signal with its default, SIGTERM."""
    if args.exit_signal is not None and not args.exit_signal_handler:
        raise ValueError(f"--exit-signal {args.exit_signal} needs --exit-signal-handler.")
    for flag, given in (("--finetune", args.finetune), ("--exit-on-missing-checkpoint", args.exit_on_missing_checkpoint)):
        if given and not args.load:
            raise ValueError(f"{flag} needs --load (the checkpoint directory).")
    if args.dist_ckpt_strictness not in (None, "raise_all"):
        raise ValueError(f"--dist-ckpt-strictness {args.dist_ckpt_strictness} is not offered: "
                         f"megatron_eopt.checkpointing refuses any key that the checkpoint and the model do "
                         f"not share (raise_all, the only value accepted).")
    return {"exit_signal": args.exit_signal or "SIGTERM"}


def run_control_lines(args: argparse.Namespace) -> list[str]:
    """Start-up lines for flags that change nothing here."""
    if args.dist_ckpt_strictness == "raise_all":
        return ["--dist-ckpt-strictness raise_all: no effect, megatron_eopt.checkpointing always refuses "
                "checkpoints whose keys differ from the model's"]
    return []


class ExitSignal:
    """--exit-signal-handler for one run: a context that installs megatron's
    DistributedSignalHandler for the signal and restores the previous handler on exit.
    `received()` is collective (an all-gather over the job), so every rank calls it at the same
    point of every iteration and all get the same answer."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.signum = signal.Signals[args.exit_signal] if args.exit_signal_handler else None
        self._handler = None

    def __enter__(self) -> "ExitSignal":
        if self.signum is not None:
            from megatron.training.dist_signal_handler import DistributedSignalHandler

            self._handler = DistributedSignalHandler(self.signum).__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._handler is not None:
            self._handler.release()
            self._handler = None

    def received(self) -> Optional[str]:
        """Why to stop after this iteration (the signal reached some rank), else None."""
        if self._handler is None or not any(self._handler.signals_received()):
            return None
        return f"--exit-signal-handler: {self.signum.name} received"
