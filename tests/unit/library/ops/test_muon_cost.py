"""The Muon cost model (ops/muon_cost.py) against independent counts (CPU, one process).

- FLOPs: `block_cost` of every mode equals torch's FlopCounterMode count of what the rank runs
  (the global block, its local shard, or the shard iterated as 'distributed' does), standard
  and Gram, wide and tall.
- Bytes: written out from the collectives' definitions (all-gather: (t-1)/t of the matrix;
  ring all-reduce: 2 (t-1)/t of the buffer; all-to-all: the shards that leave the rank).
- rank_costs: summed over ranks, 'sharded' runs every block exactly once.
- Profiles: names, a calibrated profile, and predicted time as the formula says.
"""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megatron_eopt.ops.muon_cost import (
    EXACT_MODES,
    PROFILES,
    BlockCost,
    HardwareProfile,
    block_cost,
    calibrate,
    cheapest_mode,
    clear_calibrations,
    hardware_profile,
    layout_costs,
    rank_costs,
)
from megatron_eopt.ops.newton_schulz import NewtonSchulzSettings
from megatron_eopt.ops.splits import MatrixLayout


def counted_flops(x: torch.Tensor, settings: NewtonSchulzSettings, transpose=None) -> int:
    with FlopCounterMode(display=False) as counter:
        settings.orthogonalize(x, transpose=transpose)
    return counter.get_total_flops()


@pytest.mark.parametrize("gram", [False, True])
@pytest.mark.parametrize("shape,partition_dim", [((48, 16), 0), ((16, 48), 1), ((32, 32), 0)])
def test_flops_equal_a_counted_run(shape, partition_dim, gram) -> None:
    settings, t = NewtonSchulzSettings(gram=gram), 2
    rows, cols = shape
    local = (rows // t, cols) if partition_dim == 0 else (rows, cols // t)
    with torch.no_grad():
        full = counted_flops(torch.randn(shape), settings)
        shard = counted_flops(torch.randn(local), settings)
        iterated = counted_flops(torch.randn(local), settings, transpose=partition_dim == 0)
    assert block_cost(shape, partition_dim, t, "duplicated", settings).flops == full
    assert block_cost(shape, partition_dim, t, "sharded", settings).flops == full
    assert block_cost(shape, partition_dim, t, "blockwise", settings).flops == shard
    assert block_cost(shape, partition_dim, t, "distributed", settings).flops == iterated


def test_bytes_follow_the_collectives() -> None:
    rows, cols, t, steps = 64, 16, 4, 5
    settings = NewtonSchulzSettings(num_steps=steps)
    elements = rows * cols
    assert block_cost((rows, cols), 0, t, "duplicated", settings).bytes_sent == (t - 1) / t * elements * 4
    # distributed on a row shard iterates on X^T: the Gram matrix is cols x cols, all-reduced per step.
    cost = block_cost((rows, cols), 0, t, "distributed", settings, "highest")
    assert cost.bytes_sent == pytest.approx(2 * (t - 1) / t * (steps * cols * cols * 4 + 4))
    assert cost.collectives == steps + 1
    medium = block_cost((rows, cols), 0, t, "distributed", settings, "medium")
    assert medium.bytes_sent == pytest.approx(2 * (t - 1) / t * (steps * cols * cols * 2 + 4))
    # sharded: three ranks send a quarter each; the owner sends three quarters back.
    mean = (3 * elements / t * 4 + 3 * elements / t * 4) / t
    assert block_cost((rows, cols), 0, t, "sharded", settings).bytes_sent == pytest.approx(mean)
    # A replicated block moves nothing in duplicated/distributed; sharded sends the result to all.
    for mode in ("duplicated", "distributed"):
        assert block_cost((rows, cols), -1, t, mode, settings).bytes_sent == 0
    assert block_cost((rows, cols), -1, t, "sharded", settings).bytes_sent == pytest.approx((t - 1) * elements * 4 / t)


def test_rank_costs_run_each_sharded_block_once() -> None:
    t = 4
    layouts = [MatrixLayout(f"w{i}", (8 * (i + 1), 32), partition_dim=0, tp_size=t) for i in range(6)]
    settings = NewtonSchulzSettings()
    per_rank = [rank_costs(layouts, ["sharded"] * 6, t, r, settings) for r in range(t)]
    total = sum(block_cost(s, 0, t, "sharded", settings).flops for lay in layouts for s in lay.global_block_shapes())
    assert sum(c.flops for c in per_rank) == total
    assert all(c.collectives == 2 for c in per_rank)
    duplicated = rank_costs(layouts, ["duplicated"] * 6, t, 0, settings)
    assert duplicated.flops == total and duplicated.collectives == 1
    mixed = rank_costs(layouts, ["distributed"] + ["duplicated"] * 5, t, 0, settings)
    assert mixed.collectives == 1 + settings.num_steps + 1
    with pytest.raises(ValueError, match="one mode per layout"):
        rank_costs(layouts, ["sharded"], t, 0)


def test_time_and_profiles() -> None:
    profile = HardwareProfile("toy", fp32_flops=1e9, bf16_flops=4e9, link_bytes_per_s=1e8, collective_latency_s=1e-3)
    assert profile.time_s(2e9, 1e8, 3, "highest") == pytest.approx(2 + 1 + 3e-3)
    assert profile.time_s(2e9, 0, 0, "medium") == pytest.approx(0.5)
    cost = BlockCost("sharded", "standard", 4_000_000_000, 1, 4, 1e8, 0, 2)
    assert cost.time_s(profile, "highest") == pytest.approx(1 + 1)  # mean FLOPs: a quarter
    assert hardware_profile("h100") is PROFILES["h100"]
    with pytest.raises(ValueError, match="hardware profile must be one of 'h100', 'cpu'; got 'tpu'"):
        hardware_profile("tpu")
    with pytest.raises(ValueError, match="mode must be one of"):
        block_cost((4, 4), 0, 2, "auto")
    try:
        measured = calibrate(torch.device("cpu"))
        assert measured.fp32_flops > 0 and measured.bf16_flops > 0
        assert calibrate(torch.device("cpu")) is measured  # cached
    finally:
        clear_calibrations()


def test_cheapest_mode_is_the_least_predicted_time() -> None:
    layout = MatrixLayout("w", (256, 1024), partition_dim=0, tp_size=2)
    for profile in (PROFILES["h100"], HardwareProfile("slow-link", 1e12, 1e12, 1e3, 1.0)):
        times = {m: sum(c.time_s(profile, "highest") for c in layout_costs(layout, 2, m)) for m in EXACT_MODES}
        assert cheapest_mode(layout, 2, profile) == min(EXACT_MODES, key=lambda m: (times[m], EXACT_MODES.index(m)))
    replicated = MatrixLayout("w", (64, 64))
    assert cheapest_mode(replicated, 1, PROFILES["h100"]) == "duplicated"  # TP=1: all equal, the first


def test_config_profile_names_are_the_cost_models() -> None:
    import typing

    from megatron_eopt.config.choices import HardwareProfileName
    from megatron_eopt.ops.muon_cost import CALIBRATED

    assert set(typing.get_args(HardwareProfileName)) == set(PROFILES) | set(CALIBRATED)


def test_auto_plan_is_never_predicted_slower_than_a_fixed_mode() -> None:
    from megatron_eopt.ops.muon_cost import auto_tp_modes, step_time_s

    t = 4
    layouts = [MatrixLayout("big", (1024, 256), partition_dim=0, tp_size=t),
               MatrixLayout("small", (64, 16), partition_dim=1, tp_size=t),
               MatrixLayout("whole", (32, 32))]
    for profile in (PROFILES["h100"], HardwareProfile("slow-link", 1e12, 1e12, 1e6, 1e-3),
                    HardwareProfile("slow-flops", 1e8, 1e8, 1e11, 1e-6)):
        plan = auto_tp_modes(layouts, t, profile)
        assert set(plan) <= set(EXACT_MODES)
        best_fixed = min(step_time_s(layouts, [mode] * 3, t, profile) for mode in EXACT_MODES)
        assert step_time_s(layouts, plan, t, profile) <= best_fixed
