"""Batched Newton-Schulz (one 3-D call per shape) against the per-matrix 2-D path (CPU, fp32).

Tolerance: 1e-5 absolute on orthogonalized entries of magnitude <= ~1. The batched and 2-D
kernels may sum in another order (other CPUs, other BLAS code paths), and five quintic iterations,
coefficients up to 4.8, amplify each product's fp32 round-off: measured up to 1.0e-6 under
`make test-numerics`' settings (bitwise equal under the default build here), so 1e-5 leaves 10x.
"""

import math

import pytest
import torch
from emerging_optimizers.orthogonalized_optimizers import muon_utils

from megatron_eopt.ops.newton_schulz import NewtonSchulzSettings, orthogonalize_batched
from megatron_eopt.ops.splits import MatrixLayout
from megatron_eopt.optimizers.muon.tensor_parallel_muon import TensorParallelMuon

# Square, wide and tall, each shape several times, interleaved so a group's members are not adjacent.
SHAPES = [(16, 16), (8, 24), (24, 8), (16, 16), (8, 24), (24, 8), (16, 16), (5, 7)]


def matrices(seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


def test_batched_equals_per_matrix_with_scales() -> None:
    xs = matrices()
    scales = [1.0 + i for i in range(len(xs))]
    results = orthogonalize_batched(xs, scales, NewtonSchulzSettings())
    for x, scale, result in zip(xs, scales, results):
        expected = muon_utils.newton_schulz(x, steps=5, coefficient_type="quintic")
        torch.testing.assert_close(result / scale, expected, rtol=0, atol=1e-5)


def test_result_does_not_depend_on_batch_companions() -> None:
    """Other companions of the same count: bitwise (a batched product never mixes its items). Alone:
    within the tolerance above, since a BLAS may split a lone product's inner dimension over its
    threads (MKL_CBWR=COMPATIBLE with 2 threads does, for wide 8 x 24 matrices)."""
    xs, others = matrices(), matrices(seed=1)
    together = orthogonalize_batched(xs, [1.0] * len(xs), NewtonSchulzSettings())
    swapped = orthogonalize_batched(xs[:1] + others[1:], [1.0] * len(xs), NewtonSchulzSettings())
    assert torch.equal(swapped[0], together[0])
    for x, result in zip(xs, together):
        alone = orthogonalize_batched([x], [1.0], NewtonSchulzSettings())[0]
        torch.testing.assert_close(alone, result, rtol=0, atol=1e-5)


def test_one_batched_call_per_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    original = muon_utils.newton_schulz

    def spy(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        calls.append(tuple(x.shape))
        return original(x, *args, **kwargs)

    monkeypatch.setattr(muon_utils, "newton_schulz", spy)
    orthogonalize_batched(matrices(), [1.0] * len(SHAPES), NewtonSchulzSettings())
    assert sorted(calls) == sorted([(3, 16, 16), (2, 8, 24), (2, 24, 8), (1, 5, 7)])


def test_tensor_parallel_muon_step_equals_per_block_reference() -> None:
    """Two GPT-like layers at TP=1: QKV (q/k/v blocks) and gated fc1 (gate/up) batched with the plain weights."""
    groups, q_rows, kv, hidden, ffn = 2, 8, 4, 8, 12
    shapes = {"qkv": (groups * (q_rows + 2 * kv), hidden), "proj": (hidden, hidden), "fc1": (2 * ffn, hidden),
              "fc2": (hidden, ffn)}
    names = [f"{layer}.{n}" for layer in range(2) for n in shapes]
    generator = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(shapes[n.split(".")[1]], generator=generator)) for n in names]
    grads = [torch.randn(p.shape, generator=generator) for p in params]
    layouts = {n: MatrixLayout(n, shapes["qkv"], -1, 1, groups, (q_rows, kv, kv)) for n in names if "qkv" in n}
    layouts.update({n: MatrixLayout(n, shapes["fc1"], -1, 1, 1, (ffn, ffn)) for n in names if "fc1" in n})
    optimizer = TensorParallelMuon([{"params": params, "param_fqns": names}], lr=1.0, momentum=0.0, weight_decay=0.0,
                                   fp32_matmul_prec="highest", layouts=layouts)
    before = [p.detach().clone() for p in params]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    optimizer.step()
    for name, p, b, g in zip(names, params, before, grads):
        expected = reference_update(name, g, groups, q_rows, kv, ffn)
        torch.testing.assert_close(b - p.detach(), expected, rtol=0, atol=1e-6)


def reference_update(name: str, grad: torch.Tensor, groups: int, q_rows: int, kv: int, ffn: int) -> torch.Tensor:
    """Each block orthogonalized alone (2-D) by explicit row indexing, scaled by sqrt(max(m, n))."""
    if "qkv" in name:
        per_group = q_rows + 2 * kv
        spans = [(0, q_rows), (q_rows, q_rows + kv), (q_rows + kv, per_group)]
        blocks = [[g * per_group + r for g in range(groups) for r in range(a, b)] for a, b in spans]
    elif "fc1" in name:
        blocks = [list(range(ffn)), list(range(ffn, 2 * ffn))]
    else:
        blocks = [list(range(grad.shape[0]))]
    update = torch.zeros_like(grad)
    for rows in blocks:
        update[rows] = muon_utils.newton_schulz(grad[rows], steps=5) * math.sqrt(max(len(rows), grad.shape[1]))
    return update
