"""Multi-rank behaviour of the step (gloo, CPU): TP-invariant norm and clipping, global inf
skipping, expert-parallel norms, and clear errors for missing process groups.

Every rank builds the same full tensors from a seed, keeps its shard, and compares against a
single-process full-matrix reference run on torch.optim.AdamW with clip_grad_norm_. The
norm is summed in another order than torch's, so results agree to 1e-6 relative (fp32).
"""

import pytest
import torch
import torch.distributed as dist

from megatron_eopt import OptimizerConfig, ParallelGroups, get_megatron_optimizer

CONFIG = dict(lr=0.01, weight_decay=0.1, adam_beta1=0.8, adam_beta2=0.99, adam_eps=1e-6, clip_grad=0.5)
SHAPES = {"column.weight": (8, 4), "row.weight": (4, 8), "norm.weight": (4,)}
TP_LAYOUT = {"column.weight": 0, "row.weight": 1, "norm.weight": None}  # partition_dim, None = replicated


def full_tensors(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}


def shard(tensor: torch.Tensor, partition_dim, rank: int, world_size: int) -> torch.Tensor:
    if partition_dim is None:
        return tensor.clone()
    return tensor.chunk(world_size, dim=partition_dim)[rank].clone()


class ParamHolder(torch.nn.Module):
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, tensor in tensors.items():
            module_name, attribute = name.split(".")
            if not hasattr(self, module_name):
                self.add_module(module_name, torch.nn.Module())
            getattr(self, module_name).register_parameter(attribute, torch.nn.Parameter(tensor))


def tp_model(rank: int, world_size: int) -> ParamHolder:
    model = ParamHolder(
        {n: shard(t, TP_LAYOUT[n], rank, world_size) for n, t in full_tensors(seed=0).items()}
    )
    for name, param in model.named_parameters():
        if TP_LAYOUT[name] is not None:
            param.tensor_model_parallel = True
            param.partition_dim = TP_LAYOUT[name]
    return model


def reference_run(steps: int) -> tuple[ParamHolder, list[float]]:
    model = ParamHolder(full_tensors(seed=0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
    norms = []
    for step in range(steps):
        for name, param in model.named_parameters():
            param.grad = full_tensors(seed=100 + step)[name] * 2.0
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item())
        optimizer.step()
    return model, norms


def _tp_step_body(rank: int, world_size: int, steps: int) -> dict:
    world = dist.group.WORLD
    model = tp_model(rank, world_size)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(**CONFIG),
        model,
        config_overrides={},
        pg_collection=ParallelGroups.from_groups(tp=world, mp=world),
    )
    norms = []
    for step in range(steps):
        grads = full_tensors(seed=100 + step)
        for name, param in model.named_parameters():
            param.grad = shard(grads[name] * 2.0, TP_LAYOUT[name], rank, world_size)
        ok, grad_norm, _ = optimizer.step()
        assert ok
        norms.append(grad_norm)
    reference, reference_norms = reference_run(steps)
    errors = {}
    for name, param in model.named_parameters():
        expected = shard(dict(reference.named_parameters())[name].detach(), TP_LAYOUT[name], rank, world_size)
        errors[name] = (param.detach() - expected).abs().max().item()
    return {"norms": norms, "reference_norms": reference_norms, "errors": errors}


@pytest.mark.parametrize("world_size", [2, 4])
def test_tensor_parallel_step_equals_full_matrix_reference(run_distributed, world_size: int) -> None:
    results = run_distributed(_tp_step_body, world_size=world_size, args=(3,))
    for result in results:
        assert result["norms"] == pytest.approx(result["reference_norms"], rel=1e-6)
        assert max(result["norms"]) > 0.5  # clipping was active in every step
        for name, error in result["errors"].items():
            assert error < 1e-6, (name, error)


def _nan_on_one_rank_body(rank: int, world_size: int, poisoned: str) -> dict:
    world = dist.group.WORLD
    model = tp_model(rank, world_size)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(**CONFIG), model, pg_collection=ParallelGroups.from_groups(tp=world, mp=world)
    )
    for name, param in model.named_parameters():
        param.grad = torch.ones_like(param)
    optimizer.step()  # create Adam state
    before = [p.detach().clone() for p in model.parameters()]
    state_before = [t.clone() for s in optimizer.state.values() for t in s.values()]
    for name, param in model.named_parameters():
        param.grad = torch.ones_like(param)
    if rank == world_size - 1:  # for 'norm.weight' a TP duplicate, left out of this rank's norm
        dict(model.named_parameters())[poisoned].grad.view(-1)[0] = float("nan")
    result = optimizer.step()
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and all(
        torch.equal(a, b) for a, b in zip(state_before, (t for s in optimizer.state.values() for t in s.values()))
    )
    return {"result": result, "unchanged": unchanged, "state_tensors": len(state_before)}


@pytest.mark.parametrize("poisoned", ["column.weight", "norm.weight"])
def test_nan_on_one_rank_skips_every_rank(run_distributed, poisoned: str) -> None:
    for result in run_distributed(_nan_on_one_rank_body, world_size=2, args=(poisoned,)):
        assert result["result"] == (False, None, None)
        assert result["unchanged"] and result["state_tensors"] > 0


def _expert_norm_body(rank: int, world_size: int) -> dict:
    """DP=2 for dense parameters (replicated), EP=2 for experts (each rank its own expert)."""
    torch.manual_seed(0)
    dense = torch.nn.Linear(4, 4, bias=False)  # same on both ranks
    torch.manual_seed(10 + rank)
    expert = torch.nn.Linear(4, 4, bias=False)  # this rank's expert
    expert.weight.allreduce = False
    model = torch.nn.ModuleDict({"dense": dense, "expert": expert})
    optimizer = get_megatron_optimizer(
        OptimizerConfig(**{**CONFIG, "clip_grad": 0.0}),
        model,
        pg_collection=ParallelGroups.from_groups(
            tp=None, mp=None, expt_tp=None, expt_mp=dist.group.WORLD, dp_cp=dist.group.WORLD
        ),
    )
    dense.weight.grad = torch.full((4, 4), 1.0)
    expert.weight.grad = torch.full((4, 4), float(rank + 2))
    _, grad_norm, _ = optimizer.step()
    return {"norm": grad_norm, "children": [c.name for c in optimizer.chained_optimizers]}


def test_expert_gradients_sum_over_expert_group(run_distributed) -> None:
    # dense counted once (replicated over DP); each rank's expert counted once.
    expected = (16 * 1.0 + 16 * 2.0**2 + 16 * 3.0**2) ** 0.5
    for result in run_distributed(_expert_norm_body, world_size=2):
        assert result["children"] == ["dense", "expert"]
        assert result["norm"] == pytest.approx(expected, rel=1e-6)


def _missing_groups_body(rank: int, world_size: int) -> list[str]:
    messages = []
    model = torch.nn.Linear(2, 2)
    for pg_collection in (None, object()):
        try:
            get_megatron_optimizer(OptimizerConfig(lr=0.1), model, pg_collection=pg_collection)
        except ValueError as error:
            messages.append(str(error))
    expert = torch.nn.Linear(2, 2)
    expert.weight.allreduce = False
    try:
        get_megatron_optimizer(
            OptimizerConfig(lr=0.1), expert, pg_collection=ParallelGroups.from_groups(tp=None, mp=None)
        )
    except ValueError as error:
        messages.append(str(error))
    return messages


def test_missing_process_groups_are_clear_errors(run_distributed) -> None:
    for messages in run_distributed(_missing_groups_body, world_size=2):
        assert len(messages) == 3
        assert "runs 2 ranks but no process groups were given" in messages[0]
        assert "pg_collection has no 'tp' or 'mp' process group" in messages[1]
        assert "needs the 'expt_tp' process group" in messages[2]
