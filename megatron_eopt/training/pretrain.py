"""Pretrain a megatron-core GPTModel with megatron_eopt's optimizer, from Megatron-LM's flags.

`main` is the recipe: parse and check the flags, then import torch and megatron-core, make the
process groups, own the --save directory and train.
"""

import sys
from typing import Optional

# Only the parser and torch-free checks are imported here: torch and megatron-core come after
# the flags are parsed (parse_args), so --help and flag errors do not wait for them.
from megatron_eopt.training.arguments.parser import parse_args
from megatron_eopt.training.checkpoint_paths import check_checkpoint_paths
from megatron_eopt.training.errors import exit_with_error
from megatron_eopt.training.logging.warning_policy import warning_policy


def main(argv: Optional[list[str]] = None) -> list[dict]:
    """Train as the flags say; returns the logged records (every rank keeps them).

    Called with torch.distributed already initialised (tests run many configurations in one set
    of worker processes this way), the job is that whole process group, which is left
    initialised at the end; otherwise the process group is made here and destroyed at the end.
    """
    with warning_policy():  # one line each; the harmless third-party ones once, on rank 0
        return _main(argv)


def _main(argv: Optional[list[str]]) -> list[dict]:
    dist = sys.modules.get("torch.distributed")
    owns_process_group = not (dist is not None and dist.is_available() and dist.is_initialized())
    args, settings, layout = parse_args(argv)
    try:
        check_checkpoint_paths(args)  # before any model is built: --save writable, --load as the flags need
    except ValueError as error:
        exit_with_error(str(error))
    import torch.distributed as dist

    from megatron_eopt.checkpointing.refusals import refuse_checkpoint_combinations

    try:
        refuse_checkpoint_combinations(args, "trainer")  # what the first save could not write, before any work
    except ValueError as error:
        exit_with_error(str(error))

    from megatron_eopt.training.model.gpt import destroy_model_parallel, initialize_model_parallel
    from megatron_eopt.training.parallel.cpu_threads import set_cpu_threads
    from megatron_eopt.training.parallel.elastic import collective_failures
    from megatron_eopt.training.parallel.layout import init_distributed, runs_on_cuda

    set_cpu_threads(runs_on_cuda(args), lambda line: layout.rank == 0 and print(f"> {line}", flush=True))
    device = init_distributed(args, layout)
    # A collective that fails (a rank died) or times out (a rank stopped) ends this rank in one line.
    failures = lambda: collective_failures(layout.rank, args.distributed_timeout_minutes)  # noqa: E731
    with failures():
        initialize_model_parallel(layout.tp, args.seed, pipeline_model_parallel_size=layout.pp,
                                  virtual_pipeline_model_parallel_size=layout.vpp, expert_model_parallel_size=layout.ep,
                                  distributed_timeout_minutes=args.distributed_timeout_minutes)
    try:
        with failures():
            records = _train_and_plot(args, settings, layout, device)
    except ValueError as error:  # e.g. optimizer/config combinations the factory rejects
        exit_with_error(str(error))
    finally:
        destroy_model_parallel()
        if owns_process_group:
            dist.destroy_process_group()
    return records


def _train_and_plot(args, settings, layout, device) -> list[dict]:
    from megatron_eopt.training.logging.training_log import PALETTE, Curve, plot_curves
    from megatron_eopt.training.loop.housekeeping import Housekeeping
    from megatron_eopt.training.loop.save_directory import own_save_directory
    from megatron_eopt.training.loop.train import train

    if layout.rank == 0:
        print(f"> {_describe_job(args, settings, layout)}", flush=True)
    housekeeping = Housekeeping(args, device)
    with own_save_directory(args, layout.rank), housekeeping.training():
        records = train(args, settings, layout, device, housekeeping)
    if args.plot and layout.rank == 0:
        logged = [r for r in records if r["loss"] is not None]  # None: every step of an interval skipped
        plot_curves(args.plot, [Curve(args.optimizer, [r["iteration"] for r in logged],
                                      [r["loss"] for r in logged], PALETTE[0])])
    return records


def _describe_job(args, settings, layout) -> str:
    pipeline = f" x PP {layout.pp}" + (f" ({layout.vpp} model chunks per rank)" if layout.vpp else "")
    sequence_parallel = " (sequence parallel)" if settings.sequence_parallel else ""
    return (f"world {layout.world_size} = TP {layout.tp}{sequence_parallel}{pipeline if layout.pp > 1 else ''} x DP "
            f"{layout.dp}; global batch {args.global_batch_size} = micro batch {args.micro_batch_size} x DP "
            f"{layout.dp} x {layout.grad_accumulation_steps} accumulation steps; optimizer {args.optimizer}"
            f"{' (layer-wise distributed)' if args.use_layer_wise_distributed_optimizer else ''}")


if __name__ == "__main__":  # `torchrun -m megatron_eopt.training.pretrain`, as scripts/pretrain_gpt.py
    main()
