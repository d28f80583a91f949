"""What the table holds: one entry per optimizer, and what the factory passes beyond the config.

`OptimizerEntry` builds a built-in style optimizer that steps every parameter; an
`EmergingOptimizerEntry` says how to build one class from the config, which parameters it takes
(`routing`), and which it cannot step (`param_check`: SinkhornMuon takes only non-negative,
Sinkhorn-normalized matrices; the factory checks every parameter before building and names the
first that fails). `BuildContext` carries the process groups and layouts of one child optimizer.
"""

import re
import typing
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, Optional, Union

import torch
import torch.distributed as dist

from megatron_eopt.ops.row_shards import RowShards
from megatron_eopt.ops.splits import MatrixLayout
from megatron_eopt.params.overrides import check_config_overrides

BuildOptimizer = Callable[[list[dict], Any], torch.optim.Optimizer]
# `fn(param, constructor kwargs) -> None, or why the optimizer cannot step this parameter`.
ParamCheck = Callable[[torch.Tensor, Mapping[str, Any]], Optional[str]]
InitState = Callable[[torch.optim.Optimizer], None]
ConfigToKwargs = Callable[[Any], Mapping[str, Any]]
# Which parameters an optimizer steps (`EmergingOptimizerEntry.routing`); the rest go to
# `OptimizerConfig.muon_scalar_optimizer` ('adam' or 'lion'):
# - 'hidden_matrices': 2-D parameters that are not `is_embedding_or_output_parameter`, not lookup
#   tables (owned by an embedding module) and not `use_muon=False`. Muon and its variants
#   (orthogonalize whole matrices), SOAP/REKLS (Kronecker factors of both sides: 2-D only, and a
#   vocab x vocab factor for an embedding would not fit), PSGD (one factor per dimension, the
#   same memory argument), and the oblique optimizers: their first step rescales every column
#   to unit norm, which ruins an embedding or output layer initialised with std 0.02 (a GPT's
#   loss rose from 4.16 to 4.37 after one step), so they get those layers only when asked.
#   Also the default for optimizers we know nothing about (as megatron-core routes them).
# - 'matrices': every 2-D parameter not marked `use_muon=False`, embeddings and output layer
#   included (no built-in entry uses it; for third-party optimizers made for those layers).
# Opting in: a 2-D embedding, output or lookup-table parameter tagged `use_muon=True` (the
# attribute that opts a matrix out when False) goes to the configured optimizer too, e.g.
# `model.embedding.word_embeddings.weight.use_muon = True` for oblique_adam on the embedding.
Routing = Literal["hidden_matrices", "matrices", "all"]
ROUTINGS: tuple[str, ...] = typing.get_args(Routing)

# Arguments the factory supplies (never read from the config); megatron-core's TensorParallelMuon
# arguments that it gives as tp_group, layouts and weight_decay_method instead (so that, e.g.,
# OptimizerConfig.muon_split_qkv is not passed as split_qkv: the layouts already split).
CONTEXT_ARGS = ("tp_group", "layouts", "fsdp_group", "fsdp_shards",
                "pg_collection", "split_qkv", "is_qkv_fn", "qkv_split_shapes", "use_decoupled_weight_decay")
NAME_PATTERN = re.compile(r"[a-z][a-z0-9_]*")  # optimizer names and config prefixes


@dataclass(frozen=True)
class OptimizerEntry:
    """A built-in style optimizer: `build(param_groups, config)` makes it; steps every parameter."""

    name: str
    build: BuildOptimizer
    description: str = ""


@dataclass(frozen=True)
class EmergingOptimizerEntry:
    """How to build and route one emerging optimizer (see the module docstring and `Routing`).

    optimizer_cls: a torch.optim.Optimizer subclass, built as `optimizer_cls(param_groups, **kwargs)`.
    init_state_fn: `fn(optimizer)` creating state without a step; None: `_init_group` if any.
    config_to_kwargs: `fn(config) -> dict` of constructor arguments on top of the convention.
    default_param_overrides: ParamKey -> override, added to the standard overrides
        (`config_overrides=None`) for runs of this optimizer; may not set 'optimizer'.
    routing: 'hidden_matrices', 'matrices' or 'all'.
    config_prefixes: more prefixes for config fields after the entry's name (e.g. ('muon',)).
    param_check: `fn(param, kwargs) -> None or a reason`, run on every parameter routed to it
        (kwargs: the constructor's, defaults filled in) before the optimizer is built.
    qkv_split: for a class that takes `layouts`: whether they split a fused linear_qkv into
        q/k/v blocks (Muon, as `muon_split_qkv` says); False: the fused matrix stays whole.
    """

    optimizer_cls: type
    init_state_fn: Optional[InitState] = None
    config_to_kwargs: Optional[ConfigToKwargs] = None
    default_param_overrides: Optional[Mapping[Any, Mapping[str, Any]]] = None
    routing: str = "hidden_matrices"
    config_prefixes: tuple[str, ...] = ()
    description: str = ""
    param_check: Optional[ParamCheck] = None
    qkv_split: bool = True

    def __post_init__(self) -> None:
        if not (isinstance(self.optimizer_cls, type) and issubclass(self.optimizer_cls, torch.optim.Optimizer)):
            raise TypeError(
                f"EmergingOptimizerEntry.optimizer_cls must be a torch.optim.Optimizer subclass; got "
                f"{self.optimizer_cls!r}."
            )
        for name in ("init_state_fn", "config_to_kwargs", "param_check"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TypeError(f"EmergingOptimizerEntry.{name} must be callable or None; got {value!r}.")
        if self.routing not in ROUTINGS:
            raise ValueError(
                f"EmergingOptimizerEntry.routing must be one of {', '.join(map(repr, ROUTINGS))}; got "
                f"{self.routing!r}."
            )
        if isinstance(self.config_prefixes, str) or not all(
            isinstance(p, str) and NAME_PATTERN.fullmatch(p) for p in self.config_prefixes
        ):
            raise ValueError(
                f"EmergingOptimizerEntry.config_prefixes must be a tuple of lower-case identifiers; "
                f"got {self.config_prefixes!r}."
            )
        if self.default_param_overrides is not None:
            check_config_overrides(self.default_param_overrides)


Entry = Union[OptimizerEntry, EmergingOptimizerEntry]


@dataclass(frozen=True)
class BuildContext:
    """What the factory knows about one child optimizer beyond the config."""

    tp_group: Optional[dist.ProcessGroup] = None  # None: tensor-parallel size 1
    layouts: Optional[Mapping[str, MatrixLayout]] = None  # fqn -> layout, when the class takes them
    on_cpu: bool = True  # all parameters on CPU
    fsdp_group: Optional[dist.ProcessGroup] = None  # torch FSDP2: the group the rows are split over
    fsdp_shards: Optional[Mapping[str, RowShards]] = None  # FSDP2: fqn -> row shards and owner
