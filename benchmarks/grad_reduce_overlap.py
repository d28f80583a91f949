"""Whole training iteration (micro-batches forward + backward, gradient finalisation, Adam step)
at DP=2: the trainer's bucketed data-parallel all-reduce after backward against
`--overlap-grad-reduce` (each bucket's all-reduce started in the last micro-batch's backward).

Two copies of the same megatron-core GPT (megatron_eopt/training/model/gpt.py), each with a GradReducer
(megatron_eopt/training/parallel/grad_reduction.py) and Adam, differing only in `overlap`. Buckets of --bucket-numel
elements, so the model has several and the early ones can reduce while backward goes on.

    torchrun --nproc-per-node 2 benchmarks/grad_reduce_overlap.py [--hidden 512 --layers 4]

gloo on CPU (where communication and computation share the same cores, so little can be hidden);
NCCL with one GPU per rank when CUDA is available. Median of several iterations after warm-up,
interleaved, each timed on the slowest rank. Prints numbers (rank 0); asserts nothing.
"""


import torch
import torch.distributed as dist


from _distributed import (
    finish_iteration_benchmark,
    gpt_benchmark_parser,
    report_iterations,
    start_iteration_benchmark,
    time_iterations,
)

from megatron_eopt import OptimizerConfig, get_megatron_optimizer
from megatron_eopt.training.model.gpt import build_gpt_model, gpt_loss
from megatron_eopt.training.parallel.grad_reduction import GradReducer, finalize_model_grads

MODES = {"reduce after backward": False, "overlap": True}


def main() -> None:
    parser = gpt_benchmark_parser(__doc__.splitlines()[0])
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2, help="sequences per micro-batch")
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--bucket-numel", type=int, default=1_000_000)
    args = parser.parse_args()
    device, settings, generator = start_iteration_benchmark(args)
    micro_batches = [torch.randint(0, settings.vocab_size, (args.batch, args.seq_length + 1), generator=generator)
                     .to(device) for _ in range(args.micro_batches)]
    iterations, buckets = {}, 0
    for name, overlap in MODES.items():
        model = build_gpt_model(settings, device)
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-4), [model])
        grads = GradReducer(model, dist.group.WORLD, accumulate_in_fp32=False, bucket_numel=args.bucket_numel,
                            overlap=overlap)
        buckets = len(grads.buckets)

        def iteration(model=model, optimizer=optimizer, grads=grads) -> None:
            optimizer.zero_grad()
            grads.zero_grads(len(micro_batches))
            for tokens in micro_batches:
                (gpt_loss(model, tokens) / len(micro_batches)).backward()
            finalize_model_grads([model], grads)
            optimizer.step()

        iterations[name] = iteration
    seconds = time_iterations(iterations, args, device)
    report_iterations(f"Adam, GPT hidden {args.hidden}, {args.layers} layers, {args.micro_batches} micro-batches of "
                      f"{args.batch}x{args.seq_length} per rank, {buckets} buckets, {dist.get_world_size()} ranks on "
                      f"{device.type}, median of {args.repeats} iterations", seconds, "reduce after backward",
                      args.json, overlap_ratio=seconds["overlap"] / seconds["reduce after backward"], buckets=buckets,
                      device=device.type)
    finish_iteration_benchmark()


if __name__ == "__main__":
    main()
