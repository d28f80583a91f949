"""exp_avg_dtype / exp_avg_sq_dtype: state stored in 16 bits, the update computed in fp32.

The reference is the same optimizer run with fp32 state whose moments this test itself rounds to
the stored dtype (Tensor.to: nearest, ties to even) after every step; parameters and state must
be bitwise equal to it (tolerance 0: the same fp32 update on the same values).
"""

import io

import pytest
import torch

from megatron_eopt import OptimizerConfig, get_megatron_optimizer
from megatron_eopt.wrappers.state_precision import state_precision_for

# This test's own list of what each field covers (docs/memory.md's table), not the module's.
FIRST = {"adam": "exp_avg", "muon": "momentum_buffer", "adaptive_muon": "momentum_buffer", "lion": "exp_avg",
         "soap": "exp_avg", "sgd": "momentum_buffer"}
SECOND = {"adam": "exp_avg_sq", "adaptive_muon": "moment2_buffer", "soap": "exp_avg_sq"}


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(12, 16)
        self.fc2 = torch.nn.Linear(16, 8)


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> Net:
    torch.manual_seed(seed)
    return Net().to(dtype)


def gradients(model: torch.nn.Module, steps: int) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    return [[torch.randn(p.shape, generator=generator) for p in model.parameters()] for _ in range(steps)]


def config(name: str, **precision) -> OptimizerConfig:
    return OptimizerConfig(optimizer=name, lr=0.02, clip_grad=0.0, emerging_optimizers_compile=False,
                           muon_fp32_matmul_prec="highest", **precision)


def child_states(optimizer) -> list[tuple[str, dict]]:
    """(optimizer name of the child, state) for every parameter, in a fixed order."""
    return [(child.name.split("/")[0], child.optimizer.state[main])
            for child in optimizer.chained_optimizers for main in child.main_params]


def round_reference_state(optimizer, name: str, first: torch.dtype, second: torch.dtype) -> None:
    for child_name, state in child_states(optimizer):
        owner = name if child_name in ("dense", name) else child_name
        for key, dtype in ((FIRST.get(owner), first), (SECOND.get(owner), second)):
            if key is not None:
                state[key] = state[key].to(dtype).float()


def step(model, optimizer, grads) -> None:
    for param, grad in zip(model.parameters(), grads):
        param.grad = grad.to(param.dtype)
    assert optimizer.step()[0]


CASES = [("adam", torch.bfloat16, torch.bfloat16), ("adam", torch.float16, torch.float32),
         ("adam", torch.float32, torch.bfloat16), ("muon", torch.bfloat16, torch.bfloat16),
         ("adaptive_muon", torch.bfloat16, torch.bfloat16), ("lion", torch.bfloat16, torch.float32),
         ("soap", torch.bfloat16, torch.bfloat16), ("sgd", torch.float16, torch.float32)]


@pytest.mark.parametrize("name,first,second", CASES)
def test_low_precision_state_equals_fp32_state_rounded_each_step(name, first, second) -> None:
    ours, reference = make_model(), make_model()
    optimizer = get_megatron_optimizer(config(name, use_precision_aware_optimizer=True, exp_avg_dtype=first,
                                              exp_avg_sq_dtype=second), ours)
    reference_optimizer = get_megatron_optimizer(config(name), reference)
    for grads in gradients(ours, steps=5):
        step(ours, optimizer, grads)
        step(reference, reference_optimizer, grads)
        round_reference_state(reference_optimizer, name, first, second)
        for a, b in zip(ours.parameters(), reference.parameters()):
            assert torch.equal(a, b)
        for (owner, state), (_, expected) in zip(child_states(optimizer), child_states(reference_optimizer)):
            owner = name if owner == "dense" else owner
            stored = {FIRST.get(owner): first, SECOND.get(owner): second}
            for key, value in state.items():
                if not torch.is_tensor(value) or value.dim() == 0:
                    continue
                assert value.dtype == stored.get(key, torch.float32), (owner, key)  # the live tensor's dtype
                assert torch.equal(value.float(), expected[key].float()), (owner, key)


def test_bf16_model_with_bf16_state_and_checkpoint_cross_loads() -> None:
    """fp32-state checkpoints load into a bf16-state run and the reverse; saved state keeps its dtype."""
    bf16_state = dict(use_precision_aware_optimizer=True, exp_avg_dtype=torch.bfloat16,
                      exp_avg_sq_dtype=torch.bfloat16, store_param_remainders=False)
    grads = gradients(make_model(), steps=4)
    for save_precision, load_precision in ((bf16_state, {}), ({}, bf16_state)):
        model = make_model(dtype=torch.bfloat16)
        optimizer = get_megatron_optimizer(config("adam", bf16=True, **save_precision), model)
        for g in grads[:2]:
            step(model, optimizer, g)
        saved = optimizer.state_dict()
        position = saved["param_groups"][0]["param_names"].index("fc1.weight")
        saved_dtype = saved["state"][saved["param_groups"][0]["params"][position]]["exp_avg"].dtype
        buffer = io.BytesIO()
        torch.save(saved, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        resumed = make_model(seed=1, dtype=torch.bfloat16)
        resumed.load_state_dict(model.state_dict())
        resumed_optimizer = get_megatron_optimizer(config("adam", bf16=True, **load_precision), resumed)
        resumed_optimizer.load_state_dict(loaded)
        wanted = torch.bfloat16 if load_precision else torch.float32
        for _, state in child_states(resumed_optimizer):
            assert state["exp_avg"].dtype == wanted and state["exp_avg_sq"].dtype == wanted
        # Loaded values: the saved ones, rounded to the live dtype.
        for (_, live), (_, source) in zip(child_states(resumed_optimizer), child_states(optimizer)):
            assert torch.equal(live["exp_avg"], source["exp_avg"].to(wanted))
        assert saved_dtype == (torch.bfloat16 if save_precision else torch.float32)
        step(resumed, resumed_optimizer, grads[2])  # and it steps on


def test_saved_state_keeps_its_dtype() -> None:
    model = make_model()
    optimizer = get_megatron_optimizer(config("adam", use_precision_aware_optimizer=True,
                                              exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.float16), model)
    step(model, optimizer, gradients(model, 1)[0])
    state = optimizer.state_dict()
    flat = {position: entries for position, entries in state["state"].items() if "exp_avg" in entries}
    assert {v["exp_avg"].dtype for v in flat.values()} == {torch.bfloat16}
    assert {v["exp_avg_sq"].dtype for v in flat.values()} == {torch.float16}
    assert {v["step"].dtype for v in flat.values()} == {torch.float32}


@pytest.mark.parametrize("field", ["exp_avg_dtype", "exp_avg_sq_dtype", "main_params_dtype"])
def test_fp8_state_is_refused_naming_what_is_allowed(field) -> None:
    with pytest.raises(ValueError, match=rf"^OptimizerConfig.{field} must be one of torch.float32, torch.bfloat16, "
                                         r"torch.float16 \(fp8 optimizer state is not implemented\); got "
                                         r"torch.float8_e4m3fn.$"):
        OptimizerConfig(use_precision_aware_optimizer=True, store_param_remainders=False,
                        **{field: torch.float8_e4m3fn})


@pytest.mark.parametrize("field", ["exp_avg_dtype", "exp_avg_sq_dtype", "main_params_dtype", "main_grads_dtype"])
def test_dtypes_need_the_precision_aware_optimizer(field) -> None:
    with pytest.raises(ValueError, match=rf"OptimizerConfig.{field} can only be torch.float32 without "
                                         r"use_precision_aware_optimizer=True"):
        OptimizerConfig(**{field: torch.bfloat16})


def test_an_optimizer_without_known_moments_is_refused() -> None:
    precise = config("adam", use_precision_aware_optimizer=True, exp_avg_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="not supported with optimizer 'my_optimizer'"):
        state_precision_for("my_optimizer", precise)
    assert state_precision_for("my_optimizer", config("adam", use_precision_aware_optimizer=True)) is None


def test_docs_table_is_the_module_table() -> None:
    from pathlib import Path

    from megatron_eopt.wrappers.state_precision import state_precision_table_markdown

    page = Path(__file__).resolve().parents[4] / "docs" / "memory.md"
    assert state_precision_table_markdown() in page.read_text()
