"""megatron-core 0.19.2's layer-wise Muon checkpoints (`--optimizer muon --use-distributed-optimizer`,
once `dist_muon`), both ways (issue 46).

What Megatron-LM builds for that command line (core_r0.19.0 training.py, arguments.py): parameters
tagged by `tag_params_for_buffer_routing` (2-D non-embedding matrices: Muon's), DDP with
use_distributed_optimizer and `LayerWiseDistributedOptimizer.compute_full_param_layout`, and the
chain [LayerWiseDistributedOptimizer(Muon), DistributedOptimizer(Adam over the untagged buffers)].
Its checkpoint (`dp_reshardable` metadata) holds Muon's momentum keyed by parameter
(`chained_0.optimizer.state.momentum_buffer.<key>`) and Adam's state by DDP bucket
(`chained_1.optimizer.distributed.dp_group_idx_0.gbuf_idx_0...`).
"""

import types

import pytest
import torch

from tests.gpt_training import model_parallel
from tests.megatron_core_on_cpu import cuda_named_types, distributed_optimizer_loads_on_cpu, megatron_core_ddp_on_cpu
from tests.unit.library.megatron_core_formats.test_megatron_core_checkpoints import (
    FIELDS,
    MORE_STEPS,
    SAVED_STEPS,
    SETTINGS,
    _differences,
    _optimizer_keys,
)
from tests.unit.library.megatron_core_formats.test_megatron_core_distributed_optimizer import (
    BUCKET_SIZE,
    METADATA,
    CoreRun,
    OursRun,
    _ddp_config,
    _loaded_and_continued,
)
from tests.unit.library.megatron_core_formats.test_dist_checkpointing import _megatron_save


# 8 experts (top 2) in every layer, at EP=2 on 2 ranks (expert DP 1): megatron-core's layout path
# takes experts only in its layer-wise optimizer, so they have no biases (SETTINGS' add_bias_linear=False).
# Not 4: a 4-row router's Newton-Schulz rounds differently here as a batch of one (ours batches
# equal shapes) than alone (megatron-core), by an ulp; 8 rows round alike.
EXPERTS = dict(num_moe_experts=8, moe_router_topk=2)


class CoreLayerWiseRun(CoreRun):
    """megatron-core's layer-wise Muon over a GPTModel, built as Megatron-LM builds it (bf16)."""

    def __init__(self, seed: int, experts: bool = False) -> None:
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallel
        from megatron.core.optimizer import OptimizerConfig as CoreConfig
        from megatron.core.optimizer import get_megatron_optimizer as core_get_megatron_optimizer
        from megatron.core.optimizer.layer_wise_optimizer import (
            LayerWiseDistributedOptimizer,
            tag_params_for_buffer_routing,
        )

        from megatron_eopt.training.model.gpt import GPTModelSettings, build_gpt_model

        self.settings = GPTModelSettings(**SETTINGS, bf16=True, **(EXPERTS if experts else {}))
        torch.manual_seed(seed)
        self.model = build_gpt_model(self.settings)
        tag_params_for_buffer_routing([self.model])
        ddp_config = _ddp_config()
        dp_size = torch.distributed.get_world_size() // self.model.config.tensor_model_parallel_size
        layout = LayerWiseDistributedOptimizer.compute_full_param_layout(
            [p for p in self.model.parameters() if p.requires_grad], BUCKET_SIZE, dp_size, ddp_config,
            expert_data_parallel_world_size=parallel_state.get_expert_data_parallel_world_size())
        self.ddp = DistributedDataParallel(self.model.config, ddp_config, self.model, full_param_layout=layout)
        with cuda_named_types():
            self.optimizer = core_get_megatron_optimizer(
                CoreConfig(**FIELDS["muon"], bf16=True, use_layer_wise_distributed_optimizer=True), [self.ddp])


def _ours(seed: int, layer_wise: bool) -> OursRun:
    """Ours: Muon in bf16, plain or layer-wise."""
    return OursRun(seed, layer_wise, optimizer="muon", bf16=True)


class OursWithExpertsRun(CoreRun):
    """Ours (layer-wise Muon, bf16) over megatron-core's DDP that all-reduces, as Megatron-LM runs
    ours: DDP scales the experts' gradients (expert DP 1 of DP 2) as it does megatron-core's."""

    def __init__(self, seed: int) -> None:
        from megatron.core.distributed import DistributedDataParallel

        from megatron_eopt import OptimizerConfig, get_megatron_optimizer
        from megatron_eopt.training.model.gpt import GPTModelSettings, build_gpt_model

        self.settings = GPTModelSettings(**SETTINGS, bf16=True, **EXPERTS)
        torch.manual_seed(seed)
        self.model = build_gpt_model(self.settings)
        self.ddp = DistributedDataParallel(self.model.config, _ddp_config(use_distributed_optimizer=False), self.model)
        config = OptimizerConfig(**FIELDS["muon"], bf16=True, use_distributed_optimizer=True)
        self.optimizer = get_megatron_optimizer(config, [self.ddp])

    def take_step(self) -> None:
        assert self.optimizer.step()[0]


def _ours_saves_body(rank: int, world_size: int, directory: str) -> dict:
    """DP=2: ours (layer-wise, as Megatron-LM runs it with --use-distributed-optimizer) trains and
    saves with Megatron-LM's metadata (dp_reshardable asked for); megatron-core's layer-wise Muon and
    our plain optimizer load with the metadata we left and continue: against ours continuing itself."""
    from megatron_eopt.megatron_core_formats import dist_checkpointing as megatron_sharded

    with model_parallel(1, seed=3), megatron_core_ddp_on_cpu():
        ours = _ours(seed=1, layer_wise=True)
        ours.train(range(SAVED_STEPS))
        written = dict(METADATA)
        _megatron_save(ours.sharded(metadata=written), directory)
        # as ours wrote it before this layout (stop 50's megatron_core_distributed: every child in the
        # DistributedOptimizer's), which must keep loading
        earlier_written, kept = dict(METADATA), megatron_sharded.kept_by_layer_wise
        megatron_sharded.kept_by_layer_wise = lambda child: False
        try:
            _megatron_save(ours.sharded(metadata=earlier_written), f"{directory}_earlier")
        finally:
            megatron_sharded.kept_by_layer_wise = kept
        ours.train(range(SAVED_STEPS, SAVED_STEPS + MORE_STEPS))
        expected = ours.params()
        core = CoreLayerWiseRun(seed=2)
        core.train(range(-1, 0))  # its DistributedOptimizer's sharded_state_dict reads the step from the state
        with distributed_optimizer_loads_on_cpu():
            core_continued = _loaded_and_continued(core, directory, written)
        ours_continued = _loaded_and_continued(_ours(seed=2, layer_wise=False), directory, written)
        earlier = _loaded_and_continued(_ours(seed=2, layer_wise=True), f"{directory}_earlier", earlier_written)
    return {"written": written, "keys": _optimizer_keys(directory), "core": _differences(expected, core_continued),
            "ours": _differences(expected, ours_continued), "earlier_written": earlier_written,
            "earlier": _differences(expected, earlier)}


def _core_saves_body(rank: int, world_size: int, directory: str) -> dict:
    """DP=2: megatron-core's layer-wise Muon trains, saves (dp_reshardable), continues; ours (plain and
    layer-wise) loads and continues."""
    with model_parallel(1, seed=3), megatron_core_ddp_on_cpu():
        core = CoreLayerWiseRun(seed=1)
        kinds = [type(c).__name__ for c in core.optimizer.chained_optimizers]
        core.train(range(SAVED_STEPS))
        _megatron_save(core.sharded(), directory)
        core.train(range(SAVED_STEPS, SAVED_STEPS + MORE_STEPS))
        expected = core.params()
        results = {"kinds": kinds, "keys": _optimizer_keys(directory), "expected": expected}
        for layer_wise in (False, True):
            ours = _ours(seed=2, layer_wise=layer_wise)
            fresh_differs = bool(_differences(expected, ours.params()))
            results[f"layer_wise={layer_wise}"] = (fresh_differs,
                                                   _differences(expected, _loaded_and_continued(ours, directory)))
    return results


def _experts_both_ways_body(rank: int, world_size: int, directory: str) -> dict:
    """EP=2 x DP=2, experts: megatron-core's layer-wise Muon (its layout path) trains, saves
    (dp_reshardable), continues; ours loads it and continues. Then ours trains, saves (with the
    metadata Megatron-LM passes), continues; megatron-core loads what ours wrote and continues."""
    with model_parallel(1, seed=3, expert_model_parallel_size=2), megatron_core_ddp_on_cpu():
        core = CoreLayerWiseRun(seed=1, experts=True)
        layer_wise_groups = core.optimizer.chained_optimizers[0].param_groups
        results = {"kinds": [type(c).__name__ for c in core.optimizer.chained_optimizers],
                   "experts in layer-wise groups": [g["is_expert_parallel"] for g in layer_wise_groups]}
        core.train(range(SAVED_STEPS))
        _megatron_save(core.sharded(), f"{directory}/core")
        core.train(range(SAVED_STEPS, SAVED_STEPS + MORE_STEPS))
        expected = core.params()
        ours = OursWithExpertsRun(seed=2)
        results["our children"] = [child.name for child in ours.optimizer.chained_optimizers]
        results["fresh differs"] = bool(_differences(expected, ours.params()))
        results["ours continued"] = _differences(expected, _loaded_and_continued(ours, f"{directory}/core"))

        ours = OursWithExpertsRun(seed=1)
        ours.train(range(SAVED_STEPS))
        results["written"] = dict(METADATA)
        _megatron_save(ours.sharded(metadata=results["written"]), f"{directory}/ours")
        ours.train(range(SAVED_STEPS, SAVED_STEPS + MORE_STEPS))
        expected = ours.params()
        core = CoreLayerWiseRun(seed=2, experts=True)
        core.train(range(-1, 0))  # its DistributedOptimizer's sharded_state_dict reads the step from the state
        with distributed_optimizer_loads_on_cpu():
            core_continued = _loaded_and_continued(core, f"{directory}/ours", results["written"])
        results["core continued"] = _differences(expected, core_continued)
        results["keys"] = _optimizer_keys(f"{directory}/ours")
    return results


FULLY_RESHARDABLE = {**METADATA, "distrib_optim_sharding_type": "fully_reshardable",
                     "distrib_optim_fully_reshardable_mem_efficient": False}


def _core_saves_at_tp2_body(rank: int, world_size: int, directory: str) -> list[str]:
    """TP=2: megatron-core's layer-wise Muon trains and saves as --dist-ckpt-optim-fully-reshardable
    writes (the format Megatron-LM lets a job load at another TP size)."""
    with model_parallel(2, seed=3), megatron_core_ddp_on_cpu():
        core = CoreLayerWiseRun(seed=1)
        core.train(range(SAVED_STEPS))
        _megatron_save(core.sharded(metadata=dict(FULLY_RESHARDABLE)), directory)
    return _optimizer_keys(directory)


def _tp1_loads_body(rank: int, world_size: int, directory: str) -> dict:
    """TP=1: megatron-core's layer-wise Muon loads the TP=2 checkpoint (its own reshard) and continues;
    ours (plain, layer-wise) loads it and continues: against megatron-core."""
    with model_parallel(1, seed=3), megatron_core_ddp_on_cpu():
        core = CoreLayerWiseRun(seed=2)
        core.train(range(-1, 0))  # its DistributedOptimizer's sharded_state_dict reads the step from the state
        with distributed_optimizer_loads_on_cpu():
            expected = _loaded_and_continued(core, directory, FULLY_RESHARDABLE)
        results = {}
        for layer_wise in (False, True):
            ours = _loaded_and_continued(_ours(seed=2, layer_wise=layer_wise), directory, FULLY_RESHARDABLE)
            results[f"layer_wise={layer_wise}"] = _differences(expected, ours)
    return results


def test_megatron_core_layer_wise_checkpoints_both_ways(run_distributed, tmp_path) -> None:
    directory = str(tmp_path / "core")
    for rank, results in enumerate(run_distributed(_core_saves_body, world_size=2, args=(directory,), timeout=600)):
        assert results["kinds"] == ["LayerWiseDistributedOptimizer", "DistributedOptimizer"], results["kinds"]
        keys = results["keys"]
        assert any(k.startswith("chained_0.optimizer.state.momentum_buffer.") for k in keys), keys[:5]
        assert any(k.startswith("chained_1.optimizer.distributed.") and k.endswith(".exp_avg") for k in keys), keys
        for case in ("layer_wise=False", "layer_wise=True"):
            fresh_differs, differences = results[case]
            assert fresh_differs and not differences, (rank, case, differences[:5])

    directory = str(tmp_path / "ours")
    for rank, results in enumerate(run_distributed(_ours_saves_body, world_size=2, args=(directory,), timeout=600)):
        assert results["written"]["distrib_optim_sharding_type"] == "fully_reshardable", results["written"]
        assert results["written"]["eopt_optimizer_layout"] == "megatron_core_layer_wise", results["written"]
        keys = results["keys"]
        assert any(k.startswith("optimizer.state.momentum_buffer.") for k in keys), keys[:5]
        assert any(k.startswith("optimizer.state.param.") for k in keys), keys[:5]
        assert not results["core"] and not results["ours"], (rank, results["core"][:5], results["ours"][:5])
        assert results["earlier_written"]["eopt_optimizer_layout"] == "megatron_core_distributed", results
        assert not results["earlier"], (rank, results["earlier"][:5])

    directory = str(tmp_path / "core_tp2")
    keys = run_distributed(_core_saves_at_tp2_body, world_size=2, args=(directory,), timeout=600)[0]
    for state in ("momentum_buffer", "exp_avg", "param"):  # keyed by parameter (no prefix: avoided)
        assert any(k.startswith(f"optimizer.state.{state}.") for k in keys), (state, keys[:5])
    (results,) = run_distributed(_tp1_loads_body, world_size=1, args=(directory,), timeout=600)
    for case, differences in results.items():
        assert not differences, (case, differences[:5])


def test_megatron_core_layer_wise_checkpoints_with_experts_both_ways(run_distributed, tmp_path) -> None:
    """megatron-core's layout path keeps the dense and the expert matrices in one layer-wise Muon;
    ours keeps them in two children, merged into that one on save and cut apart on load
    (megatron_core_formats/layer_wise_optimizer.py). Each continues the other's checkpoint as the
    saver continues itself, every parameter bitwise."""
    for rank, results in enumerate(run_distributed(_experts_both_ways_body, world_size=2,
                                                   args=(str(tmp_path),), timeout=600)):
        assert results["kinds"] == ["LayerWiseDistributedOptimizer", "DistributedOptimizer"], results["kinds"]
        assert set(results["experts in layer-wise groups"]) == {False, True}, results
        assert len([name for name in results["our children"] if name.startswith("muon")]) == 2, results
        assert results["fresh differs"] and not results["ours continued"], (rank, results["ours continued"][:5])
        assert results["written"]["eopt_optimizer_layout"] == "megatron_core_layer_wise", results["written"]
        assert any(".experts." in k and k.startswith("optimizer.state.momentum_buffer.") for k in results["keys"])
        assert not results["core continued"], (rank, results["core continued"][:5])


def _child(name: str, optimizer: str, expert: bool) -> types.SimpleNamespace:
    """What the layer-wise chain's check reads of a child: its name, config and param groups."""
    from megatron_eopt import OptimizerConfig

    return types.SimpleNamespace(name=name, config=OptimizerConfig(**FIELDS["muon"], bf16=True),
                                 param_groups=[{"optimizer": optimizer, "is_expert_parallel": expert}])


def test_layer_wise_layout_refuses_experts_outside_the_emerging_optimizer() -> None:
    """megatron-core's layout path refuses expert parameters outside Muon (expert biases); so does
    ours, naming the child, instead of writing a checkpoint megatron-core has no optimizer for."""
    from megatron_eopt.megatron_core_formats.dist_checkpointing import _check_layer_wise_chain

    dense = [_child("muon/dense", "muon", False), _child("adam/dense", "adam", False)]
    _check_layer_wise_chain(dense + [_child("muon/expert", "muon", True)], [True, False, True])
    with pytest.raises(ValueError, match=r"\['adam/expert'\] steps expert parameters outside 'muon'.*add_bias_linear"):
        _check_layer_wise_chain(dense + [_child("muon/expert", "muon", True), _child("adam/expert", "adam", True)],
                                [True, False, True, False])
    with pytest.raises(ValueError, match="its first child does not step 'muon'"):
        _check_layer_wise_chain(dense[::-1], [False, True])
