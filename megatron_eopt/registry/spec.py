"""`OptimizerSpec`: a registered optimizer as the factory uses it (routing, support, build)."""

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from megatron_eopt.registry.entries import BuildContext, EmergingOptimizerEntry, Entry
from megatron_eopt.registry.kwargs import build_emerging, check_fields_taken, check_params, constructor_parameters
from megatron_eopt.registry.support import Support


@dataclass(frozen=True)
class OptimizerSpec:
    """A registered optimizer as the factory uses it."""

    name: str
    entry: Entry

    @property
    def emerging(self) -> bool:
        return isinstance(self.entry, EmergingOptimizerEntry)

    @property
    def routing(self) -> str:
        return self.entry.routing if self.emerging else "all"

    @property
    def default_param_overrides(self) -> Mapping[Any, Mapping[str, Any]]:
        return (self.emerging and self.entry.default_param_overrides) or {}

    @property
    def support(self) -> Support:
        """Where this optimizer works (registry/support.py)."""
        return Support(
            tensor_parallel=self.routing == "all" or self.accepts("tp_group"),
            layer_wise=True,
            fsdp2=self.routing == "all" or self.accepts("fsdp_shards"),
            bf16=True,
            fp16=not self.emerging,
        )

    def check_params(self, param_groups: list[dict], config: Any) -> None:
        """Raise, naming the parameter, if the optimizer cannot step one of `param_groups`."""
        if self.emerging:
            check_params(self.name, self.entry, param_groups, config)

    def check_config_fields(self, config: Any) -> None:
        """Raise ValueError naming a field set in `config` that this optimizer would ignore
        (kwargs.fields_not_taken); building checks it too, this is for the flag checks before."""
        if self.emerging:
            check_fields_taken(self.name, self.entry, config)

    def accepts(self, argument: str) -> bool:
        """Whether the optimizer's constructor takes `argument` (e.g. 'tp_group', 'layouts')."""
        return self.emerging and argument in constructor_parameters(self.entry.optimizer_cls)

    def build(
        self, param_groups: list[dict], config: Any, context: BuildContext = BuildContext()
    ) -> torch.optim.Optimizer:
        """The torch optimizer over `param_groups` (torch format, with 'param_fqns'), state created."""
        if not self.emerging:
            return self.entry.build(param_groups, config)
        return build_emerging(self.name, self.entry, param_groups, config, context)
