"""megatron-core's step in its phases (`prepare_grads`, `get_grad_norm`, `clip_grad_norm`, `count_zeros`,
`step_with_ready_grads`) on what our `get_megatron_optimizer` returns (wrappers/step_phases.py).

Reference: megatron-core 0.19.2's own optimizer from its own factory for the same config and
model (a GPTModel, Adam, fp32 and bf16 with fp32 main copies), given the same gradients, each
phase called in turn (tests/megatron_core_on_cpu.py runs its norm on CPU). Norms agree to 1e-6
(summed in another order), zero counts exactly, and the stepped parameters to the round-off of
the clipping factor (fp32: 1e-5; bf16 weights: one bf16 ulp). Then: our phases in turn are bitwise our `step()`; an inf gradient is
reported by `prepare_grads` (ours also in fp32, where megatron-core's FP32Optimizer reports none:
our step skips it); the stub and the layer-wise optimizer take the phases too.
"""

import math

import pytest
import torch

from megatron_eopt import OptimizerConfig, get_megatron_optimizer
from megatron_eopt.training.model.gpt import GPTModelSettings, build_gpt_model
from tests.gpt_training import model_parallel, step_loss, token_batch
from tests.megatron_core_on_cpu import cuda_named_types, cuda_tensors_on_cpu, megatron_core_steps_on_cpu

SETTINGS = dict(num_layers=2, hidden_size=32, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=48,
                vocab_size=64, seq_length=16, position_embedding_type="none", swiglu=False)
FIELDS = dict(optimizer="adam", lr=0.01, min_lr=0.0, weight_decay=0.05, clip_grad=0.5, log_num_zeros_in_grad=True)
CLIP = 0.05  # below the first step's norm (~2): the clipping changes every gradient


def _model_and_optimizer(library: str, bf16: bool, **fields):
    from megatron.core.optimizer import OptimizerConfig as CoreConfig
    from megatron.core.optimizer import get_megatron_optimizer as core_get_megatron_optimizer

    settings = GPTModelSettings(**SETTINGS, bf16=bf16)
    torch.manual_seed(7)
    model = build_gpt_model(settings)
    config = dict(FIELDS, bf16=bf16, **fields)
    if library == "ours":
        return model, get_megatron_optimizer(OptimizerConfig(**config), [model], config_overrides={})
    from megatron.core.distributed import DistributedDataParallelConfig

    model.ddp_config = DistributedDataParallelConfig()  # its factory reads it; no DDP: gradients in .grad
    with cuda_tensors_on_cpu(), cuda_named_types():
        return model, core_get_megatron_optimizer(CoreConfig(**config), [model], config_overrides={})


def _backward(model, settings_bf16: bool) -> None:
    batch = token_batch(GPTModelSettings(**SETTINGS, bf16=settings_bf16), batch=4, seed=5)
    step_loss(model, batch).backward()
    model.output_layer.weight.grad[:3].zero_()  # some zeros to count


def _phases(library: str, bf16: bool) -> dict:
    model, optimizer = _model_and_optimizer(library, bf16)
    _backward(model, bf16)
    with megatron_core_steps_on_cpu():
        found_inf = optimizer.prepare_grads()
        norm = optimizer.get_grad_norm()
        clipped_from = optimizer.clip_grad_norm(CLIP)
        norm_after = optimizer.get_grad_norm()
        zeros = optimizer.count_zeros()
        stepped = optimizer.step_with_ready_grads()
    return dict(found_inf=found_inf, norm=float(norm), clipped_from=float(clipped_from),
                norm_after=float(norm_after), zeros=int(zeros), stepped=stepped,
                params={n: p.detach().float().clone() for n, p in model.named_parameters()})


def _phases_of(rank: int, world_size: int, library: str, bf16: bool) -> dict:
    with model_parallel(1, seed=3):
        return _phases(library, bf16)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_each_phase_equals_megatron_cores(run_distributed, bf16: bool) -> None:
    (ours,), (core,) = (run_distributed(_phases_of, 1, args=(library, bf16), timeout=600) for library in ("ours", "core"))
    assert ours["found_inf"] is core["found_inf"] is False
    assert ours["norm"] == pytest.approx(core["norm"], rel=1e-6) and ours["norm"] > 10 * CLIP
    assert ours["clipped_from"] == pytest.approx(core["clipped_from"], rel=1e-6)
    assert ours["norm_after"] == pytest.approx(core["norm_after"], rel=1e-5) == pytest.approx(CLIP, rel=1e-4)
    assert ours["zeros"] == core["zeros"] > 0
    assert ours["stepped"] is core["stepped"] is True
    rtol = 2.0**-7 if bf16 else 1e-5  # bf16: a clipping factor 1 fp32 ulp apart may round a weight 1 bf16 ulp apart
    for name, value in core["params"].items():
        torch.testing.assert_close(ours["params"][name], value, rtol=rtol, atol=1e-7, msg=name)


def _phases_and_step(rank: int, world_size: int) -> dict:
    """Ours: the phases as megatron-core's step calls them, against our step(), from the same gradients."""
    results = {}
    with model_parallel(1, seed=3):
        for how in ("phases", "step"):
            model, optimizer = _model_and_optimizer("ours", bf16=True)
            _backward(model, True)
            if how == "step":
                results[how] = optimizer.step()
            else:
                assert not optimizer.prepare_grads()
                norm = optimizer.clip_grad_norm(optimizer.config.clip_grad)
                results[how] = (optimizer.step_with_ready_grads(), norm, optimizer.count_zeros())
            results[how + " params"] = [p.detach().clone() for p in model.parameters()]
        model, optimizer = _model_and_optimizer("ours", bf16=False)
        _backward(model, False)
        model.output_layer.weight.grad[0, 0] = math.inf
        results["inf"] = (optimizer.prepare_grads(), optimizer.step()[0])
        results["groups"] = (optimizer.get_grad_stats_parallel_group() is None,  # one rank: every rank
                             optimizer.grads_states_parallel_group_is_shared(), optimizer.has_grad_norm_group("mtp"))
        stub = get_megatron_optimizer(OptimizerConfig(**FIELDS), [torch.nn.Linear(2, 2).requires_grad_(False)])
        results["stub"] = (stub.prepare_grads(), stub.get_grad_norm(), stub.clip_grad_norm(1.0), stub.count_zeros(),
                           stub.step_with_ready_grads())
    return results


def test_our_phases_are_our_step(run_distributed) -> None:
    (results,) = run_distributed(_phases_and_step, 1, timeout=600)
    stepped, norm, zeros = results["phases"]
    assert stepped is True and results["step"][0] is True
    assert norm == results["step"][1] and zeros == results["step"][2]  # count_zeros after clipping: none made
    assert all(torch.equal(a, b) for a, b in zip(results["phases params"], results["step params"]))
    assert results["inf"] == (True, False)
    assert results["stub"] == (False, 0.0, 0.0, 0, True)
    assert results["groups"] == (True, True, False)  # no 'mtp' parameter


def _layer_wise_phases(rank: int, world_size: int) -> dict:
    """The layer-wise optimizer at DP=2: the phases reduce the gradients to the owners first and
    broadcast the stepped parameters last, as its step() does."""
    import torch.distributed as dist

    results = {}
    with model_parallel(1, seed=3):
        for how in ("phases", "step"):
            model, optimizer = _model_and_optimizer("ours", bf16=False, optimizer="muon",
                                                    use_layer_wise_distributed_optimizer=True)
            _backward(model, False)
            for param in model.parameters():  # what DDP hands the optimizer: averaged gradients
                dist.all_reduce(param.grad)
                param.grad /= world_size
            if how == "step":
                results[how] = optimizer.step()[:2]
            else:
                assert not optimizer.prepare_grads()
                norm = optimizer.clip_grad_norm(optimizer.config.clip_grad)
                results[how] = (optimizer.step_with_ready_grads(), norm)
            results[how + " params"] = [p.detach().clone() for p in model.parameters()]
        try:  # summed over the owners' group, then the model-parallel one: no one group
            optimizer.get_grad_stats_parallel_group()
            results["one group"] = True
        except ValueError as error:
            results["one group"] = str(error)
    return results


def test_the_layer_wise_optimizers_phases_are_its_step(run_distributed) -> None:
    for results in run_distributed(_layer_wise_phases, 2, timeout=600):
        assert results["phases"] == results["step"] and results["step"][0] is True
        assert "more than one group" in results["one group"]
        assert all(torch.equal(a, b) for a, b in zip(results["phases params"], results["step params"]))
