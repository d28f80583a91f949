"""Per-rank plan of a Muon step: owned matrices, Newton-Schulz FLOPs, bytes, state, time.

Everything but the time is exact for the library's step: ownership is `assign_owners` (layer-wise)
or the FSDP2 owners, blocks are `matrix_layout`'s, FLOPs and TP bytes are the cost model's
`rank_costs` (ops/muon_cost.py), checked against counted real steps by
tests/unit/training/test_planner.py. Times are estimates: the hardware profile's rates, and
an iteration of 6 * active parameters * tokens FLOPs at a stated MFU of the profile's peak.
"""

import dataclasses
import functools
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Optional

from megatron_eopt.config.newton_schulz import coefficients_and_steps
from megatron_eopt.ops.muon_cost import EXACT_MODES, HardwareProfile, choose_tp_modes, rank_costs
from megatron_eopt.ops.newton_schulz import NewtonSchulzSettings
from megatron_eopt.ops.ownership import assign_owners
from megatron_eopt.ops.row_shards import chunk_rows
from megatron_eopt.params.groups import ParamRecord, ParamRouting, matrix_layout
from megatron_eopt.registry import lookup_optimizer
from megatron_eopt.training.data.tokenizer import padded_vocab_size
from megatron_eopt.training.model.settings import GPTModelSettings
from megatron_eopt.training.planning.inventory import planned_records, stage_parameters

MODES = (*EXACT_MODES, "auto")
FP32 = 4
# Optimizer state per element (fp32 tensors) and per parameter (torch Adam's 0-d `step`).
STATE_PER_ELEMENT = {"muon": 1, "adaptive_muon": 2, "adam": 2, "lion": 1}
STATE_PER_PARAM = {"adam": FP32}


@dataclass(frozen=True)
class PlanLayout:
    """World = TP x PP x DP (megatron-core's rank order tp-dp-pp); EP out of DP, expert TP = TP."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    fsdp: bool = False  # torch FSDP2: every matrix split by rows over DP, one owner orthogonalizes it
    layer_wise: bool = True  # the layer-wise distributed optimizer; False: every DP rank steps everything

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "ep"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}.")
        if self.dp % self.ep:
            raise ValueError(f"ep {self.ep} must divide dp {self.dp} (experts are split over data-parallel ranks).")
        if self.fsdp and self.ep > 1:
            raise ValueError("fsdp with ep > 1 is not a layout the library supports (FSDP2 refuses expert parameters).")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """(pipeline stage, data-parallel rank, tensor-parallel rank) of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}); got {rank}.")
        return rank // (self.tp * self.dp), rank // self.tp % self.dp, rank % self.tp


@dataclass(frozen=True)
class RankPlan:
    """One rank's Muon step (see the module docstring for what is exact)."""

    rank: int
    stage: int
    dp_rank: int
    tp_rank: int
    matrices: tuple[str, ...]  # Muon matrices whose update this rank computes (owned, or all)
    flops: dict[str, int]  # mode -> Newton-Schulz FLOPs (standard iteration)
    gram_flops: dict[str, int]  # mode -> FLOPs with Gram Newton-Schulz where it pays
    bytes_sent: dict[str, float]  # mode -> bytes sent over the TP group (FSDP2: plus the row exchange);
    collectives: dict[str, int]  # both with the standard iteration ('step' has the configured one)
    state_bytes: int  # optimizer state (and fp32 main copies with bf16) on this rank
    step: tuple[int, float, int]  # (FLOPs, bytes sent, collectives) of the configured mode and Gram setting
    auto_modes: dict[str, int] = field(default_factory=dict)  # mode -> matrices 'auto' gives it
    muon_time_s: float = 0.0  # configured mode, standard or Gram as configured
    iteration_time_s: float = 0.0

    @property
    def share(self) -> float:
        return self.muon_time_s / self.iteration_time_s if self.iteration_time_s else 0.0


@dataclass(frozen=True)
class PlanInputs:
    """What the plan is of: model, layout, Muon settings, hardware, and the iteration's tokens."""

    settings: GPTModelSettings
    layout: PlanLayout
    config: Any  # an OptimizerConfig (optimizer muon or adaptive_muon)
    profile: HardwareProfile
    peak_flops: float  # the profile's dense bf16 peak, for the iteration time
    mfu: float = 0.4
    tokens_per_iteration: int = 0  # 0: no iteration time
    make_vocab_size_divisible_by: int = 128

    @property
    def precision(self) -> str:
        return self.config.muon_fp32_matmul_prec

    def newton_schulz(self, gram: bool) -> NewtonSchulzSettings:
        coefficient_type, steps = coefficients_and_steps(self.config)
        return NewtonSchulzSettings(steps, coefficient_type, gram=gram,
                                    aol=bool(getattr(self.config, "muon_aol_preconditioner", False)))

    def padded_settings(self) -> GPTModelSettings:
        vocab = padded_vocab_size(self.settings.vocab_size, self.make_vocab_size_divisible_by, self.layout.tp)
        return dataclasses.replace(self.settings, vocab_size=vocab)


def routing_of(config: Any) -> ParamRouting:
    """The factory's routing for `config.optimizer` (registry routing, muon_scalar_optimizer)."""
    spec = lookup_optimizer(config.optimizer)
    if spec.routing == "all" or not spec.accepts("tp_group"):
        raise ValueError(f"the planner plans Muon-family optimizers with TP support (muon, adaptive_muon); "
                         f"got optimizer {config.optimizer!r}.")
    return ParamRouting(spec.name, spec.routing, config.muon_scalar_optimizer)


def model_config_of(settings: GPTModelSettings) -> SimpleNamespace:
    """What `matrix_layout` reads of a TransformerConfig, from the settings."""
    return SimpleNamespace(num_attention_heads=settings.num_attention_heads, num_query_groups=settings.query_groups,
                           kv_channels=settings.kv_channels, hidden_size=settings.hidden_size,
                           gated_linear_unit=settings.gated, attention_output_gate=False,
                           multi_latent_attention=settings.multi_latent_attention,
                           kv_lora_rank=settings.kv_lora_rank, qk_head_dim=settings.qk_head_dim,
                           qk_pos_emb_head_dim=settings.qk_pos_emb_head_dim, v_head_dim=settings.v_head_dim)


@dataclass
class _Stage:
    """One pipeline stage's records, Muon layouts and owners, shared by its ranks."""

    records: list[ParamRecord]
    layouts: dict[str, Any]  # fqn -> MatrixLayout of each Muon matrix
    owners: dict[str, int]  # fqn -> owning rank in its data-parallel group (layer-wise, FSDP2)
    chosen: dict = field(default_factory=dict)  # (expert, mode, gram) -> fqn -> TP mode


def _stage(inputs: PlanInputs, settings: GPTModelSettings, routing: ParamRouting, stage: int) -> _Stage:
    # Every EP rank of a stage holds the same parameters: its experts are named by local index
    # (inventory._moe), so EP rank 0 stands for all of them (256 ranks of kimi-k2 plan 4 stages).
    layout = inputs.layout
    params = stage_parameters(settings, layout.tp, layout.pp, stage, layout.ep, ep_rank=0)
    records = planned_records(params, routing)
    muon = [r for r in records if r.optimizer_name == routing.optimizer]
    model_config = model_config_of(settings)
    split_qkv = inputs.config.muon_split_qkv
    layouts = {r.fqn: matrix_layout(r, model_config, layout.tp, split_qkv,
                                    split_qkv and inputs.config.muon_split_qkv_per_head) for r in muon}
    owners: dict[str, int] = {}
    if layout.fsdp:  # distributed/fsdp2.py: the Muon child's matrices, balanced over the mesh
        owners = assign_owners(muon, {r.fqn for r in muon}, layout.dp, layout.tp)
    elif layout.layer_wise:  # factory._layer_wise: dense over DP, experts over expert DP
        matrices = {r.fqn for r in muon}
        for expert, size in ((False, layout.dp), (True, layout.dp // layout.ep)):
            members = [r for r in records if r.is_expert_parallel == expert]
            owners.update(assign_owners(members, matrices, size, layout.tp))
    return _Stage(records, layouts, owners)


def _stepped(inputs: PlanInputs, stage: _Stage, dp_rank: int) -> list[ParamRecord]:
    """The records whose update this rank computes (FSDP2: whose Newton-Schulz it runs)."""
    layout = inputs.layout
    if not (layout.fsdp or layout.layer_wise):
        return list(stage.records)
    expert_dp_rank = dp_rank // layout.ep
    return [r for r in stage.records if r.fqn in stage.owners
            and stage.owners[r.fqn] == (expert_dp_rank if r.is_expert_parallel else dp_rank)]


def _modes(inputs: PlanInputs, stage: _Stage, expert: bool, owned: list, mode: str, gram: bool) -> list[str]:
    """The TP mode of each owned layout, as the optimizer resolves them: 'auto' is the cost
    model's `choose_tp_modes` over every matrix the optimizer knows (owned or not); with FSDP2
    the owners run 'duplicated' as 'sharded' (ops/row_shards.py)."""
    key = (expert, mode, gram)
    if key not in stage.chosen:
        known = [stage.layouts[r.fqn] for r in stage.records if r.fqn in stage.layouts and r.is_expert_parallel == expert]
        stage.chosen[key] = choose_tp_modes(mode, known, inputs.layout.tp, inputs.profile, inputs.newton_schulz(gram),
                                            inputs.precision)
    chosen = stage.chosen[key]
    modes = [chosen[layout.name] for layout in owned]
    return ["sharded" if inputs.layout.fsdp and m == "duplicated" else m for m in modes]


def _tp_costs(inputs: PlanInputs, stage: _Stage, muon: list[ParamRecord], tp_rank: int, mode: str, gram: bool
              ) -> tuple[int, float, int, list[str]]:
    """(FLOPs, bytes sent, collectives, modes) of the dense and the expert Muon optimizers' steps."""
    flops, sent, calls, modes = 0, 0.0, 0, []
    for expert in (False, True):
        owned = [stage.layouts[r.fqn] for r in muon if r.is_expert_parallel == expert]
        if not owned:
            continue
        expert_mode = getattr(inputs.config, "muon_expert_tp_mode", None) if expert else None
        child_modes = _modes(inputs, stage, expert, owned, expert_mode or mode, gram)
        cost = rank_costs(owned, child_modes, inputs.layout.tp, tp_rank, inputs.newton_schulz(gram), inputs.precision)
        flops, sent, calls, modes = flops + cost.flops, sent + cost.bytes_sent, calls + cost.collectives, modes + child_modes
    return flops, sent, calls, modes


def _fsdp_exchange_bytes(inputs: PlanInputs, stage: _Stage, dp_rank: int) -> float:
    """Bytes this rank sends in FSDP2's two row exchanges (ops/row_shards.py): its rows of each
    matrix to the owner, and, as owner, every other rank's rows of the result."""
    sent = 0
    for fqn, layout in stage.layouts.items():
        rows, cols = layout.local_shape
        by_rank = chunk_rows(rows, inputs.layout.dp)
        if stage.owners[fqn] == dp_rank:
            sent += (rows - by_rank[dp_rank]) * cols * FP32
        else:
            sent += by_rank[dp_rank] * cols * FP32
    return float(sent)


def _state_bytes(inputs: PlanInputs, records: list[ParamRecord], dp_rank: int) -> int:
    """Optimizer state this rank holds for `records` (FSDP2: its row shard of each)."""
    total, layout = 0, inputs.layout
    for record in records:
        elements = record.param.numel()
        if layout.fsdp:
            rows = record.param.shape[0]
            elements = chunk_rows(rows, layout.dp)[dp_rank] * (elements // rows)
        name = record.optimizer_name
        if name not in STATE_PER_ELEMENT:
            raise ValueError(f"the planner does not know the state of optimizer {name!r}; it knows "
                             f"{', '.join(STATE_PER_ELEMENT)}.")
        per_element = STATE_PER_ELEMENT[name] + (1 if inputs.config.bf16 else 0)  # + fp32 main copy
        total += elements * FP32 * per_element + STATE_PER_PARAM.get(name, 0)
    return total


def plan_rank(inputs: PlanInputs, rank: int, stages: Optional[dict] = None) -> RankPlan:
    """The plan of one global rank; `stages` caches the per-stage work across calls."""
    layout, routing = inputs.layout, routing_of(inputs.config)
    stage_index, dp_rank, tp_rank = layout.coordinates(rank)
    stages = {} if stages is None else stages
    if stage_index not in stages:
        stages[stage_index] = _stage(inputs, inputs.padded_settings(), routing, stage_index)
    stage = stages[stage_index]
    stepped = _stepped(inputs, stage, dp_rank)
    muon = [r for r in stepped if r.optimizer_name == routing.optimizer]
    muon = [r for r in muon if not r.is_expert_parallel] + [r for r in muon if r.is_expert_parallel]  # child order
    flops, gram_flops, sent, calls, auto = {}, {}, {}, {}, {}
    exchange = _fsdp_exchange_bytes(inputs, stage, dp_rank) if layout.fsdp else 0.0
    gram = bool(getattr(inputs.config, "muon_gram_newton_schulz", False))
    for mode in MODES:
        flops[mode], sent[mode], calls[mode], modes = _tp_costs(inputs, stage, muon, tp_rank, mode, gram=False)
        gram_flops[mode], _, _, gram_modes = _tp_costs(inputs, stage, muon, tp_rank, mode, gram=True)
        sent[mode] += exchange
        calls[mode] += 2 if layout.fsdp else 0
        if mode == "auto":  # what 'auto' picks with the configured Gram setting
            picked = gram_modes if gram else modes
            auto = {m: picked.count(m) for m in EXACT_MODES if m in picked}
    configured = inputs.config.muon_tp_mode
    step_flops, step_sent, step_calls, _ = _tp_costs(inputs, stage, muon, tp_rank, configured, gram)
    step = (step_flops, step_sent + exchange, step_calls + (2 if layout.fsdp else 0))
    muon_time = inputs.profile.time_s(*step, inputs.precision)
    state = _state_bytes(inputs, stage.records if layout.fsdp else stepped, dp_rank)
    return RankPlan(rank, stage_index, dp_rank, tp_rank, tuple(r.fqn for r in muon), flops, gram_flops, sent, calls,
                    state, step, auto, muon_time, iteration_seconds(inputs))


def plan_ranks(inputs: PlanInputs, ranks: Optional[list[int]] = None) -> list[RankPlan]:
    """The plan of `ranks` (all by default)."""
    stages: dict = {}
    return [plan_rank(inputs, rank, stages) for rank in (range(inputs.layout.world_size) if ranks is None else ranks)]


@functools.lru_cache(maxsize=16)
def active_parameters(settings: GPTModelSettings) -> int:
    """Parameters a token passes through in matrix products: all but the embedding tables, the
    routed experts counted at top-k / experts."""
    total = 0.0
    topk_share = (settings.moe_router_topk / settings.num_moe_experts) if settings.num_moe_experts else 1.0
    for param in stage_parameters(settings):
        if param.lookup_table:
            continue
        elements = functools.reduce(lambda a, b: a * b, param.shape, 1)
        total += elements * (topk_share if ".experts." in param.name else 1.0)
    return int(total)


def iteration_seconds(inputs: PlanInputs) -> float:
    """6 * active parameters * tokens FLOPs over every rank at `mfu` of the peak (0: no tokens given)."""
    if not inputs.tokens_per_iteration:
        return 0.0
    model_flops = 6 * active_parameters(inputs.settings) * inputs.tokens_per_iteration
    return model_flops / (inputs.layout.world_size * inputs.peak_flops * inputs.mfu)
