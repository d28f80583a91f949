"""Whole training iteration (forward + backward + step) with the layer-wise optimizer at DP=2:
parameter sync waited at the end of step() against overlap_param_gather (and with the
optimizer step too).

Three copies of the same megatron-core GPT (megatron_eopt/training/model/gpt.py), each with layer-wise Muon
(`layer_wise_reduce_grads=True`: each rank's own gradients are reduced onto the owners),
differing only in the overlap flags. Each timed iteration is zero_grad, forward, backward,
step on one rank's batch; the overlapped broadcasts of one iteration are waited for in the
next iteration's forward, so their cost lands where a trainer would see it.

    torchrun --nproc-per-node 2 benchmarks/layer_wise_overlap.py [--hidden 512 --layers 4]

gloo on CPU; NCCL with one GPU per rank when CUDA is available. Median of several iterations
after warm-up, interleaved, each timed on the slowest rank. Prints numbers (rank 0); asserts
nothing.
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

MODES = {"wait in step": {}, "overlap": {"overlap_param_gather": True},
         "overlap + optimizer step": {"overlap_param_gather": True, "overlap_param_gather_with_optimizer_step": True}}


def main() -> None:
    parser = gpt_benchmark_parser(__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--seq-length", type=int, default=128)
    args = parser.parse_args()
    device, settings, generator = start_iteration_benchmark(args)
    tokens = torch.randint(0, settings.vocab_size, (args.batch, args.seq_length + 1), generator=generator).to(device)
    iterations = {}
    for name, flags in MODES.items():
        model = build_gpt_model(settings)
        config = OptimizerConfig(optimizer="muon", lr=1e-3, use_layer_wise_distributed_optimizer=True,
                                 layer_wise_reduce_grads=True, **flags)
        optimizer = get_megatron_optimizer(config, [model])

        def iteration(model=model, optimizer=optimizer) -> None:
            optimizer.zero_grad()
            gpt_loss(model, tokens).backward()
            optimizer.step()

        iterations[name] = iteration
    seconds = time_iterations(iterations, args, device)
    report_iterations(f"layer-wise Muon, GPT hidden {args.hidden}, {args.layers} layers, batch {args.batch}x"
                      f"{args.seq_length} per rank, {dist.get_world_size()} ranks on {device.type}, "
                      f"median of {args.repeats} iterations", seconds, "wait in step", args.json, device=device.type)
    finish_iteration_benchmark()


if __name__ == "__main__":
    main()
