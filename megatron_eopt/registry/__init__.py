"""The optimizers `OptimizerConfig.optimizer` may name; this module only re-exports.

table.py: the table and its public functions; entries.py: the entry types and routing;
builtin.py: adam, sgd and the decisions per emerging_optimizers name; kwargs.py: constructor
arguments from the config; spec.py: a registered optimizer as the factory uses it; support.py:
where each optimizer works; fields_read.py: the config fields an optimizer reads. The process's table is `table._TABLE` (tests replace it there).
"""

from megatron_eopt.registry.builtin import init_torch_state
from megatron_eopt.registry.entries import (
    CONTEXT_ARGS,
    ROUTINGS,
    BuildContext,
    EmergingOptimizerEntry,
    Entry,
    OptimizerEntry,
    Routing,
)
from megatron_eopt.registry.kwargs import check_params, constructor_parameters, init_state_step_free, optimizer_kwargs
from megatron_eopt.registry.spec import OptimizerSpec
from megatron_eopt.registry.support import SUPPORT_COLUMNS, Support
from megatron_eopt.registry.table import (
    EMERGING_MODULES,
    ENTRY_POINT_GROUP,
    OptimizerTable,
    get_optimizer_entry,
    list_optimizers,
    lookup_optimizer,
    optimizers_supporting,
    register_emerging_optimizer,
    register_optimizer,
    support_table_markdown,
)

__all__ = [
    "CONTEXT_ARGS",
    "EMERGING_MODULES",
    "ENTRY_POINT_GROUP",
    "ROUTINGS",
    "SUPPORT_COLUMNS",
    "BuildContext",
    "EmergingOptimizerEntry",
    "Entry",
    "OptimizerEntry",
    "OptimizerSpec",
    "OptimizerTable",
    "Routing",
    "Support",
    "check_params",
    "constructor_parameters",
    "get_optimizer_entry",
    "init_state_step_free",
    "init_torch_state",
    "list_optimizers",
    "lookup_optimizer",
    "optimizer_kwargs",
    "optimizers_supporting",
    "register_emerging_optimizer",
    "register_optimizer",
    "support_table_markdown",
]
