"""Optimizer state bytes per parameter: Adam, Muon, and layer-wise Muon at DP=2 and DP=4.

GPT-shaped fp32 weights (hidden 512, 4 layers, GQA, SwiGLU, layer norms by default), one step
each so the state exists. Adam and Muon (get_megatron_optimizer, muon_scalar_optimizer adam
for the layer norms) are replicated: every data-parallel rank holds all of it; rank 0 measures
them. Layer-wise Muon (use_layer_wise_distributed_optimizer=True) is measured on every rank of
a DP=2 group ({0, 1} and {2, 3}) and of DP=4 (all ranks); per rank means the largest rank.
fp32 parameters, so there are no fp32 main copies.

    torchrun --nproc-per-node 4 benchmarks/memory.py [--json PATH]
"""

import argparse

import torch
import torch.distributed as dist


from _distributed import gather_ints, init_distributed
from _gpt import GptShape, GptWeights, add_shape_arguments, shape_from
from _timing import write_json
from layer_wise_vs_replicated import state_tensor_bytes

from megatron_eopt import OptimizerConfig, ParallelGroups, get_megatron_optimizer


def stepped(model: GptWeights, groups: ParallelGroups, **config) -> object:
    """The optimizer after one step on fixed gradients (its state created)."""
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-3, weight_decay=0.1, **config), model,
                                       config_overrides={}, pg_collection=groups)
    torch.manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    return optimizer


def replicated_bytes(shape: GptShape) -> dict[str, int]:
    single = ParallelGroups.single_process()
    return {name: state_tensor_bytes(stepped(GptWeights(shape), single, optimizer=name)) for name in ("adam", "muon")}


def layer_wise_bytes(shape: GptShape, group: dist.ProcessGroup, device: torch.device) -> list[int]:
    groups = ParallelGroups.from_groups(tp=None, mp=None, dp_cp=group)
    optimizer = stepped(GptWeights(shape), groups, optimizer="muon", use_layer_wise_distributed_optimizer=True)
    return gather_ints(optimizer.optimizer_state_bytes(), device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_arguments(parser, GptShape(hidden=512, layers=4))
    parser.add_argument("--json", metavar="PATH", help="also write the numbers here (rank 0)")
    args = parser.parse_args()
    device = init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 4:
        raise SystemExit("memory.py measures DP=2 and DP=4: launch it with torchrun --nproc-per-node 4")
    shape = shape_from(args)
    torch.manual_seed(0)
    params = sum(p.numel() for p in GptWeights(shape).parameters())
    replicated = replicated_bytes(shape) if rank == 0 else {}
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both
    layer_wise = {2: layer_wise_bytes(shape, pairs[rank // 2], device),
                  4: layer_wise_bytes(shape, dist.group.WORLD, device)}
    if rank == 0:
        report(shape, params, replicated, layer_wise, args.json)
    dist.destroy_process_group()


def report(shape: GptShape, params: int, replicated: dict, layer_wise: dict, path) -> None:
    rows = {f"{name} (replicated)": [b] for name, b in replicated.items()}
    rows.update({f"layer-wise muon DP={dp}": per_rank for dp, per_rank in layer_wise.items()})
    muon = replicated["muon"]
    print(f"Optimizer state per rank, {params / 1e6:.2f}M fp32 parameters ({shape.describe()})")
    print(f"  {'':24} {'bytes/param':>11} {'/ replicated muon':>18}   bytes/param on each rank")
    summary = {}
    for name, per_rank in rows.items():
        largest = max(per_rank)
        summary[name] = {"bytes_per_param": largest / params, "ratio_to_replicated_muon": largest / muon,
                         "bytes_per_rank": per_rank}
        each = " ".join(f"{b / params:.2f}" for b in per_rank)
        print(f"  {name:24} {largest / params:11.2f} {largest / muon:18.3f}   {each}")
    write_json(path, {"model": shape.describe(), "parameters": params, "rows": summary})


if __name__ == "__main__":
    main()
