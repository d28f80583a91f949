"""The optimizer as torch's optimizers are held (docs/engines.md): what torch's lr schedulers, the
engines' offload walks and `torch.save` read of it.

References are torch's own: each scheduler drives a torch SGD over stand-in parameters with the same
initial group lrs, and every inner group of ours must see that lr sequence; a resumed run must
continue bitwise like the run that was never saved.
"""

import io

import pytest
import torch

from megatron_eopt import OptimizerConfig, get_megatron_optimizer

STEPS = 4


def _model(dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.ModuleDict({"embed": torch.nn.Embedding(16, 8), "hidden": torch.nn.Linear(8, 8),
                                 "norm": torch.nn.LayerNorm(8), "head": torch.nn.Linear(8, 16)})
    return model.to(dtype)


def _loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    tokens = torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(step))
    hidden = model["norm"](torch.tanh(model["hidden"](model["embed"](tokens))))
    return model["head"](hidden).float().logsumexp(-1).mean()


def _optimizer(model: torch.nn.Module, **overrides):
    config = dict(optimizer="muon", lr=1e-2, weight_decay=0.1, muon_fp32_matmul_prec="highest", clip_grad=1.0)
    return get_megatron_optimizer(OptimizerConfig(**{**config, **overrides}), [model])


def test_is_a_torch_optimizer_whose_groups_hold_the_models_parameters() -> None:
    model = _model(torch.bfloat16)
    optimizer = _optimizer(model, bf16=True)
    assert isinstance(optimizer, torch.optim.Optimizer)
    assert {"lr", "momentum", "betas", "weight_decay"} <= set(optimizer.defaults)
    model_params = {id(p) for p in model.parameters()}
    shown = [p for group in optimizer.param_groups for p in group["params"]]
    assert sorted(map(id, shown)) == sorted(model_params)  # bf16 parameters, not the fp32 main copies
    inner = [g for child in optimizer.chained_optimizers for g in child.param_groups]
    assert all(p.dtype == torch.float32 for g in inner for p in g["params"])
    for index, group in enumerate(optimizer.param_groups):  # a value set on a group reaches the inner one
        group["lr"] = 0.5 + index
        group.setdefault("initial_lr", 7.0)
    assert [g["lr"] for g in inner] == [0.5 + i for i in range(len(inner))]
    assert {g["initial_lr"] for g in inner} == {7.0}
    with pytest.raises(TypeError, match="add_param_group is not supported"):
        optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    with pytest.raises(TypeError, match="'params' are fixed"):
        optimizer.param_groups[0]["params"] = []
    optimizer.param_groups = [dict(group) for group in optimizer.param_groups]  # copies of the views set back
    assert all(p.dtype == torch.float32 for child in optimizer.chained_optimizers
               for g in child.param_groups for p in g["params"])


SCHEDULERS = {
    "LambdaLR": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step),
    "CosineAnnealingLR": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS, eta_min=1e-4),
    "OneCycleLR": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=STEPS + 1,
                                                                  cycle_momentum=False),
    "SequentialLR": lambda opt: torch.optim.lr_scheduler.SequentialLR(
        opt, [torch.optim.lr_scheduler.LinearLR(opt, 0.1, total_iters=2),
              torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.7)], milestones=[2]),
    "transformers cosine": lambda opt: __import__("transformers").get_scheduler(
        "cosine", opt, num_warmup_steps=1, num_training_steps=STEPS),
}


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_torch_schedulers_drive_every_group_as_they_drive_torchs_optimizers(name: str) -> None:
    model = _model()
    optimizer = _optimizer(model)
    initial = [group["lr"] for group in optimizer.param_groups]
    reference = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in initial])
    schedulers = [SCHEDULERS[name](optimizer), SCHEDULERS[name](reference)]
    seen, expected = [], []
    for step in range(STEPS):
        _loss(model, step).backward()
        assert optimizer.step()[0]
        reference.step()
        optimizer.zero_grad()
        for scheduler in schedulers:
            scheduler.step()
        seen.append([g["lr"] for child in optimizer.chained_optimizers for g in child.param_groups])
        expected.append([g["lr"] for g in reference.param_groups])
    assert seen == expected
    assert len({tuple(lrs) for lrs in seen}) > 1  # the schedule moved the lr


def test_state_is_live_by_model_parameter_as_offload_walks_read_it() -> None:
    """verl's offload_fsdp_optimizer: for every p in param_groups, every tensor of state[p] to the host
    and back, by assignment into state[p]."""
    model = _model()
    optimizer = _optimizer(model)
    head = model["head"].weight
    assert optimizer.state[head] == {} or set(optimizer.state[head]) == {"exp_avg", "exp_avg_sq", "step"}
    _loss(model, 0).backward()
    optimizer.step()
    assert set(optimizer.state[model["hidden"].weight]) == {"momentum_buffer"}  # Muon's momentum
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state[param]
            for key, value in state.items():
                if torch.is_tensor(value):
                    state[key] = value * 0 + 3.0  # stands in for .to("cpu"): a new tensor put back
    inner = [s for child in optimizer.chained_optimizers for s in child.state.values()]
    assert all(torch.equal(v, torch.full_like(v, 3.0)) for s in inner for v in s.values() if torch.is_tensor(v))
    assert optimizer.state[torch.nn.Parameter(torch.zeros(1))] == {}


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_torch_save_round_trip_continues_bitwise(precision: str) -> None:
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    flags = {"bf16": {"bf16": True}, "fp16": {"fp16": True, "optimizer": "adam"}}.get(precision, {})

    def run(model, optimizer, steps):
        for step in steps:
            optimizer.scale_loss(_loss(model, step)).backward()
            optimizer.step()
            optimizer.zero_grad()

    model = _model(dtype)
    optimizer = _optimizer(model, **flags)
    run(model, optimizer, range(2))
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    run(model, optimizer, range(2, STEPS))
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = _model(dtype, seed=1)
    resumed_optimizer = _optimizer(resumed, **flags)
    resumed.load_state_dict(saved["model"])
    resumed_optimizer.load_state_dict(saved["optimizer"])
    run(resumed, resumed_optimizer, range(2, STEPS))
    for (name, value), other in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(value, other), name
    assert torch.equal(optimizer.get_loss_scale(), resumed_optimizer.get_loss_scale())
    with pytest.raises(ValueError, match="restores no"):  # a state that is not there is refused
        partial = dict(saved["optimizer"], state={})
        _optimizer(_model(dtype), **flags).load_state_dict(partial)


def test_hooks_closure_and_zero_grad_behave_as_torchs() -> None:
    model = _model()
    optimizer = _optimizer(model)
    calls = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: calls.append("pre"))
    optimizer.register_step_post_hook(lambda opt, args, kwargs: calls.append("post"))
    optimizer.register_state_dict_pre_hook(lambda opt: calls.append("sd pre"))
    optimizer.register_state_dict_post_hook(lambda opt, sd: {**sd, "extra": 1})
    optimizer.register_load_state_dict_pre_hook(lambda opt, sd: {k: v for k, v in sd.items() if k != "extra"})
    optimizer.register_load_state_dict_post_hook(lambda opt: calls.append("load post"))

    def closure():
        calls.append("closure")
        loss = _loss(model, 0)
        loss.backward()
        return loss

    result = optimizer.step(closure)
    assert result[0] and calls == ["pre", "closure", "post"]
    state_dict = optimizer.state_dict()
    assert state_dict["extra"] == 1
    optimizer.load_state_dict(state_dict)
    assert calls[-2:] == ["sd pre", "load post"]
    _loss(model, 1).backward()
    optimizer.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    optimizer.zero_grad()
    assert all(p.grad is None for p in model.parameters())
