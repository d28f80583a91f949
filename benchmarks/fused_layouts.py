"""Muon on fused projections: per component against the whole matrix (step time and FLOPs).

One weight of each kind that params/fused_layouts.py splits, at the shapes below (a hidden-h
model; MLA as DeepSeek-V3's ratios at a smaller width; Mamba-2 as Nemotron-H's; gated delta net
as Qwen3-Next's), stepped by TensorParallelMuon at TP=1 with the table's layout and with each
weight whole. Blocks of equal shape go through one batched call (MLA's heads). FLOPs are
Newton-Schulz's matmul FLOPs per step (ops/gram_newton_schulz.py's `standard_flops`).

    python benchmarks/fused_layouts.py [--hidden 1024] [--repeats 5] [--json PATH]

fp32 ('highest'). Median of interleaved steps. Prints numbers; asserts nothing.
"""

import argparse
from types import SimpleNamespace

import torch
from _timing import interleaved_times, medians, paired_ratio, write_json

from megatron_eopt.ops.gram_newton_schulz import standard_flops
from megatron_eopt.ops.splits import MatrixLayout
from megatron_eopt.optimizers.muon.tensor_parallel_muon import TensorParallelMuon
from megatron_eopt.params import fused_layouts as table

STEPS = 5
SPLITS = ("whole", "per_component")


def weights(hidden: int) -> dict[str, tuple[tuple[int, int], table.FusedBlocks]]:
    """name -> (shape, the table's blocks) of each fused weight of a hidden-`hidden` model."""
    heads = hidden // 128
    mla = SimpleNamespace(qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128, kv_lora_rank=hidden // 2)
    q_lora = 3 * hidden // 4
    mamba = SimpleNamespace(d_inner_local_tp=2 * hidden, ngroups_local_tp=8, d_state=128, nheads_local_tp=2 * hidden // 64)
    gdn = SimpleNamespace(in_proj_split_sections=(hidden // 2, hidden // 2, hidden, hidden, hidden // 64, hidden // 64))
    shapes = {
        "mla.linear_q_up_proj": ((heads * 192, q_lora), table.mla_query_up, None),
        "mla.linear_kv_down_proj": ((mla.kv_lora_rank + 64, hidden), table.mla_kv_down, None),
        "mla.linear_kv_up_proj": ((heads * 256, mla.kv_lora_rank), table.mla_kv_up, None),
        "mamba.in_proj": ((4 * hidden + 2 * 8 * 128 + 2 * hidden // 64, hidden), table.mamba_in_proj, mamba),
        "gdn.in_proj": ((3 * hidden + 2 * hidden // 64, hidden), table.gated_delta_net_in_proj, gdn),
    }
    result = {}
    for name, (shape, function, owner) in shapes.items():
        weight = table.FusedWeight(name, torch.empty(shape, device="meta"), owner, name.split(".")[-1], mla, 1)
        result[name] = shape, function(weight)
    return result


def layout(name: str, shape: tuple[int, int], blocks: table.FusedBlocks, split: bool) -> MatrixLayout:
    if not split:
        return MatrixLayout(name, shape)
    return MatrixLayout(name, shape, num_row_groups=blocks.num_row_groups, row_blocks=blocks.row_blocks,
                        per_group=blocks.per_group)


def flops(lay: MatrixLayout) -> int:
    return sum(standard_flops(min(s), max(s), STEPS) for s in lay.global_block_shapes())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.manual_seed(0)
    fused = weights(args.hidden)
    layouts = {split: {n: layout(n, shape, blocks, split == "per_component") for n, (shape, blocks) in fused.items()}
               for split in SPLITS}
    names = list(fused)
    grads = [torch.randn(fused[n][0]) for n in names]
    params = {split: [torch.nn.Parameter(torch.zeros_like(g)) for g in grads] for split in SPLITS}
    per_weight, rows = {}, {}
    for k, name in enumerate(names):  # each weight alone: its own ratio
        optimizers = {s: TensorParallelMuon([{"params": [params[s][k]], "param_fqns": [name]}], lr=1e-3,
                                            fp32_matmul_prec="highest", layouts={name: layouts[s][name]}) for s in SPLITS}

        def prepare(split: str, k: int = k) -> None:
            params[split][k].grad = grads[k].clone()

        times = interleaved_times({s: optimizers[s].step for s in SPLITS}, {s: (lambda s=s: prepare(s)) for s in SPLITS},
                                  args.warmup, args.repeats)
        seconds = medians(times)
        gflop = {s: flops(layouts[s][name]) / 1e9 for s in SPLITS}
        blocks = layouts["per_component"][name].global_block_shapes()
        rows[name] = {"shape": list(fused[name][0]), "blocks": len(blocks), "block_shapes": sorted(set(blocks)),
                      "gflop": gflop, "step_ms": {s: t * 1e3 for s, t in seconds.items()},
                      "step_ratio": paired_ratio(times, "per_component", "whole"),
                      "flop_ratio": gflop["per_component"] / gflop["whole"]}
        per_weight[name] = rows[name]["step_ratio"]
    print(f"fused weights of a hidden-{args.hidden} model; cpu, {torch.get_num_threads()} threads, fp32 'highest', "
          f"torch {torch.__version__}, median of {args.repeats} steps; per component / whole")
    print(f"{'weight':26} {'shape':>12} {'blocks':>7} {'GFLOP whole':>12} {'per comp.':>10} {'ms whole':>9} "
          f"{'per comp.':>10} {'FLOPs':>6} {'time':>6}")
    for name, row in rows.items():
        print(f"{name:26} {'x'.join(map(str, row['shape'])):>12} {row['blocks']:>7} {row['gflop']['whole']:12.2f} "
              f"{row['gflop']['per_component']:10.2f} {row['step_ms']['whole']:9.1f} "
              f"{row['step_ms']['per_component']:10.1f} {row['flop_ratio']:6.3f} {row['step_ratio']:6.3f}")
    total = {s: sum(r["gflop"][s] for r in rows.values()) for s in SPLITS}
    write_json(args.json, {"hidden": args.hidden, "repeats": args.repeats, "weights": rows,
                           "flop_ratio": total["per_component"] / total["whole"],
                           "mla_kv_up_step_ratio": per_weight["mla.linear_kv_up_proj"],
                           "mamba_step_ratio": per_weight["mamba.in_proj"]})


if __name__ == "__main__":
    main()
