"""The planner's output: a readable table of ranks (grouped where equal) and JSON of every rank."""

import json
from typing import Any

from megatron_eopt.training.planning.plan import MODES, PlanInputs, RankPlan

GIB, MIB = 2**30, 2**20


def _ranks_text(ranks: list[int]) -> str:
    return ",".join(map(str, ranks)) if len(ranks) <= 4 else f"{ranks[0]},{ranks[1]},... ({len(ranks)})"


def _cells(p: RankPlan, mode: str) -> tuple[str, ...]:
    """A row's cells after the ranks: ranks whose cells are equal share a row."""
    return (str(p.stage), str(len(p.matrices)),
            f"{p.flops[mode] / 1e9:,.0f}" if mode in p.flops else "-",
            f"{p.gram_flops[mode] / 1e9:,.0f}" if mode in p.gram_flops else "-",
            *[f"{p.bytes_sent[m] / MIB:,.1f}" for m in MODES],
            " ".join(f"{m[:4]} {n}" for m, n in p.auto_modes.items()) or "-",
            f"{p.state_bytes / GIB:,.2f}", f"{p.muon_time_s * 1e3:,.1f}",
            f"{100 * p.share:.2f}" if p.iteration_time_s else "-")


def table_rows(plans: list[RankPlan], mode: str, limit: int) -> tuple[list[list[str]], int]:
    """Rows of equal ranks, slowest first, at most `limit` (0: all); and how many rows there are."""
    groups: dict[tuple, list[RankPlan]] = {}
    for plan in plans:
        groups.setdefault(_cells(plan, mode), []).append(plan)
    ordered = sorted(groups.items(), key=lambda item: (-item[1][0].muon_time_s, item[1][0].rank))
    rows = [[_ranks_text([p.rank for p in group]), *cells] for cells, group in ordered[:limit or None]]
    return rows, len(groups)


HEADER = ["ranks", "stage", "Muon matrices", "NS GFLOP", "NS GFLOP (Gram)",
          *[f"MiB sent {m}" for m in MODES], "auto picks", "state GiB", "Muon ms", "% of iteration"]


def render_table(inputs: PlanInputs, plans: list[RankPlan], limit: int = 12) -> str:
    """Markdown: a summary line, then the rank groups (slowest first)."""
    mode, gram = inputs.config.muon_tp_mode, bool(getattr(inputs.config, "muon_gram_newton_schulz", False))
    layout = inputs.layout
    slowest = max(plans, key=lambda p: p.muon_time_s)
    lines = [f"TP={layout.tp} PP={layout.pp} DP={layout.dp} EP={layout.ep} ({layout.world_size} ranks), "
             f"{'FSDP2' if layout.fsdp else 'layer-wise' if layout.layer_wise else 'replicated'} optimizer, "
             f"muon_tp_mode={mode}, Gram {'on' if gram else 'off'}, {inputs.precision} precision, "
             f"hardware {inputs.profile.name}."]
    if slowest.iteration_time_s:
        lines.append(f"Iteration {slowest.iteration_time_s:.2f} s (6 x active parameters x "
                     f"{inputs.tokens_per_iteration:,} tokens at {inputs.mfu:.0%} MFU); the slowest rank's "
                     f"Muon step {slowest.muon_time_s * 1e3:.1f} ms = {100 * slowest.share:.2f}% of it.")
    else:
        lines.append(f"The slowest rank's Muon step: {slowest.muon_time_s * 1e3:.1f} ms (give "
                     f"--global-batch-size for the iteration time).")
    rows, groups = table_rows(plans, mode, limit)
    lines += ["", "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    if limit and groups > limit:
        lines.append(f"\n{groups - limit} more groups of ranks; --all-ranks lists them, --json gives every rank.")
    return "\n".join(lines)


def as_json(inputs: PlanInputs, plans: list[RankPlan]) -> str:
    layout = inputs.layout
    document: dict[str, Any] = {
        "layout": {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp, "ep": layout.ep, "fsdp": layout.fsdp,
                   "layer_wise": layout.layer_wise},
        "muon_tp_mode": inputs.config.muon_tp_mode, "precision": inputs.precision,
        "gram_newton_schulz": bool(getattr(inputs.config, "muon_gram_newton_schulz", False)),
        "hardware": inputs.profile.name, "mfu": inputs.mfu, "tokens_per_iteration": inputs.tokens_per_iteration,
        "ranks": [{"rank": p.rank, "stage": p.stage, "dp_rank": p.dp_rank, "tp_rank": p.tp_rank,
                   "matrices": list(p.matrices), "flops": p.flops, "gram_flops": p.gram_flops,
                   "bytes_sent": p.bytes_sent, "collectives": p.collectives, "state_bytes": p.state_bytes,
                   "step": {"flops": p.step[0], "bytes_sent": p.step[1], "collectives": p.step[2]},
                   "auto_modes": p.auto_modes, "muon_time_s": p.muon_time_s,
                   "iteration_time_s": p.iteration_time_s, "share": p.share} for p in plans],
    }
    return json.dumps(document, indent=1)
