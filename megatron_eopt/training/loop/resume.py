"""Resuming from --load: the checkpoint, --finetune, --no-load-optim's fresh schedule."""

import argparse
import copy
import os

from megatron_eopt.checkpointing import has_checkpoints, load_checkpoint
from megatron_eopt.training.errors import exit_with_error
from megatron_eopt.training.logging.training_log import (
    Logger,
)


def resume(args: argparse.Namespace, chunks, optimizer, scheduler, log: Logger) -> int:
    """Load --load's checkpoint (if there is one); returns the iteration training continues
    from: the saved one, or 0 with --finetune (weights only, as Megatron-LM). --skip-train loads
    the model only, as Megatron-LM (it sets --no-load-optim)."""
    if not args.load:
        return 0
    if args.ckpt_step is None and not has_checkpoints(args.load):
        why = "it holds no checkpoint" if os.path.isdir(args.load) else "it does not exist"
        if args.exit_on_missing_checkpoint:
            exit_with_error(f"--exit-on-missing-checkpoint: no checkpoint in --load {args.load} ({why}).")
        log.say(f"no checkpoint in {args.load} ({why}): training from scratch")
        return 0
    model_only = args.no_load_optim or args.finetune or args.skip_train
    loaded = load_checkpoint(args.load, chunks, optimizer, scheduler, iteration=args.ckpt_step,
                             load_optimizer=not model_only, load_rng=not (args.no_load_rng or args.finetune))
    for message in loaded.messages:
        log.say(message)
    log.say(f"loaded checkpoint {loaded.path} (iteration {loaded.iteration}"
            f"{', model only' if model_only else ''})")
    if args.finetune:
        log.say("--finetune: weights loaded; iteration, consumed samples, optimizer, lr schedule and RNG start fresh")
        return 0
    if args.no_load_optim and not args.skip_train:
        log.say(fresh_schedule_note(args, scheduler, loaded.iteration))
    log.start_at(loaded.iteration, args.batch_schedule.first_sample(loaded.iteration + 1))
    return loaded.iteration


def fresh_schedule_note(args: argparse.Namespace, scheduler, start: int) -> str:
    """--no-load-optim keeps Megatron-LM's semantics: the iteration count continues from the
    checkpoint, the lr schedule starts again at step 0. Say where that leaves this run."""
    def lr_after(iterations: int) -> float:
        probe = copy.copy(scheduler)  # get_lr reads only num_steps and the schedule values
        schedule = args.batch_schedule
        probe.num_steps = schedule.first_sample(start + 1 + iterations) - schedule.first_sample(start + 1)
        return probe.get_lr({})

    last, span = args.train_iters, args.lr_decay_iters or args.train_iters
    if args.train_samples is not None:
        span = (args.lr_decay_samples or args.train_samples) // args.global_batch_size
    note = (f"--no-load-optim: fresh optimizer, lr schedule from step 0 at iteration {start + 1} (lr "
            f"{lr_after(0):.6e}) over --lr-decay-iters {span} iterations; the last iteration, {last}, "
            f"runs at lr {lr_after(last - start - 1):.6e}")
    if span != last - start:
        note += f" (--lr-decay-iters {last - start} fits the schedule to this run)"
    return note
