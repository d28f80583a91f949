"""TensorParallelMuon against a single-process full-matrix reference (CPU, gloo, fp32).

The reference orthogonalizes each block of the unsharded weight by explicit row indexing
(q, k, v rows of every query group; gate and up halves of fc1) with emerging_optimizers'
newton_schulz, and scales by the block's global shape. 'duplicated', 'distributed' and
'sharded' must match it to 1e-5 (the Gram matrices are summed in another order, and
'distributed' iterates on the transpose), and so must 'auto' (calibrated here) and a mix of
all three, one per matrix; 'blockwise' must equal per-shard Newton-Schulz and differ from the
reference.
"""

import math

import pytest
import torch
import torch.distributed as dist
from emerging_optimizers.orthogonalized_optimizers.muon_utils import newton_schulz

from megatron_eopt.ops.muon_cost import clear_calibrations
from megatron_eopt.ops.splits import MatrixLayout, merge_blocks, split_blocks
from megatron_eopt.optimizers.muon.tensor_parallel_muon import TensorParallelMuon

HEADS, GROUPS, KV = 8, 4, 2  # GQA: 2 heads per group; q rows per group = 4
Q_ROWS = HEADS // GROUPS * KV
QKV_ROWS_PER_GROUP = Q_ROWS + 2 * KV
FFN, HIDDEN = 8, 12
# name -> (global shape, kind, partition_dim)
MATRICES = {
    "qkv": ((GROUPS * QKV_ROWS_PER_GROUP, HIDDEN), "qkv", 0),
    "fc1": ((2 * FFN, HIDDEN), "glu", 0),
    "proj": ((HIDDEN, 16), "plain", 1),
    "column": ((16, HIDDEN), "plain", 0),
    "replicated": ((6, 10), "plain", -1),
}
LR, MOMENTUM, WD, STEPS = 0.05, 0.9, 0.1, 3


def block_rows(name: str, per_head: bool = False) -> list[list[int]]:
    """Row indices of each block of the global matrix (per head: each q, k and v head's KV rows)."""
    (rows, _), kind, _ = MATRICES[name]
    if kind == "qkv" and per_head:
        return [[g * QKV_ROWS_PER_GROUP + head * KV + r for r in range(KV)]
                for g in range(GROUPS) for head in range(QKV_ROWS_PER_GROUP // KV)]
    if kind == "qkv":
        offsets = [(0, Q_ROWS), (Q_ROWS, Q_ROWS + KV), (Q_ROWS + KV, QKV_ROWS_PER_GROUP)]
        return [[g * QKV_ROWS_PER_GROUP + r for g in range(GROUPS) for r in range(a, b)] for a, b in offsets]
    if kind == "glu":
        return [list(range(FFN)), list(range(FFN, 2 * FFN))]
    return [list(range(rows))]


def reference_update(name: str, momentum: torch.Tensor, per_head: bool = False) -> torch.Tensor:
    update = torch.zeros_like(momentum)
    for rows in block_rows(name, per_head):
        block = momentum[rows]
        update[rows] = newton_schulz(block, steps=5) * math.sqrt(max(block.shape))
    return update


def local_shard(name: str, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    _, kind, dim = MATRICES[name]
    if dim < 0:
        return full.clone()
    if kind == "glu":  # partition_stride=2: rank r holds [gate_r; up_r]
        return torch.cat([half.chunk(size, dim=0)[rank] for half in full.chunk(2, dim=0)])
    return full.chunk(size, dim=dim)[rank].clone()  # qkv: whole query groups per rank


def layout_for(name: str, local: torch.Tensor, size: int, split: bool = True, per_head: bool = False) -> MatrixLayout:
    _, kind, dim = MATRICES[name]
    if kind == "qkv" and split:
        return MatrixLayout(name, tuple(local.shape), dim, size, GROUPS // size, (Q_ROWS, KV, KV),
                            head_rows=KV if per_head else 0)
    if kind == "glu" and split:
        return MatrixLayout(name, tuple(local.shape), dim, size, 1, (local.shape[0] // 2,) * 2)
    return MatrixLayout(name, tuple(local.shape), dim, size)


def initial(name: str) -> torch.Tensor:
    return torch.randn(MATRICES[name][0], generator=torch.Generator().manual_seed(sum(map(ord, name))))


def gradient(name: str, step: int) -> torch.Tensor:
    return torch.randn(MATRICES[name][0], generator=torch.Generator().manual_seed(100 * step + len(name)))


def reference_run(per_head: bool = False) -> dict[str, torch.Tensor]:
    params = {name: initial(name) for name in MATRICES}
    momenta = {name: torch.zeros_like(p) for name, p in params.items()}
    for step in range(STEPS):
        for name in MATRICES:
            momenta[name] = MOMENTUM * momenta[name] + (1 - MOMENTUM) * gradient(name, step)
            params[name] = params[name] * (1 - LR * WD) - LR * reference_update(name, momenta[name], per_head)
    return params


def blockwise_reference(rank: int, size: int, per_head: bool = False) -> dict[str, torch.Tensor]:
    """Per-shard Newton-Schulz with the shard's own blocks and shape (what blockwise means)."""
    params = {n: local_shard(n, initial(n), rank, size) for n in MATRICES}
    momenta = {n: torch.zeros_like(p) for n, p in params.items()}
    for step in range(STEPS):
        for name in MATRICES:
            momenta[name] = MOMENTUM * momenta[name] + (1 - MOMENTUM) * local_shard(name, gradient(name, step), rank, size)
            layout = layout_for(name, params[name], size, per_head=per_head)
            blocks = [newton_schulz(b, steps=5) * math.sqrt(max(b.shape)) for b in split_blocks(momenta[name], layout)]
            params[name] = params[name] * (1 - LR * WD) - LR * merge_blocks(blocks, layout)
    return params


# One mode per matrix, every exact mode present: the per-parameter path that 'auto' takes.
MIXED_MODES = {"qkv": "distributed", "fc1": "sharded", "proj": "duplicated", "column": "sharded",
               "replicated": "distributed"}


def _tp_body(rank: int, size: int, tp_mode: str, per_head: bool = False) -> dict:
    world = dist.group.WORLD
    params = {n: torch.nn.Parameter(local_shard(n, initial(n), rank, size)) for n in MATRICES}
    layouts = {n: layout_for(n, p, size, per_head=per_head) for n, p in params.items()}
    try:
        optimizer = TensorParallelMuon(
            [{"params": list(params.values()), "param_fqns": list(params)}], lr=LR, momentum=MOMENTUM,
            nesterov=False, weight_decay=WD, fp32_matmul_prec="highest", tp_mode="auto" if tp_mode == "mixed" else tp_mode,
            tp_group=world, layouts=layouts,  # 'auto': calibrated here, over the group
        )
    finally:
        clear_calibrations()  # the reused workers start the next test without a cached profile
    if tp_mode == "mixed":
        optimizer.tp_modes = dict(MIXED_MODES)
    for step in range(STEPS):
        for name, param in params.items():
            param.grad = local_shard(name, gradient(name, step), rank, size)
        optimizer.step()
    full_reference = reference_run(per_head)
    shard_reference = blockwise_reference(rank, size, per_head)
    errors = {
        name: (
            (param.detach() - local_shard(name, full_reference[name], rank, size)).abs().max().item(),
            (param.detach() - shard_reference[name]).abs().max().item(),
        )
        for name, param in params.items()
    }
    return {"errors": errors, "tp_modes": optimizer.tp_modes}


@pytest.mark.parametrize("per_head", [False, True], ids=["qkv", "per_head"])
@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("tp_mode", ["duplicated", "distributed", "sharded", "auto", "mixed"])
def test_tp_modes_equal_full_matrix_reference(run_distributed, size: int, tp_mode: str, per_head: bool) -> None:
    """Per head (GQA: 2 q heads, k and v per query group), each of the 24 heads of qkv is its
    own KV x HIDDEN matrix in the reference; every rank holds whole heads."""
    results = run_distributed(_tp_body, world_size=size, args=(tp_mode, per_head))
    for result in results:
        bad = {name: e for name, (e, _) in result["errors"].items() if e > 1e-5}
        assert not bad, (tp_mode, size, bad)
    if tp_mode == "auto":  # exact modes only, the same on every rank (calibration MAX-reduced)
        assert all(r["tp_modes"] == results[0]["tp_modes"] for r in results)
        assert set(results[0]["tp_modes"]) == set(MATRICES)
        assert set(results[0]["tp_modes"].values()) <= {"duplicated", "distributed", "sharded"}


def test_blockwise_is_per_shard_and_tp_dependent(run_distributed) -> None:
    for errors in (r["errors"] for r in run_distributed(_tp_body, world_size=2, args=("blockwise",))):
        assert all(per_shard < 1e-6 for _, per_shard in errors.values()), errors
        assert errors["column"][0] > 1e-3 and errors["qkv"][0] > 1e-3  # differs from TP=1
        assert errors["replicated"][0] < 1e-6  # nothing sharded, nothing differs


def test_blockwise_per_head_qkv_is_exact(run_distributed) -> None:
    """Per head, no head is split over TP ranks: blockwise equals TP=1 on qkv (not on others)."""
    for errors in (r["errors"] for r in run_distributed(_tp_body, world_size=2, args=("blockwise", True))):
        assert errors["qkv"][0] < 1e-6 and errors["column"][0] > 1e-3, errors


def test_single_process_splits_equal_explicit_blocks() -> None:
    """QKV (GQA 8 heads / 4 groups) and gated fc1 split exactly as explicit row indexing."""
    for name in ("qkv", "fc1"):
        param = torch.nn.Parameter(initial(name))
        optimizer = TensorParallelMuon([{"params": [param], "param_fqns": [name]}], lr=1.0, momentum=0.0,
                                       weight_decay=0.0, fp32_matmul_prec="highest",
                                       layouts={name: layout_for(name, param, 1)})
        grad = gradient(name, 0)
        param.grad = grad.clone()
        before = param.detach().clone()
        optimizer.step()
        torch.testing.assert_close(before - param.detach(), reference_update(name, grad), rtol=0, atol=1e-6)


def test_mha_qkv_split() -> None:
    """Multi-head attention: one head per group, blocks of kv rows."""
    heads, kv, hidden = 4, 3, 10
    weight = torch.randn(heads * 3 * kv, hidden)
    layout = MatrixLayout("qkv", tuple(weight.shape), -1, 1, heads, (kv, kv, kv))
    param = torch.nn.Parameter(weight.clone())
    optimizer = TensorParallelMuon([{"params": [param], "param_fqns": ["qkv"]}], lr=1.0, momentum=0.0,
                                   weight_decay=0.0, fp32_matmul_prec="highest", layouts={"qkv": layout})
    param.grad = weight.clone()
    optimizer.step()
    expected = torch.zeros_like(weight)
    for offset in range(3):
        rows = [h * 3 * kv + offset * kv + r for h in range(heads) for r in range(kv)]
        expected[rows] = newton_schulz(weight[rows], steps=5) * math.sqrt(max(len(rows), hidden))
    torch.testing.assert_close(weight - param.detach(), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("scale_mode,expected_scale", [
    ("spectral", lambda m, n: math.sqrt(max(m, n))),
    ("shape_scaling", lambda m, n: math.sqrt(max(1.0, m / n))),
    ("unit_rms_norm", lambda m, n: math.sqrt(m / n)),
])
def test_update_rms_follows_scale_mode(scale_mode: str, expected_scale) -> None:
    m, n = 48, 16
    grad = torch.randn(m, n, generator=torch.Generator().manual_seed(3))
    param = torch.nn.Parameter(torch.zeros(m, n))
    optimizer = TensorParallelMuon([param], lr=1.0, momentum=0.0, weight_decay=0.0, scale_mode=scale_mode,
                                   extra_scale_factor=0.2, fp32_matmul_prec="highest")
    param.grad = grad
    optimizer.step()
    update_rms = param.detach().square().mean().sqrt().item()
    orthogonal_rms = newton_schulz(grad, steps=5).square().mean().sqrt().item()
    assert update_rms == pytest.approx(0.2 * expected_scale(m, n) * orthogonal_rms, rel=1e-5)
    if scale_mode == "spectral":  # Moonlight: 0.2 * sqrt(max(m, n)) gives AdamW-like RMS ~0.2
        assert 0.14 < update_rms < 0.26


def test_bad_arguments() -> None:
    param = torch.nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="tp_mode must be one of 'blockwise', 'duplicated', 'distributed', 'sharded', 'auto'; got 'dist'"):
        TensorParallelMuon([param], tp_mode="dist")
    with pytest.raises(ValueError, match=r"coefficient_type must be one of .*'quintic'.*got 'fast'"):
        TensorParallelMuon([param], coefficient_type="fast")
    with pytest.raises(ValueError, match="num_ns_steps must be >= 1"):
        TensorParallelMuon([param], num_ns_steps=0)
    with pytest.raises(ValueError, match=r"parameter 'norm.weight' has shape \(4,\); Muon updates 2-D"):
        TensorParallelMuon([{"params": [torch.nn.Parameter(torch.zeros(4))], "param_fqns": ["norm.weight"]}])
    with pytest.raises(ValueError, match=r"'qkv': 10 rows on this TP rank is not 1 group\(s\) of the split total 8"):
        MatrixLayout("qkv", (10, 4), 0, 2, 1, (4, 2, 2))
