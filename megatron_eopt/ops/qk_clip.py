"""QK-clip (MuonClip, Kimi K2): scale factors from the largest attention logits, and their
application to a fused weight's rows, or to the rows a rank holds of it (a row shard of torch FSDP2
or Megatron-FSDP, cut anywhere: `scale_clip_rows`). Pure tensor math; no communication.

Rule: for each attention head h whose largest pre-softmax logit S_h = max q.k / sqrt(d) exceeds
the threshold tau, eta_h = tau / S_h; W_q of the head is multiplied by eta_h^alpha and W_k by
eta_h^(1 - alpha), so every logit of that head is multiplied by eta_h and the largest becomes tau.

Grouped-query attention: the k rows of a query group are shared by its heads, so there is one
eta per query group, from the largest logit over the group's heads; it scales all of the group's
q heads by eta^alpha and its k by eta^(1 - alpha) (megatron-core's rule). The group's largest
logit becomes tau; its other heads are scaled by the same eta, possibly more than they needed.

Multi-latent attention, as Kimi K2 does: one eta per head; its query and key rows by eta^alpha and
eta^(1 - alpha), its rotary query by eta, the rotary key all heads share not at all (`ClipRows`).
"""

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class QKVRows:
    """Row layout of one rank's `linear_qkv` weight (or bias): `groups` query groups, each the rows
    of its q heads (`heads_per_group * head_dim`), then k (`head_dim`), then v (`head_dim`)."""

    name: str  # the weight's fqn, for messages
    groups: int  # query groups on this tensor-parallel rank
    heads_per_group: int
    head_dim: int

    def __post_init__(self) -> None:
        for field in ("groups", "heads_per_group", "head_dim"):
            if getattr(self, field) < 1:
                raise ValueError(f"{self.name!r}: {field} must be >= 1; got {getattr(self, field)}.")

    @property
    def heads(self) -> int:
        return self.groups * self.heads_per_group

    @property
    def rows(self) -> int:
        return self.groups * (self.heads_per_group + 2) * self.head_dim


def group_max_logits(max_logits: torch.Tensor, rows: QKVRows) -> torch.Tensor:
    """The largest logit of each query group from the per-head maxima ([heads] -> [groups])."""
    if tuple(max_logits.shape) != (rows.heads,):
        raise ValueError(
            f"{rows.name!r}: the per-head maximum logits have shape {tuple(max_logits.shape)}; "
            f"expected ({rows.heads},), the heads on this tensor-parallel rank."
        )
    return max_logits.view(rows.groups, rows.heads_per_group).amax(dim=1)


def max_attention_logits(query: torch.Tensor, key: torch.Tensor, softmax_scale: float,
                         allowed: Optional[torch.Tensor] = None, causal: bool = False) -> torch.Tensor:
    """Each head's largest pre-softmax logit q.k * softmax_scale over the batch and the positions it
    attends to ([heads], fp32). `query` [b, heads, sq, d], `key` [b, heads, sk, d] (a query group's
    key repeated for each of its heads); `allowed` (True where a query may attend) broadcasts to
    [b, heads, sq, sk], or `causal` allows each query the keys up to its own position."""
    scores = torch.matmul(query.float(), key.float().transpose(-2, -1)) * softmax_scale
    sq, sk = scores.shape[-2:]
    if causal:
        allowed = torch.ones(sq, sk, dtype=torch.bool, device=scores.device).tril()
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return scores.amax(dim=(0, 2, 3))


def clip_scales(group_max: torch.Tensor, threshold: float, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(q scale, k scale) per query group: eta^alpha and eta^(1 - alpha), eta = min(1, tau / max).

    A group at or below the threshold (or without a finite maximum: no forward pass, or NaN)
    gets exactly 1, so its rows are left bitwise unchanged.
    """
    group_max = group_max.double()
    clipped = group_max > threshold  # False for NaN and -inf
    eta = torch.where(clipped, threshold / torch.where(clipped, group_max, 1.0), 1.0)
    return eta.pow(alpha), eta.pow(1.0 - alpha)


# The power of eta that each kind of part is multiplied by; "" is not scaled.
PART_KINDS = ("q", "k", "qk", "")


@dataclass(frozen=True)
class ClipRows:
    """Rows of one weight (or bias) that QK-clip scales: `units` repetitions (query groups, or
    MLA heads: one eta each) of `parts`, each (rows, kind): 'q' takes eta^alpha, 'k'
    eta^(1 - alpha), 'qk' eta (MLA's rotary query), '' nothing (values)."""

    name: str
    units: int
    parts: tuple[tuple[int, str], ...]

    def __post_init__(self) -> None:
        if self.units < 1 or any(rows < 1 or kind not in PART_KINDS for rows, kind in self.parts):
            raise ValueError(f"{self.name!r}: ClipRows needs units >= 1 and parts of >= 1 rows of a kind in "
                             f"{PART_KINDS}; got {self.units} units, parts {self.parts}.")

    @property
    def rows(self) -> int:
        return self.units * sum(rows for rows, _ in self.parts)


def qkv_clip_rows(rows: QKVRows) -> ClipRows:
    """A `linear_qkv` weight's ClipRows: per query group its q heads, k, v."""
    return ClipRows(rows.name, rows.groups, ((rows.heads_per_group * rows.head_dim, "q"), (rows.head_dim, "k"),
                                             (rows.head_dim, "")))


def clip_row_factors(rows: ClipRows, q_scale: torch.Tensor, k_scale: torch.Tensor) -> torch.Tensor:
    """The factor of every row of the whole weight ([rows.rows], the scales' dtype): per unit u,
    its parts' rows by `q_scale[u]`, `k_scale[u]`, their product, or exactly 1 (kind '')."""
    by_kind = {"q": q_scale, "k": k_scale, "qk": q_scale * k_scale, "": torch.ones_like(q_scale)}
    return torch.cat([by_kind[kind].view(rows.units, 1).expand(rows.units, part_rows)
                      for part_rows, kind in rows.parts], dim=1).reshape(-1)


def scale_clip_rows(tensor: torch.Tensor, rows: ClipRows, q_scale: torch.Tensor, k_scale: torch.Tensor,
                    held: Optional[tuple[int, int]] = None) -> None:
    """Multiply, in place, each unit's parts by its scale (`clip_row_factors`); the rows of kind ''
    stay as they are (times exactly 1). `tensor` is a weight [rows, in] or a bias: the whole one,
    or with `held` = (first, end) the rows first..end-1 of it that this rank holds (a row shard)."""
    first, end = (0, rows.rows) if held is None else held
    if not 0 <= first <= end <= rows.rows or tensor.shape[0] != end - first:
        where = "" if held is None else f" (its row shard: rows [{first}, {end}) of the whole)"
        raise ValueError(f"{rows.name!r}: {tensor.shape[0]} rows on this tensor-parallel rank{where}; expected "
                         f"{end - first} of {rows.units} x ({'+'.join(str(r) for r, _ in rows.parts)}) = {rows.rows}.")
    factors = clip_row_factors(rows, q_scale, k_scale)[first:end].to(tensor.dtype)
    with torch.no_grad():
        tensor.mul_(factors.view(-1, *([1] * (tensor.dim() - 1))))
