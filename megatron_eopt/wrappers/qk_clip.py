"""QK-clip as part of the optimizer step (MuonClip): settings, attention layers, the step hook.

The optimizer finds every attention layer of its model chunks (a module with a `core_attention`
and a fused `linear_qkv`, or multi-latent attention's `linear_kv_up_proj`, behind any wrappers)
and asks each core attention to record `current_max_attn_logits`, megatron-core's per-head
maximum of q.k/sqrt(d).

In `step()` the maxima are MAX-reduced over the data x context-parallel group and reset. With
`qk_clip`, after a successful update each child scales the q/k rows of the `linear_qkv` weights
and biases in its fp32 main copies (ops/qk_clip.py); under the layer-wise optimizer only the
owner does, and its broadcast carries the result. On row-sharded models (torch FSDP2,
Megatron-FSDP) every rank has every head's scale after the MAX-reduce, and scales the rows it
holds of each weight (`held_rows`), wherever a head's rows are cut: no further communication. The
scales stay on the device; `max_attention_logit` is read back only when asked for.
docs/qk-clip.md describes it.
"""

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_eopt.runtime.process_groups import ProcessGroup, group_size
from megatron_eopt.ops.qk_clip import (ClipRows, QKVRows, clip_scales, group_max_logits, qkv_clip_rows,
                                       scale_clip_rows)
from megatron_eopt.ops.splits import qkv_row_blocks

# megatron-core's names and defaults (TransformerConfig); also fields of OptimizerConfig.
QK_CLIP_DEFAULTS = {"qk_clip": False, "qk_clip_threshold": 100.0, "qk_clip_alpha": 0.5,
                    "log_max_attention_logit": False}


@dataclass(frozen=True)
class QKClipSettings:
    """The merged QK-clip settings of the optimizer config and the model's TransformerConfig."""

    qk_clip: bool = False
    qk_clip_threshold: float = 100.0
    qk_clip_alpha: float = 0.5
    log_max_attention_logit: bool = False

    def __post_init__(self) -> None:
        if not (math.isfinite(self.qk_clip_threshold) and self.qk_clip_threshold > 0.0):
            raise ValueError(f"qk_clip_threshold must be a finite number > 0; got {self.qk_clip_threshold}.")
        if not 0.0 < self.qk_clip_alpha < 1.0:
            raise ValueError(f"qk_clip_alpha must be in (0, 1) (as Megatron-LM requires); got {self.qk_clip_alpha}.")

    @property
    def records_logits(self) -> bool:
        return self.qk_clip or self.log_max_attention_logit


def resolve_qk_clip_settings(config: Any, model_configs: Iterable[Any]) -> QKClipSettings:
    """Each setting from whichever config sets it (differs from the default); configs that set it
    to different values are refused, naming both."""
    values = {}
    for field, default in QK_CLIP_DEFAULTS.items():
        value, source = getattr(config, field, default), "OptimizerConfig"
        for model_config in model_configs:
            other = getattr(model_config, field, default)
            if other == default or other == value:
                continue
            if value != default:
                raise ValueError(
                    f"{field} is {value!r} in the {source} but {other!r} in the model's "
                    f"{type(model_config).__name__}; set it in one of them, or to the same value in both."
                )
            value, source = other, type(model_config).__name__
        values[field] = value
    return QKClipSettings(**values)


@dataclass(frozen=True)
class AttentionLayer:
    """One attention layer: where its maxima come from and which tensors the clip scales."""

    name: str  # module path inside its chunk, for messages
    core_attention: torch.nn.Module
    rows: QKVRows  # the heads on this rank and their query groups (MLA: one group per head)
    fqns: tuple[str, ...]  # linear_qkv.weight (and .bias) as the optimizer names them; MLA: its up-projections
    clip_rows: tuple[ClipRows, ...]  # which rows of each of `fqns` the clip scales how


def find_attention_layers(chunks: Sequence[torch.nn.Module], fqn_of: dict[int, str], tp_size: int,
                          clips: bool = True) -> list[AttentionLayer]:
    """Every self-attention layer with a fused linear_qkv in `chunks`; others are refused, and
    with `clips` (QK-clip, not only the logging of the maximum logit) also the layers whose
    logits the clip cannot change.

    `fqn_of`: id(parameter) -> fqn of every parameter the optimizer steps on this rank.
    """
    layers = []
    for chunk in chunks:
        for name, module in chunk.named_modules():
            if isinstance(getattr(module, "core_attention", None), torch.nn.Module):
                layers.append(_attention_layer(name, module, fqn_of, tp_size, clips))
    for layer in layers:  # check every layer before switching any on
        _check_records_logits(layer)
    for layer in layers:
        if hasattr(layer.core_attention, "record_max_attn_logits"):
            layer.core_attention.record_max_attn_logits = True
    return layers


def _attention_layer(name: str, module: torch.nn.Module, fqn_of: dict[int, str], tp_size: int,
                     clips: bool) -> AttentionLayer:
    if isinstance(getattr(module, "linear_kv_up_proj", None), torch.nn.Module):
        return _latent_attention_layer(name, module, fqn_of, tp_size)
    kind = type(module).__name__
    linear_qkv = getattr(module, "linear_qkv", None)
    model_config = getattr(module, "config", None)
    if linear_qkv is None or model_config is None:
        raise ValueError(
            f"QK-clip: attention {name!r} ({kind}) has no fused linear_qkv and TransformerConfig; "
            f"only self-attention with linear_qkv is supported (not multi-latent or cross attention)."
        )
    # A norm after the projection undoes the clip's scaling of W_q/W_k (the logits it records
    # are still the logits); a gated projection has another row layout.
    refused = ("qk_layernorm", "qk_l2_norm", "attention_output_gate") if clips else ("attention_output_gate",)
    for option in refused:
        if getattr(model_config, option, False):
            raise ValueError(
                f"QK-clip: attention {name!r} uses {option}=True, which QK-clip does not support "
                f"(normalized q/k do not scale with W_q/W_k; the gated layout differs)."
            )
    tensors = [linear_qkv.weight]
    bias = getattr(linear_qkv, "bias", None)
    if isinstance(bias, torch.nn.Parameter) and bias.numel() > 0:
        tensors.append(bias)
    missing = [f"{name}.linear_qkv.{'weight' if t is linear_qkv.weight else 'bias'}" for t in tensors if id(t) not in fqn_of]
    if missing:
        raise ValueError(f"QK-clip: {missing[0]!r} is not a parameter this optimizer steps (frozen?); it cannot be clipped.")
    weight = linear_qkv.weight
    fqn = fqn_of[id(weight)]
    sharded = getattr(weight, "tensor_model_parallel", False) and getattr(weight, "partition_dim", -1) == 0
    groups, blocks = qkv_row_blocks(model_config, tp_size if sharded else 1, fqn)
    rows = QKVRows(fqn, groups, blocks[0] // blocks[1], blocks[1])
    if weight.shape[0] != rows.rows:
        raise ValueError(f"QK-clip: {fqn!r} has {weight.shape[0]} rows on this rank; its TransformerConfig says {rows.rows}.")
    fqns = tuple(fqn_of[id(t)] for t in tensors)
    return AttentionLayer(name, module.core_attention, rows, fqns,
                          tuple(qkv_clip_rows(dataclasses.replace(rows, name=f)) for f in fqns))


def _latent_attention_layer(name: str, module: torch.nn.Module, fqn_of: dict[int, str], tp_size: int) -> AttentionLayer:
    """Multi-latent attention, clipped per head as Kimi K2 does (ops/qk_clip.py). Its norms act
    on the latents, before the up-projections the clip scales, so they do not undo it."""
    config = module.config
    query = getattr(module, "linear_q_up_proj", None) or getattr(module, "linear_q_proj")
    targets = ((query, ((config.qk_head_dim, "q"), (config.qk_pos_emb_head_dim, "qk"))),
               (module.linear_kv_up_proj, ((config.qk_head_dim, "k"), (config.v_head_dim, ""))))
    heads = config.num_attention_heads // tp_size
    fqns, clip_rows = [], []
    for linear, parts in targets:
        fqn = fqn_of.get(id(linear.weight))
        if fqn is None:
            raise ValueError(f"QK-clip: the {name!r} projection {type(linear).__name__} is not a parameter this "
                             f"optimizer steps (frozen?); it cannot be clipped.")
        fqns.append(fqn)
        clip_rows.append(ClipRows(fqn, heads, parts))
        if linear.weight.shape[0] != clip_rows[-1].rows:
            raise ValueError(f"QK-clip: {fqn!r} has {linear.weight.shape[0]} rows on this rank; its "
                             f"TransformerConfig says {clip_rows[-1].rows} ({heads} heads).")
    rows = QKVRows(fqns[0], heads, 1, config.qk_head_dim)  # one eta per head: each has its own key
    return AttentionLayer(name, module.core_attention, rows, tuple(fqns), tuple(clip_rows))


def _check_records_logits(layer: AttentionLayer) -> None:
    """The optimizer switches recording on where the module has `record_max_attn_logits` (our SDPA
    attention); Transformer Engine's records only when built with qk_clip/log_max_attention_logit
    (then it has `current_max_attn_logits`)."""
    core_attention = layer.core_attention
    if not hasattr(core_attention, "record_max_attn_logits") and not hasattr(core_attention, "current_max_attn_logits"):
        raise ValueError(
            f"QK-clip: the core attention of {layer.name!r} ({type(core_attention).__name__}) does not record "
            f"the maximum attention logits (current_max_attn_logits). Build the model with "
            f"TransformerConfig(qk_clip=True or log_max_attention_logit=True) and Transformer Engine "
            f">= 2.9, or with an attention that records them (megatron_eopt/training/model/sdpa_attention.py's SDPACoreAttention)."
        )


class QKClip:
    """The step hook (module docstring). `step()` is a context around the optimizer's step."""

    def __init__(self, settings: QKClipSettings, layers: list[AttentionLayer], dp_cp_group: Optional[ProcessGroup],
                 mp_group: Optional[ProcessGroup], device: torch.device,
                 held_rows: Optional[dict[str, tuple[int, int]]] = None) -> None:
        self.settings, self.layers = settings, layers
        self.dp_cp_group, self.mp_group, self.device = dp_cp_group, mp_group, device
        # fqn -> (first, end) of the rows of the whole weight this rank holds (row-sharded models)
        self.held_rows = held_rows or {}
        self._largest: Optional[torch.Tensor] = None  # this step's largest logit, on the device
        self._pending: dict[str, tuple[ClipRows, torch.Tensor, torch.Tensor]] = {}

    @property
    def max_attention_logit(self) -> Optional[float]:
        """The largest attention logit of the model at the last step (None before any forward)."""
        if self._largest is None:
            return None
        value = self._largest.item()
        return value if math.isfinite(value) else None

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        self._measure()
        try:
            yield
        finally:
            self._pending = {}  # only this step's update may be clipped with these scales

    def clip_main_params(self, named_main_params: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Scale the q/k rows of the given (fqn, fp32 main parameter) pairs that need it; a
        main parameter of a row-sharded model is this rank's rows of the weight."""
        for fqn, main in named_main_params:
            if fqn in self._pending:
                scale_clip_rows(main.detach(), *self._pending[fqn], held=self.held_rows.get(fqn))

    def _measure(self) -> None:
        per_layer = [self._local_max(layer) for layer in self.layers]  # checks all before resetting
        for layer in self.layers:
            layer.core_attention.current_max_attn_logits = None
        maxima = torch.cat(per_layer) if per_layer else torch.full((1,), -math.inf, device=self.device)
        _all_reduce_max(maxima, self.dp_cp_group)
        largest = maxima.max().reshape(1)
        _all_reduce_max(largest, self.mp_group)
        self._largest = largest
        if self.settings.qk_clip:
            self._pending = self._scales(maxima.split([layer.rows.heads for layer in self.layers]))

    def _local_max(self, layer: AttentionLayer) -> torch.Tensor:
        maxima = layer.core_attention.current_max_attn_logits
        if maxima is None:  # no forward pass since the last step: nothing to clip
            return torch.full((layer.rows.heads,), -math.inf, device=self.device)
        maxima = maxima.detach().float().reshape(-1).to(self.device)
        group_max_logits(maxima, layer.rows)  # raises on a wrong shape
        return maxima

    def _scales(self, maxima: Sequence[torch.Tensor]) -> dict[str, tuple[ClipRows, torch.Tensor, torch.Tensor]]:
        pending = {}
        for layer, layer_max in zip(self.layers, maxima):
            group_max = group_max_logits(layer_max, layer.rows)
            q_scale, k_scale = clip_scales(group_max, self.settings.qk_clip_threshold, self.settings.qk_clip_alpha)
            for fqn, rows in zip(layer.fqns, layer.clip_rows):
                pending[fqn] = (rows, q_scale, k_scale)
        return pending


def qk_clip_step(qk_clip: Optional[QKClip]) -> contextlib.AbstractContextManager:
    """`with qk_clip_step(optimizer.qk_clip): take_step(...)`; a no-op without QK-clip."""
    return contextlib.nullcontext() if qk_clip is None else qk_clip.step()


def _all_reduce_max(tensor: torch.Tensor, group: Optional[ProcessGroup]) -> None:
    if group_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)



def qk_clip_settings(config: Any, chunks: Sequence[torch.nn.Module]) -> QKClipSettings:
    """The settings from `config` and the TransformerConfig of the chunks' attention layers."""
    model_configs = {id(c): c for c in _attention_configs(chunks)}.values()
    return resolve_qk_clip_settings(config, model_configs)


def build_qk_clip(settings: QKClipSettings, chunks: Sequence[torch.nn.Module], fqn_of: dict[int, str],
                  tp_group: Optional[ProcessGroup], dp_cp_group: Optional[ProcessGroup],
                  mp_group: Optional[ProcessGroup], device: Optional[torch.device],
                  held_rows: Optional[dict[str, tuple[int, int]]] = None) -> QKClip:
    """The QK-clip hook for `chunks` (call only when `settings.records_logits`).

    `fqn_of`: id(parameter) -> fqn of every parameter the optimizer steps on this rank.
    `held_rows`: for a row-sharded model (DTensor Shard(0)), fqn -> (first, end) of the rows of
    each weight this rank holds; `dp_cp_group` is then its mesh's group.
    """
    layers = find_attention_layers(chunks, fqn_of, group_size(tp_group), clips=settings.qk_clip)
    if not layers:
        raise ValueError(
            "qk_clip/log_max_attention_logit is set, but model_chunks have no attention layer "
            "(a module with core_attention and linear_qkv) whose logits could be recorded."
        )
    return QKClip(settings, layers, dp_cp_group, mp_group, device or torch.device("cpu"), held_rows)


def _attention_configs(chunks: Sequence[torch.nn.Module]) -> list[Any]:
    return [module.config for chunk in chunks for module in chunk.modules()
            if hasattr(module, "core_attention") and getattr(module, "config", None) is not None]
