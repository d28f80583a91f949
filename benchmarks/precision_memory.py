"""Optimizer-owned bytes per parameter on each rank: fp32 state against the precision-aware optimizer.

Counted from allocated tensors, not a formula: after a step and `zero_grad()`, every tensor
reachable from the optimizer object (state, main weights, remainders, buffers), storages
deduplicated, the model's parameters left out, divided by the model's parameter count.
adam and muon (adam for the layer norms), each with fp32 state (bf16 parameters, fp32 main copies
and moments) and precision-aware state (bf16 moments, int16 remainders), replicated, layer-wise
DP=4 and torch FSDP2 over 4 ranks. FSDP2 keeps fp32 shards as the main weights (bf16 compute
through MixedPrecisionPolicy), so there only the moments change. Beside them: megatron-core's
documented figures for its distributed optimizer (docs/memory.md).

    torchrun --nproc-per-node 4 benchmarks/precision_memory.py [--json PATH]
"""

import argparse
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from _distributed import gather_ints, init_distributed
from _gpt import GptShape, GptWeights, add_shape_arguments, shape_from
from _timing import write_json

from megatron_eopt import OptimizerConfig, ParallelGroups, get_megatron_optimizer

PRECISION_AWARE = {"use_precision_aware_optimizer": True, "exp_avg_dtype": torch.bfloat16,
                   "exp_avg_sq_dtype": torch.bfloat16, "store_param_remainders": True}
STATES = {"fp32 state": {}, "precision-aware": PRECISION_AWARE}
# Objects whose attributes the walk follows: the optimizers, their wrappers and records. A model
# module is never followed (its parameters are the model's, not the optimizer's).
WALKED_MODULES = ("megatron_eopt", "emerging_optimizers", "torch.optim", "megatron.core.optimizer")
# https://docs.nvidia.com/megatron-core/developer-guide/latest/distrib_optimizer.html: "the
# theoretical number of bytes per parameter" (parameter + gradient + Adam's optimizer state), d the
# data-parallel size. (non-distributed, distributed at d) for each (param, grad) dtype pair.
MEGATRON_CORE_DOCS = "https://docs.nvidia.com/megatron-core/developer-guide/latest/distrib_optimizer.html"
MEGATRON_CORE_FIGURES = {
    "float16 param, float16 grads": (20, lambda d: 4 + 16 / d),
    "float16 param, fp32 grads": (18, lambda d: 6 + 12 / d),
    "fp32 param, fp32 grads": (16, lambda d: 8 + 8 / d),
}


def _storage_key(tensor: torch.Tensor) -> tuple:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    storage = local.untyped_storage()
    return storage.device, storage.data_ptr(), storage.nbytes()


def _reachable_tensors(root: Any) -> Iterator[torch.Tensor]:
    """Every tensor reachable from `root` through containers and the attributes of library objects."""
    seen, stack = set(), [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            yield obj
        elif isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif isinstance(obj, torch.nn.Module):
            continue
        elif type(obj).__module__.startswith(WALKED_MODULES) and not isinstance(obj, type):
            stack.extend(vars(obj).values() if hasattr(obj, "__dict__") else ())
            stack.extend(getattr(obj, name) for name in getattr(type(obj), "__slots__", ()) if hasattr(obj, name))


def owned_bytes(optimizer: Any, model: torch.nn.Module) -> int:
    """Bytes of the distinct storages reachable from `optimizer`, the model's parameters excluded."""
    model_storages = {_storage_key(p) for p in model.parameters()}
    storages = {_storage_key(t) for t in _reachable_tensors(optimizer)} - model_storages
    return sum(nbytes for _, _, nbytes in storages)


def accounted_bytes(optimizer: Any) -> int:
    """The optimizer's own accounting, a check on the walk: its state tensors plus main_param_bytes()."""
    return sum(t.numel() * t.element_size() for child in optimizer.chained_optimizers
               for state in child.state.values() for t in state.values() if torch.is_tensor(t)) + \
        sum(child.main_param_bytes() for child in optimizer.chained_optimizers)


def model_bytes(model: torch.nn.Module) -> int:
    return sum(nbytes for _, _, nbytes in {_storage_key(p) for p in model.parameters()})


def matrix_bytes(optimizer: Any, model: torch.nn.Module) -> tuple[int, int]:
    """(owned bytes on this rank, parameters on all ranks) of the Muon-stepped matrices: the
    children whose inner optimizer is not Adam (which steps the layer norms)."""
    children = [c for c in optimizer.chained_optimizers if not c.inner_class_name().startswith("Adam")]
    return sum(owned_bytes(c, model) for c in children), sum(p.numel() for p in model.parameters() if p.dim() == 2)


def stepped(optimizer: Any, model: torch.nn.Module, mesh: Optional[Any]) -> Any:
    """`optimizer` after one step on fixed gradients and zero_grad (its state created)."""
    torch.manual_seed(1)
    for p in model.parameters():
        grad = torch.randn(p.shape, dtype=p.dtype)
        p.grad = distribute_tensor(grad, mesh, [Shard(0)]) if isinstance(p, DTensor) else grad.to(p.device)
    optimizer.step()
    optimizer.zero_grad()
    return optimizer


def build_model(shape: GptShape, layout: str, device: torch.device, mesh: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    model = GptWeights(shape).to(device)
    if layout != "fsdp2":
        return model.to(torch.bfloat16)
    for layer in model.decoder.layers.children():
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def config_for(name: str, state: str, layout: str) -> OptimizerConfig:
    # FSDP2: bf16=False (its shards are fp32), so store_param_remainders applies to nothing there.
    return OptimizerConfig(optimizer=name, lr=1e-3, weight_decay=0.1, bf16=layout != "fsdp2",
                           use_layer_wise_distributed_optimizer=layout == "layer-wise", **STATES[state])


def measure(shape: GptShape, name: str, state: str, layout: str, device: torch.device, mesh: Any) -> dict:
    """Bytes on this rank: {'owned', 'model', 'matrix_owned', 'matrix_params'} or {'refused': why}."""
    model = build_model(shape, layout, device, mesh)
    groups = (ParallelGroups.single_process() if layout == "replicated" else
              ParallelGroups.from_groups(tp=None, mp=None, dp_cp=dist.group.WORLD))
    try:
        optimizer = get_megatron_optimizer(config_for(name, state, layout), model,
                                           pg_collection=None if layout == "fsdp2" else groups)
    except ValueError as error:
        return {"refused": str(error)}
    stepped(optimizer, model, mesh)
    result = {"owned": owned_bytes(optimizer, model), "model": model_bytes(model),
              "accounted": accounted_bytes(optimizer)}
    if name == "muon":
        result["matrix_owned"], result["matrix_params"] = matrix_bytes(optimizer, model)
    return result


def gathered(result: dict, device: torch.device) -> dict:
    """Each rank's numbers, by rank (a refusal is the same on every rank)."""
    if "refused" in result:
        return result
    return {key: gather_ints(value, device) for key, value in result.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_arguments(parser, GptShape(hidden=512, layers=4))
    parser.add_argument("--json", metavar="PATH", help="also write the numbers here (rank 0)")
    args = parser.parse_args()
    device = init_distributed()
    if dist.get_world_size() != 4:
        raise SystemExit("precision_memory.py measures DP=4: launch it with torchrun --nproc-per-node 4")
    shape = shape_from(args)
    mesh = init_device_mesh(device.type, (4,))
    params = sum(p.numel() for p in GptWeights(shape).parameters())
    rows = {}
    for layout in ("replicated", "layer-wise", "fsdp2"):
        for name in ("adam", "muon"):
            for state in STATES:
                rows[f"{name} {layout} {state}"] = {"optimizer": name, "layout": layout, "state": state,
                                                    **gathered(measure(shape, name, state, layout, device, mesh),
                                                               device)}
    if dist.get_rank() == 0:
        report(shape, params, rows, args.json)
    dist.destroy_process_group()


def report(shape: GptShape, params: int, rows: dict, path: Optional[str]) -> None:
    print(f"Optimizer-owned bytes per parameter on each rank, {params / 1e6:.2f}M parameters ({shape.describe()})")
    print("  (state + main weights + remainders, after step and zero_grad; model: its parameters on that rank)")
    print(f"  {'':38} {'largest rank':>12} {'model':>6} {'muon matrices':>13} {'walk - state':>12}   each rank")
    for key, row in rows.items():
        if "refused" in row:
            print(f"  {key:38} refused: {row['refused']}")
            continue
        per_rank = [b / params for b in row["owned"]]
        row["bytes_per_param"], row["bytes_per_param_by_rank"] = max(per_rank), per_rank
        row["model_bytes_per_param"] = max(row["model"]) / params
        matrices = ""
        if "matrix_owned" in row:  # the Muon-stepped matrices alone (the norms are adam's)
            row["muon_matrix_bytes_per_param"] = max(row["matrix_owned"]) / row["matrix_params"][0]
            matrices = f"{row['muon_matrix_bytes_per_param']:.3f}"
        # Bytes the walk found beyond the state tensors and main_param_bytes(): scalars, placeholders.
        row["unaccounted_bytes"] = max(o - a for o, a in zip(row["owned"], row["accounted"]))
        print(f"  {key:38} {max(per_rank):12.3f} {row['model_bytes_per_param']:6.2f} {matrices:>13} "
              f"{row['unaccounted_bytes']:12d}   "
              + " ".join(f"{b:.3f}" for b in per_rank))
    ratios = {f"{name} {layout}": rows[f"{name} {layout} precision-aware"]["bytes_per_param"]
              / rows[f"{name} {layout} fp32 state"]["bytes_per_param"]
              for name in ("adam", "muon") for layout in ("replicated", "layer-wise", "fsdp2")
              if "bytes_per_param" in rows[f"{name} {layout} precision-aware"]}
    print("  precision-aware / fp32 state: " + ", ".join(f"{key} {value:.3f}" for key, value in ratios.items()))
    print(f"megatron-core's distributed optimizer, Adam, bytes per parameter (parameter + gradient + optimizer "
          f"state), d = data-parallel size, from {MEGATRON_CORE_DOCS}:")
    cited = {}
    for dtypes, (plain, sharded) in MEGATRON_CORE_FIGURES.items():
        cited[dtypes] = {"non_distributed": plain, "distributed_d4": sharded(4)}
        print(f"  {dtypes:30} non-distributed {plain:2d}   distributed at d=4 {sharded(4):5.2f}")
    write_json(path, {"model": shape.describe(), "parameters": params, "rows": rows, "ratios": ratios,
                      "megatron_core": {"source": MEGATRON_CORE_DOCS, "figures": cited}})


if __name__ == "__main__":
    main()
