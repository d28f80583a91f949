"""Logging flags: the log line, TensorBoard and metrics files (`LOGGING`), throughput and
profiling (`PERFORMANCE`)."""

from megatron_eopt.training.arguments.flags.table import Flag, switch

DEFAULT_PROFILE_STEP_START = 10  # Megatron-LM's ProfilingConfig defaults
DEFAULT_PROFILE_STEP_END = 12

LOGGING_TITLE = 'logging'
LOGGING: tuple[Flag, ...] = (
    Flag('--log-interval', int, 100),
    Flag('--tensorboard-dir', help='write TensorBoard event files here (rank 0)'),
    Flag('--tensorboard-log-interval', int, 1),
    Flag('--tensorboard-queue-size', int, 1000, help="events TensorBoard's writer holds before writing them to disk"),
    Flag('--no-log-loss-scale-to-tensorboard', action="store_false", dest='log_loss_scale_to_tensorboard',
         aliases=('--disable-log-loss-scale-to-tensorboard',),
         help='leave the loss-scale tag out of TensorBoard'),
    switch('--log-world-size-to-tensorboard', help='write the number of ranks (tag world-size)'),
    switch('--log-memory-to-tensorboard',
           help="write torch.cuda.memory_stats()'s reserved/allocated bytes (CUDA only)"),
    switch('--log-params-norm', help="log the parameters' L2 norm"),
    Flag('--metrics-jsonl', help='write one JSON object per logged iteration'),
    Flag('--plot', help='write the loss curve as a PNG'),
)

PERFORMANCE_TITLE = 'throughput and profiling'
PERFORMANCE: tuple[Flag, ...] = (
    switch('--log-throughput',
           help=('add the TFLOP/s per GPU (per process on CPU) to the iteration line, the `throughput` TensorBoard'
                 ' scalar and --metrics-jsonl')),
    switch('--profile',
           help=('profile iterations --profile-step-start to --profile-step-end: a CUDA profiler capture range for'
                 ' nsys, or torch.profiler with --use-pytorch-profiler')),
    switch('--use-pytorch-profiler',
           help='with --profile: torch.profiler (also on CPU), its trace in <--tensorboard-dir>/../torch_profile'),
    Flag('--profile-step-start', int, help=f'with --profile (default {DEFAULT_PROFILE_STEP_START})'),
    Flag('--profile-step-end', int, help=f'with --profile (default {DEFAULT_PROFILE_STEP_END})'),
    Flag('--profile-ranks', int, nargs='+', help='with --profile: the global ranks to profile (default: every rank)'),
)
