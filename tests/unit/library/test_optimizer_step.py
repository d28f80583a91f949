"""get_megatron_optimizer for adam/sgd against torch's own optimizers, on one process.

Tolerances: fp32 results must be bit-identical to torch.optim (same update code, same
inputs). Clipping compares with torch.nn.utils.clip_grad_norm_, whose norm is accumulated in
a different order, so to 1e-6 relative. bf16 runs feed gradients that bf16 represents exactly,
so the fp32 main parameters must equal an fp32 torch run exactly and the model parameters
must equal them rounded to bf16.
"""

import io
import math

import pytest
import torch

from megatron_eopt import (
    ChainedOptimizer,
    OptimizerConfig,
    get_megatron_optimizer,
    list_optimizers,
)


class TinyNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 5)
        self.norm = torch.nn.LayerNorm(5)
        self.fc2 = torch.nn.Linear(5, 3)


def make_model(dtype: torch.dtype = torch.float32, seed: int = 0) -> TinyNet:
    torch.manual_seed(seed)
    return TinyNet().to(dtype)


def gradient_sequence(model: torch.nn.Module, steps: int, scale: float = 1.0) -> list[list[torch.Tensor]]:
    """Fixed gradients per step, rounded to bf16 so bf16 and fp32 runs see the same values."""
    generator = torch.Generator().manual_seed(42)
    return [
        [
            (torch.randn(p.shape, generator=generator) * scale).to(torch.bfloat16).float()
            for p in model.parameters()
        ]
        for _ in range(steps)
    ]


def set_grads(model: torch.nn.Module, grads: list[torch.Tensor], attribute: str = "grad") -> None:
    for param, grad in zip(model.parameters(), grads):
        setattr(param, attribute, grad.clone().to(param.dtype if attribute == "grad" else torch.float32))


def step_alike(optimizer, torch_optimizer, ours: torch.nn.Module, reference: torch.nn.Module,
               sequence: list[list[torch.Tensor]], attribute: str = "grad") -> list[bool]:
    """Each step: the same gradients on both models (ours in `attribute`), then both optimizers
    step. Returns whether each of our steps succeeded."""
    succeeded = []
    for grads in sequence:
        set_grads(ours, grads, attribute=attribute)
        set_grads(reference, grads)
        succeeded.append(optimizer.step()[0])
        torch_optimizer.step()
    return succeeded


def no_decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """The standard overrides written out by hand: no decay for 1-D parameters and biases."""
    decay = [p for n, p in model.named_parameters() if p.dim() > 1 and not n.endswith(".bias")]
    no_decay = [p for n, p in model.named_parameters() if p.dim() == 1 or n.endswith(".bias")]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def params_of(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def assert_all_equal(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=0, atol=0)


ADAM = dict(lr=0.01, weight_decay=0.1, adam_beta1=0.8, adam_beta2=0.99, adam_eps=1e-6, clip_grad=0.0)


@pytest.mark.parametrize("decoupled", [True, False])
def test_adam_equals_torch_exactly(decoupled: bool) -> None:
    ours, reference = make_model(), make_model()
    optimizer = get_megatron_optimizer(
        OptimizerConfig(**ADAM, decoupled_weight_decay=decoupled), ours, config_overrides={}
    )
    torch_class = torch.optim.AdamW if decoupled else torch.optim.Adam
    torch_optimizer = torch_class(reference.parameters(), lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
    assert all(ok is True for ok in step_alike(optimizer, torch_optimizer, ours, reference,
                                               gradient_sequence(ours, steps=4)))
    assert_all_equal(params_of(ours), params_of(reference))


def test_standard_overrides_equal_torch_with_no_decay_group() -> None:
    ours, reference = make_model(), make_model()
    optimizer = get_megatron_optimizer(OptimizerConfig(**ADAM), ours)  # None = standard
    torch_optimizer = torch.optim.AdamW(
        no_decay_groups(reference, 0.1), lr=0.01, betas=(0.8, 0.99), eps=1e-6
    )
    step_alike(optimizer, torch_optimizer, ours, reference, gradient_sequence(ours, steps=3))
    assert_all_equal(params_of(ours), params_of(reference))


def test_sgd_equals_torch_exactly() -> None:
    ours, reference = make_model(), make_model()
    config = OptimizerConfig(optimizer="sgd", lr=0.05, sgd_momentum=0.7, weight_decay=0.01, clip_grad=0.0)
    optimizer = get_megatron_optimizer(config, ours, config_overrides={})
    torch_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.7, weight_decay=0.01)
    step_alike(optimizer, torch_optimizer, ours, reference, gradient_sequence(ours, steps=4))
    assert_all_equal(params_of(ours), params_of(reference))


def test_clipping_matches_clip_grad_norm() -> None:
    ours, reference = make_model(), make_model()
    optimizer = get_megatron_optimizer(OptimizerConfig(**{**ADAM, "clip_grad": 0.5}), ours, config_overrides={})
    torch_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
    for grads in gradient_sequence(ours, steps=3, scale=3.0):
        set_grads(ours, grads)
        set_grads(reference, grads)
        ok, grad_norm, zeros = optimizer.step()
        expected_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.5)
        torch_optimizer.step()
        assert ok and zeros is None
        assert grad_norm == pytest.approx(expected_norm.item(), rel=1e-6)
        assert grad_norm > 0.5  # clipping was active
    for a, e in zip(params_of(ours), params_of(reference)):
        torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-7)


def test_reads_megatron_main_grad() -> None:
    """megatron-core's DDP leaves gradients in param.main_grad (fp32), not param.grad."""
    ours, reference = make_model(), make_model()
    optimizer = get_megatron_optimizer(OptimizerConfig(**ADAM), ours, config_overrides={})
    torch_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
    step_alike(optimizer, torch_optimizer, ours, reference, gradient_sequence(ours, steps=2), attribute="main_grad")
    assert_all_equal(params_of(ours), params_of(reference))


def test_bf16_model_reads_megatron_main_grad() -> None:
    """A bf16 model under megatron-core's DDP: fp32 main_grad on bf16 parameters (torch refuses
    an fp32 .grad on them); the fp32 main copies step as torch's AdamW on fp32 parameters."""
    ours = make_model(torch.bfloat16)
    reference = make_model()
    reference.load_state_dict({k: v.float() for k, v in ours.state_dict().items()})
    optimizer = get_megatron_optimizer(OptimizerConfig(**ADAM, bf16=True), ours, config_overrides={})
    torch_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
    assert all(step_alike(optimizer, torch_optimizer, ours, reference, gradient_sequence(ours, steps=2),
                          attribute="main_grad"))
    assert_all_equal([m.detach() for m in optimizer.chained_optimizers[0].main_params], params_of(reference))


def snapshot(optimizer: ChainedOptimizer, model: torch.nn.Module) -> list[torch.Tensor]:
    state = [t.clone() for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    return params_of(model) + state


@pytest.mark.parametrize("bad_value", [float("inf"), float("nan")])
@pytest.mark.parametrize("bf16", [False, True])
def test_found_inf_changes_nothing(bad_value: float, bf16: bool) -> None:
    model = make_model(torch.bfloat16 if bf16 else torch.float32)
    optimizer = get_megatron_optimizer(OptimizerConfig(**ADAM, bf16=bf16), model)
    sequence = gradient_sequence(model, steps=3)
    for grads in sequence[:2]:
        set_grads(model, grads)
        optimizer.step()
    before = snapshot(optimizer, model)
    assert len(before) > len(list(model.parameters()))  # Adam state exists and is compared
    poisoned = [g.clone() for g in sequence[2]]
    poisoned[1].view(-1)[0] = bad_value
    set_grads(model, poisoned)
    assert optimizer.step() == (False, None, None)
    assert_all_equal(snapshot(optimizer, model), before)


def test_grad_norm_skip_threshold() -> None:
    model = make_model()
    optimizer = get_megatron_optimizer(OptimizerConfig(**{**ADAM, "grad_norm_skip_threshold": 1.0}), model)
    before = params_of(model)
    set_grads(model, gradient_sequence(model, steps=1, scale=10.0)[0])
    ok, grad_norm, _ = optimizer.step()
    expected = math.sqrt(sum(p.grad.double().square().sum().item() for p in model.parameters()))
    assert ok is False
    assert grad_norm == pytest.approx(expected, rel=1e-6)
    assert_all_equal(params_of(model), before)


def test_counts_zeros_in_grad() -> None:
    model = make_model()
    optimizer = get_megatron_optimizer(OptimizerConfig(**{**ADAM, "log_num_zeros_in_grad": True}), model)
    grads = gradient_sequence(model, steps=1)[0]
    grads[0][0, :4] = 0.0
    grads[3][:2] = 0.0
    set_grads(model, grads)
    expected = sum(int((g == 0).sum()) for g in grads)
    assert optimizer.step()[2] == expected == 6


def test_bf16_main_params_equal_fp32_run() -> None:
    """bf16 model + fp32 main params: main params follow an fp32 AdamW run exactly."""
    model, reference = make_model(torch.bfloat16), make_model()
    with torch.no_grad():  # start from the same (bf16-representable) values
        for p, r in zip(model.parameters(), reference.parameters()):
            r.copy_(p.float())
    optimizer = get_megatron_optimizer(OptimizerConfig(**ADAM, bf16=True), model, config_overrides={})
    torch_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
    step_alike(optimizer, torch_optimizer, model, reference, gradient_sequence(model, steps=4))
    child = optimizer.chained_optimizers[0]
    assert_all_equal([m.detach() for m in child.main_params], params_of(reference))
    assert_all_equal(params_of(model), [r.to(torch.bfloat16) for r in params_of(reference)])
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_fp16_dynamic_loss_scale() -> None:
    model = make_model(torch.float16)
    config = OptimizerConfig(**ADAM, fp16=True, initial_loss_scale=2.0**10, hysteresis=1, loss_scale_window=2)
    optimizer = get_megatron_optimizer(config, model, config_overrides={})
    reference = make_model()
    with torch.no_grad():
        for p, r in zip(model.parameters(), reference.parameters()):
            r.copy_(p.float())
    torch_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
    assert optimizer.get_loss_scale().shape == (1,)
    assert optimizer.get_loss_scale().item() == 2.0**10
    grads = gradient_sequence(model, steps=2, scale=0.25)
    for step, step_grads in enumerate(grads):
        scale = optimizer.get_loss_scale().item()
        set_grads(model, [g * scale for g in step_grads])  # what backward of a scaled loss gives
        set_grads(reference, step_grads)
        assert optimizer.step()[0] is True
        torch_optimizer.step()
    assert optimizer.get_loss_scale().item() == 2.0**11  # grew after loss_scale_window=2 clean steps
    child = optimizer.chained_optimizers[0]
    for main, ref in zip(child.main_params, reference.parameters()):
        torch.testing.assert_close(main.detach(), ref.detach(), rtol=1e-3, atol=1e-5)  # fp16 grads
    poisoned = [g * 2.0**11 for g in grads[0]]
    poisoned[0].view(-1)[0] = float("inf")
    set_grads(model, poisoned)
    assert optimizer.step() == (False, None, None)
    assert optimizer.get_loss_scale().item() == 2.0**10  # backed off (hysteresis=1)


def test_scale_loss_and_zero_grad() -> None:
    model = make_model()
    optimizer = get_megatron_optimizer(OptimizerConfig(**ADAM), model)
    loss = torch.tensor(3.0)
    assert optimizer.scale_loss(loss).item() == 3.0
    set_grads(model, gradient_sequence(model, steps=1)[0])
    optimizer.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    set_grads(model, gradient_sequence(model, steps=1)[0])
    optimizer.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_param_groups_settable_and_shared_with_children() -> None:
    model = make_model()
    optimizer = get_megatron_optimizer(OptimizerConfig(**ADAM), model)
    groups = optimizer.param_groups
    assert len(groups) == 2 and isinstance(optimizer, ChainedOptimizer)
    groups[0]["lr"] = 0.5
    assert optimizer.chained_optimizers[0].optimizer.param_groups[0]["lr"] == 0.5
    optimizer.param_groups = [dict(g) for g in groups]
    with pytest.raises(ValueError, match="must keep its 2 groups"):
        optimizer.param_groups = groups[:1]


def test_unknown_optimizer_lists_valid_names() -> None:
    with pytest.raises(ValueError, match=r"unknown optimizer 'adamw'; valid names: .*adam.*sgd"):
        get_megatron_optimizer(OptimizerConfig(optimizer="adamw", lr=0.1), make_model())
    assert {"adam", "sgd"} <= set(list_optimizers())


def test_bf16_params_need_bf16_config() -> None:
    with pytest.raises(TypeError, match="bf16/fp16"):
        get_megatron_optimizer(OptimizerConfig(lr=0.1), make_model(torch.bfloat16))


def test_accepts_megatron_core_config() -> None:
    from megatron.core.optimizer import OptimizerConfig as CoreConfig

    ours, reference = make_model(), make_model()
    core_config = CoreConfig(optimizer="sgd", lr=0.05, sgd_momentum=0.5, weight_decay=0.0, clip_grad=0.0)
    optimizer = get_megatron_optimizer(core_config, ours)
    torch_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.5)
    step_alike(optimizer, torch_optimizer, ours, reference, gradient_sequence(ours, steps=2))
    assert_all_equal(params_of(ours), params_of(reference))


def run_steps(model, optimizer, sequence) -> None:
    for grads in sequence:
        set_grads(model, grads)
        optimizer.step()


@pytest.mark.parametrize("bf16", [False, True])
def test_state_dict_resume_is_exact(bf16: bool) -> None:
    dtype = torch.bfloat16 if bf16 else torch.float32
    config = OptimizerConfig(**ADAM, bf16=bf16)
    straight = make_model(dtype)
    straight_optimizer = get_megatron_optimizer(config, straight)
    sequence = gradient_sequence(straight, steps=6)
    run_steps(straight, straight_optimizer, sequence)

    first = make_model(dtype)
    first_optimizer = get_megatron_optimizer(config, first)
    run_steps(first, first_optimizer, sequence[:3])
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "optimizer": first_optimizer.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=False)

    resumed = make_model(dtype, seed=123)  # different init: everything must come from the checkpoint
    resumed.load_state_dict(checkpoint["model"])
    resumed_optimizer = get_megatron_optimizer(config, resumed)
    resumed_optimizer.reload_model_params()
    resumed_optimizer.load_state_dict(checkpoint["optimizer"])
    run_steps(resumed, resumed_optimizer, sequence[3:])
    assert_all_equal(params_of(resumed), params_of(straight))
    assert_all_equal(snapshot(resumed_optimizer, resumed), snapshot(straight_optimizer, straight))


def test_load_refuses_other_optimizer_and_other_groups() -> None:
    adam_model = make_model()
    adam = get_megatron_optimizer(OptimizerConfig(**ADAM), adam_model)
    sgd = get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=0.1), make_model())
    run_steps(adam_model, adam, gradient_sequence(adam_model, steps=1))
    adam_state = adam.state_dict()
    with pytest.raises(ValueError, match="saved by 'AdamW' but this optimizer is 'SGD'"):
        sgd.load_state_dict(adam_state)
    no_overrides = get_megatron_optimizer(OptimizerConfig(**ADAM), make_model(), config_overrides={})
    with pytest.raises(ValueError, match="saved from another model, optimizer or parameter routing"):
        no_overrides.load_state_dict(adam_state)
    with pytest.raises(ValueError, match="not a ChainedOptimizer state dict"):
        adam.load_state_dict({"state": {}})
    before = snapshot(no_overrides, make_model())
    assert before  # the refused loads above left the optimizer usable


def test_distributed_optimizer_is_the_layer_wise_one() -> None:
    from megatron_eopt import LayerWiseDistributedOptimizer

    optimizer = get_megatron_optimizer(OptimizerConfig(lr=0.1, use_distributed_optimizer=True), make_model())
    assert isinstance(optimizer, LayerWiseDistributedOptimizer)


def test_chained_state_finds_every_childs_state_without_creating_entries() -> None:
    model = torch.nn.ModuleDict({"proj": torch.nn.Linear(8, 8)})
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="muon", lr=0.01), model)
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    optimizer.step()
    bias_state = optimizer.state[model["proj"].bias]  # an Adam (scalar) child's parameter
    assert set(bias_state) >= {"exp_avg", "exp_avg_sq"}
    assert set(optimizer.state[model["proj"].weight]) == {"momentum_buffer"}
    assert optimizer.state[torch.nn.Parameter(torch.zeros(1))] == {}  # torch's defaultdict gives {}
    assert len(optimizer.state) == 2
    optimizer.state_dict()  # still consistent after the lookups
