"""Training flags: length, lr and weight-decay schedule, recompute, loss (`TRAINING`), the growing
global batch (`BATCH_SCHEDULE`) and memory housekeeping (`MEMORY`)."""

from megatron_eopt.training.arguments.flags.table import Flag, switch

DEFAULT_TRAIN_ITERS = 100  # without --train-iters or --train-samples

# Megatron-LM's --recompute-modules that this trainer's models have (no grouped GEMM, MLA, shared
# experts or gated delta net).
RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp", "moe")

TRAINING_TITLE = 'training'
TRAINING: tuple[Flag, ...] = (
    Flag('--micro-batch-size', int, 4),
    Flag('--global-batch-size', int, help='default: micro batch * DP'),
    Flag('--train-iters', int, help=f'default {DEFAULT_TRAIN_ITERS} (without --train-samples)'),
    Flag('--train-samples', int,
         help=('train on this many samples (--train-samples // --global-batch-size iterations); the lr schedule '
               'then counts samples (--lr-decay-samples, --lr-warmup-samples, --lr-wsd-decay-samples)')),
    Flag('--exit-interval', int, help='stop after an iteration divisible by this'),
    Flag('--exit-duration-in-mins', float,
         help=('stop (saving first, with --save) after the iteration that ends past this many minutes of '
               'training, on every rank together')),
    Flag('--lr-decay-style', default='linear', choices=('constant', 'linear', 'cosine', 'inverse-square-root', 'WSD')),
    Flag('--lr-decay-iters', int, help='default: train iters'),
    Flag('--lr-warmup-iters', int, 0),
    Flag('--lr-warmup-fraction', float,
         help='warmup over this fraction of --lr-decay-iters (instead of --lr-warmup-iters)'),
    Flag('--lr-warmup-init', float, 0.0, help='the lr warmup starts from'),
    Flag('--lr-wsd-decay-style', choices=('exponential', 'linear', 'cosine', 'minus_sqrt'),
         help='the decay phase of --lr-decay-style WSD (default: exponential)'),
    Flag('--lr-wsd-decay-iters', int, help="length of WSD's decay phase (needed with --lr-decay-style WSD)"),
    Flag('--lr-decay-samples', int, help='with --train-samples (default: it)'),
    Flag('--lr-warmup-samples', int, help='with --train-samples (default 0)'),
    Flag('--lr-wsd-decay-samples', int, help='with --train-samples and --lr-decay-style WSD'),
    Flag('--start-weight-decay', float,
         help='with --weight-decay-incr-style linear or cosine: the weight decay at the start'),
    Flag('--end-weight-decay', float,
         help=('with --weight-decay-incr-style linear or cosine: the weight decay at the end of training (it '
               'grows over all --train-iters or --train-samples)')),
    Flag('--weight-decay-incr-style', default='constant', choices=('constant', 'linear', 'cosine'),
         help='constant: --weight-decay throughout'),
    Flag('--seed', int, 1234),
    switch('--recompute-activations',
           help=("recompute each layer's core attention in backward instead of keeping its activations "
                 '(--recompute-granularity selective)')),
    Flag('--recompute-granularity', choices=('full', 'selective'),
         help=('full: recompute whole layers (with --recompute-method and --recompute-num-layers); selective: '
               'the core attention')),
    Flag('--recompute-method', choices=('uniform', 'block'),
         help=('with --recompute-granularity full: uniform recomputes groups of --recompute-num-layers layers, '
               'block the first --recompute-num-layers of each stage')),
    Flag('--recompute-num-layers', int),
    Flag('--recompute-modules', choices=RECOMPUTE_MODULES, nargs='*',
         help=('with selective recompute: the submodules recomputed in backward (default: core_attn; moe with '
               '--num-experts)')),
    switch('--distribute-saved-activations',
           help=('with full recompute at TP > 1: split each checkpointed layer input over the tensor-parallel '
                 'ranks (CUDA only: megatron gathers it into a CUDA buffer)')),
    switch('--calculate-per-token-loss',
           help=("the step's loss is the sum of the global batch's token losses over their number (over micro-"
                 'batches and data-parallel ranks), not a mean of micro-batch means (the same without --eod-mask-'
                 'loss)')),
    Flag('--no-check-for-nan-in-loss-and-grad', action="store_false", dest='check_for_nan_in_loss_and_grad',
         help=('a NaN loss or gradient norm skips the step (counted in the log line) instead of stopping the run'
               " with an error (Megatron-LM's default)")),
)

BATCH_SCHEDULE_TITLE = 'growing global batch'
BATCH_SCHEDULE: tuple[Flag, ...] = (
    Flag('--rampup-batch-size', int, nargs=3, metavar=('START', 'INCREMENT', 'SAMPLES'),
         help=('grow the global batch from START by INCREMENT in equal steps over the first SAMPLES samples up '
               'to --global-batch-size (needs --train-samples)')),
    Flag('--step-batch-size-schedule',
         help=('"THRESHOLD:BATCH ...": BATCH from THRESHOLD consumed tokens on (K/M/B/T suffixes, first '
               'threshold 0); the last BATCH is the global batch size (needs --train-samples, excludes --global-'
               'batch-size)')),
)

MEMORY_TITLE = 'memory and garbage collection'
MEMORY: tuple[Flag, ...] = (
    switch('--manual-gc',
           help="turn Python's automatic garbage collector off and collect at fixed points on every rank instead"),
    Flag('--manual-gc-interval', int, 0, help='with --manual-gc: also collect every this many iterations (0: never)'),
    Flag('--no-manual-gc-eval', action="store_false", dest='manual_gc_eval',
         help='with --manual-gc: do not collect before and after each evaluation'),
    Flag('--empty-unused-memory-level', int, 0, choices=(0, 1, 2),
         help=('empty the CUDA caching allocator after each forward/backward (1) and also after each optimizer '
               'step (2)')),
)
