"""The import paths users depend on (/CONTRACT: megatron-core's public names, the deprecated Muon
entry) and the documented ones keep working wherever the code behind them moves."""

import importlib

import pytest

import megatron_eopt

# Every name `from megatron_eopt import ...` gave before the package root was grouped by concern.
TOP_LEVEL_NAMES = {
    "AdamOptimizerConfig", "ChainedOptimizer", "ConstantGradScaler", "DynamicGradScaler", "EmergingOptimizerEntry",
    "FP32Optimizer", "LayerWiseDistributedOptimizer", "MegatronOptimizer", "MixedPrecisionOptimizer",
    "OptimizerConfig", "OptimizerEntry", "ParallelGroups", "ParamGroupOverride", "ParamKey", "ParamPredicate",
    "ParamWithNamePredicate", "SGDOptimizerConfig", "TensorParallelAdaptiveMuon", "TensorParallelMuon",
    "get_megatron_optimizer", "get_standard_config_overrides", "list_optimizers", "lookup_optimizer",
    "register_emerging_optimizer", "register_optimizer",
}
# module -> names, as the contract and docs/ spell them.
DOCUMENTED_PATHS = {
    "megatron_eopt.muon": ["get_megatron_muon_optimizer"],
    "megatron_eopt.config": ["OptimizerConfig", "FieldUse", "MEGATRON_CORE_FIELDS", "as_optimizer_config"],
    "megatron_eopt.integrations.megatron_bridge": ["setup_optimizer", "SchedulerConfig", "to_yaml", "from_yaml"],
    "megatron_eopt.integrations.megatron_lm": ["install", "uninstall", "installed", "add_megatron_eopt_args"],
    "megatron_eopt.checkpointing": ["load_checkpoint", "save_checkpoint", "start_save_checkpoint", "DirectoryOwner",
                                    "CheckpointError", "latest_checkpoint"],
    "megatron_eopt.registry": ["support_table_markdown"],
    "megatron_eopt.ops.muon_cost": ["auto_tp_modes", "block_cost", "step_time_s", "PROFILES"],
    "megatron_eopt.ops.splits": ["MatrixLayout"],
}


def test_every_top_level_name_is_still_there() -> None:
    assert TOP_LEVEL_NAMES <= set(megatron_eopt.__all__)
    for name in sorted(TOP_LEVEL_NAMES):
        assert getattr(megatron_eopt, name) is not None, name


def test_the_aliases_are_the_config() -> None:
    assert megatron_eopt.AdamOptimizerConfig is megatron_eopt.SGDOptimizerConfig is megatron_eopt.OptimizerConfig


@pytest.mark.parametrize("module", sorted(DOCUMENTED_PATHS))
def test_documented_paths_import(module: str) -> None:
    imported = importlib.import_module(module)
    missing = [name for name in DOCUMENTED_PATHS[module] if not hasattr(imported, name)]
    assert not missing, f"{module} lost {missing}"


def test_the_deprecated_muon_path_is_the_forwarding_function() -> None:
    from megatron_eopt.integrations.deprecated_muon import get_megatron_muon_optimizer
    from megatron_eopt.muon import get_megatron_muon_optimizer as via_old_path

    assert via_old_path is get_megatron_muon_optimizer
