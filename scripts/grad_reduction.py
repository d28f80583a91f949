"""Gradient accumulation across micro-batches and the data-parallel average, bucketed.

Megatron-LM's `--accumulate-allreduce-grads-in-fp32` (its default with `--bf16`): each 16-bit
parameter gets an fp32 `main_grad`, a view into a flat fp32 bucket. After every backward a hook
adds the parameter's 16-bit gradient to it and frees the 16-bit one (as megatron-core's
DistributedDataParallel does), so micro-batches are summed in fp32 and the data-parallel
all-reduce runs in fp32, one collective per bucket. The optimizer reads `main_grad` when it is
there (megatron_eopt/wrappers/fp32.py, mixed_precision.py).

Without fp32 accumulation the gradients stay in `param.grad`; they are copied into flat buckets
of their own dtype for the all-reduce and copied back. Either way there is one collective per
bucket (about BUCKET_NUMEL elements, Megatron-LM's default bucket size), never one per parameter.
Gradients are divided by the data-parallel size before the sum (megatron-core's DDP default),
which keeps scaled fp16 gradients in range.

Expert parameters (megatron-core tags them `allreduce=False` at expert-parallel size > 1) are
summed over the expert data-parallel group instead, but still divided by the whole
data-parallel size, as megatron-core's DDP does: the token dispatcher has already brought each
expert the gradients of the tokens of every rank in its expert-parallel group, so the sum over
the expert data-parallel group covers every data-parallel rank once.
"""

from typing import Optional

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

BUCKET_NUMEL = 40_000_000  # megatron-core DDP's default bucket size, in elements
HALF_DTYPES = (torch.float16, torch.bfloat16)


def split_into_buckets(params: list[torch.nn.Parameter], bucket_numel: int) -> list[list[torch.nn.Parameter]]:
    """Consecutive parameters of one dtype, each bucket up to `bucket_numel` elements (a larger
    parameter gets a bucket of its own)."""
    buckets: list[list[torch.nn.Parameter]] = []
    size = 0
    for param in params:
        last = buckets[-1] if buckets else None
        if last and last[0].dtype == param.dtype and size + param.numel() <= bucket_numel:
            last.append(param)
            size += param.numel()
        else:
            buckets.append([param])
            size = param.numel()
    return buckets


class GradReducer:
    """Accumulates (optionally in fp32) and averages a model's gradients over `dp_group`.

    Use per step: `zero_grads()` before the micro-batches, `average_over_data_parallel()` after
    the last backward. `reduce_over_dp=False` when the optimizer reduces gradients itself (the
    layer-wise distributed optimizer). `expert_dp_group`: where expert parameters
    (`allreduce=False`) are summed (module docstring); needed when the model has any.
    """

    def __init__(self, model: torch.nn.Module, dp_group, accumulate_in_fp32: bool,
                 reduce_over_dp: bool = True, bucket_numel: int = BUCKET_NUMEL, expert_dp_group=None) -> None:
        self.dp_group = dp_group
        self.reduce_over_dp = reduce_over_dp
        params = [p for p in model.parameters() if p.requires_grad]
        dense = [p for p in params if getattr(p, "allreduce", True)]
        experts = [p for p in params if not getattr(p, "allreduce", True)]
        if experts and reduce_over_dp and expert_dp_group is None:
            raise ValueError(f"GradReducer: the model has {len(experts)} expert parameters (allreduce=False); "
                             f"pass expert_dp_group, the group their gradients are summed over.")
        self.fp32_accumulation = accumulate_in_fp32 and any(p.dtype in HALF_DTYPES for p in params)
        dense_buckets, expert_buckets = split_into_buckets(dense, bucket_numel), split_into_buckets(experts, bucket_numel)
        self.buckets = dense_buckets + expert_buckets
        self.groups = [dp_group] * len(dense_buckets) + [expert_dp_group] * len(expert_buckets)  # summed over
        self.main_grad_buffers: list[Optional[torch.Tensor]] = [None] * len(self.buckets)
        if self.fp32_accumulation:
            self.main_grad_buffers = [self._attach_main_grads(bucket) for bucket in self.buckets]

    @staticmethod
    def _attach_main_grads(bucket: list[torch.nn.Parameter]) -> torch.Tensor:
        """One flat fp32 buffer; each parameter's `main_grad` is a view into it."""
        buffer = torch.zeros(sum(p.numel() for p in bucket), dtype=torch.float32, device=bucket[0].device)
        offset = 0
        for param in bucket:
            param.main_grad = buffer[offset:offset + param.numel()].view(param.shape)
            offset += param.numel()
            param.register_post_accumulate_grad_hook(_add_grad_to_main_grad)
        return buffer

    def zero_grads(self) -> None:
        for buffer in self.main_grad_buffers:
            if buffer is not None:
                buffer.zero_()

    def average_over_data_parallel(self) -> None:
        """Each bucket divided by the data-parallel size and summed over its group."""
        dp_size = dist.get_world_size(self.dp_group)
        if not self.reduce_over_dp or dp_size == 1:
            return
        for bucket, buffer, group in zip(self.buckets, self.main_grad_buffers, self.groups):
            if buffer is not None:
                buffer.div_(dp_size)
                if dist.get_world_size(group) > 1:
                    dist.all_reduce(buffer, group=group)
            else:
                _average_grads(bucket, dp_size, group)


def _add_grad_to_main_grad(param: torch.nn.Parameter) -> None:
    """After each backward: fold the 16-bit gradient into the fp32 sum and free it."""
    param.main_grad.add_(param.grad)
    param.grad = None


def _average_grads(bucket: list[torch.nn.Parameter], dp_size: int, group) -> None:
    """`param.grad` of a bucket divided by `dp_size`, flattened for one all-reduce over `group`.
    Every rank runs the same model on the same number of micro-batches, so the same parameters
    have gradients on every rank."""
    grads = [p.grad for p in bucket if p.grad is not None]
    if not grads:
        return
    flat = _flatten_dense_tensors(grads).div_(dp_size)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(flat, group=group)
    for grad, averaged in zip(grads, _unflatten_dense_tensors(flat, grads)):
        grad.copy_(averaged)
