"""The step waits for the device at most once, and duplicated TP gathers all blocks at once.

On a GPU every read of a device tensor by the host (`.item()`, `.cpu()`, `.tolist()`, a tensor in
an `if`, `float(tensor)`, `int(tensor)`) stalls the CPU until the device has caught up. On the
CPU those calls are free, so they are counted instead: the tensor methods are wrapped with
counters for one step (after a warm-up step that creates the state). torch's own optimizers keep
their `step` counters on the host by design (capturable=False), so reads of those tensors are
not device syncs and are exempt. The contract returns Python numbers, so one read-back is the
minimum; at most 2 are allowed per step. The GPU tier checks the same with
torch.cuda.set_sync_debug_mode("error") (tests/unit/library/test_gpu.py).
"""

import contextlib
from collections import Counter
from typing import Iterator

import pytest
import torch
import torch.distributed as dist

from megatron_eopt import OptimizerConfig, ParallelGroups, get_megatron_optimizer
from megatron_eopt.ops.newton_schulz import NewtonSchulzSettings, orthogonalize_batched, orthogonalize_updates
from megatron_eopt.ops.splits import MatrixLayout

MAX_SYNCS_PER_STEP = 2
READ_BACKS = ("item", "cpu", "tolist", "__bool__", "__float__", "__int__")


@contextlib.contextmanager
def counted_read_backs(exempt_ids: set[int]) -> Iterator[Counter]:
    """Count host read-backs of tensors (by method) while active; `exempt_ids` are host-resident tensors."""
    counts: Counter = Counter()
    originals = {name: getattr(torch.Tensor, name) for name in READ_BACKS}

    def wrap(name, original):
        def counted(self, *args, **kwargs):
            if id(self) not in exempt_ids:
                counts[name] += 1
            return original(self, *args, **kwargs)
        return counted

    try:
        for name, original in originals.items():
            setattr(torch.Tensor, name, wrap(name, original))
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def host_step_counters(optimizer) -> set[int]:
    """ids of torch optimizers' `step` tensors (kept on the host, also on GPUs)."""
    children = getattr(optimizer, "chained_optimizers", [optimizer])
    return {id(state["step"]) for child in children for state in child.optimizer.state.values()
            if torch.is_tensor(state.get("step")) and state["step"].device.type == "cpu"}


class TwoLayers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 8)


def set_grads(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=generator).to(p.dtype)
        p.grad.view(-1)[0] = 0.0  # something for the zero count


def syncs_in_one_step(optimizer, model: torch.nn.Module) -> tuple[Counter, tuple]:
    set_grads(model, seed=1)
    optimizer.step()  # creates the state
    set_grads(model, seed=2)
    with counted_read_backs(host_step_counters(optimizer)) as counts:
        result = optimizer.step()
    return counts, result


@pytest.mark.parametrize("optimizer_name", ["adam", "muon"])
@pytest.mark.parametrize("log_num_zeros", [False, True])
def test_one_step_reads_back_at_most_twice(optimizer_name: str, log_num_zeros: bool) -> None:
    torch.manual_seed(0)
    model = TwoLayers()
    config = OptimizerConfig(optimizer=optimizer_name, lr=1e-3, clip_grad=0.1, log_num_zeros_in_grad=log_num_zeros)
    optimizer = get_megatron_optimizer(config, model, config_overrides={})
    counts, (ok, grad_norm, zeros) = syncs_in_one_step(optimizer, model)
    assert ok and isinstance(grad_norm, float) and grad_norm > 0.1  # clipping was active
    assert zeros == (4 if log_num_zeros else None)  # one zero in each of the 4 gradients
    assert sum(counts.values()) <= MAX_SYNCS_PER_STEP, dict(counts)


def test_fp16_overflow_skip_reads_back_at_most_twice_and_changes_nothing() -> None:
    torch.manual_seed(0)
    model = TwoLayers().half()
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-3, fp16=True, hysteresis=1), model, config_overrides={})
    set_grads(model, seed=1)
    optimizer.step()
    params = [p.detach().clone() for p in model.parameters()]
    scale = optimizer.get_loss_scale().item()
    set_grads(model, seed=2)
    model.fc1.weight.grad.view(-1)[3] = float("inf")
    with counted_read_backs(host_step_counters(optimizer)) as counts:
        result = optimizer.step()
    assert result == (False, None, None)
    assert sum(counts.values()) <= MAX_SYNCS_PER_STEP, dict(counts)
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    assert optimizer.get_loss_scale().item() == scale * 0.5  # backed off on the device


def test_grad_norm_skip_threshold_reads_back_at_most_twice_and_changes_nothing() -> None:
    torch.manual_seed(0)
    model = TwoLayers()
    config = OptimizerConfig(optimizer="muon", lr=1e-3, clip_grad=0.0, grad_norm_skip_threshold=1e-3)
    optimizer = get_megatron_optimizer(config, model, config_overrides={})
    params = [p.detach().clone() for p in model.parameters()]
    set_grads(model, seed=2)
    with counted_read_backs(set()) as counts:
        ok, grad_norm, _ = optimizer.step()
    assert not ok and grad_norm > 1e-3
    assert sum(counts.values()) <= MAX_SYNCS_PER_STEP, dict(counts)
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))


def _tp2_duplicated_muon_body(rank: int, world_size: int) -> dict:
    world = dist.group.WORLD
    torch.manual_seed(0)
    model = TwoLayers()
    for name, param in model.named_parameters():  # column-parallel fc1, row-parallel fc2 (shards)
        dim = 0 if name.startswith("fc1") else (1 if name == "fc2.weight" else None)
        if dim is not None:
            param.data = param.data.chunk(world_size, dim=dim)[rank].clone()
            param.tensor_model_parallel, param.partition_dim = True, dim
    config = OptimizerConfig(optimizer="muon", lr=1e-3, clip_grad=0.1, muon_tp_mode="duplicated",
                             log_num_zeros_in_grad=True)
    optimizer = get_megatron_optimizer(config, model, config_overrides={},
                                       pg_collection=ParallelGroups.from_groups(tp=world, mp=world))
    gathers = Counter()
    original_all_gather = dist.all_gather

    def counted_all_gather(*args, **kwargs):
        gathers["all_gather"] += 1
        return original_all_gather(*args, **kwargs)

    dist.all_gather = counted_all_gather
    try:
        counts, result = syncs_in_one_step(optimizer, model)
    finally:
        dist.all_gather = original_all_gather
    return {"syncs": dict(counts), "ok": result[0], "all_gathers_in_two_steps": gathers["all_gather"]}


def test_tp2_duplicated_muon_step_reads_back_at_most_twice(run_distributed) -> None:
    for result in run_distributed(_tp2_duplicated_muon_body, world_size=2):
        assert result["ok"]
        # fc1.weight and fc2.weight are sharded: one bucketed all_gather per step, not one per block.
        assert result["all_gathers_in_two_steps"] == 2, result
        assert sum(result["syncs"].values()) <= MAX_SYNCS_PER_STEP, result["syncs"]


def _bucketed_gather_is_bitwise_body(rank: int, world_size: int) -> dict:
    """Duplicated-mode updates against per-block all_gathers done here, then the same batched math."""
    world = dist.group.WORLD
    generator = torch.Generator().manual_seed(7)
    full = {"a": torch.randn(12, 8, generator=generator), "b": torch.randn(12, 8, generator=generator),
            "c": torch.randn(6, 16, generator=generator), "r": torch.randn(5, 7, generator=generator)}
    dims = {"a": 0, "b": 0, "c": 1, "r": -1}
    local = {n: t if dims[n] < 0 else t.chunk(world_size, dim=dims[n])[rank].clone() for n, t in full.items()}
    layouts = [MatrixLayout(n, tuple(t.shape), dims[n], world_size if dims[n] >= 0 else 1) for n, t in local.items()]
    settings = NewtonSchulzSettings()
    updates = orthogonalize_updates(list(local.values()), layouts, "duplicated", world, settings)

    gathered = []
    for name, shard in local.items():
        if dims[name] < 0:
            gathered.append(shard)
            continue
        pieces = [torch.empty_like(shard) for _ in range(world_size)]
        dist.all_gather(pieces, shard.contiguous(), group=world)
        gathered.append(torch.cat(pieces, dim=dims[name]))
    scales = [settings.scale(*full[n].shape) for n in local]
    reference = orthogonalize_batched(gathered, scales, settings)
    reference = [r if dims[n] < 0 else r.chunk(world_size, dim=dims[n])[rank] for r, n in zip(reference, local)]
    return {"bitwise": [torch.equal(u, r) for u, r in zip(updates, reference)]}


def test_bucketed_duplicated_gather_is_bitwise_per_block_gather(run_distributed) -> None:
    for result in run_distributed(_bucketed_gather_is_bitwise_body, world_size=2):
        assert all(result["bitwise"]), result
