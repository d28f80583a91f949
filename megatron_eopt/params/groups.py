"""Model chunks + overrides -> torch param groups, routing, and one record of facts per parameter.

A group is identified by a stable text key `<optimizer>/<dense|expert>/<override keys>`: the
optimizer that steps it, whether it holds expert parameters, and the descriptions of the
override keys its parameters matched (never the override values, so a checkpoint still matches
its groups after an lr change). Every rank creates the same set of keys, some groups possibly
empty, because checkpoints match groups by key. Groups list their parameters' fqns in
`param_fqns`, parallel to `params` (metadata; torch ignores it).

Routing (`ParamRouting`): an optimizer that takes only some parameters (Muon: hidden 2-D
matrices) gets those; the others go to the scalar optimizer; see megatron_eopt.registry for
which optimizer takes what. `matrix_layouts` describes the matrices such an optimizer
orthogonalizes (tensor-parallel shards, fused QKV and gate/up weights).
"""

import fnmatch
import json
import os
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_eopt.ops.splits import MatrixLayout, tensor_parallel_rank_shape
from megatron_eopt.params.fused_layouts import (FusedBlocks, FusedWeight, expert_batch_blocks, fused_blocks,
                                                is_experts_container, registered_function, unknown_fused_name)
from megatron_eopt.params.heads import embedding_and_output_reasons
from megatron_eopt.params.overrides import describe_key, matching_keys, merge_overrides
from megatron_eopt.runtime.process_groups import group_size

DEFAULT_GROUP_NAME = "default"
# How `routed_because` begins for an N-D tensor that no table entry describes: the scalar optimizer
# steps it by fallback, and the build names it (routing_fallbacks).
UNKNOWN_LAYOUT = "N-D tensor of no known layout"


@dataclass(frozen=True)
class ParamRecord:
    """What the optimizer needs to know about one parameter, computed once."""

    fqn: str  # unique across model chunks; the key of this parameter's optimizer state
    name: str  # name inside its model chunk, as override globs see it
    param: torch.nn.Parameter
    group_key: str
    is_expert_parallel: bool  # megatron-core: param.allreduce is False
    tensor_model_parallel: bool  # sharded over the (expert) tensor-parallel group
    partition_dim: int  # -1 when not tensor-parallel
    is_shared: bool  # a second copy of a tied parameter (megatron-core: param.shared)
    optimizer_name: str = ""  # the registered optimizer that steps it
    chunk_index: int = 0  # which model chunk owns it
    # Its name in DTensor optimizer state (torch DCP, fsdp_dtensor) when not `fqn`: a routed expert's
    # on a mesh of its own, by global index (params/expert_names.py); "" when its layout has none.
    stored_name: Optional[str] = None
    routed_because: str = ""  # why `optimizer_name` steps it (ParamRouting.route); the param map dump shows it

    @property
    def checkpoint_name(self) -> str:
        return self.fqn if self.stored_name is None else self.stored_name


@dataclass(frozen=True)
class ParamRouting:
    """Which optimizer steps each parameter, and why (`route`).

    optimizer: the configured optimizer.  routing: what it takes (registry's `Routing`):
    'all' every parameter; 'matrices' every 2-D parameter not marked `use_muon=False`;
    'hidden_matrices' those that are moreover neither `is_embedding_or_output_parameter`, nor a
    lookup table (a parameter of a `lookup_table_types` module: megatron-core tags only the word
    embedding and the output layer, not the learned position embedding), nor a token embedding
    or output head found by structure (params/heads.py, passed per parameter to `route`),
    unless the user opted them in with `use_muon=True`.
    scalar_optimizer: steps the rest.
    embedding_or_output_names: name globs (fnmatch, as override keys match names) of parameters
    that count as `is_embedding_or_output_parameter` without the attribute: torch FSDP2's
    `fully_shard` replaces every parameter by a DTensor and drops megatron-core's attributes,
    so for such models the factory names the output layer here (distributed/fsdp2.py).
    expert_parallel_fqns: parameters that count as expert-parallel (megatron-core's
    `allreduce=False`) without the attribute: the routed experts that torch FSDP2 shards over a
    mesh of their own (placement/fully_sharded_layout.py).
    matrix_batches: whether the optimizer also takes N-D experts tensors, a batch of matrices
    each (params/fused_layouts.py says which: the parameters of a known experts container);
    their containers' other parameters (per-expert biases) go to the scalar optimizer.
    use_muon_names: (glob, value) pairs that set `use_muon` by parameter name
    (OptimizerConfig.muon_include_params / muon_exclude_params), which survive `fully_shard`
    where a parameter attribute set before it does not. A name and an attribute that disagree,
    or two globs that do, raise.
    """

    optimizer: str
    routing: str = "all"
    scalar_optimizer: Optional[str] = None
    lookup_table_types: tuple[type, ...] = (torch.nn.Embedding,)
    embedding_or_output_names: tuple[str, ...] = ()
    expert_parallel_fqns: frozenset[str] = frozenset()
    matrix_batches: bool = False
    use_muon_names: tuple[tuple[str, bool], ...] = ()

    def __post_init__(self) -> None:
        if self.routing != "all" and not self.scalar_optimizer:
            raise ValueError(f"routing {self.routing!r} of optimizer {self.optimizer!r} needs a scalar optimizer.")

    @property
    def optimizers(self) -> tuple[str, ...]:
        """The optimizers in chain order: the configured one, then the scalar one (if used)."""
        if self.routing == "all" or self.scalar_optimizer == self.optimizer:
            return (self.optimizer,)
        return (self.optimizer, self.scalar_optimizer)

    def optimizer_for(self, param: torch.nn.Parameter, owner: Optional[torch.nn.Module], name: str = "") -> str:
        return self.route(param, owner, name)[0]

    def route(self, param: torch.nn.Parameter, owner: Optional[torch.nn.Module], name: str = "",
              structural: Optional[str] = None) -> tuple[str, str]:
        """(optimizer, why). `structural`: why the parameter is a token embedding or output head
        found by structure (params/heads.py), None when it is not one."""
        takes, why = self._takes(param, owner, name, structural)
        return (self.optimizer if takes else self.scalar_optimizer), why

    def _takes(self, param: torch.nn.Parameter, owner: Optional[torch.nn.Module], name: str,
               structural: Optional[str]) -> tuple[bool, str]:
        if self.routing == "all":
            return True, f"{self.optimizer} steps every parameter"
        use_muon, source = self.use_muon_of(param, name)  # None: not set; True opts in, False out
        if param.dim() > 2 or is_experts_container(owner):
            return (False, source) if use_muon is False else self._takes_experts(param, owner, name)
        if param.dim() != 2:
            return False, f"{param.dim()}-D, not a matrix"
        if use_muon is not None:
            return use_muon, source
        if self.routing == "matrices":
            return True, "matrix"
        not_hidden = self._embedding_or_output(param, owner, name, structural)
        return (False, not_hidden) if not_hidden else (True, "hidden matrix")

    def _embedding_or_output(self, param: torch.nn.Parameter, owner: Optional[torch.nn.Module], name: str,
                             structural: Optional[str]) -> str:
        """Why `param` is an embedding or output layer; "" when it is not one."""
        if getattr(param, "is_embedding_or_output_parameter", False):
            return "is_embedding_or_output_parameter"
        if structural:  # what the model reports is the most specific reason
            return structural
        if isinstance(owner, self.lookup_table_types):
            base = next(t for t in self.lookup_table_types if isinstance(owner, t))
            return f"lookup table ({'nn.Embedding' if base is torch.nn.Embedding else base.__name__})"
        named = next((p for p in self.embedding_or_output_names if fnmatch.fnmatchcase(name, p)), None)
        return f"output layer by megatron-core's name ({named})" if named is not None else ""

    def use_muon_of(self, param: torch.nn.Parameter, name: str) -> tuple[Optional[bool], str]:
        """The parameter's `use_muon` (attribute, else a name glob), and where it was set."""
        attribute = getattr(param, "use_muon", None)
        globs = {value: glob for glob, value in self.use_muon_names if fnmatch.fnmatchcase(name, glob)}
        if len(globs) == 2:
            raise ValueError(
                f"parameter {name!r} matches OptimizerConfig.muon_include_params ({globs[True]!r}) and "
                f"muon_exclude_params ({globs[False]!r}); a parameter may be in one of them only.")
        by_name = next(iter(globs), None)
        if attribute is not None and by_name is not None and bool(attribute) != by_name:
            field = "muon_include_params" if by_name else "muon_exclude_params"
            raise ValueError(
                f"parameter {name!r} has use_muon={attribute!r} but matches OptimizerConfig.{field} "
                f"({globs[by_name]!r}); drop one of the two.")
        if attribute is not None:
            return bool(attribute), f"use_muon={bool(attribute)}"
        if by_name is not None:
            field = "muon_include_params" if by_name else "muon_exclude_params"
            return by_name, f"{field} ({globs[by_name]!r})"
        return None, ""


    def _takes_experts(self, param: torch.nn.Parameter, owner: Optional[torch.nn.Module], name: str
                       ) -> tuple[bool, str]:
        """An N-D tensor, or a parameter of an experts container: a batch of matrices for an optimizer
        that takes them (params/fused_layouts.py), else the scalar optimizer's."""
        if param.dim() == 2:
            return False, "per-expert vectors of an experts container (biases)"
        if expert_batch_blocks(owner, name.rpartition(".")[2], name, param) is None:
            return False, self._not_a_batch(param, owner, name)
        if not self.matrix_batches:
            return False, f"experts tensor ({param.dim()}-D): {self.optimizer} orthogonalizes 2-D matrices only"
        return True, f"experts tensor ({param.dim()}-D): one matrix per expert"

    def _not_a_batch(self, param: torch.nn.Parameter, owner: Optional[torch.nn.Module], name: str) -> str:
        """Why an N-D tensor that is no known batch of matrices goes to the scalar optimizer; a
        parameter opted into Muon by the user is refused: its matrices are unknown."""
        if isinstance(owner, torch.nn.modules.conv._ConvNd):
            why = f"convolution kernel ({param.dim()}-D)"
        elif sum(size > 1 for size in param.shape) <= 1:
            why = f"{param.dim()}-D with one dimension over 1: a vector"
        else:
            why = f"{UNKNOWN_LAYOUT} ({param.dim()}-D {type(owner).__name__}.{name.rpartition('.')[2]})"
        use_muon, source = self.use_muon_of(param, name)
        if use_muon:
            raise ValueError(
                f"parameter {name!r} ({tuple(param.shape)}) is opted into {self.optimizer} by {source}, but it is "
                f"a {why}: which of its dimensions index matrices is unknown. Declare its module with "
                f"megatron_eopt.params.fused_layouts.register_experts_container, or leave it out of the opt-in.")
        return why


def named_trainable_parameters(
    model_chunks: Iterable[torch.nn.Module], trainable_only: bool = True
) -> list[tuple[str, str, torch.nn.Parameter]]:
    """(fqn, name, param) for every trainable parameter, each parameter once, in chunk order.

    With several chunks (virtual pipeline stages) names repeat across chunks, so the fqn
    gets a `model_chunk{i}.` prefix. `trainable_only=False` includes frozen parameters too
    (checkpoints save the whole model).
    """
    chunks = list(model_chunks)
    seen: set[int] = set()
    result = []
    for index, chunk in enumerate(chunks):
        if not isinstance(chunk, torch.nn.Module):
            raise TypeError(
                f"model_chunks must be torch.nn.Module objects; item {index} is "
                f"{type(chunk).__name__}."
            )
        for name, param in chunk.named_parameters():
            if (trainable_only and not param.requires_grad) or id(param) in seen:
                continue
            seen.add(id(param))
            fqn = name if len(chunks) == 1 else f"model_chunk{index}.{name}"
            result.append((fqn, name, param))
    return result


def group_key_for(optimizer: str, is_expert_parallel: bool, key_descriptions: Iterable[str]) -> str:
    kind = "expert" if is_expert_parallel else "dense"
    keys = sorted(set(key_descriptions))
    return f"{optimizer}/{kind}/{'+'.join(keys) if keys else DEFAULT_GROUP_NAME}"


@dataclass(frozen=True)
class _GroupId:
    optimizer: str
    is_expert_parallel: bool
    descriptions: tuple[str, ...]

    @property
    def key(self) -> str:
        return group_key_for(self.optimizer, self.is_expert_parallel, self.descriptions)


def _owners_and_chunks(chunks: list) -> dict[int, tuple[torch.nn.Module, int]]:
    """id(param) -> (the module holding it directly, its chunk index); the first, if tied."""
    found: dict[int, tuple[torch.nn.Module, int]] = {}
    for index, chunk in enumerate(chunks):
        for module in chunk.modules() if isinstance(chunk, torch.nn.Module) else ():
            for param in module.parameters(recurse=False):
                found.setdefault(id(param), (module, index))
    return found


def build_param_groups(
    model_chunks: Iterable[torch.nn.Module],
    config: Any,
    config_overrides: Mapping[Any, Mapping[str, Any]],
    align_groups: Sequence[dist.ProcessGroup] = (),
    routing: Optional[ParamRouting] = None,
) -> tuple[list[dict], list[ParamRecord]]:
    """Param groups (torch format plus megatron-core's keys) and the per-parameter records.

    `align_groups`: groups over which, one after the other, the group keys are gathered so that
    they agree on all ranks that checkpoint together (`ParallelGroups.spanning_groups()`); none
    for a single process. `routing`: None sends every parameter to `config.optimizer`.
    Groups come dense before expert, the configured optimizer's before the scalar one's.
    """
    routing = routing or ParamRouting(config.optimizer)
    key_by_description = _keys_by_description(config_overrides)
    records, local_ids = _records_and_group_ids(list(model_chunks), config_overrides, routing)
    groups = []
    for group_id in _aligned_group_ids(local_ids, align_groups, routing.optimizers):
        unknown = [d for d in group_id.descriptions if d not in key_by_description]
        if unknown:
            raise ValueError(
                f"param group {group_id.key!r} exists on another rank but its override keys "
                f"{unknown} are not in this rank's config_overrides; every rank must pass the "
                f"same config_overrides."
            )
        keys = [key_by_description[d] for d in group_id.descriptions]
        override = merge_overrides(keys, config_overrides, f"<group {group_id.key}>")
        members = [r for r in records if r.group_key == group_id.key]
        groups.append(_make_group(group_id, members, override, config))
    return groups, records


def _records_and_group_ids(
    chunks: list, config_overrides: Mapping[Any, Mapping[str, Any]], routing: ParamRouting
) -> tuple[list[ParamRecord], dict[str, _GroupId]]:
    """Route and record every trainable parameter; the group ids this rank uses."""
    records: list[ParamRecord] = []
    group_ids: dict[str, _GroupId] = {}
    parameters = named_trainable_parameters(chunks)  # checks the chunks' types
    owners = _owners_and_chunks(chunks)
    structural = _structural_reasons(chunks, routing)
    for fqn, name, param in parameters:
        keys = matching_keys(config_overrides, param, name)
        merge_overrides(keys, config_overrides, name)  # a conflict raises here, naming `name`
        is_expert = not getattr(param, "allreduce", True) or fqn in routing.expert_parallel_fqns
        owner, chunk_index = owners[id(param)]
        optimizer, why = routing.route(param, owner, name, structural.get(id(param)))
        group_id = _GroupId(optimizer, is_expert, tuple(sorted(describe_key(key) for key in keys)))
        group_ids[group_id.key] = group_id
        records.append(_make_record(fqn, name, param, group_id.key, is_expert, optimizer, chunk_index, why))
    return records, group_ids


def _structural_reasons(chunks: list, routing: ParamRouting) -> dict[int, str]:
    """Token embeddings and output heads by structure (params/heads.py), only where routing asks."""
    if routing.routing != "hidden_matrices":
        return {}
    return embedding_and_output_reasons(chunks, routing.lookup_table_types)


def _keys_by_description(config_overrides: Mapping[Any, Mapping[str, Any]]) -> dict[str, Any]:
    key_by_description: dict[str, Any] = {}
    for key in config_overrides:
        description = describe_key(key)
        if description in key_by_description:
            # Groups are identified by these descriptions; two keys sharing one would share a
            # group and silently lose one key's override.
            raise ValueError(
                f"config_overrides has two different keys described as {description}: "
                f"{key_by_description[description]!r} and {key!r}. Give their predicates "
                f"distinct names, or merge them into one key."
            )
        key_by_description[description] = key
    return key_by_description


def _make_record(
    fqn: str, name: str, param: torch.nn.Parameter, group_key: str, is_expert: bool, optimizer: str, chunk: int,
    routed_because: str = "",
) -> ParamRecord:
    tensor_parallel = bool(getattr(param, "tensor_model_parallel", False))
    return ParamRecord(
        fqn=fqn,
        name=name,
        param=param,
        group_key=group_key,
        is_expert_parallel=is_expert,
        tensor_model_parallel=tensor_parallel,
        partition_dim=int(getattr(param, "partition_dim", -1)) if tensor_parallel else -1,
        is_shared=bool(getattr(param, "shared", False)),
        optimizer_name=optimizer,
        chunk_index=chunk,
        routed_because=routed_because,
    )


def _aligned_group_ids(
    local: dict[str, _GroupId], groups: Sequence[dist.ProcessGroup], optimizers: Sequence[str]
) -> list[_GroupId]:
    """The group ids of all ranks, in one order on every rank."""
    union = dict(local)
    for group in groups:  # each gather passes on what the previous ones collected
        gathered: list[Optional[dict[str, _GroupId]]] = [None] * group_size(group)
        dist.all_gather_object(gathered, union, group=group)
        union = {key: group_id for per_rank in gathered for key, group_id in per_rank.items()}

    def order(key: str) -> tuple:
        group_id = union[key]
        rank = optimizers.index(group_id.optimizer) if group_id.optimizer in optimizers else len(optimizers)
        # Dense before expert; the configured optimizer first; the default group first.
        return (group_id.is_expert_parallel, rank, group_id.optimizer, bool(group_id.descriptions), key)

    return [union[key] for key in sorted(union, key=order)]


def _make_group(group_id: _GroupId, members: list[ParamRecord], override: dict, config: Any) -> dict:
    group_key = group_id.key
    group = {
        "params": [r.param for r in members],
        "param_fqns": [r.fqn for r in members],
        "group_key": group_key,
        "optimizer": group_id.optimizer,
        "is_expert_parallel": group_id.is_expert_parallel,
        # megatron-core's logging reads the lr of the first default_config group.
        "default_config": not any("lr" in field for field in override),
        "wd_mult": 1.0,
        "lr_mult": 1.0,
        "is_decoupled_lr": False,
        "max_lr": config.lr,
        "min_lr": config.min_lr,
    }
    group.update(override)
    if group["max_lr"] is None:
        raise ValueError(
            f"param group {group_key!r} has no learning rate: set OptimizerConfig.lr (the peak "
            f"learning rate), or max_lr in its override."
        )
    # Right before any scheduler runs; the scheduler later sets both the same way.
    group["lr"] = group["max_lr"]
    start_wd = group.get("start_wd", config.weight_decay)
    group["weight_decay"] = start_wd * group["wd_mult"]
    return group


def dump_param_group_map(path: str, param_groups: list[dict], records: list[ParamRecord],
                         tp_modes: Optional[Mapping[str, str]] = None) -> str:
    """Write which optimizer and group every parameter of this rank got, and why, as JSON.

    `path` is a directory; each rank writes `rank_{rank:05d}.json` there. Returns the file.
    `tp_modes` (fqn -> Muon TP mode, 'auto' resolved) adds a 'tp_mode' entry to those parameters.
    """
    index_by_key = {group["group_key"]: i for i, group in enumerate(param_groups)}
    entries = {
        r.fqn: {
            "group_index": index_by_key[r.group_key],
            "group_key": r.group_key,
            "optimizer": r.optimizer_name,
            "routed_because": r.routed_because,
            "shape": list(r.param.shape),
        }
        for r in records
    }
    for fqn, mode in (tp_modes or {}).items():
        if fqn in entries:
            entries[fqn]["tp_mode"] = mode
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    os.makedirs(path, exist_ok=True)
    file_path = os.path.join(path, f"rank_{rank:05d}.json")
    with open(file_path, "w") as handle:
        json.dump(entries, handle, indent=1, sort_keys=True)
    return file_path


def matrix_layouts(
    records: Iterable[ParamRecord], model_chunks: Sequence[torch.nn.Module], tp_size: int, split_qkv: bool,
    per_head: bool = False,
) -> dict[str, MatrixLayout]:
    """fqn -> MatrixLayout of every record: its shard of the global matrix and its fused blocks.

    The blocks come from params/fused_layouts.py's table, by the module that holds the weight's
    linear layer: `linear_qkv.weight` splits into q/k/v(/gate) blocks per query group when
    `split_qkv` (per head with `per_head`), a gated `linear_fc1.weight` into gate and up halves,
    MLA's, Mamba's and gated delta net's projections into their parts. They read the owner's
    TransformerConfig (`.config`, else the chunk's). A layout that does not fit raises, naming the fqn.
    """
    chunks = list(model_chunks)
    sites = {**_linear_layer_sites(chunks), **batch_sites(chunks)}
    return {
        r.fqn: matrix_layout(r, chunk_model_config(chunks[r.chunk_index]), tp_size, split_qkv, per_head,
                             *sites.get(id(r.param), (None, "")))
        for r in records
    }


def _linear_layer_sites(chunks: list) -> dict[int, tuple[torch.nn.Module, str]]:
    """id(weight) -> (the module holding its linear layer, that layer's attribute name)."""
    sites: dict[int, tuple[torch.nn.Module, str]] = {}
    for chunk in chunks:
        for module in chunk.modules() if isinstance(chunk, torch.nn.Module) else ():
            for attribute, child in module.named_children():
                # a registered list of linear layers (Zamba2's adapters): every weight in it, under the list
                listed = isinstance(child, (torch.nn.ModuleList, torch.nn.Sequential)) \
                    and registered_function(module, attribute) is not None
                for name, param in child.named_parameters(recurse=listed):
                    if name.rsplit(".", 1)[-1].startswith("weight"):  # 'weight', or a grouped layer's 'weight0', ...
                        sites.setdefault(id(param), (module, attribute))
            for name, param in module.named_parameters(recurse=False):  # a matrix held as a bare parameter
                if param.dim() == 2 and registered_function(module, name) is not None:
                    sites[id(param)] = (module, name)
    return sites


def splits_any_per_head(records: Iterable[ParamRecord], chunks: Sequence[torch.nn.Module], optimizer: str) -> bool:
    """Whether `muon_split_qkv_per_head` changes the blocks of a 2-D weight routed to `optimizer`:
    a megatron-core `linear_qkv`, or a weight whose table entry reads `per_head` (a family's q/k/v)."""
    chunks = list(chunks)
    sites = _linear_layer_sites(chunks)
    for record in records:
        if record.optimizer_name != optimizer or record.param.dim() != 2:
            continue
        if record.name.endswith("linear_qkv.weight"):
            return True
        owner, attribute = sites.get(id(record.param), (None, ""))
        function = registered_function(owner, attribute) if owner is not None else None
        if function is None:
            continue
        weights = [FusedWeight(fqn=record.fqn, param=record.param, owner=owner, attribute=attribute, tp_size=1,
                               model_config=chunk_model_config(chunks[record.chunk_index]), per_head=per_head)
                   for per_head in (False, True)]
        try:
            if function(weights[0]) != function(weights[1]):
                return True
        except (ValueError, AttributeError, TypeError):
            continue  # the layout step says what is wrong, in its own error
    return False


def routing_fallbacks(records: Iterable[ParamRecord], chunks: Sequence[torch.nn.Module], optimizer: str
                      ) -> dict[str, str]:
    """fqn -> why, for every parameter routed by a fallback: an N-D tensor of no known layout (to the
    scalar optimizer), or a 2-D weight whose name marks it fused but that no table entry describes
    (to `optimizer` whole). docs/fsdp2.md lists the weights kept whole on purpose."""
    chunks = list(chunks)
    sites = _linear_layer_sites(chunks)
    found = {}
    for record in records:
        if record.routed_because.startswith(UNKNOWN_LAYOUT):
            found[record.fqn] = record.routed_because
        elif record.param.dim() == 2 and record.optimizer_name == optimizer:
            owner, attribute = sites.get(id(record.param), (None, ""))
            why = _whole_by_fallback(record, owner, attribute, chunk_model_config(chunks[record.chunk_index]))
            if why:
                found[record.fqn] = why
    return found


def _whole_by_fallback(record: ParamRecord, owner: Optional[torch.nn.Module], attribute: str, model_config: Any
                       ) -> str:
    """Why a 2-D weight goes to the matrix optimizer whole though it looks fused; "" when it does not."""
    kind = f"{type(owner).__name__}.{attribute}" if owner is not None else record.fqn
    function = registered_function(owner, attribute) if owner is not None else None
    if function is not None:
        try:
            facts = function(FusedWeight(fqn=record.fqn, param=record.param, owner=owner, attribute=attribute,
                                         model_config=model_config, tp_size=1))
        except (ValueError, AttributeError, TypeError):
            return ""  # the layout step says what is wrong, in its own error
        return "" if facts is not None else f"2-D {kind}: its module lacks the facts its table entry reads: one matrix"
    if owner is not None and unknown_fused_name(owner, attribute):
        return f"2-D {kind} is named like a fused weight but no table entry describes it: one matrix"
    if int(getattr(record.param, "partition_stride", 1)) > 1 and not getattr(record.param, "partition_sizes", None):
        return f"2-D {kind} has partition_stride={record.param.partition_stride} and no table entry: one matrix"
    return ""


def batch_sites(chunks: list) -> dict[int, tuple[torch.nn.Module, str]]:
    """id(N-D parameter) -> (the module holding it directly, its attribute): experts tensors."""
    sites: dict[int, tuple[torch.nn.Module, str]] = {}
    for chunk in chunks:
        for module in chunk.modules() if isinstance(chunk, torch.nn.Module) else ():
            for name, param in module.named_parameters(recurse=False):
                if param.dim() > 2:
                    sites.setdefault(id(param), (module, name))
    return sites


def _batch_layout(record: ParamRecord, owner: Optional[torch.nn.Module], attribute: str) -> MatrixLayout:
    """The layout of an N-D experts tensor: one row group per expert over its 2-D view."""
    blocks = expert_batch_blocks(owner, attribute, record.fqn, record.param)
    if blocks is None or record.tensor_model_parallel:
        raise ValueError(
            f"parameter {record.fqn!r} has shape {tuple(record.param.shape)}, but optimizer "
            f"{record.optimizer_name!r} orthogonalizes 2-D matrices, and N-D tensors only as the experts "
            f"of a known experts container without tensor parallelism (docs/fsdp2.md); route it to the "
            f"scalar optimizer (muon_scalar_optimizer)."
        )
    return _layout_of_batch(record, blocks)


def _layout_of_batch(record: ParamRecord, blocks: FusedBlocks) -> MatrixLayout:
    """One row group per matrix of `blocks.batch`, over its 2-D view."""
    if record.tensor_model_parallel:
        raise ValueError(f"parameter {record.fqn!r}: a weight stored as its matrices' transposes (or a batch of "
                         f"them) is not split by tensor parallelism here; it has partition_dim={record.partition_dim}.")
    return MatrixLayout(name=record.fqn, local_shape=blocks.batch.matrix_shape, num_row_groups=blocks.num_row_groups,
                        row_blocks=blocks.row_blocks, per_group=True, batch=blocks.batch)


def matrix_layout(record: ParamRecord, model_config: Any, tp_size: int, split_qkv: bool,
                  per_head: bool = False, owner: Optional[torch.nn.Module] = None,
                  attribute: str = "") -> MatrixLayout:
    """The MatrixLayout of one 2-D parameter (see `matrix_layouts`). Without `owner` (the module
    holding its linear layer as `attribute`) the blocks are found by the name's last but one part."""
    # A TP rank's part on Megatron-FSDP's (dp, tp) mesh; other DTensors (torchtitan's TP) are whole.
    shape = tensor_parallel_rank_shape(record.param) if record.tensor_model_parallel else tuple(record.param.shape)
    if len(shape) > 2:
        return _batch_layout(record, owner, attribute)
    if len(shape) != 2:
        raise ValueError(
            f"parameter {record.fqn!r} has shape {shape}, but optimizer {record.optimizer_name!r} "
            f"orthogonalizes 2-D matrices only; route it to the scalar optimizer (muon_scalar_optimizer)."
        )
    if owner is None:
        parts = record.name.split(".")
        attribute = parts[-2] if len(parts) > 1 and parts[-1] == "weight" else ""
    sharded_rows = record.tensor_model_parallel and record.partition_dim == 0
    owner_config = getattr(owner, "config", None)
    owner_config = owner_config if _has_head_count(owner_config) else None
    blocks = fused_blocks(FusedWeight(
        fqn=record.fqn, param=record.param, owner=owner, attribute=attribute,
        model_config=owner_config if owner_config is not None else model_config,
        tp_size=tp_size if sharded_rows else 1, split_qkv=split_qkv, per_head=per_head))
    if blocks.batch is not None:  # one matrix stored [in, out] (transformers' Conv1D): its transpose's rows
        return _layout_of_batch(record, blocks)
    return MatrixLayout(
        name=record.fqn,
        local_shape=shape,
        partition_dim=record.partition_dim,
        tp_size=tp_size,
        num_row_groups=blocks.num_row_groups,
        row_blocks=blocks.row_blocks,
        head_rows=blocks.head_rows,
        per_group=blocks.per_group,
        tp_contiguous=blocks.tp_contiguous,
    )


def _has_head_count(config: Any) -> bool:
    """Whether `config` has a global `num_attention_heads` (transformers' heterogeneous configs
    raise their own error for a per-layer attribute)."""
    try:
        return hasattr(config, "num_attention_heads")
    except Exception:  # transformers' AmbiguousGlobalPerLayerAttributeError
        return False


def chunk_model_config(chunk: torch.nn.Module) -> Any:
    """The TransformerConfig of a chunk, looking through wrappers (DDP, Float16Module: `.module`)."""
    module = chunk
    while module is not None:
        config = getattr(module, "config", None)
        if config is not None and _has_head_count(config):
            return config
        module = getattr(module, "module", None)
    return None


# Expert parameters are in optimizer children (and param groups) of their own only when
# megatron-core marks them `allreduce=False`, which it does at expert-parallel size > 1: at EP=1
# they are dense parameters. Checkpoints (ours and megatron-core's format) file them under the
# dense names, so state saved at one EP size is found at another.
DENSE, EXPERT = "dense", "expert"


def stored_child_name(child_name: str) -> str:
    """'expert' -> 'dense', 'muon/expert' -> 'muon/dense' (factory._child_name's forms)."""
    head, slash, kind = child_name.rpartition("/")
    return head + slash + DENSE if kind == EXPERT else child_name


def stored_group_key(group_key: str) -> str:
    """'adam/expert/<overrides>' -> 'adam/dense/<overrides>' (param_groups.group_key_for's form)."""
    optimizer, kind, rest = (group_key.split("/", 2) + ["", ""])[:3]
    return f"{optimizer}/{DENSE}/{rest}" if kind == EXPERT else group_key
