"""megatron-core's own OptimizerConfig passed to get_megatron_optimizer: its values are kept.

megatron-core 0.19 defaults `muon_tp_mode` to 'blockwise' (ours: 'duplicated'). The value is
kept, and where blockwise really runs (a Muon parameter split over a TP group of size > 1) a
warning naming the field is given once per process. The TP=2 case runs on two gloo ranks with
column- and row-parallel weights (tests/unit/test_distributed_step.py's model).
"""

import warnings

import pytest
import torch
import torch.distributed as dist

from megatron_eopt import ParallelGroups, get_megatron_optimizer
from megatron_eopt.optimizers import tensor_parallel_muon
from tests.unit.test_distributed_step import tp_model


def _mcore_config(**kwargs):
    from megatron.core.optimizer import OptimizerConfig as McoreOptimizerConfig

    return McoreOptimizerConfig(optimizer="muon", lr=0.01, **kwargs)


def _build_twice_and_record(model: torch.nn.Module, config, pg_collection=None) -> tuple[str, list[str]]:
    """(the optimizer's muon_tp_mode, messages of blockwise warnings) over two builds."""
    getattr(tensor_parallel_muon, "_WARNED_ONCE", set()).clear()  # a fresh process, for this warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            optimizer = get_megatron_optimizer(config, model, pg_collection=pg_collection)
    messages = [str(w.message) for w in caught if "muon_tp_mode='blockwise'" in str(w.message)]
    return optimizer.config.muon_tp_mode, messages


def _tp2_body(rank: int, world_size: int, use_mcore_default: bool) -> tuple[str, list[str]]:
    from megatron_eopt.config import OptimizerConfig

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
