"""The parameters of one pipeline stage on one TP and EP rank, without building the model.

Names, order, local shapes and megatron-core's attributes are those of the trainer's GPTModel
(local layer spec, SequentialMLP experts): tests/unit/training/test_planner.py builds the real
model at TP, PP and EP 2 and compares. `planned_records` turns them into the library's
ParamRecords over meta tensors (no memory), routed by the library's ParamRouting, so ownership
(`assign_owners`) and block layouts (`matrix_layout`) are the library's own.
"""

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_eopt.params.groups import ParamRecord, ParamRouting
from megatron_eopt.training.arguments.moe import moe_layer_pattern
from megatron_eopt.training.model.settings import GPTModelSettings


@dataclass(frozen=True)
class PlannedParam:
    """One parameter of a stage as this TP/EP rank holds it."""

    name: str
    shape: tuple[int, ...]
    partition_dim: int = -1  # 0: rows split over TP (column-parallel), 1: columns, -1: not split
    expert: bool = False  # megatron-core's allreduce=False (experts at EP > 1)
    embedding_or_output: bool = False  # megatron-core's is_embedding_or_output_parameter
    lookup_table: bool = False  # a parameter of an embedding module


def stage_layers(settings: GPTModelSettings, pp: int, stage: int) -> range:
    """Global numbers of the decoder layers on pipeline stage `stage` (megatron-core's split: the
    first and last stages may have their own counts, the others share the rest evenly)."""
    first, last = settings.num_layers_in_first_pipeline_stage, settings.num_layers_in_last_pipeline_stage
    if settings.pipeline_model_parallel_layout is not None:
        raise ValueError("the planner does not read --pipeline-model-parallel-layout; give "
                         "--decoder-first/last-pipeline-num-layers or an even split.")
    if pp == 1:
        return range(settings.num_layers)
    sizes = [first, *([None] * (pp - 2)), last]
    middle = [i for i, size in enumerate(sizes) if size is None]
    rest = settings.num_layers - sum(size for size in sizes if size is not None)
    if rest < 0 or (middle and rest % len(middle)) or (not middle and rest):
        raise ValueError(f"{settings.num_layers} layers do not split over {pp} pipeline stages "
                         f"(first stage {first}, last {last}); give the first and last stages' counts so "
                         f"that the rest divides evenly.")
    counts = [size if size is not None else rest // len(middle) for size in sizes]
    start = sum(counts[:stage])
    return range(start, start + counts[stage])


def stage_parameters(settings: GPTModelSettings, tp: int = 1, pp: int = 1, stage: int = 0,
                     ep: int = 1, ep_rank: int = 0) -> list[PlannedParam]:
    """This stage's parameters on one TP rank and EP rank, in registration (named_parameters) order."""
    if not 0 <= stage < pp or not 0 <= ep_rank < ep:
        raise ValueError(f"stage {stage} of {pp} and EP rank {ep_rank} of {ep} are not a rank of this layout.")
    settings.check_tensor_parallel(tp)
    h, params = settings.hidden_size, []
    if stage == 0:
        params.append(PlannedParam("embedding.word_embeddings.weight", (settings.vocab_size // tp, h), 0,
                                   embedding_or_output=True, lookup_table=True))
        if settings.position_embedding_type == "learned_absolute":
            params.append(PlannedParam("embedding.position_embeddings.weight", (settings.max_positions, h),
                                       lookup_table=True))
    pattern = ([0] * settings.num_layers if settings.num_moe_experts is None
               else moe_layer_pattern(settings.moe_layer_freq, settings.num_layers))
    for local, layer in enumerate(stage_layers(settings, pp, stage)):
        prefix = f"decoder.layers.{local}."
        params += _norm(settings, prefix + "input_layernorm", h)
        params += _attention(settings, prefix + "self_attention.", tp)
        params += _norm(settings, prefix + "pre_mlp_layernorm", h)
        if pattern[layer]:
            params += _moe(settings, prefix + "mlp.", tp, ep, ep_rank)
        else:
            params += _mlp(settings, prefix + "mlp.", settings.ffn_hidden_size, tp)
    if stage == pp - 1:
        params += _norm(settings, "decoder.final_layernorm", h)
        if not settings.share_embeddings_and_output_weights or pp > 1:
            params.append(PlannedParam("output_layer.weight", (settings.vocab_size // tp, h), 0,
                                       embedding_or_output=True))
    return params


def _norm(settings: GPTModelSettings, name: str, size: int) -> list[PlannedParam]:
    norm = [PlannedParam(name + ".weight", (size,))]
    return norm + ([PlannedParam(name + ".bias", (size,))] if settings.normalization == "LayerNorm" else [])


def _linear(settings: GPTModelSettings, name: str, rows: int, cols: int, tp: int, partition_dim: int,
            bias: Optional[bool] = None, expert: bool = False) -> list[PlannedParam]:
    """A column- (partition_dim 0) or row-parallel (1) linear layer, or a plain one (-1)."""
    shape = (rows // tp, cols) if partition_dim == 0 else (rows, cols // tp) if partition_dim == 1 else (rows, cols)
    linear = [PlannedParam(name + ".weight", shape, partition_dim, expert=expert)]
    if settings.add_bias_linear if bias is None else bias:
        bias_split = partition_dim == 0
        linear.append(PlannedParam(name + ".bias", (shape[0],), 0 if bias_split else -1, expert=expert))
    return linear


def _attention(settings: GPTModelSettings, prefix: str, tp: int) -> list[PlannedParam]:
    heads, h = settings.num_attention_heads, settings.hidden_size
    if settings.multi_latent_attention:
        return _mla(settings, prefix, tp)
    kv = settings.kv_channels or h // heads
    params = _linear(settings, prefix + "linear_proj", h, heads * kv, tp, 1)
    qkv_bias = settings.add_bias_linear or settings.add_qkv_bias
    params += _linear(settings, prefix + "linear_qkv", (heads + 2 * settings.query_groups) * kv, h, tp, 0, qkv_bias)
    if settings.qk_layernorm:
        params += _norm(settings, prefix + "q_layernorm", kv) + _norm(settings, prefix + "k_layernorm", kv)
    return params


def _mla(settings: GPTModelSettings, prefix: str, tp: int) -> list[PlannedParam]:
    """megatron-core's MLASelfAttention: down-projections column-parallel (outputs gathered)."""
    heads, h, s = settings.num_attention_heads, settings.hidden_size, settings
    params = _linear(s, prefix + "linear_proj", h, heads * s.v_head_dim, tp, 1)
    q_width = heads * (s.qk_head_dim + s.qk_pos_emb_head_dim)
    if s.q_lora_rank is None:
        params += _linear(s, prefix + "linear_q_proj", q_width, h, tp, 0)
    else:
        params += _linear(s, prefix + "linear_q_down_proj", s.q_lora_rank, h, tp, 0)
        params += _linear(s, prefix + "linear_q_up_proj", q_width, s.q_lora_rank, tp, 0)
    params += _linear(s, prefix + "linear_kv_down_proj", s.kv_lora_rank + s.qk_pos_emb_head_dim, h, tp, 0)
    params += _linear(s, prefix + "linear_kv_up_proj", heads * (s.qk_head_dim + s.v_head_dim), s.kv_lora_rank, tp, 0)
    if s.qk_layernorm:
        if s.q_lora_rank is not None:
            params += _norm(s, prefix + "q_layernorm", s.q_lora_rank)
        params += _norm(s, prefix + "kv_layernorm", s.kv_lora_rank)
    return params


def _mlp(settings: GPTModelSettings, prefix: str, ffn: int, tp: int, expert: bool = False) -> list[PlannedParam]:
    fc1_rows = ffn * (2 if settings.gated else 1)
    fc1 = _linear(settings, prefix + "linear_fc1", fc1_rows, settings.hidden_size, tp, 0, expert=expert)
    return fc1 + _linear(settings, prefix + "linear_fc2", settings.hidden_size, ffn, tp, 1, expert=expert)


def _moe(settings: GPTModelSettings, prefix: str, tp: int, ep: int, ep_rank: int) -> list[PlannedParam]:
    """Router, this EP rank's experts (expert TP = TP), shared experts (dense, TP-split)."""
    experts, h = settings.num_moe_experts, settings.hidden_size
    if experts % ep:
        raise ValueError(f"{experts} experts do not split over expert-parallel size {ep}.")
    params = [PlannedParam(prefix + "router.weight", (experts, h))]
    ffn = settings.moe_ffn_hidden_size or settings.ffn_hidden_size
    for local in range(experts // ep):
        params += _mlp(settings, f"{prefix}experts.local_experts.{local}.", ffn, tp, expert=ep > 1)
    shared = settings.moe_shared_expert_intermediate_size
    if shared:
        if settings.moe_shared_expert_gate:
            params.append(PlannedParam(prefix + "shared_experts.gate_weight", (1, h)))
        params += _mlp(settings, prefix + "shared_experts.", shared, tp)
    return params


def planned_records(params: list[PlannedParam], routing: ParamRouting) -> list[ParamRecord]:
    """The library's ParamRecord of each parameter (over a meta tensor), routed by `routing`."""
    lookup_table = torch.nn.Embedding(1, 1, device="meta")  # the owner of lookup-table parameters
    records = []
    for spec in params:
        param = torch.nn.Parameter(torch.empty(spec.shape, device="meta"))
        if spec.embedding_or_output:
            param.is_embedding_or_output_parameter = True
        owner = lookup_table if spec.lookup_table else None
        optimizer = routing.optimizer_for(param, owner, spec.name)
        records.append(ParamRecord(fqn=spec.name, name=spec.name, param=param, group_key="", optimizer_name=optimizer,
                                   is_expert_parallel=spec.expert, tensor_model_parallel=spec.partition_dim >= 0,
                                   partition_dim=spec.partition_dim, is_shared=False))
    return records
