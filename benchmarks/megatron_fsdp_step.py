"""Muon on a Megatron-FSDP model against the same model unsharded and sharded by torch FSDP2.

A megatron-core GPT three ways on every rank: wrapped by Megatron-FSDP (`fully_shard_model`,
ZeRO-3, each transformer layer a unit; on CPU through runtime/megatron_fsdp_cpu.py), sharded with
torch FSDP2's `fully_shard`, and unsharded (what each rank of a replicated run steps). Timed: the
Muon part of one step (the inner TensorParallelMuon step: with FSDP each matrix's rows go to its
owner, which runs Newton-Schulz, and back). Per rank: optimizer-state and parameter bytes, and the
bytes a step sends for the Muon matrices.

    torchrun --nproc-per-node 2 benchmarks/megatron_fsdp_step.py [--hidden 256 --layers 4]

gloo on CPU (fp32, 'highest'); NCCL with one GPU per rank under CUDA. Medians after warm-up,
interleaved, on the slowest rank. Prints numbers (rank 0); asserts nothing.
"""

import torch
import torch.distributed as dist

from _distributed import time_iterations
from _timing import write_json
from fsdp2_step import build, exchanged_bytes, max_over_ranks, muon_benchmark, sharded_gpt_optimizer, state_bytes

from megatron_eopt import OptimizerConfig, get_megatron_optimizer
from megatron_eopt.runtime.process_groups import ParallelGroups
from megatron_eopt.training.model.gpt import gpt_loss
from megatron_eopt.training.parallel.megatron_fsdp import finish_grad_sync, megatron_fsdp_gpt


def ready_muon(optimizer):
    """The first child's inner optimizer (the matrices'), its gradients in place on the shard aliases."""
    child = optimizer.chained_optimizers[0]
    child.grad_stats(False)
    return child.optimizer


def megatron_fsdp_optimizer(settings, config: OptimizerConfig, device: torch.device):
    """The GPT wrapped by Megatron-FSDP, one backward's gradient shards attached, its optimizer."""
    model = megatron_fsdp_gpt(build(settings, device), device)
    tokens = torch.randint(0, settings.vocab_size, (2, settings.seq_length + 1), device=device,
                           generator=torch.Generator(device).manual_seed(dist.get_rank()))
    gpt_loss(model, tokens).backward()
    finish_grad_sync([model])
    return model, get_megatron_optimizer(config, [model])


def unsharded_optimizer(settings, config: OptimizerConfig, device: torch.device):
    model = build(settings, device)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    return model, get_megatron_optimizer(config, [model], pg_collection=ParallelGroups.single_process())


def local_param_bytes(model: torch.nn.Module) -> int:
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    return sum(t.numel() * t.element_size() for t in local)


def main() -> None:
    args, device, precision, config = muon_benchmark(__doc__.splitlines()[0])
    settings, _, fsdp2_opt, fsdp2_muon = sharded_gpt_optimizer(args, config, device)
    mfsdp_model, mfsdp_opt = megatron_fsdp_optimizer(settings, config, device)
    full_model, full_opt = unsharded_optimizer(settings, config, device)
    mfsdp_muon, full_muon = ready_muon(mfsdp_opt), ready_muon(full_opt)
    steps = {"megatron_fsdp": mfsdp_muon.step, "fsdp2": fsdp2_muon.step, "unsharded": full_muon.step}
    seconds = time_iterations(steps, args, device)
    world = dist.get_world_size()
    state = {name: max_over_ranks(state_bytes(opt), device)
             for name, opt in (("megatron_fsdp", mfsdp_opt), ("fsdp2", fsdp2_opt), ("unsharded", full_opt))}
    params = {"megatron_fsdp": max_over_ranks(local_param_bytes(mfsdp_model), device),
              "unsharded": local_param_bytes(full_model)}
    sent = {"megatron_fsdp": exchanged_bytes(mfsdp_muon, world)[0], "fsdp2": exchanged_bytes(fsdp2_muon, world)[0]}
    if dist.get_rank() == 0:
        ms = {name: s * 1e3 for name, s in seconds.items()}
        print(f"Muon step, GPT hidden {args.hidden}, {args.layers} layers, {world} ranks on {device.type} "
              f"({precision}), median of {args.repeats} steps")
        print("Muon step (ms): " + ", ".join(f"{name} {value:.1f}" for name, value in ms.items()))
        print(f"ratios: Megatron-FSDP / unsharded {ms['megatron_fsdp'] / ms['unsharded']:.3f}, "
              f"Megatron-FSDP / FSDP2 {ms['megatron_fsdp'] / ms['fsdp2']:.3f}")
        print("optimizer state bytes, max per rank: " + ", ".join(f"{n} {b}" for n, b in state.items()))
        print(f"parameter bytes, max per rank: Megatron-FSDP {params['megatron_fsdp']}, unsharded {params['unsharded']}")
        print("bytes sent per step for the Muon matrices (all ranks): " + ", ".join(f"{n} {b}" for n, b in sent.items()))
        write_json(args.json, {"step_ms": ms, "ratio_to_unsharded": ms["megatron_fsdp"] / ms["unsharded"],
                               "ratio_to_fsdp2": ms["megatron_fsdp"] / ms["fsdp2"], "state_bytes": state,
                               "state_ratio": state["megatron_fsdp"] / state["unsharded"], "param_bytes": params,
                               "exchanged_bytes": sent, "world_size": world, "device": device.type})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
