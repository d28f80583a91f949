"""Gradient accumulation across micro-batches and the data-parallel average, bucketed.

With `--accumulate-allreduce-grads-in-fp32` (implied by `--bf16`) each 16-bit parameter gets an
fp32 `main_grad`, a view into a flat fp32 bucket; a hook adds every backward's gradient to it and
frees the 16-bit one, as megatron-core's DDP does. Without it the gradients stay in `param.grad`
and are copied into flat buckets of their own dtype for the all-reduce. Either way there is one
collective per bucket (about BUCKET_NUMEL elements), and gradients are divided by the
data-parallel size before the sum.

Expert parameters (`allreduce=False`) are summed over the expert data-parallel group and divided
by the whole data-parallel size, as megatron-core's DDP does. `finalize_model_grads` then sums
the sequence-parallel gradients over TP and the tied embedding's over the pipeline.
"""

import functools
import weakref
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.tensor import DTensor

from megatron_eopt.ops.collectives import wait_bounded
from megatron_eopt.training.arguments.flags.parallel import BUCKET_NUMEL  # noqa: F401 (re-exported)
from megatron_eopt.training.parallel.sequence_parallel import (
    sum_grads_over_tensor_parallel,
)

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


def _grad_ready(reducer: "weakref.ref[GradReducer]", index: int, _param: torch.Tensor) -> None:
    live = reducer()
    if live is not None:
        live._grad_ready(index)


class GradReducer:
    """Accumulates (optionally in fp32) and averages a model's gradients over `dp_group`.

    Use per step: `zero_grads(micro_batches)` before the micro-batches, then
    `average_over_data_parallel()` after the last backward (or `finalize_model_grads`, which
    calls it). `reduce_over_dp=False` when the optimizer reduces gradients itself (the
    layer-wise distributed optimizer). `expert_dp_group`: where expert parameters
    (`allreduce=False`) are summed (module docstring); needed when the model has any.

    Buckets hold the parameters in reverse order, the order backward produces their gradients
    (as megatron-core's DDP). `overlap` (`--overlap-grad-reduce`): a bucket's all-reduce starts,
    asynchronously, as soon as the last micro-batch's backward has produced all of its gradients,
    and `average_over_data_parallel` waits for them. Buckets start in index order only (a ready
    bucket waits for the ones before it), so every rank issues the same collectives in the same
    order; the results are those of the non-overlapped reduction, bit for bit.
    """

    def __init__(self, model: torch.nn.Module, dp_group, accumulate_in_fp32: bool,
                 reduce_over_dp: bool = True, bucket_numel: int = BUCKET_NUMEL, expert_dp_group=None,
                 overlap: bool = False) -> None:
        self.dp_group = dp_group
        self.reduce_over_dp = reduce_over_dp
        params = [p for p in model.parameters() if p.requires_grad][::-1]
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
        self.overlap = overlap and reduce_over_dp and dp_group is not None and dist.get_world_size(dp_group) > 1
        self._in_flight: list[tuple[Any, Optional[torch.Tensor], list[torch.Tensor]]] = []
        self._grads_left: list[int] = []  # per bucket: gradients the step's backward passes still owe
        if self.overlap:  # registered after _attach_main_grads' hooks, so they run after them
            # Weakly: autograd keeps a parameter's hooks in C++, out of the collector's sight, and a
            # hook holding this reducer would keep it, its groups and the model alive for good.
            reducer = weakref.ref(self)
            for index, bucket in enumerate(self.buckets):
                for param in bucket:
                    param.register_post_accumulate_grad_hook(functools.partial(_grad_ready, reducer, index))

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

    def zero_grads(self, micro_batches: int = 1) -> None:
        """Start a step of `micro_batches` backward passes (with `overlap`, the last one starts
        the buckets' all-reduces)."""
        for buffer in self.main_grad_buffers:
            if buffer is not None:
                buffer.zero_()
        self._grads_left = [len(bucket) * micro_batches for bucket in self.buckets]

    @property
    def buckets_started(self) -> int:
        """Buckets whose all-reduce has started this step (overlap: during backward)."""
        return len(self._in_flight)

    def _grad_ready(self, index: int) -> None:
        if not self._grads_left:  # a backward outside a step (zero_grads not called): not ours
            return
        self._grads_left[index] -= 1
        while self.buckets_started < len(self.buckets) and self._grads_left[self.buckets_started] == 0:
            self._start(self.buckets_started)

    def average_over_data_parallel(self) -> None:
        """Each bucket divided by the data-parallel size and summed over its group: starts the
        buckets not started yet, then waits for all of them."""
        dp_size = dist.get_world_size(self.dp_group)
        if not self.reduce_over_dp or dp_size == 1:
            return
        for index in range(self.buckets_started, len(self.buckets)):
            self._start(index)
        for index, (handle, flat, grads) in enumerate(self._in_flight):
            if handle is not None:
                wait_bounded(handle, self.groups[index], f"torch.distributed all_reduce of gradient bucket {index} "
                                                         f"({len(self.buckets[index])} parameters, "
                                                         f"{sum(p.numel() for p in self.buckets[index]):,} elements)")
            if flat is not None:
                for grad, averaged in zip(grads, _unflatten_dense_tensors(flat, grads)):
                    grad.copy_(averaged)
        self._in_flight, self._grads_left = [], []

    def _start(self, index: int) -> None:
        """Bucket `index` divided by the DP size, its asynchronous sum over its group started.
        Without an fp32 buffer the gradients are flattened into a copy (copied back when done).
        Every rank runs the same model on the same number of micro-batches, so the same
        parameters have gradients on every rank."""
        group, buffer = self.groups[index], self.main_grad_buffers[index]
        grads: list[torch.Tensor] = []
        if buffer is None:
            grads = [p.grad for p in self.buckets[index] if p.grad is not None]
            buffer = _flatten_dense_tensors(grads) if grads else None
        handle = None
        if buffer is not None:
            buffer.div_(dist.get_world_size(self.dp_group))
            if dist.get_world_size(group) > 1:
                handle = dist.all_reduce(buffer, group=group, async_op=True)
        self._in_flight.append((handle, buffer if grads else None, grads))


def _add_grad_to_main_grad(param: torch.nn.Parameter) -> None:
    """After each backward: fold the 16-bit gradient into the fp32 sum and free it."""
    param.main_grad.add_(param.grad)
    param.grad = None


def finalize_model_grads(chunks: list[torch.nn.Module], grads: GradReducer) -> None:
    """After a step's last backward, before the optimizer, what megatron-core's
    `finalize_model_grads` does: the data-parallel average (waiting for overlapped buckets), the
    sequence-parallel and query/key-norm gradients summed over tensor-parallel ranks, the tied embedding gradients
    summed over the first and last pipeline stage. Sums over different groups, so their order
    does not change the result; the DP reduction goes first because overlapped buckets may still
    be reading the gradients the other two write."""
    from megatron.core import parallel_state

    grads.average_over_data_parallel()
    sum_grads_over_tensor_parallel(tensor_parallel_partial_params(chunks),
                                   parallel_state.get_tensor_model_parallel_group())
    sum_tied_embedding_grads(chunks)


def tensor_parallel_partial_params(chunks: list[torch.nn.Module]) -> list[torch.nn.Parameter]:
    """Parameters replicated over the tensor-parallel ranks whose gradients cover only this
    rank's share: those tagged `sequence_parallel` (this rank's tokens) and the per-head
    query/key norms (this rank's heads), which megatron-core's `finalize_model_grads` sums over
    TP (the latter by name). Multi-latent attention's `q_layernorm`/`kv_layernorm` normalise the
    whole latent on every rank and their gradient is complete there (megatron-core's local spec
    sums it by name all the same, which doubles it at TP=2): only their `sequence_parallel` tag
    counts."""
    latent_norms = {id(param) for chunk in chunks for param in _latent_norm_params(chunk)}
    return [param for chunk in chunks for name, param in chunk.named_parameters()
            if param.requires_grad and (getattr(param, "sequence_parallel", False)
                                        or (_is_qk_norm(name) and id(param) not in latent_norms))]


def _is_qk_norm(name: str) -> bool:
    return "q_layernorm." in name or "k_layernorm." in name


def _latent_norm_params(chunk: torch.nn.Module) -> list[torch.nn.Parameter]:
    from megatron.core.transformer.multi_latent_attention import MultiLatentAttention

    return [param for module in chunk.modules() if isinstance(module, MultiLatentAttention)
            for norm in (getattr(module, "q_layernorm", None), getattr(module, "kv_layernorm", None))
            if norm is not None for param in norm.parameters()]


def sum_tied_embedding_grads(chunks: list[torch.nn.Module]) -> None:
    """Sum the tied word-embedding gradient of the first stage and the output-layer gradient of
    the last over megatron's embedding group (both copies then take the same step). Into
    `main_grad` where the trainer accumulates in fp32."""
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return
    if not parallel_state.is_rank_in_embedding_group(ignore_virtual=True):
        return
    for chunk in chunks:
        if not (chunk.share_embeddings_and_output_weights and (chunk.pre_process or chunk.post_process)):
            continue
        grad = accumulated_grad(chunk.shared_embedding_or_output_weight())
        dist.all_reduce(grad, group=parallel_state.get_embedding_group())


def accumulated_grad(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """The gradient the optimizer will read: `main_grad` where the trainer accumulates in fp32,
    else `param.grad`."""
    grad = getattr(param, "main_grad", None)
    return param.grad if grad is None else grad


def nan_in_grads(model: torch.nn.Module, device: torch.device) -> bool:
    """Whether any rank's gradients hold a NaN (an inf alone does not count): each rank looks at
    its own (local shards under FSDP2) and the verdict is all-reduced (MAX) over every rank, so
    all of them agree."""
    found = torch.zeros(1, device=device)
    for param in model.parameters():
        grad = accumulated_grad(param)
        if grad is not None:
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            found = torch.maximum(found, local.isnan().any().float().to(device))
    dist.all_reduce(found, op=dist.ReduceOp.MAX)
    return bool(found.item())
