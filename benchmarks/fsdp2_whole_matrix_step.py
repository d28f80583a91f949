"""mop/polargrad/scion on a torch FSDP2 model: our owner-per-matrix step against gather-everywhere.

A megatron-core GPT (megatron_eopt/training/model/gpt.py) sharded with `fully_shard` (each layer, then the
root) on all ranks. Timed: the inner optimizer's step over the local shards (gradients already
in place), against the simpler design we did not take: the same momentum update, then every
matrix's `full_tensor()` (an all-gather each) and the class's own `orthogonalize` of every
matrix on every rank, keeping the local rows. Also the bytes each rank receives per step for the
matrices in both designs.

    torchrun --nproc-per-node 2 benchmarks/fsdp2_whole_matrix_step.py --optimizer polargrad [--hidden 256]

gloo on CPU (fp32); NCCL with one GPU per rank when CUDA is available. Median of several steps
after warm-up, interleaved, on the slowest rank. Prints numbers (rank 0); asserts nothing.
"""


import torch
import torch.distributed as dist


from _distributed import gpt_benchmark_parser, init_distributed, time_iterations
from _timing import write_json
from fsdp2_step import gathered_momentum, row_shards, sharded_gpt_optimizer

from megatron_eopt import OptimizerConfig


def gather_everywhere_step(inner, mesh) -> None:
    """Momentum on the shard, then every rank all-gathers and orthogonalizes every matrix."""
    rank = dist.get_rank()
    with torch.no_grad():
        for group in inner.param_groups:
            for p in group["params"]:
                full, shards = gathered_momentum(inner, p, group, mesh)
                update = inner.scaled_orthogonalize_fn(full)
                p.add_(update.split(shards.rows_by_rank)[rank], alpha=-group["lr"])


def received_bytes(inner, rank: int) -> tuple[int, int]:
    """(ours, gather-everywhere): fp32 bytes this rank receives per step for the matrices."""
    ours, everywhere = 0, 0
    for s in row_shards(inner):
        cols = s.layout.local_shape[1]
        if s.owner == rank:  # the other ranks' rows in, none of the results
            ours += sum(rows for r, rows in enumerate(s.rows_by_rank) if r != rank) * cols * 4
        else:  # its rows of the result
            ours += s.rows_by_rank[rank] * cols * 4
        everywhere += (s.layout.local_shape[0] - s.rows_by_rank[rank]) * cols * 4
    return ours, everywhere


def main() -> None:
    parser = gpt_benchmark_parser(__doc__.splitlines()[0])
    parser.add_argument("--optimizer", choices=("polargrad", "scion", "mop"), default="polargrad")
    args = parser.parse_args()
    device = init_distributed()
    _, mesh, _, inner = sharded_gpt_optimizer(args, OptimizerConfig(optimizer=args.optimizer, lr=1e-3), device)
    seconds = time_iterations({"ours": inner.step, "everywhere": lambda: gather_everywhere_step(inner, mesh)},
                              args, device)
    ours, everywhere = received_bytes(inner, dist.get_rank())
    if dist.get_rank() == 0:
        ratio = seconds["ours"] / seconds["everywhere"]
        print(f"FSDP2 {args.optimizer}, GPT hidden {args.hidden}, {args.layers} layers, {dist.get_world_size()} "
              f"ranks on {device.type}, median of {args.repeats} steps")
        print(f"step: ours {seconds['ours'] * 1e3:.1f} ms, gather everywhere {seconds['everywhere'] * 1e3:.1f} ms, "
              f"ratio {ratio:.3f}")
        print(f"received per step by rank 0: ours {ours} bytes, gather everywhere {everywhere} bytes")
        write_json(args.json, {"step_ms": {n: s * 1e3 for n, s in seconds.items()}, "step_ratio": ratio,
                               "received_bytes_rank0": {"ours": ours, "everywhere": everywhere},
                               "world_size": dist.get_world_size(), "device": device.type})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
