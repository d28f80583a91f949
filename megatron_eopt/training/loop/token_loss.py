"""How a step's per-token losses become the loss its gradients follow, as in Megatron-LM.

- By default a micro-batch's loss is the mean over its tokens, and the step's is the mean of
  its micro-batches'.
- `--eod-mask-loss`: end-of-document labels do not count; a micro-batch's loss is its counted
  tokens' sum over their number (at least 1).
- `--calculate-per-token-loss`: the step's loss is the global batch's counted-token sum over
  their number. The global count is all-reduced over data parallelism before the forward passes,
  and each micro-batch contributes sum * DP / count, since the DP gradients are averaged.

Evaluation reports the counted tokens' mean over all its batches.
"""

from typing import Optional

import torch
import torch.distributed as dist


class TokenLoss:
    """The rules above for one run: `eod` is the masked label id (None: no mask), `per_token`
    --calculate-per-token-loss over `dp_group`."""

    def __init__(self, eod: Optional[int] = None, per_token: bool = False, dp_group=None) -> None:
        if per_token and dp_group is None:
            raise ValueError("TokenLoss(per_token=True) needs the data-parallel group its global count spans")
        self.eod, self.per_token, self.dp_group = eod, per_token, dp_group
        self._micro_batches = 1
        self._per_token_scale = 1.0  # DP / the global batch's count (per_token)

    def start_step(self, micro_batches: list[torch.Tensor]) -> None:
        """Before a step's forward passes: its micro-batches (token tensors [b, seq + 1]) on
        this rank."""
        self._micro_batches = len(micro_batches)
        if not self.per_token:
            return
        count = sum(self.count(tokens[:, 1:]) for tokens in micro_batches).to(torch.float64)
        global_count = count.to(_group_device(self.dp_group))
        dist.all_reduce(global_count, group=self.dp_group)
        self._per_token_scale = dist.get_world_size(self.dp_group) / max(global_count.item(), 1.0)

    def count(self, labels: torch.Tensor) -> torch.Tensor:
        """The number of labels that count."""
        if self.eod is None:
            return torch.tensor(labels.numel())
        return (labels != self.eod).sum().cpu()

    def _masked_sum(self, losses: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.eod is None:
            return losses.sum()
        return (losses * (labels != self.eod)).sum()

    def share(self, losses: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """A micro-batch's part of the step's loss, from its per-token losses [b, s] (fp32)."""
        if self.per_token:
            return self._masked_sum(losses, labels) * self._per_token_scale
        if self.eod is None:
            return losses.mean() / self._micro_batches  # kept as it always was: bitwise the same runs
        return self._masked_sum(losses, labels) / self.count(labels).clamp(min=1).item() / self._micro_batches

    def eval_sum_and_count(self, losses: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
        """An evaluation micro-batch's (summed counted loss, count) in fp64."""
        count = int(self.count(labels))
        if self.eod is None:
            return losses.mean().double() * count, count
        return self._masked_sum(losses, labels).double(), count


def _group_device(group) -> torch.device:
    backend = dist.get_backend(group)
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
