"""Fixtures of the library tests.

``mcore``: megatron-core's optimizer API that our versions are compared with (imported when a
test asks for it, so tests that do not compare skip megatron-core's import).
"""

import types

import pytest


@pytest.fixture(scope="module")
def mcore() -> types.SimpleNamespace:
    import megatron.core.optimizer as mcore_optimizer
    from megatron.core.optimizer_param_scheduler import combine_param_group_overrides

    return types.SimpleNamespace(
        OptimizerConfig=mcore_optimizer.OptimizerConfig,
        ParamKey=mcore_optimizer.ParamKey,
        ParamPredicate=mcore_optimizer.ParamPredicate,
        ParamWithNamePredicate=mcore_optimizer.ParamWithNamePredicate,
        get_standard_config_overrides=mcore_optimizer.get_standard_config_overrides,
        get_param_groups=mcore_optimizer._get_param_groups,
        combine=combine_param_group_overrides,
    )
