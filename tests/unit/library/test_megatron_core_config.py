"""megatron-core's own OptimizerConfig passed to get_megatron_optimizer: its values are kept.

megatron-core 0.19 defaults `muon_tp_mode` to 'blockwise' (ours: 'duplicated'). The value is
kept, and where blockwise really runs (a Muon parameter split over a TP group of size > 1) a
warning naming the field is given once per process. The TP=2 case runs on two gloo ranks with
column- and row-parallel weights (tests/unit/library/distributed/test_distributed_step.py's model).
"""

import warnings

import pytest
import torch
import torch.distributed as dist

from megatron_eopt import ParallelGroups, get_megatron_optimizer
from megatron_eopt.runtime import once
from tests.unit.library.distributed.test_distributed_step import tp_model


def _mcore_config(**kwargs):
    from megatron.core.optimizer import OptimizerConfig as McoreOptimizerConfig

    return McoreOptimizerConfig(optimizer="muon", lr=0.01, **kwargs)


def _build_twice_and_record(model: torch.nn.Module, config, pg_collection=None) -> tuple[str, list[str]]:
    """(the optimizer's muon_tp_mode, messages of blockwise warnings) over two builds."""
    once._GIVEN.clear()  # a fresh process, for this warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            optimizer = get_megatron_optimizer(config, model, pg_collection=pg_collection)
    messages = [str(w.message) for w in caught if "muon_tp_mode='blockwise'" in str(w.message)]
    return optimizer.config.muon_tp_mode, messages


def _tp2_body(rank: int, world_size: int, use_mcore_default: bool) -> tuple[str, list[str]]:
    from megatron_eopt.config.optimizer_config import OptimizerConfig

    world = dist.group.WORLD
    config = _mcore_config() if use_mcore_default else OptimizerConfig(optimizer="muon", lr=0.01)
    return _build_twice_and_record(tp_model(rank, world_size), config, ParallelGroups.from_groups(tp=world, mp=world))


def test_megatron_core_blockwise_is_kept_and_warned_once_at_tp2(run_distributed) -> None:
    for tp_mode, messages in run_distributed(_tp2_body, world_size=2, args=(True,)):
        assert tp_mode == "blockwise"
        assert len(messages) == 1, messages
        assert "muon_tp_mode" in messages[0] and "split over 2 TP ranks" in messages[0]
        assert "'duplicated'" in messages[0]


def test_our_default_does_not_warn_at_tp2(run_distributed) -> None:
    for tp_mode, messages in run_distributed(_tp2_body, world_size=2, args=(False,)):
        assert tp_mode == "duplicated" and messages == []


def test_megatron_core_blockwise_is_kept_without_warning_at_tp1() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 4))
    assert _mcore_config().muon_tp_mode == "blockwise"  # megatron-core 0.19's default
    tp_mode, messages = _build_twice_and_record(model, _mcore_config())
    assert tp_mode == "blockwise" and messages == []


# ------------------------------------------------------------------------------------------------
# Every megatron-core field does what it does there, or says why not
# ------------------------------------------------------------------------------------------------

from megatron_eopt.config.optimizer_config import MEGATRON_CORE_FIELDS, OptimizerConfig  # noqa: E402

# A non-default value for each field that is not 'used'.
NON_DEFAULT = {
    "fp8_recipe": "delayed", "params_dtype": torch.bfloat16, "reuse_grad_buf_for_mxfp8_param_ag": True,
    "optimizer_cuda_graph": True, "main_grads_dtype": torch.bfloat16,
    "use_torch_optimizer_for_cpu_offload": True, "pin_cpu_grads": False,
    "config_logger_dir": "config-logs",
}


def test_the_field_table_covers_every_megatron_core_field() -> None:
    import dataclasses

    from megatron.core.optimizer import OptimizerConfig as McoreOptimizerConfig

    assert set(MEGATRON_CORE_FIELDS) == {f.name for f in dataclasses.fields(McoreOptimizerConfig)}
    for name, use in MEGATRON_CORE_FIELDS.items():
        assert use.kind in ("used", "inert", "warns", "refused"), name
        assert (use.kind == "used") == (use.why == ""), name  # every field not used says why
        assert "\n" not in use.why, name
    assert set(NON_DEFAULT) == {n for n, use in MEGATRON_CORE_FIELDS.items() if use.kind != "used"}


@pytest.mark.parametrize("name", sorted(n for n, use in MEGATRON_CORE_FIELDS.items() if use.kind == "refused"))
def test_refused_fields_raise_naming_the_field(name: str) -> None:
    with pytest.raises(ValueError, match=rf"OptimizerConfig\.{name} "):
        OptimizerConfig(**{name: NON_DEFAULT[name]})


def _build_warnings(**fields) -> list[str]:
    once._GIVEN.clear()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            get_megatron_optimizer(OptimizerConfig(lr=0.1, **fields), model)
    return [str(w.message) for w in caught if "has no effect in megatron_eopt" in str(w.message)]


@pytest.mark.parametrize("name", sorted(n for n, use in MEGATRON_CORE_FIELDS.items() if use.kind == "warns"))
def test_warning_fields_warn_once_when_set(name: str) -> None:
    messages = _build_warnings(**{name: NON_DEFAULT[name]})
    assert len(messages) == 1, messages
    assert messages[0].startswith(f"OptimizerConfig.{name}=") and MEGATRON_CORE_FIELDS[name].why in messages[0]
    assert _build_warnings() == []  # at their defaults: silent


@pytest.mark.parametrize("name", sorted(n for n, use in MEGATRON_CORE_FIELDS.items() if use.kind == "inert"))
def test_inert_fields_are_silent(name: str) -> None:
    fields = {name: NON_DEFAULT[name]}
    if name == "params_dtype":
        fields["bf16"] = True  # a consistent mixed-precision config
    if name == "main_grads_dtype":
        fields["use_precision_aware_optimizer"] = True  # megatron-core refuses it without
    assert _build_warnings(**fields) == []


# ------------------------------------------------------------------------------------------------
# timers and barrier_with_L1_time
# ------------------------------------------------------------------------------------------------

STEP_TIMERS = {"optimizer-copy-to-main-grad", "optimizer-clip-main-grad", "optimizer-inner-step",
               "optimizer-copy-main-to-model-params"}


def _step_with(timers, **fields) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    config = OptimizerConfig(optimizer="muon", lr=0.1, muon_fp32_matmul_prec="highest", timers=timers, **fields)
    optimizer = get_megatron_optimizer(config, model, pg_collection=ParallelGroups.single_process())
    for param in model.parameters():
        param.grad = torch.randn_like(param)
    assert optimizer.step()[0]


def test_megatron_timers_time_megatron_cores_phases(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.core.timers import Timers

    if not torch.cuda.is_available():  # megatron's Timer synchronizes CUDA around each reading
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)

    timers = Timers(log_level=2, log_option="minmax")
    _step_with(timers)
    assert STEP_TIMERS <= set(timers._timers), sorted(timers._timers)
    assert all(timers._timers[name].elapsed(reset=False) > 0.0 for name in STEP_TIMERS)

    layer_wise = Timers(log_level=2, log_option="minmax")
    _step_with(layer_wise, use_layer_wise_distributed_optimizer=True)
    assert STEP_TIMERS | {"params-all-gather"} <= set(layer_wise._timers), sorted(layer_wise._timers)


class _RecordingTimers:
    """megatron's Timers interface, recording (name, barrier) of every start."""

    def __init__(self) -> None:
        self.starts: list[tuple[str, bool]] = []

    def __call__(self, name: str, log_level=None):
        recorder = self

        class _Timer:
            def start(self, barrier: bool = False) -> None:
                recorder.starts.append((name, barrier))

            def stop(self, barrier: bool = False) -> None:
                pass

        return _Timer()


@pytest.mark.parametrize("barrier", [False, True])
def test_timers_start_with_barrier_with_L1_time(barrier: bool) -> None:
    timers = _RecordingTimers()
    _step_with(timers, barrier_with_L1_time=barrier)
    assert {name for name, _ in timers.starts} == STEP_TIMERS
    assert all(flag is barrier for _, flag in timers.starts)
