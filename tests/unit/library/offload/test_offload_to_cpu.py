"""megatron-core's `offload_to_cpu()` / `restore_from_cpu()` on what `get_megatron_optimizer` returns.

Reference: the same optimizer stepped with the same gradients without offloading; after an
offload and a restore between steps, parameters and state are bitwise equal to it. On this
machine (no accelerator) the methods change nothing, as megatron-core's do; to exercise the move
itself the tests treat the host as the accelerator (`offload_to_cpu.on_accelerator`): the
optimizer's storages are copied aside and freed (0 bytes), the model's are not.
"""

import pytest
import torch

from megatron_eopt import OptimizerConfig, get_megatron_optimizer
from megatron_eopt.offload import offload_to_cpu
from tests.small_model import small_model, step_on_random_grads

CONFIGS = {
    "adam fp32": OptimizerConfig(optimizer="adam", lr=1e-2),
    "muon fp32": OptimizerConfig(optimizer="muon", lr=1e-2, muon_fp32_matmul_prec="highest"),
    "muon bf16, bf16 moments and parameter remainders": OptimizerConfig(
        optimizer="muon", lr=1e-2, bf16=True, use_precision_aware_optimizer=True, store_param_remainders=True,
        exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16, muon_fp32_matmul_prec="highest"),
    "soap fp32": OptimizerConfig(optimizer="soap", lr=1e-2),
}


def _state_tensors(optimizer) -> list[torch.Tensor]:
    return [t for child in optimizer.chained_optimizers for t in child._owned_tensors()]


def _snapshot(model: torch.nn.Module, optimizer) -> list[torch.Tensor]:
    """The model's weights, the fp32 main weights (bf16 + remainder) and the inner optimizers' state."""
    values = [*model.parameters()]
    for child in optimizer.chained_optimizers:
        values += [*child.fp32_main_params(), *offload_to_cpu.tensors_in(list(child.optimizer.state.values()))]
    return [t.detach().clone() for t in values]


def _run(config: OptimizerConfig, monkeypatch, offloading: bool) -> list[torch.Tensor]:
    """Two steps; with `offloading`, an offload and a restore between them, checked on the way."""
    model = small_model(config)
    optimizer = get_megatron_optimizer(config, [model])
    step_on_random_grads(model, optimizer, seed=1)
    if offloading:
        with monkeypatch.context() as patch:
            patch.setattr(offload_to_cpu, "on_accelerator", lambda tensor: True)
            weights = [p.detach().clone() for p in model.parameters()]
            optimizer.offload_to_cpu()
            optimizer.offload_to_cpu()  # again: nothing more to move
            model_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
            owned = [t for t in _state_tensors(optimizer) if t.untyped_storage().data_ptr() not in model_storages]
            assert owned and all(t.untyped_storage().nbytes() == 0 for t in owned)  # freed
            assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))  # the model keeps its own
            with pytest.raises(ValueError, match=r"restore_from_cpu\(\) before step\(\)"):
                optimizer.step()
            optimizer.restore_from_cpu()
    step_on_random_grads(model, optimizer, seed=2)
    return _snapshot(model, optimizer)


@pytest.mark.parametrize("name", CONFIGS)
def test_offload_and_restore_between_steps_leave_the_run_bitwise_unchanged(name: str, monkeypatch) -> None:
    with torch.compiler.set_stance("force_eager"):  # the state is the question, not compiled kernels
        plain, offloaded = (_run(CONFIGS[name], monkeypatch, offloading) for offloading in (False, True))
    assert len(plain) == len(offloaded)
    assert all(torch.equal(a, b) for a, b in zip(plain, offloaded)), name


def test_without_an_accelerator_nothing_moves() -> None:
    config = CONFIGS["muon fp32"]
    model = small_model(config)
    optimizer = get_megatron_optimizer(config, [model])
    step_on_random_grads(model, optimizer, seed=1)
    before = [(t.untyped_storage().data_ptr(), t.clone()) for t in _state_tensors(optimizer)]
    optimizer.offload_to_cpu()
    after = _state_tensors(optimizer)
    assert all(t.untyped_storage().data_ptr() == ptr and torch.equal(t, value) for t, (ptr, value) in zip(after, before))
    step_on_random_grads(model, optimizer, seed=2)  # no restore needed: nothing was moved
    optimizer.restore_from_cpu()
