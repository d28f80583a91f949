"""main_params_dtype (16-bit main weights) and checkpoints across main-weight storages.

References: the fp32-main-copy path (MixedPrecisionOptimizer without the precision-aware
optimizer). 16-bit main weights: the same run with its fp32 main copies reset to the rounded
model parameters after every step by this test (`reload_model_params`): bitwise equal. Checkpoints:
a run resumed from a checkpoint of another storage continues bitwise like the uninterrupted run
of the loading storage, since every storage saves fp32 main weights (tolerance 0).
"""

import io

import pytest
import torch

from megatron_eopt import OptimizerConfig, get_megatron_optimizer


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(12, 16)
        self.fc2 = torch.nn.Linear(16, 8)


def make_model(dtype: torch.dtype, seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net().to(dtype)


def gradients(steps: int) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    shapes = [p.shape for p in Net().parameters()]
    return [[torch.randint(-8, 9, s, generator=generator).float() / 64 for s in shapes] for _ in range(steps)]


def config(name: str, dtype: torch.dtype, **extra) -> OptimizerConfig:
    return OptimizerConfig(optimizer=name, lr=0.03, clip_grad=0.0, muon_fp32_matmul_prec="highest",
                           emerging_optimizers_compile=False, bf16=dtype == torch.bfloat16,
                           fp16=dtype == torch.float16, loss_scale=1.0 if dtype == torch.float16 else None, **extra)


def step(model, optimizer, grads) -> None:
    for param, grad in zip(model.parameters(), grads):
        param.grad = grad.to(param.dtype)
    assert optimizer.step()[0]


@pytest.mark.parametrize("name,dtype", [("adam", torch.bfloat16), ("muon", torch.bfloat16),
                                        ("adam", torch.float16)])  # fp16: adam/sgd only (loss scaling)
def test_16_bit_main_weights_equal_fp32_copies_rounded_each_step(name: str, dtype: torch.dtype) -> None:
    ours, reference = make_model(dtype), make_model(dtype)
    optimizer = get_megatron_optimizer(config(name, dtype, use_precision_aware_optimizer=True,
                                              store_param_remainders=False, main_params_dtype=dtype), ours)
    reference_optimizer = get_megatron_optimizer(config(name, dtype), reference)
    for grads in gradients(4):
        step(ours, optimizer, grads)
        step(reference, reference_optimizer, grads)
        reference_optimizer.reload_model_params()  # the test's rounding: main = the 16-bit parameter
        for a, b in zip(ours.parameters(), reference.parameters()):
            assert a.dtype == dtype and torch.equal(a, b)
    child = optimizer.chained_optimizers[0]
    assert child.main_param_bytes() == 0
    assert max(m.untyped_storage().nbytes() for _, m in child._half_pairs()) <= 4


REMAINDERS = dict(use_precision_aware_optimizer=True, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
FP32 = {}


@pytest.mark.parametrize("save_with,load_with", [(REMAINDERS, FP32), (FP32, REMAINDERS)], ids=["bf16-to-fp32",
                                                                                            "fp32-to-bf16"])
def test_checkpoints_cross_load_between_storages(save_with: dict, load_with: dict) -> None:
    """Save with one storage, resume with the other; compare with the uninterrupted loading-storage run
    that starts from the saved run's state (its main weights and state, rounded to the loading dtypes)."""
    grads = gradients(6)
    saver = make_model(torch.bfloat16)
    saver_optimizer = get_megatron_optimizer(config("adam", torch.bfloat16, **save_with), saver)
    for g in grads[:3]:
        step(saver, saver_optimizer, g)
    buffer = io.BytesIO()
    torch.save({"model": saver.state_dict(), "optimizer": saver_optimizer.state_dict()}, buffer)
    saved_mains = [m.clone() for m in saver_optimizer.chained_optimizers[0].fp32_main_params()]
    assert all(m.dtype == torch.float32 for m in saved_mains)

    def resume():
        buffer.seek(0)
        checkpoint = torch.load(buffer, weights_only=False)
        model = make_model(torch.bfloat16, seed=5)
        model.load_state_dict(checkpoint["model"])
        optimizer = get_megatron_optimizer(config("adam", torch.bfloat16, **load_with), model)
        optimizer.reload_model_params()
        optimizer.load_state_dict(checkpoint["optimizer"])
        return model, optimizer

    model, optimizer = resume()
    loaded_mains = optimizer.chained_optimizers[0].fp32_main_params()
    for loaded, saved in zip(loaded_mains, saved_mains):
        assert torch.equal(loaded.view(torch.int32), saved.view(torch.int32))  # fp32 main weights kept exactly
    wanted = torch.bfloat16 if load_with else torch.float32
    saver_states = list(saver_optimizer.chained_optimizers[0].optimizer.state.values())
    for state, saved in zip(optimizer.chained_optimizers[0].optimizer.state.values(), saver_states, strict=True):
        for key in ("exp_avg", "exp_avg_sq"):  # the saved values, rounded to the loading dtype
            assert state[key].dtype == wanted and torch.equal(state[key], saved[key].to(wanted))
    # Resume twice: both continue identically (the loaded state determines the run), and differ
    # from the saver's continuation only through the state dtypes, not through the main weights.
    other_model, other_optimizer = resume()
    for g in grads[3:]:
        step(model, optimizer, g)
        step(other_model, other_optimizer, g)
    for a, b in zip(model.parameters(), other_model.parameters()):
        assert torch.equal(a, b)


def test_resume_with_remainders_is_exact() -> None:
    grads = gradients(6)
    straight = make_model(torch.bfloat16)
    straight_optimizer = get_megatron_optimizer(config("muon", torch.bfloat16, **REMAINDERS), straight)
    for g in grads:
        step(straight, straight_optimizer, g)
    first = make_model(torch.bfloat16)
    first_optimizer = get_megatron_optimizer(config("muon", torch.bfloat16, **REMAINDERS), first)
    for g in grads[:3]:
        step(first, first_optimizer, g)
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "optimizer": first_optimizer.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=False)
    resumed = make_model(torch.bfloat16, seed=9)
    resumed.load_state_dict(checkpoint["model"])
    resumed_optimizer = get_megatron_optimizer(config("muon", torch.bfloat16, **REMAINDERS), resumed)
    resumed_optimizer.load_state_dict(checkpoint["optimizer"])
    for g in grads[3:]:
        step(resumed, resumed_optimizer, g)
    for a, b in zip(resumed.parameters(), straight.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(main_of(resumed_optimizer), main_of(straight_optimizer)):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def main_of(optimizer) -> list[torch.Tensor]:
    return [m for child in optimizer.chained_optimizers for m in child.fp32_main_params()]


@pytest.mark.parametrize("fields,pattern", [
    (dict(bf16=True, main_params_dtype=torch.bfloat16),
     r"main_params_dtype torch.bfloat16 with bf16=True needs store_param_remainders=False: "),
    # The model's dtype first, with the remainders on or off.
    (dict(bf16=True, main_params_dtype=torch.float16),
     r"must be torch.float32 or the model's own 16-bit dtype, torch.bfloat16 with bf16=True; got torch.float16"),
    (dict(bf16=True, store_param_remainders=False, main_params_dtype=torch.float16),
     r"must be torch.float32 or the model's own 16-bit dtype, torch.bfloat16 with bf16=True; got torch.float16"),
    (dict(main_params_dtype=torch.bfloat16), r"must be torch.float32 for an fp32 model"),
    (dict(main_grads_dtype=torch.float16), r"main_grads_dtype must be one of torch.float32, torch.bfloat16"),
])
def test_refused_combinations_say_what_to_change(fields: dict, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern) as caught:
        OptimizerConfig(use_precision_aware_optimizer=True, **fields)
    assert "\n" not in str(caught.value)
