"""Checkpoint flags: saving and loading (`CHECKPOINT`) and run control: exit signals, finetuning,
skipping training (`RUN_CONTROL`)."""

from megatron_eopt.training.arguments.flags.table import Flag, switch
from megatron_eopt.training.loop.run_control import CATCHABLE_SIGNALS, STRICTNESS_CHOICES

CHECKPOINT_TITLE = 'checkpointing'
CHECKPOINT: tuple[Flag, ...] = (
    Flag('--save', help='directory to save checkpoints in'),
    Flag('--save-interval', int, help='save every this many iterations (and after the last one)'),
    Flag('--load', help='directory to resume from (its latest checkpoint)'),
    Flag('--ckpt-step', int, help='load this iteration instead of the latest'),
    switch('--no-load-optim', help='load the model only (fresh optimizer; the lr schedule starts again at step 0)'),
    switch('--override-opt_param-scheduler', aliases=('--override-opt-param-scheduler',),
           help=("resuming: keep this run's lr schedule (lr, min lr, warmup and decay iters, decay style, weight "
                 "decay), not the checkpoint's; the step count still comes from the checkpoint")),
    switch('--use-checkpoint-opt_param-scheduler', aliases=('--use-checkpoint-opt-param-scheduler',),
           help="resuming: take the lr schedule from the checkpoint, ignoring this run's schedule flags"),
    switch('--no-load-rng', help='do not restore the RNG states'),
    switch('--no-save-optim',
           help='save the model only (no optimizer or lr schedule state; resume it with --no-load-optim)'),
    switch('--no-save-rng', help='save no RNG states'),
    switch('--async-save',
           help=("write each --save-interval checkpoint in the background: the state is copied to the CPU, training "
                 "goes on, and the next save, the run's end and --exit-signal-handler wait for it; the checkpoint "
                 "after the last iteration (or on an exit signal) is written before exiting")),
    switch('--continue-on-save-failure',
           help=("ours (Megatron-LM has none): a save that fails with an OS error (a full disk, an unwritable --save) "
                 "is reported in one line and training goes on to the next save; without it training stops there, "
                 "with a non-zero exit status. Either way the failed save leaves the directory as it was")),
)

RUN_CONTROL_TITLE = 'run control'
RUN_CONTROL: tuple[Flag, ...] = (
    switch('--exit-signal-handler',
           help=('on --exit-signal, save a checkpoint (with --save) at the end of the current iteration and exit, '
                 'every rank together')),
    Flag('--exit-signal', choices=CATCHABLE_SIGNALS, metavar='SIGNAL',
         help='the signal --exit-signal-handler waits for (default SIGTERM)'),
    switch('--finetune',
           help=('load the model weights only: iteration, consumed samples, optimizer, lr schedule and RNG start '
                 'fresh')),
    switch('--exit-on-missing-checkpoint',
           help='stop when --load holds no checkpoint, instead of training from scratch'),
    Flag('--dist-ckpt-strictness', choices=STRICTNESS_CHOICES,
         help="only raise_all, what megatron_eopt's loader does: any key difference is an error"),
)
