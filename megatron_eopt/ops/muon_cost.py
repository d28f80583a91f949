"""What one Muon step costs per matrix block and TP mode: FLOPs, bytes, predicted time.

Public names (stable): EXACT_MODES, HardwareProfile, PROFILES, hardware_profile, calibrate,
clear_calibrations, BlockCost, block_cost, layout_costs, cheapest_mode, RankCost, rank_costs,
step_costs, step_time_s, auto_tp_modes, choose_tp_modes, newton_schulz_flops.
- block_cost(shape, partition_dim, tp_size, mode, settings, precision): one block's Newton-Schulz
  FLOPs (standard or Gram, chosen as the step chooses) and bytes per rank, as the step runs it.
- rank_costs(layouts, modes, tp_size, rank, ...): one rank's exact totals for a step, owners
  of 'sharded' blocks assigned as the step assigns them.
- HardwareProfile.time_s / BlockCost.time_s: predicted seconds (an estimate: peak-rate matmul
  FLOP/s, one link rate, a fixed latency per collective). 'h100' holds measured GPU figures;
  'cpu' is calibrated here (a timed matmul, and a timed all-reduce over a given group).
Bytes are what a rank sends over the TP group's links: all-gather and all-to-all as sent, an
all-reduce of B bytes as a ring sends it, 2 (t - 1) / t * B. FLOPs count matrix products only.
"""

import functools
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist

from megatron_eopt.ops.gram_newton_schulz import gram_flops, restart_steps, standard_flops
from megatron_eopt.ops.newton_schulz import NewtonSchulzSettings
from megatron_eopt.ops.ownership import assign_owner_ranks
from megatron_eopt.ops.splits import MatrixLayout, newton_schulz_cost
from megatron_eopt.runtime.process_groups import group_size

EXACT_MODES: tuple[str, ...] = ("duplicated", "distributed", "sharded")
TP_MODES: tuple[str, ...] = ("blockwise", *EXACT_MODES)
FP32_BYTES = 4  # updates travel as fp32 (all-gather, all-to-all, the norm all-reduce)


@dataclass(frozen=True)
class HardwareProfile:
    """Rates a prediction uses: matmul FLOP/s per precision, the TP link, collective latency."""

    name: str
    fp32_flops: float  # matmul FLOP/s at muon_fp32_matmul_prec='highest'
    bf16_flops: float  # at 'medium' (bf16 products)
    link_bytes_per_s: float  # what one rank sends per second over the TP group's links
    collective_latency_s: float  # fixed cost of one collective call
    tf32_flops: Optional[float] = None  # at 'high'; None: as fp32_flops
    peak_bf16_flops: Optional[float] = None  # the device's dense bf16 peak (datasheet); None: unknown
    notes: str = field(default="", compare=False)

    def matmul_flops(self, precision: str) -> float:
        """FLOP/s of matrix products at a `muon_fp32_matmul_prec` value."""
        rates = {"highest": self.fp32_flops, "high": self.tf32_flops or self.fp32_flops, "medium": self.bf16_flops}
        if precision not in rates:
            raise ValueError(f"precision must be one of 'highest', 'high', 'medium'; got {precision!r}.")
        return rates[precision]

    def time_s(self, flops: float, bytes_sent: float, collectives: int, precision: str) -> float:
        """Predicted seconds: FLOPs at the matmul rate + bytes at the link rate + latencies."""
        return (flops / self.matmul_flops(precision) + bytes_sent / self.link_bytes_per_s
                + collectives * self.collective_latency_s)


# H100 SXM: Newton-Schulz's own bf16 and fp32 rates measured by benchmarks/gpu_check.py (docs/gpu.md);
# tf32 assumed half of bf16; the dense bf16 peak is the datasheet's. The TP link is an assumption:
# NVLink 4, about 450 GB/s each way, and about 10 us per NCCL collective inside one node.
PROFILES: dict[str, HardwareProfile] = {
    "h100": HardwareProfile("h100", fp32_flops=50.2e12, bf16_flops=569e12, link_bytes_per_s=450e9,
                            collective_latency_s=10e-6, tf32_flops=284e12, peak_bf16_flops=989e12,
                            notes="Newton-Schulz rates measured on one H100 (docs/gpu.md); NVLink 450 GB/s "
                                  "and 10 us per collective assumed"),
}
CALIBRATED = ("cpu",)  # names that `hardware_profile` measures on this machine instead of reading
# Without a group to time, the link of a calibrated profile is this (gloo over loopback, about).
UNTIMED_LINK_BYTES_PER_S, UNTIMED_LATENCY_S = 1e9, 100e-6
_calibrations: dict[tuple, HardwareProfile] = {}


def hardware_profile(name: str, group: Optional[dist.ProcessGroup] = None) -> HardwareProfile:
    """A named profile: one of PROFILES, or 'cpu', calibrated here (see `calibrate`)."""
    if name in PROFILES:
        return PROFILES[name]
    if name in CALIBRATED:
        return calibrate(torch.device(name), group)
    raise ValueError(f"hardware profile must be one of {', '.join(map(repr, (*PROFILES, *CALIBRATED)))}; "
                     f"got {name!r}.")


def calibrate(device: torch.device, group: Optional[dist.ProcessGroup] = None) -> HardwareProfile:
    """Rates measured on `device`: timed fp32 and bf16 matmuls and, with `group`, a timed small and
    large all-reduce. Cached per process, device and group. With a group every member gets the
    same profile: each measured time is MAX-reduced over it (a collective every member must call)."""
    device = torch.device(device)
    ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else ()
    key = (device.type, ranks)
    if key not in _calibrations:
        wire = collective_device(group)
        times = torch.tensor([*_matmul_seconds(device), *_all_reduce_seconds(wire, group)], dtype=torch.float64)
        if len(ranks) > 1:
            shared = times.to(wire)
            dist.all_reduce(shared, op=dist.ReduceOp.MAX, group=group)
            times = shared.cpu()
        _calibrations[key] = _profile_from_times(device, times.tolist(), len(ranks))
    return _calibrations[key]


def collective_device(group: Optional[dist.ProcessGroup]) -> torch.device:
    """Where a collective's tensors live for `group`: the current GPU for NCCL, else the CPU."""
    if group is not None and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def clear_calibrations() -> None:
    """Forget cached calibrations (tests do, so that reused workers start clean)."""
    _calibrations.clear()


MATMUL_SIZE, BF16_MATMUL_SIZE, REPEATS = 384, 128, 5  # a few ms each on a CPU core
SMALL_BYTES, LARGE_BYTES = 4, 4 << 20


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_seconds(run, device: torch.device) -> float:
    """Median, not best: on a shared machine the rates the step will see, not the peak."""
    run()  # warm-up
    times = []
    for _ in range(REPEATS):
        _synchronize(device)
        start = time.perf_counter()
        run()
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _matmul_seconds(device: torch.device) -> tuple[float, float]:
    """Seconds of one fp32 MATMUL_SIZE^3 and one bf16 BF16_MATMUL_SIZE^3 product (fp32 in 'highest')."""
    a = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device=device)
    b = torch.randn(BF16_MATMUL_SIZE, BF16_MATMUL_SIZE, device=device, dtype=torch.bfloat16)
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        return _median_seconds(lambda: a @ a, device), _median_seconds(lambda: b @ b, device)
    finally:
        torch.set_float32_matmul_precision(previous)


def _all_reduce_seconds(device: torch.device, group: Optional[dist.ProcessGroup]) -> tuple[float, float]:
    """Seconds of a SMALL_BYTES and a LARGE_BYTES fp32 all-reduce over `group` (0, 0 without one)."""
    if group_size(group) < 2:
        return 0.0, 0.0
    small = torch.zeros(SMALL_BYTES // 4, device=device)
    large = torch.zeros(LARGE_BYTES // 4, device=device)
    return (_median_seconds(lambda: dist.all_reduce(small, group=group), device),
            _median_seconds(lambda: dist.all_reduce(large, group=group), device))


def _profile_from_times(device: torch.device, times: list[float], group_size: int) -> HardwareProfile:
    fp32_s, bf16_s, small_s, large_s = times
    fp32_flops = 2 * MATMUL_SIZE**3 / fp32_s
    bf16_flops = 2 * BF16_MATMUL_SIZE**3 / bf16_s
    latency, bandwidth = UNTIMED_LATENCY_S, UNTIMED_LINK_BYTES_PER_S
    notes = f"calibrated on {device.type}: matmuls timed; no group, so the link is assumed"
    if group_size > 1:
        # The small all-reduce's time is the latency; the large one sends ring_bytes per rank beyond it.
        latency = small_s
        bandwidth = ring_all_reduce_bytes(LARGE_BYTES, group_size) / max(large_s - small_s, 1e-9)
        notes = f"calibrated on {device.type}: matmuls and all-reduces timed over a group of {group_size}"
    return HardwareProfile(device.type, fp32_flops=fp32_flops, bf16_flops=bf16_flops, link_bytes_per_s=bandwidth,
                           collective_latency_s=latency, notes=notes)


def ring_all_reduce_bytes(buffer_bytes: float, group_size: int) -> float:
    """Bytes one rank sends in a ring all-reduce of `buffer_bytes`: 2 (t - 1) / t of them."""
    return 2 * (group_size - 1) / group_size * buffer_bytes


@functools.lru_cache(maxsize=4096)  # the planner asks per block per rank: ~700k calls, a few hundred distinct (kimi-k2)
def newton_schulz_flops(rows: int, cols: int, settings: NewtonSchulzSettings, precision: str,
                        transpose: Optional[bool] = None) -> tuple[str, int]:
    """('gram' or 'standard', matmul FLOPs) of Newton-Schulz on a rows x cols matrix, the path
    chosen as the step chooses it (`NewtonSchulzSettings.takes_gram_path`)."""
    transpose = rows > cols if transpose is None else transpose
    m, n = (cols, rows) if transpose else (rows, cols)
    if settings.takes_gram_path(rows, cols, precision, transpose):
        return "gram", gram_flops(m, n, settings.num_steps, restart_steps(settings.num_steps))
    return "standard", standard_flops(m, n, settings.num_steps)


@dataclass(frozen=True)
class BlockCost:
    """One block's cost in one TP mode, per step (the numbers are exact; `time_s` is an estimate).

    flops: of each rank that orthogonalizes it (`computing_ranks` of them: the whole TP group, or
    the owner in 'sharded'); bytes_sent: by each rank, the mean over the TP group; collectives:
    calls this block makes alone ('distributed': per-iteration all-reduces); shared_collectives:
    calls its mode makes once per step for all its blocks (all-gather, two all-to-alls).
    """

    mode: str
    path: str  # 'standard' or 'gram'
    flops: int
    computing_ranks: int
    tp_size: int
    bytes_sent: float
    collectives: int
    shared_collectives: int

    @property
    def mean_flops(self) -> float:
        """FLOPs per TP rank, averaged over the group."""
        return self.flops * self.computing_ranks / self.tp_size

    def time_s(self, profile: HardwareProfile, precision: str) -> float:
        """Predicted marginal seconds per rank: mean FLOPs, mean bytes and its own collectives
        (the shared ones cost the step once, whatever the number of blocks)."""
        return profile.time_s(self.mean_flops, self.bytes_sent, self.collectives, precision)


def block_cost(shape: tuple[int, int], partition_dim: int, tp_size: int, mode: str,
               settings: NewtonSchulzSettings = NewtonSchulzSettings(), precision: str = "highest") -> BlockCost:
    """The cost of one block of global `shape`, split over `tp_size` ranks along `partition_dim`
    (-1: replicated), in `mode`, as ops/newton_schulz.py runs it (see BlockCost)."""
    if mode not in TP_MODES:
        raise ValueError(f"mode must be one of {', '.join(map(repr, TP_MODES))}; got {mode!r}.")
    rows, cols = shape
    t = tp_size
    sharded = t > 1 and partition_dim >= 0
    local = (rows // t, cols) if partition_dim == 0 else (rows, cols // t)
    if mode == "sharded" and t > 1:
        path, flops = newton_schulz_flops(rows, cols, settings, precision)
        return _sharded_block(shape, sharded, path, flops, t)
    if mode == "distributed" and sharded:
        return _distributed_block(local, partition_dim, t, settings, precision)
    if mode == "blockwise" and sharded:
        path, flops = newton_schulz_flops(*local, settings, precision)
        return BlockCost(mode, path, flops, t, t, 0.0, 0, 0)
    # 'duplicated', or a replicated block (or TP=1) in any mode: every rank runs the global block.
    path, flops = newton_schulz_flops(rows, cols, settings, precision)
    sent = (t - 1) * rows * cols / t * FP32_BYTES if sharded else 0.0
    return BlockCost(mode, path, flops, t, t, sent, 0, int(sharded))


def _distributed_block(local: tuple[int, int], partition_dim: int, t: int, settings: NewtonSchulzSettings,
                       precision: str) -> BlockCost:
    """'distributed': the shard is iterated with the sharded dimension as the long side; each
    iteration (Gram: each (re)start) all-reduces the Gram matrix, after one norm all-reduce."""
    transpose = partition_dim == 0
    path, flops = newton_schulz_flops(*local, settings, precision, transpose)
    gram_side = local[1] if transpose else local[0]
    steps = settings.num_steps
    reductions = 1 + len(restart_steps(steps)) if path == "gram" else steps
    element_bytes = 2 if precision == "medium" else 4  # the iterate (so its Gram matrix) is bf16 in 'medium'
    sent = reductions * ring_all_reduce_bytes(gram_side**2 * element_bytes, t) + ring_all_reduce_bytes(FP32_BYTES, t)
    return BlockCost("distributed", path, flops, t, t, sent, reductions + 1, 0)


def _sharded_block(shape: tuple[int, int], sharded: bool, path: str, flops: int, t: int) -> BlockCost:
    """'sharded': the owner orthogonalizes; mean bytes of the two all-to-alls (`sharded_bytes_sent`)."""
    mean_sent = (sharded_bytes_sent(shape, sharded, t, True) + (t - 1) * sharded_bytes_sent(shape, sharded, t, False)) / t
    return BlockCost("sharded", path, flops, 1, t, mean_sent, 0, 2)


def sharded_bytes_sent(shape: tuple[int, int], sharded: bool, tp_size: int, owner: bool) -> float:
    """Bytes a rank sends for one block in 'sharded' mode: its shard to the owner (a TP-sharded
    block), and, on the owner, every other rank's slice (or the whole replicated block) back."""
    elements, t = shape[0] * shape[1], tp_size
    if owner:
        return (t - 1) * (elements / t if sharded else elements) * FP32_BYTES
    return elements / t * FP32_BYTES if sharded else 0.0


def layout_costs(layout: MatrixLayout, tp_size: int, mode: str, settings: NewtonSchulzSettings = NewtonSchulzSettings(),
                 precision: str = "highest") -> list[BlockCost]:
    """`block_cost` of every block of one parameter (q/k/v, gate/up, or the whole matrix). Per-head
    blocks are whole on their rank: each rank runs its own, with no communication, in any mode."""
    partition_dim, mode = _block_placement(layout, tp_size, mode)
    return [block_cost(shape, partition_dim, tp_size, mode, settings, precision)
            for shape in layout.global_block_shapes()]


def _block_placement(layout: MatrixLayout, tp_size: int, mode: str) -> tuple[int, str]:
    """(partition_dim, mode) that `block_cost` counts a block of `layout` with: a per-head block
    costs what a replicated one does in 'duplicated' (every rank runs it, nothing is sent). A
    `tp_contiguous` matrix is gathered whole first (`step_costs` counts that all-gather): its
    blocks cost what replicated ones do in the mode ('blockwise' counts the global parts)."""
    if layout.per_head:
        return -1, "duplicated"
    if layout.tp_contiguous:
        return -1, mode
    return (layout.partition_dim if tp_size > 1 else -1), mode


def cheapest_mode(layout: MatrixLayout, tp_size: int, profile: HardwareProfile,
                  settings: NewtonSchulzSettings = NewtonSchulzSettings(), precision: str = "highest",
                  modes: Sequence[str] = EXACT_MODES) -> str:
    """The mode of `modes` with the least predicted marginal time for this parameter; ties go to
    the earlier mode. Depends only on shapes, settings and the profile, so every rank agrees."""
    times = [sum(cost.time_s(profile, precision) for cost in layout_costs(layout, tp_size, mode, settings, precision))
             for mode in modes]
    return modes[min(range(len(modes)), key=lambda i: (times[i], i))]


@dataclass(frozen=True)
class RankCost:
    """One TP rank's totals for one optimizer step (exact counts; `time_s` is an estimate)."""

    flops: int
    bytes_sent: float
    collectives: int

    def time_s(self, profile: HardwareProfile, precision: str) -> float:
        return profile.time_s(self.flops, self.bytes_sent, self.collectives, precision)


def rank_costs(layouts: Sequence[MatrixLayout], modes: Sequence[str], tp_size: int, rank: int,
               settings: NewtonSchulzSettings = NewtonSchulzSettings(), precision: str = "highest") -> RankCost:
    """TP rank `rank`'s FLOPs, bytes sent and collective calls when one step orthogonalizes
    `layouts` (parameter i in `modes[i]`), as `orthogonalize_updates` runs them (`step_costs`)."""
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank must be in [0, tp_size={tp_size}); got {rank}.")
    return step_costs(layouts, modes, tp_size, settings, precision)[rank]


def step_costs(layouts: Sequence[MatrixLayout], modes: Sequence[str], tp_size: int,
               settings: NewtonSchulzSettings = NewtonSchulzSettings(), precision: str = "highest") -> list[RankCost]:
    """Every TP rank's RankCost for one step: 'sharded' blocks get their owners from
    `assign_owner_ranks` over those blocks' costs, in parameter order, as the step assigns them."""
    if len(modes) != len(layouts):
        raise ValueError(f"modes must give one mode per layout; got {len(modes)} for {len(layouts)} layouts.")
    blocks = [(shape, *_block_placement(layout, tp_size, mode))
              for layout, mode in zip(layouts, modes) for shape in layout.global_block_shapes()]
    if tp_size == 1:
        return [RankCost(sum(newton_schulz_flops(*shape, settings, precision)[1] for shape, _, _ in blocks), 0.0, 0)]
    flops, sent, collectives = 0, 0.0, 0  # the same on every rank outside 'sharded'
    cut = [layout for layout, mode in zip(layouts, modes) if layout.cut_by_tp and mode != "blockwise"]
    if cut:  # ops/whole_matrix.py's gather_cut_matrices: one all-gather of every rank's shards
        sent += (tp_size - 1) * sum(layout.local_shape[0] * layout.local_shape[1] for layout in cut) * FP32_BYTES
        collectives += 1
    for mode in ("blockwise", "duplicated", "distributed"):
        costs = [block_cost(shape, dim, tp_size, mode, settings, precision) for shape, dim, m in blocks if m == mode]
        flops += sum(c.flops for c in costs)
        sent += sum(c.bytes_sent for c in costs)
        collectives += sum(c.collectives for c in costs) + max((c.shared_collectives for c in costs), default=0)
    owned = [(shape, dim) for shape, dim, mode in blocks if mode == "sharded"]
    owners = assign_owner_ranks([newton_schulz_cost(*shape) for shape, _ in owned], tp_size)
    per_rank = [[flops, sent] for _ in range(tp_size)]
    for (shape, dim), owner in zip(owned, owners):
        per_rank[owner][0] += newton_schulz_flops(*shape, settings, precision)[1]
        for rank in range(tp_size):
            per_rank[rank][1] += sharded_bytes_sent(shape, dim >= 0, tp_size, owner == rank)
    return [RankCost(f, b, collectives + (2 if owned else 0)) for f, b in per_rank]


def step_time_s(layouts: Sequence[MatrixLayout], modes: Sequence[str], tp_size: int, profile: HardwareProfile,
                settings: NewtonSchulzSettings = NewtonSchulzSettings(), precision: str = "highest") -> float:
    """Predicted seconds of one step's orthogonalization: the slowest TP rank's."""
    return max(cost.time_s(profile, precision) for cost in step_costs(layouts, modes, tp_size, settings, precision))


AUTO = "auto"


def resolve_profile(name: Union[None, str, HardwareProfile], device: Optional[torch.device],
                    group: Optional[dist.ProcessGroup]) -> HardwareProfile:
    """The profile 'auto' uses: a HardwareProfile, a name (PROFILES, or 'cpu'), or None: calibrated
    on `device` (None: the group's collective device) over `group` (a collective all call)."""
    if isinstance(name, HardwareProfile):
        return name
    if name is not None:
        return hardware_profile(name, group)
    return calibrate(collective_device(group) if device is None else device, group)


def choose_tp_modes(tp_mode: str, layouts: Sequence[MatrixLayout], tp_size: int,
                    profile: Optional[HardwareProfile], settings: NewtonSchulzSettings = NewtonSchulzSettings(),
                    precision: str = "highest") -> dict[str, str]:
    """fqn -> the mode its matrix runs in: `tp_mode` itself, or for 'auto' `auto_tp_modes`
    ('duplicated' at TP=1, where all modes are the same and need no profile)."""
    if tp_mode != AUTO:
        return {layout.name: tp_mode for layout in layouts}
    if tp_size == 1:
        return {layout.name: EXACT_MODES[0] for layout in layouts}
    if profile is None:
        raise ValueError("tp_mode='auto' at TP > 1 needs a hardware profile to choose modes with.")
    return dict(zip((layout.name for layout in layouts), auto_tp_modes(layouts, tp_size, profile, settings, precision)))


def auto_tp_modes(layouts: Sequence[MatrixLayout], tp_size: int, profile: HardwareProfile,
                  settings: NewtonSchulzSettings = NewtonSchulzSettings(), precision: str = "highest") -> list[str]:
    """One exact mode per layout: of a few candidate plans, the one with the least `step_time_s`.

    Candidates: each matrix's `cheapest_mode` (marginal, which assumes 'sharded' owners balance);
    each matrix's cheaper of 'duplicated'/'distributed' ("unsharded"); for k = 1, 2, 4, ...: the
    k costliest matrices 'sharded' and the rest unsharded, or the other way round; all 'sharded'.
    Few sharded matrices balance badly over t ranks, which the marginal view cannot see.
    Shapes, settings and the profile decide, so every rank that knows the same layouts agrees.
    """
    count = len(layouts)
    marginal = [cheapest_mode(lay, tp_size, profile, settings, precision) for lay in layouts]
    unsharded = [cheapest_mode(lay, tp_size, profile, settings, precision, EXACT_MODES[:2]) for lay in layouts]
    cost = [sum(newton_schulz_cost(*shape) for shape in lay.global_block_shapes()) for lay in layouts]
    order = sorted(range(count), key=lambda i: (-cost[i], i))
    candidates = [marginal, unsharded]
    k = 1
    while k < count:
        top = set(order[:k])  # the k costliest sharded, the rest not; then the other way round
        candidates.append([("sharded" if i in top else mode) for i, mode in enumerate(unsharded)])
        candidates.append([(mode if i in top else "sharded") for i, mode in enumerate(unsharded)])
        k *= 2
    candidates.append(["sharded"] * count)
    times = [step_time_s(layouts, plan, tp_size, profile, settings, precision) for plan in candidates]
    return candidates[min(range(len(candidates)), key=lambda i: (times[i], i))]
