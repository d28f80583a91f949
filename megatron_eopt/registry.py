"""The table of optimizers that `OptimizerConfig.optimizer` may name.

Importing this module has no side effects; the table fills at its first use from three sources:
1. built in: 'adam' (torch AdamW, or Adam with L2 decay when `decoupled_weight_decay=False`)
   and 'sgd' (torch SGD with momentum);
2. every optimizer in `emerging_optimizers.registry`: its optimizer subpackages are imported
   explicitly (their `@register_optimizer` decorators fill that registry). If one fails to
   import, asking for any optimizer but adam/sgd raises an ImportError naming the failure, so a
   renamed module can never silently disable them. 'muon' and
   'adaptive_muon' are megatron_eopt's TensorParallelMuon and TensorParallelAdaptiveMuon (same
   update at every TP degree);
3. Python entry points of group `megatron_eopt.optimizers` (third-party packages): each loads to
   an `EmergingOptimizerEntry` (registered under the entry point's name), a torch optimizer
   class (registered with default settings) or a callable that registers by itself.

Routing: which parameters an optimizer steps (`EmergingOptimizerEntry.routing`); the rest go to
`OptimizerConfig.muon_scalar_optimizer` ('adam' or 'lion'):
- 'hidden_matrices': 2-D parameters that are not `is_embedding_or_output_parameter`, not lookup
  tables (owned by an embedding module) and not `use_muon=False`. Muon and its variants
  (orthogonalize whole matrices), SOAP/REKLS (Kronecker factors of both sides: 2-D only, and a
  vocab x vocab factor for an embedding would not fit), PSGD (one factor per dimension, the
  same memory argument), and the oblique optimizers: their first step rescales every column
  to unit norm, which ruins an embedding or output layer initialised with std 0.02 (a GPT's
  loss rose from 4.16 to 4.37 after one step), so they get those layers only when asked.
  Also the default for optimizers we know nothing about (as megatron-core routes them).
- 'matrices': every 2-D parameter not marked `use_muon=False`, embeddings and output layer
  included (no built-in entry uses it; for third-party optimizers made for those layers).
- 'all': every parameter; elementwise optimizers (lion, laprop, adam, sgd). No scalar optimizer.
Opting in: a 2-D embedding, output or lookup-table parameter tagged `use_muon=True` (the
attribute that opts a matrix out when False) goes to the configured optimizer too, e.g.
`model.embedding.word_embeddings.weight.use_muon = True` for oblique_adam on the embedding.

Support (`OptimizerSpec.support`, rendered by `support_table_markdown()` into the README):
tensor parallelism needs an elementwise optimizer ('all') or one that takes a `tp_group`
(whole-matrix math over TP shards); fp16 needs loss scaling, which only adam/sgd have; the
layer-wise distributed optimizer and bf16 (fp32 main copies) work for every optimizer; FSDP2
needs an elementwise optimizer or one that takes `fsdp_shards` (Muon, AdaptiveMuon, and
MOP/PolarGrad/Scion through `with_tensor_parallelism`). The factory and `arguments.validate_args` refuse from these same facts.

Parameter requirements: an entry's `param_check(param, kwargs)` says why a parameter cannot be
stepped (SinkhornMuon: non-negative, Sinkhorn-normalized matrices only); the factory checks
every parameter before building the optimizer and names the first that fails.

Constructor arguments come from the config by name: for each `__init__` argument `arg` (through
`**kwargs` to the parent class's), `config.<prefix>_<arg>` for the entry's prefixes (its name
first, then `config_prefixes`), else `config.<arg>`, else the class default; config values that
are None count as unset. Then, where the class takes them: `weight_decay_method` is 'decoupled'
or 'l2' from `decoupled_weight_decay`; the entry's `config_to_kwargs(config)` may add or
replace values (adam's betas/eps, lion's betas); `tp_group`/`layouts` (and, for FSDP2,
`fsdp_group`/`fsdp_shards`) come from the factory.
Matmul precisions (`muon_fp32_matmul_prec`) are honoured on every device; 'medium' (bf16
Newton-Schulz) on a CPU without bf16 instructions warns once that it is emulated there.
Names and values are checked against the signature (`Literal` annotations, Newton-Schulz coefficient sets and matmul
precisions of the installed emerging_optimizers) before the optimizer is built.

State is created eagerly, so a checkpoint loads into a fresh optimizer and every rank has the
same keys: `init_state_fn(optimizer)`, by default the class's own step-free initialisation
`_init_group(group, skip_non_grad_params=False)` where it has one. PSGD-Pro and the oblique
optimizers have none, so their entries create what their first step would (zero moments,
identity Kronecker factors); MuonHyperball also records the weight norm its step stores.
tests/unit/library/test_registry.py checks each against the state of a stepped optimizer. torch's
AdamW/SGD (adam, sgd) and third-party classes without `_init_group` keep lazy state.
"""

import importlib
import importlib.metadata
import inspect
import re
import types
import typing
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, Optional, Union

import torch
import torch.distributed as dist

from megatron_eopt.config import CPU_BF16_FLAGS, native_bf16_matmul
from megatron_eopt.ops.row_shards import RowShards
from megatron_eopt.optimizers.compiled_step import watch_first_step
from megatron_eopt.ops.splits import MatrixLayout
from megatron_eopt.param_key import check_config_overrides

BuildOptimizer = Callable[[list[dict], Any], torch.optim.Optimizer]
# `fn(param, constructor kwargs) -> None, or why the optimizer cannot step this parameter`.
ParamCheck = Callable[[torch.Tensor, Mapping[str, Any]], Optional[str]]
InitState = Callable[[torch.optim.Optimizer], None]
ConfigToKwargs = Callable[[Any], Mapping[str, Any]]
Routing = Literal["hidden_matrices", "matrices", "all"]
ROUTINGS: tuple[str, ...] = typing.get_args(Routing)

ENTRY_POINT_GROUP = "megatron_eopt.optimizers"
# Modules whose import registers emerging_optimizers' optimizers (or that we read values from).
EMERGING_MODULES = (
    "emerging_optimizers.registry",
    "emerging_optimizers.utils",
    "emerging_optimizers.orthogonalized_optimizers",
    "emerging_optimizers.orthogonalized_optimizers.muon_utils",
    "emerging_optimizers.scalar_optimizers",
    "emerging_optimizers.soap",
    "emerging_optimizers.psgd",
    "emerging_optimizers.riemannian_optimizers",
)
# Arguments the factory supplies (never read from the config).
CONTEXT_ARGS = ("tp_group", "layouts", "fsdp_group", "fsdp_shards")
_NAME_PATTERN = re.compile(r"[a-z][a-z0-9_]*")


@dataclass(frozen=True)
class OptimizerEntry:
    """A built-in style optimizer: `build(param_groups, config)` makes it; steps every parameter."""

    name: str
    build: BuildOptimizer
    description: str = ""


@dataclass(frozen=True)
class EmergingOptimizerEntry:
    """How to build and route one emerging optimizer (see the module docstring).

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
            isinstance(p, str) and _NAME_PATTERN.fullmatch(p) for p in self.config_prefixes
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
    def support(self) -> "Support":
        """Where this optimizer works (module docstring: Support)."""
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

    def accepts(self, argument: str) -> bool:
        """Whether the optimizer's constructor takes `argument` (e.g. 'tp_group', 'layouts')."""
        return self.emerging and argument in constructor_parameters(self.entry.optimizer_cls)

    def build(
        self, param_groups: list[dict], config: Any, context: BuildContext = BuildContext()
    ) -> torch.optim.Optimizer:
        """The torch optimizer over `param_groups` (torch format, with 'param_fqns'), state created."""
        if not self.emerging:
            return self.entry.build(param_groups, config)
        return _build_emerging(self.name, self.entry, param_groups, config, context)


@dataclass(frozen=True)
class Support:
    """Which parallel layouts and precisions an optimizer works with (one row of the README table)."""

    tensor_parallel: bool  # tensor_model_parallel_size > 1
    layer_wise: bool  # use_layer_wise_distributed_optimizer (and use_distributed_optimizer)
    fsdp2: bool  # torch FSDP2 (1-D mesh, Shard(0)): elementwise, or takes `fsdp_shards`
    bf16: bool  # bf16 parameters, fp32 main copies
    fp16: bool  # fp16 parameters with loss scaling

    def why_not(self, feature: str) -> str:
        """Why `feature` (a field name) is unsupported, for error messages."""
        return _WHY_UNSUPPORTED[feature]


# (field, README column heading)
SUPPORT_COLUMNS = (
    ("tensor_parallel", "TP > 1"),
    ("layer_wise", "layer-wise distributed"),
    ("fsdp2", "FSDP2"),
    ("bf16", "bf16"),
    ("fp16", "fp16"),
)
_WHY_UNSUPPORTED = {
    "tensor_parallel": "it works on whole matrices and cannot see the other tensor-parallel shards, so its "
                       "update would depend on the TP degree",
    "layer_wise": "it cannot run on whole-parameter owners",
    "fsdp2": "it works on whole matrices and does not take FSDP2 row shards (`fsdp_shards`) yet",
    "bf16": "it has no bf16 support",
    "fp16": "it has no loss scaling, which fp16 needs (bf16 works)",
}


def support_table_markdown() -> str:
    """The README's support table: one row per registered optimizer, 'yes'/'no' per column."""
    header = "| optimizer | " + " | ".join(title for _, title in SUPPORT_COLUMNS) + " |"
    rows = [header, "|---" * (len(SUPPORT_COLUMNS) + 1) + "|"]
    for name in list_optimizers():
        support = lookup_optimizer(name).support
        cells = ["yes" if getattr(support, field) else "no" for field, _ in SUPPORT_COLUMNS]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def optimizers_supporting(feature: str) -> list[str]:
    """Registered optimizers whose `Support.<feature>` is True (for error messages)."""
    return [name for name in list_optimizers() if getattr(lookup_optimizer(name).support, feature)]


# ------------------------------------------------------------------------------------------------
# The table
# ------------------------------------------------------------------------------------------------


class OptimizerTable:
    """Registered optimizers by name; fills itself from emerging_optimizers and entry points."""

    def __init__(self) -> None:
        self.entries: dict[str, Entry] = {}
        self.emerging_import_errors: list[str] = []
        self.unavailable: dict[str, str] = {}  # name -> why it could not be registered
        self._state = "empty"  # -> "loading" -> "loaded"
        self._add("adam", OptimizerEntry("adam", _build_adam, "torch AdamW (Adam if not decoupled)"))
        self._add("sgd", OptimizerEntry("sgd", _build_sgd, "torch SGD with momentum"))

    def register(self, name: str, entry: Entry) -> None:
        self.ensure_loaded()  # a duplicate of a name loaded later would go unnoticed
        self._add(name, entry)

    def names(self) -> list[str]:
        self.ensure_loaded()
        return sorted(self.entries)

    def lookup(self, name: str) -> OptimizerSpec:
        self.ensure_loaded()
        if self.emerging_import_errors and not isinstance(self.entries.get(name), OptimizerEntry):
            raise ImportError(
                f"optimizer {name!r} is unavailable: emerging_optimizers did not import completely "
                f"({'; '.join(self.emerging_import_errors)}). Install a compatible "
                f"emerging-optimizers (this library is tested with 0.3); only 'adam' and 'sgd' work "
                f"without it."
            )
        if name in self.unavailable:
            raise ImportError(f"optimizer {name!r} is unavailable: {self.unavailable[name]}")
        if name not in self.entries:
            failed = ""
            if self.unavailable:
                failed = f" (could not be registered: {', '.join(sorted(self.unavailable))})"
            raise ValueError(f"unknown optimizer {name!r}; valid names: {', '.join(self.names())}.{failed}")
        return OptimizerSpec(name, self.entries[name])

    def ensure_loaded(self) -> None:
        if self._state != "empty":
            return
        self._state = "loading"
        try:
            self._load_emerging()
            self._load_entry_points()
        finally:
            self._state = "loaded"

    def _add(self, name: str, entry: Entry) -> None:
        if not isinstance(name, str) or not _NAME_PATTERN.fullmatch(name):
            raise ValueError(
                f"optimizer names are lower-case identifiers (letters, digits, '_'; starting with a "
                f"letter); got {name!r}."
            )
        if not isinstance(entry, (OptimizerEntry, EmergingOptimizerEntry)):
            raise TypeError(
                f"optimizer {name!r}: expected an OptimizerEntry or EmergingOptimizerEntry; got "
                f"{type(entry).__name__}."
            )
        if isinstance(entry, OptimizerEntry) and entry.name != name:
            raise ValueError(f"OptimizerEntry named {entry.name!r} registered as {name!r}.")
        if name in self.entries:
            raise ValueError(f"an optimizer named {name!r} is already registered; names are unique.")
        self.entries[name] = entry

    def _load_emerging(self) -> None:
        for module in EMERGING_MODULES:
            try:
                importlib.import_module(module)
            except Exception as error:  # any failure must surface, not just ImportError
                self.emerging_import_errors.append(f"import {module} failed: {type(error).__name__}: {error}")
        if self.emerging_import_errors:
            return
        from emerging_optimizers import registry as eo_registry

        names = eo_registry.get_optimizer_name_list()
        for name in names:
            try:
                entry = _emerging_entry(name, eo_registry.get_optimizer_cls(name))
            except Exception as error:
                self.unavailable[name] = f"making its entry failed: {type(error).__name__}: {error}"
                continue
            self._add(name, entry)
        for name in sorted(set(_CURATED) - set(names)):
            self.unavailable[name] = (
                f"the installed emerging_optimizers ({_emerging_version()}) has no optimizer named "
                f"{name!r} (it has {', '.join(sorted(names))})."
            )

    def _load_entry_points(self) -> None:
        for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            try:
                loaded = entry_point.load()
                if isinstance(loaded, (OptimizerEntry, EmergingOptimizerEntry)):
                    self._add(entry_point.name, loaded)
                elif isinstance(loaded, type) and issubclass(loaded, torch.optim.Optimizer):
                    self._add(entry_point.name, EmergingOptimizerEntry(loaded))
                elif callable(loaded):
                    loaded()
                else:
                    raise TypeError(
                        f"it loaded {type(loaded).__name__}, not an EmergingOptimizerEntry, an "
                        f"optimizer class or a callable that registers optimizers"
                    )
            except Exception as error:
                why = (
                    f"entry point {entry_point.name!r} ({entry_point.value}) of group "
                    f"{ENTRY_POINT_GROUP!r} failed: {type(error).__name__}: {error}"
                )
                self.unavailable.setdefault(entry_point.name, why)
                warnings.warn(why, RuntimeWarning, stacklevel=2)


# ------------------------------------------------------------------------------------------------
# Public functions (on the process's table, `_TABLE`, at the end of this file)
# ------------------------------------------------------------------------------------------------


def register_optimizer(entry: OptimizerEntry) -> None:
    """Add a built-in style `entry` under `entry.name`; an existing name is an error."""
    if not isinstance(entry, OptimizerEntry):
        raise TypeError(f"register_optimizer takes an OptimizerEntry; got {type(entry).__name__}.")
    _TABLE.register(entry.name, entry)


def register_emerging_optimizer(name: str, entry: EmergingOptimizerEntry) -> None:
    """Add `entry` under `name`; an existing or malformed name is an error."""
    if not isinstance(entry, EmergingOptimizerEntry):
        raise TypeError(
            f"register_emerging_optimizer takes an EmergingOptimizerEntry; got {type(entry).__name__}."
        )
    _TABLE.register(name, entry)


def list_optimizers() -> list[str]:
    """Every name `OptimizerConfig.optimizer` accepts, sorted."""
    return _TABLE.names()


def lookup_optimizer(name: str) -> OptimizerSpec:
    """The optimizer named `name`; unknown names list the valid ones."""
    return _TABLE.lookup(name)


def get_optimizer_entry(name: str) -> Entry:
    return _TABLE.lookup(name).entry


# ------------------------------------------------------------------------------------------------
# Built-in optimizers
# ------------------------------------------------------------------------------------------------


def _build_adam(param_groups: list[dict], config: Any) -> torch.optim.Optimizer:
    adam_class = torch.optim.AdamW if config.decoupled_weight_decay else torch.optim.Adam
    return adam_class(
        param_groups,
        lr=config.lr,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_eps,
        weight_decay=config.weight_decay,
    )


def _build_sgd(param_groups: list[dict], config: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(
        param_groups, lr=config.lr, momentum=config.sgd_momentum, weight_decay=config.weight_decay
    )


# ------------------------------------------------------------------------------------------------
# emerging_optimizers: per-name decisions
# ------------------------------------------------------------------------------------------------


def _adam_style_kwargs(config: Any) -> dict[str, Any]:
    return {"betas": (config.adam_beta1, config.adam_beta2), "eps": config.adam_eps}


def _lion_kwargs(config: Any) -> dict[str, Any]:
    return {"betas": (config.lion_beta1, config.lion_beta2)}


# Eager state for classes without a step-free `_init_group`: the state their first step creates.
def _init_psgd_state(optimizer: torch.optim.Optimizer) -> None:
    from emerging_optimizers.psgd import psgd

    for param, state in _params_without_state(optimizer):
        state["step"] = 0
        state["exp_avg"] = torch.zeros_like(param)
        state["Q"], state["L"] = psgd._init_psgd_kron_states(param, precond_init_scale=optimizer.precond_init_scale)


def _init_muon_hyperball_state(optimizer: torch.optim.Optimizer) -> None:
    # 'hyperball_R' is the weight norm each step records before its update; recorded now too, so
    # a fresh optimizer has the keys a stepped one has.
    init_state_step_free(optimizer)
    for group in optimizer.param_groups:
        for param in group["params"]:
            radius = optimizer.hyperball_radius
            optimizer.state[param].setdefault("hyperball_R", radius if radius is not None else param.norm().item())


def _init_oblique_sgd_state(optimizer: torch.optim.Optimizer) -> None:
    for param, state in _params_without_state(optimizer):
        state["momentum_buffer"] = torch.zeros_like(param)


def _init_oblique_adam_state(optimizer: torch.optim.Optimizer) -> None:
    for param, state in _params_without_state(optimizer):
        state["step"] = 0
        state["exp_avg"] = torch.zeros_like(param)
        state["exp_avg_sq"] = torch.zeros_like(param)


def init_torch_state(optimizer: torch.optim.Optimizer) -> None:
    """Zero state for torch's Adam/AdamW/SGD, which create it only at their first step.

    Loading a sharded checkpoint needs the state's tensors to exist as targets; other classes
    (the emerging optimizers) create theirs at construction (`init_state_fn`).
    """
    for group in optimizer.param_groups:
        for param in group["params"]:
            if optimizer.state.get(param):
                continue
            if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
                state = {"step": torch.zeros((), dtype=torch.float32),
                         "exp_avg": torch.zeros_like(param), "exp_avg_sq": torch.zeros_like(param)}
                if group.get("amsgrad"):
                    state["max_exp_avg_sq"] = torch.zeros_like(param)
                optimizer.state[param] = state
            elif isinstance(optimizer, torch.optim.SGD) and group.get("momentum", 0) != 0:
                optimizer.state[param] = {"momentum_buffer": torch.zeros_like(param)}


def _params_without_state(optimizer: torch.optim.Optimizer) -> list[tuple[torch.Tensor, dict]]:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return [(p, optimizer.state[p]) for p in params if not optimizer.state[p]]


def init_state_step_free(optimizer: torch.optim.Optimizer) -> None:
    """The default `init_state_fn`: the class's `_init_group(group, skip_non_grad_params=False)`.

    Classes without such a method keep torch's lazy state (created at the first step).
    """
    init_group = getattr(optimizer, "_init_group", None)
    if init_group is None or "skip_non_grad_params" not in inspect.signature(init_group).parameters:
        return
    with torch.no_grad():
        for group in optimizer.param_groups:
            init_group(group, skip_non_grad_params=False)


def _emerging_entry(name: str, optimizer_cls: type) -> EmergingOptimizerEntry:
    """Our entry for emerging_optimizers' optimizer `name`: curated, else default settings."""
    make = _CURATED.get(name)
    if make is not None:
        return make(optimizer_cls)
    return EmergingOptimizerEntry(optimizer_cls, description=f"emerging_optimizers {optimizer_cls.__name__}")


def _emerging_version() -> str:
    try:
        return f"version {importlib.metadata.version('emerging-optimizers')}"
    except importlib.metadata.PackageNotFoundError:
        return "unknown version"


def _muon_scale_kwargs(config: Any) -> dict[str, Any]:
    """`muon_match_adamw_rms` multiplies the extra scale by 0.2 (Moonlight's AdamW-RMS rule)."""
    from megatron_eopt.optimizers.tensor_parallel_muon import ADAMW_RMS_MATCHING_EXTRA_SCALE

    factor = ADAMW_RMS_MATCHING_EXTRA_SCALE if getattr(config, "muon_match_adamw_rms", False) else 1.0
    return {"extra_scale_factor": config.muon_extra_scale_factor * factor}


def _muon_entry(optimizer_cls: type) -> EmergingOptimizerEntry:
    from megatron_eopt.optimizers.tensor_parallel_muon import TensorParallelMuon

    return EmergingOptimizerEntry(
        TensorParallelMuon, routing="hidden_matrices", config_prefixes=("muon",),
        config_to_kwargs=_muon_scale_kwargs,
        description=f"megatron_eopt TensorParallelMuon ({optimizer_cls.__name__} over TP shards)",
    )


def _adaptive_muon_entry(optimizer_cls: type) -> EmergingOptimizerEntry:
    from megatron_eopt.optimizers.tensor_parallel_adaptive_muon import TensorParallelAdaptiveMuon

    return EmergingOptimizerEntry(
        TensorParallelAdaptiveMuon, routing="hidden_matrices", config_prefixes=("muon",),
        config_to_kwargs=_muon_scale_kwargs,
        description=f"megatron_eopt TensorParallelAdaptiveMuon ({optimizer_cls.__name__} over TP shards)",
    )


_SINKHORN_REQUIREMENT = (
    "sinkhorn_muon steps only non-negative, Sinkhorn-normalized matrices (rows summing to "
    "max(1, n/m), columns to max(1, m/n)): initialise such parameters with emerging_optimizers' "
    "SinkhornMapper, and tag every other 2-D parameter use_muon=False so that the scalar optimizer "
    "steps it. A normally initialised model (e.g. a GPT) does not fit; use 'muon' there."
)


def _sinkhorn_param_problem(param: torch.Tensor, kwargs: Mapping[str, Any]) -> Optional[str]:
    """SinkhornMuon's precondition (its constructor checks it, without naming the parameter).

    It keeps each matrix Sinkhorn-normalized (non-negative; rows sum to max(1, n/m), columns
    to max(1, m/n)), so it suits matrices made that way at initialisation (e.g. mixing
    matrices initialised with emerging_optimizers.utils.sinkhorn_mapper.SinkhornMapper), not
    normally initialised weights.
    """
    if param.dim() != 2:
        return None  # the 2-D check names it separately
    with torch.no_grad():
        rows, cols = param.shape
        minimum = param.min().item()
        if minimum < 0:
            return f"it has negative entries (min {minimum:.4g}). {_SINKHORN_REQUIREMENT}"
        tolerance = kwargs.get("doubly_stochastic_tolerance", 0.1)
        row_error = (param.sum(dim=1) - max(1.0, cols / rows)).abs().max().item()
        col_error = (param.sum(dim=0) - max(1.0, rows / cols)).abs().max().item()
    if max(row_error, col_error) > tolerance:
        return (
            f"its row/column sums deviate from the Sinkhorn targets by {max(row_error, col_error):.4g} "
            f"(tolerance {tolerance}). {_SINKHORN_REQUIREMENT}"
        )
    return None


def _whole_matrix_entry(optimizer_cls: type) -> EmergingOptimizerEntry:
    """An orthogonalized optimizer whose only whole-matrix step is `orthogonalize`, made TP-aware."""
    from megatron_eopt.optimizers.tensor_parallel_whole_matrix import with_tensor_parallelism

    return EmergingOptimizerEntry(
        with_tensor_parallelism(optimizer_cls), qkv_split=False,
        description=f"emerging_optimizers {optimizer_cls.__name__} over TP shards or FSDP2 row shards "
                    f"(whole matrix gathered)",
    )


def _entry_maker(**settings: Any) -> Callable[[type], EmergingOptimizerEntry]:
    return lambda optimizer_cls: EmergingOptimizerEntry(optimizer_cls, **settings)


# Muon subclasses read the muon_* fields too; the other orthogonalized optimizers (mop,
# polargrad, scion, spel) keep their own defaults (mop's nuclear-norm scale, for one) apart from
# lr and weight decay. mop, polargrad and scion gain tensor parallelism and FSDP2 (their update
# is a function of the whole momentum matrix only); spel projects the weights after each update, so
# it has none. REKLS is a SOAP variant: soap_* fields apply.
_CURATED: dict[str, Callable[[type], EmergingOptimizerEntry]] = {
    "muon": _muon_entry,
    "adaptive_muon": _adaptive_muon_entry,
    "mop": _whole_matrix_entry,
    "polargrad": _whole_matrix_entry,
    "scion": _whole_matrix_entry,
    "muon_hyperball": _entry_maker(
        routing="hidden_matrices", config_prefixes=("muon",), init_state_fn=_init_muon_hyperball_state
    ),
    "sinkhorn_muon": _entry_maker(
        routing="hidden_matrices", config_prefixes=("muon",), param_check=_sinkhorn_param_problem
    ),
    "soap": _entry_maker(routing="hidden_matrices", config_to_kwargs=_adam_style_kwargs),
    "rekls": _entry_maker(routing="hidden_matrices", config_to_kwargs=_adam_style_kwargs, config_prefixes=("soap",)),
    "psgd_pro": _entry_maker(routing="hidden_matrices", init_state_fn=_init_psgd_state),
    "oblique_sgd": _entry_maker(routing="hidden_matrices", init_state_fn=_init_oblique_sgd_state),
    "oblique_adam": _entry_maker(
        routing="hidden_matrices", init_state_fn=_init_oblique_adam_state, config_to_kwargs=_adam_style_kwargs
    ),
    "lion": _entry_maker(routing="all", config_to_kwargs=_lion_kwargs),
    "laprop": _entry_maker(routing="all", config_to_kwargs=_adam_style_kwargs),
}


# ------------------------------------------------------------------------------------------------
# Building an emerging optimizer: kwargs from the config, checked against the signature
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Argument:
    parameter: inspect.Parameter
    annotation: Any  # resolved type hint, or inspect.Parameter.empty


def constructor_parameters(optimizer_cls: type) -> dict[str, _Argument]:
    """Named `__init__` arguments of `optimizer_cls`, following `**kwargs` into parent classes."""
    found: dict[str, _Argument] = {}
    for klass in optimizer_cls.__mro__:
        if klass in (torch.optim.Optimizer, object):
            break
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            hints = typing.get_type_hints(init)
        except Exception:  # unresolvable annotations: no value checks for this class
            hints = {}
        forwards_kwargs = False
        for parameter in list(inspect.signature(init).parameters.values())[1:]:
            if parameter.kind is inspect.Parameter.VAR_KEYWORD:
                forwards_kwargs = True
            elif parameter.kind is not inspect.Parameter.VAR_POSITIONAL and parameter.name != "params":
                annotation = hints.get(parameter.name, inspect.Parameter.empty)
                found.setdefault(parameter.name, _Argument(parameter, annotation))
        if not forwards_kwargs:
            break
    return found


def _build_emerging(
    name: str, entry: EmergingOptimizerEntry, param_groups: list[dict], config: Any, context: BuildContext
) -> torch.optim.Optimizer:
    arguments = constructor_parameters(entry.optimizer_cls)
    kwargs, sources = optimizer_kwargs(name, entry, config, context)
    if "lr" in arguments and "lr" not in kwargs and param_groups:
        kwargs["lr"], sources["lr"] = param_groups[0]["lr"], "the first param group's lr"
    _check_kwargs(name, entry.optimizer_cls, arguments, kwargs, sources)
    _check_param_shapes(name, entry.routing, param_groups)
    if entry.param_check is not None:
        check_params(name, entry, param_groups, config, context)
    optimizer = entry.optimizer_cls(param_groups, **kwargs)
    (entry.init_state_fn or init_state_step_free)(optimizer)
    return watch_first_step(name, optimizer, config)  # torch.compile'd updates (optimizers/compiled_step.py)


def optimizer_kwargs(
    name: str, entry: EmergingOptimizerEntry, config: Any, context: BuildContext = BuildContext()
) -> tuple[dict[str, Any], dict[str, str]]:
    """(constructor kwargs, where each came from) for `entry` under `config` (module docstring)."""
    arguments = constructor_parameters(entry.optimizer_cls)
    kwargs: dict[str, Any] = {}
    sources: dict[str, str] = {}
    prefixes = (name, *entry.config_prefixes)
    for argument in arguments:
        if argument in CONTEXT_ARGS:
            continue
        for field_name in (*(f"{prefix}_{argument}" for prefix in prefixes), argument):
            if getattr(config, field_name, None) is not None:
                kwargs[argument], sources[argument] = getattr(config, field_name), f"OptimizerConfig.{field_name}"
                break
    if "weight_decay_method" in arguments and "weight_decay_method" not in kwargs:
        kwargs["weight_decay_method"] = "decoupled" if config.decoupled_weight_decay else "l2"
        sources["weight_decay_method"] = "OptimizerConfig.decoupled_weight_decay"
    if entry.config_to_kwargs is not None:
        extra = dict(entry.config_to_kwargs(config))
        kwargs.update(extra)
        sources.update({key: f"config_to_kwargs of optimizer {name!r}" for key in extra})
    if context.on_cpu:
        _warn_if_bf16_is_emulated({a: kwargs[a] for a in kwargs if a.endswith("fp32_matmul_prec")}, sources)
    if "tp_group" in arguments:
        kwargs["tp_group"], sources["tp_group"] = context.tp_group, "the factory"
    if "layouts" in arguments:
        kwargs["layouts"], sources["layouts"] = dict(context.layouts or {}), "the factory"
    if context.fsdp_shards is not None:  # only classes that take them support FSDP2 (`Support`)
        kwargs["fsdp_group"], sources["fsdp_group"] = context.fsdp_group, "the factory"
        kwargs["fsdp_shards"], sources["fsdp_shards"] = dict(context.fsdp_shards), "the factory"
    return kwargs, sources


_WARNED_ONCE: set[str] = set()  # warnings this process has given


def _warn_if_bf16_is_emulated(precisions: Mapping[str, Any], sources: Mapping[str, str]) -> None:
    """'medium' means bf16 matrix products: honoured, but slow on a CPU that emulates them."""
    medium = [argument for argument, value in precisions.items() if value == "medium"]
    if not medium or "emulated_bf16" in _WARNED_ONCE or native_bf16_matmul(torch.device("cpu")):
        return
    _WARNED_ONCE.add("emulated_bf16")
    warnings.warn(
        f"{sources[medium[0]]}='medium' runs matrix products in bf16, which this CPU emulates "
        f"(no {'/'.join(CPU_BF16_FLAGS)} instructions): expect it far slower than fp32. Set it to "
        f"'highest' for fp32 on this machine.",
        UserWarning,
        stacklevel=4,
    )


def _allowed_values(argument: str, annotation: Any) -> Optional[tuple]:
    """The values an argument may take, when its annotation or name says so; None: any."""
    if argument == "coefficient_type":
        from megatron_eopt.ops.newton_schulz import coefficient_types

        return coefficient_types()
    if argument.endswith("fp32_matmul_prec"):
        from emerging_optimizers.utils import FP32MatmulPrecT

        return typing.get_args(FP32MatmulPrecT)
    return _literal_values(annotation)


def _literal_values(annotation: Any) -> Optional[tuple]:
    if typing.get_origin(annotation) is Literal:
        return typing.get_args(annotation)
    if typing.get_origin(annotation) in (Union, types.UnionType):
        members = [_literal_values(arg) if arg is not type(None) else (None,) for arg in typing.get_args(annotation)]
        if all(m is not None for m in members):
            return tuple(value for m in members for value in m)
    return None


def _check_kwargs(
    name: str,
    optimizer_cls: type,
    arguments: Mapping[str, _Argument],
    kwargs: Mapping[str, Any],
    sources: Mapping[str, str],
) -> None:
    unknown = sorted(set(kwargs) - set(arguments))
    if unknown:
        raise TypeError(
            f"optimizer {name!r}: {optimizer_cls.__name__} takes no argument(s) {unknown} (from "
            f"{sources[unknown[0]]}); it takes {sorted(arguments)}."
        )
    for argument, value in kwargs.items():
        allowed = _allowed_values(argument, arguments[argument].annotation)
        if allowed is not None and value not in allowed:
            raise ValueError(
                f"optimizer {name!r}: {sources[argument]} must be one of "
                f"{', '.join(map(repr, allowed))} for {optimizer_cls.__name__}.{argument} (from the "
                f"installed {optimizer_cls.__module__.split('.')[0]}); got {value!r}."
            )
    missing = [
        argument for argument, spec in arguments.items()
        if spec.parameter.default is inspect.Parameter.empty and argument not in kwargs
    ]
    if missing:
        raise ValueError(
            f"optimizer {name!r}: {optimizer_cls.__name__} needs {missing}, which the config does not "
            f"give; set OptimizerConfig fields named '{name}_<argument>' or '<argument>' (or give the "
            f"entry a config_to_kwargs)."
        )


def check_params(
    name: str, entry: EmergingOptimizerEntry, param_groups: list[dict], config: Any,
    context: BuildContext = BuildContext(),
) -> None:
    """Run `entry.param_check` on every parameter; the first failure raises, naming it by fqn."""
    if entry.param_check is None:
        return
    defaults = {
        argument: spec.parameter.default
        for argument, spec in constructor_parameters(entry.optimizer_cls).items()
        if spec.parameter.default is not inspect.Parameter.empty
    }
    kwargs = {**defaults, **optimizer_kwargs(name, entry, config, context)[0]}
    for group in param_groups:
        fqns = group.get("param_fqns") or [f"<parameter {i}>" for i in range(len(group["params"]))]
        for param, fqn in zip(group["params"], fqns):
            problem = entry.param_check(param, kwargs)
            if problem:
                raise ValueError(
                    f"optimizer {name!r} cannot step parameter {fqn!r} (shape {tuple(param.shape)}): {problem}"
                )


def _check_param_shapes(name: str, routing: str, param_groups: list[dict]) -> None:
    if routing == "all":
        return
    for group in param_groups:
        fqns = group.get("param_fqns") or [f"<parameter {i}>" for i in range(len(group["params"]))]
        for param, fqn in zip(group["params"], fqns):
            if param.dim() != 2:
                raise ValueError(
                    f"parameter {fqn!r} has shape {tuple(param.shape)}, but optimizer {name!r} steps "
                    f"2-D matrices only; route it to the scalar optimizer (muon_scalar_optimizer)."
                )


_TABLE = OptimizerTable()  # the process's table; filled at its first use
