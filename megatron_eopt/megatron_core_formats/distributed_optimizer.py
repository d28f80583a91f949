"""megatron-core 0.19.2's DDP bucket layout, computed from the model: where each parameter lies in
the buckets its DistributedOptimizer keys a `dp_reshardable` checkpoint by (read from its
param_and_grad_buffer.py, distrib_optimizer.py and param_layout.py):
- DDP puts a chunk's trainable parameters, in `named_parameters()` order, into buffers by (param
  dtype, grad dtype, expert-parallel, layer-wise-managed); grads are fp32 with grad_reduce_in_fp32.
- A buffer lays its parameters out last to first, each at a multiple of 64 elements. A bucket
  closes once it holds `bucket_size` elements (never when None); its end is padded to a multiple
  of lcm(DP, 128) (and of 2**16 with `pad_buckets_for_high_nccl_busbw`). A `shared_embedding`
  parameter gets a bucket of its own.
- The DistributedOptimizer cuts each padded bucket into DP equal shards, rank r owning shard r;
  its `gbuf_idx` counts the dense buffers of its model chunks, chunk after chunk.
Unpadded bucket sizes and places in a bucket do not depend on DP (bucket starts are multiples of
128): megatron-core's loader accepts such a checkpoint at another DP size, no other layout.
"""

import math
from dataclasses import dataclass
from typing import Iterable, Optional

import torch

PARAM_ALIGNMENT = 64
BUCKET_ALIGNMENT = 128
HIGH_NCCL_BUSBW_ALIGNMENT = 2**16
# DDP's bucket_size when the config leaves it None: max(40M, 1M x DP) (distributed_data_parallel.py).
DEFAULT_BUCKET_NUMEL, DEFAULT_BUCKET_NUMEL_PER_RANK = 40_000_000, 1_000_000


@dataclass(frozen=True)
class BufferKey:
    """What puts two parameters into the same DDP buffer."""

    param_dtype: torch.dtype
    grad_dtype: torch.dtype
    is_expert_parallel: bool
    is_managed_by_layer_wise_optimizer: bool

    def dtype_name(self) -> str:
        """As megatron-core's checkpoint keys write it: `dtype_(torch.float32, torch.float32)`."""
        return str((self.param_dtype, self.grad_dtype))


@dataclass(frozen=True)
class Bucket:
    start: int  # in its buffer
    end: int  # padded to the DP multiple
    numel_unpadded: int

    def shard(self, dp_size: int, dp_rank: int) -> tuple[int, int]:
        """The part of the bucket DP rank `dp_rank` owns, in buffer positions."""
        size = (self.end - self.start) // dp_size
        return self.start + dp_rank * size, self.start + (dp_rank + 1) * size


@dataclass(frozen=True)
class BufferLayout:
    key: BufferKey
    params: list  # the buffer's parameters, in the model's order
    ranges: dict  # id(param) -> (start, end, bucket index), in buffer positions
    buckets: list[Bucket]


@dataclass(frozen=True)
class BucketPlace:
    """A parameter's place in a `dp_reshardable` checkpoint: which bucket tensor, which elements."""

    buffer_index: int  # megatron-core's gbuf_idx
    key: BufferKey
    bucket_index: int
    start: int  # in the bucket's unpadded tensor
    end: int
    bucket_numel_unpadded: int

    def tensor_key(self, data_parallel_group_index: int, state_name: str) -> str:
        return (f"optimizer.distributed.dp_group_idx_{data_parallel_group_index}.gbuf_idx_{self.buffer_index}"
                f".dtype_{self.key.dtype_name()}.bucket_idx_{self.bucket_index}.{state_name}")


def buffer_key_of(param: torch.nn.Parameter, grad_reduce_in_fp32: bool, layer_wise: bool = False) -> BufferKey:
    """`layer_wise`: as Megatron-LM tags the parameters for megatron-core's layer-wise optimizer
    (`tag_params_for_buffer_routing`) where they carry no tag of their own."""
    return BufferKey(param.dtype, torch.float32 if grad_reduce_in_fp32 else param.dtype,
                     not getattr(param, "allreduce", True), _managed_by_layer_wise(param, layer_wise))


def _managed_by_layer_wise(param: torch.nn.Parameter, layer_wise: bool) -> bool:
    if hasattr(param, "is_managed_by_layer_wise_optimizer") or not layer_wise:
        return bool(getattr(param, "is_managed_by_layer_wise_optimizer", False))
    from megatron.core.optimizer.layer_wise_optimizer import is_managed_by_layer_wise_optimizer

    return is_managed_by_layer_wise_optimizer(param)


def group_into_buffers(params: Iterable[torch.nn.Parameter], grad_reduce_in_fp32: bool,
                       layer_wise: bool = False) -> dict[BufferKey, list]:
    """The parameters of each buffer, buffers in the order their first parameter appears."""
    buffers: dict[BufferKey, list] = {}
    for param in params:
        buffers.setdefault(buffer_key_of(param, grad_reduce_in_fp32, layer_wise), []).append(param)
    return buffers


def lay_out_buffer(key: BufferKey, params: list, bucket_size: Optional[int], dp_size: int,
                   pad_for_high_nccl_busbw: bool = False) -> BufferLayout:
    """Each parameter's range and bucket in one buffer, as megatron-core's DistributedOptimizer lays it out."""
    divisor = math.lcm(dp_size, BUCKET_ALIGNMENT, *((HIGH_NCCL_BUSBW_ALIGNMENT,) if pad_for_high_nccl_busbw else ()))
    ranges, buckets = {}, []
    bucket_start = position = end = 0
    open_bucket = False

    def close_bucket(end: int) -> int:
        buckets.append(Bucket(bucket_start, _round_up(end, divisor), end - bucket_start))
        return buckets[-1].end

    for param in reversed(params):
        position = _round_up(position, PARAM_ALIGNMENT)
        own_bucket = getattr(param, "shared_embedding", False)
        if own_bucket and open_bucket:  # close the bucket before it
            bucket_start = position = close_bucket(position)
        end = position + param.numel()
        ranges[id(param)] = (position, end, len(buckets))
        open_bucket = True
        if own_bucket or (bucket_size is not None and end - bucket_start >= bucket_size):
            bucket_start = position = close_bucket(end)
            open_bucket = False
        else:
            position = end
    if open_bucket:
        close_bucket(end)
    return BufferLayout(key, list(params), ranges, buckets)


def shard_ranges(layout: BufferLayout, dp_size: int, dp_rank: int) -> dict[int, tuple[int, int, int]]:
    """id(param) -> (bucket index, first, last + 1 element of the flattened parameter) that DP rank
    `dp_rank` steps, for the parameters it holds a part of."""
    owned = {}
    for param in layout.params:
        start, end, bucket_index = layout.ranges[id(param)]
        shard_start, shard_end = layout.buckets[bucket_index].shard(dp_size, dp_rank)
        first, last = max(start, shard_start), min(end, shard_end)
        if last > first:
            owned[id(param)] = (bucket_index, first - start, last - start)
    return owned


@dataclass(frozen=True)
class ChunkDDPSettings:
    """What the layout reads of a model chunk's DDP: its parameters and settings."""

    params: list
    bucket_size: Optional[int]
    grad_reduce_in_fp32: bool
    pad_for_high_nccl_busbw: bool


def chunk_ddp_settings(chunk: torch.nn.Module, chunk_index: int, dp_size: int) -> ChunkDDPSettings:
    """megatron-core's DDP wrapper (it keeps the bucket size it chose), or a module carrying a
    `ddp_config` (chosen here as DDP chooses: none without overlap_grad_reduce, none on a pipeline
    stage but the first or a virtual chunk but the first, as Megatron-LM builds them), or a bare
    module (megatron-core's DistributedDataParallelConfig defaults: one bucket per buffer)."""
    module = getattr(chunk, "module", chunk) if hasattr(chunk, "buffers") and hasattr(chunk, "bucket_size") else chunk
    params = [p for _, p in module.named_parameters() if p.requires_grad]
    config = getattr(chunk, "ddp_config", None)
    if config is None:
        return ChunkDDPSettings(params, None, False, False)
    if module is not chunk:
        bucket_size = chunk.bucket_size
    elif not config.overlap_grad_reduce or chunk_index > 0 or not getattr(chunk, "pre_process", True):
        bucket_size = None
    else:
        bucket_size = config.bucket_size or max(DEFAULT_BUCKET_NUMEL, DEFAULT_BUCKET_NUMEL_PER_RANK * dp_size)
    return ChunkDDPSettings(params, bucket_size, bool(config.grad_reduce_in_fp32),
                            bool(config.pad_buckets_for_high_nccl_busbw))


def distributed_optimizer_buffers(chunks: list, dp_size: int, layer_wise: bool = False) -> list[BufferLayout]:
    """The dense buffers of megatron-core's DistributedOptimizer over `chunks`, in gbuf_idx order.
    `layer_wise`: the one chained after its layer-wise optimizer, which keeps the matrices' buffers."""
    layouts = []
    for index, chunk in enumerate(chunks):
        settings = chunk_ddp_settings(chunk, index, dp_size)
        for key, params in group_into_buffers(settings.params, settings.grad_reduce_in_fp32, layer_wise).items():
            if not key.is_expert_parallel and not key.is_managed_by_layer_wise_optimizer:
                layouts.append(lay_out_buffer(key, params, settings.bucket_size, dp_size,
                                              settings.pad_for_high_nccl_busbw))
    return layouts


def bucket_places(layouts: list[BufferLayout]) -> dict[int, BucketPlace]:
    """id(param) -> its BucketPlace, for every parameter of `layouts`."""
    places = {}
    for buffer_index, layout in enumerate(layouts):
        for param in layout.params:
            start, end, bucket_index = layout.ranges[id(param)]
            bucket = layout.buckets[bucket_index]
            places[id(param)] = BucketPlace(buffer_index, layout.key, bucket_index, start - bucket.start,
                                            end - bucket.start, bucket.numel_unpadded)
    return places


def per_bucket_numel_unpadded(layouts: list[BufferLayout]) -> list[dict]:
    """As megatron-core's DistributedOptimizer records it in the checkpoint, to compare."""
    return [{(layout.key.param_dtype, layout.key.grad_dtype): [b.numel_unpadded for b in layout.buckets]}
            for layout in layouts]


def _round_up(value: int, divisor: int) -> int:
    return -(-value // divisor) * divisor


class DistributedOptimizerBuckets:
    """Where megatron-core's DistributedOptimizer over these model chunks keeps each parameter's
    state (computed when asked: a load of such a checkpoint needs it)."""

    def __init__(self, chunks: list, dp_size: int, dp_rank: int, model_parallel_rank: int,
                 layer_wise: bool = False) -> None:
        self.chunks, self.dp_size, self.dp_rank = list(chunks), dp_size, dp_rank
        self.model_parallel_rank = model_parallel_rank  # megatron-core's dp_group_idx in its keys
        # the DistributedOptimizer chained after megatron-core's layer-wise one (Megatron-LM's
        # --optimizer muon --use-distributed-optimizer): the matrices' buffers are not its own
        self.layer_wise = layer_wise

    def after_layer_wise(self) -> "DistributedOptimizerBuckets":
        return DistributedOptimizerBuckets(self.chunks, self.dp_size, self.dp_rank, self.model_parallel_rank, True)

    def layouts(self) -> list[BufferLayout]:
        return distributed_optimizer_buffers(self.chunks, self.dp_size, self.layer_wise)

    def places(self) -> dict[int, BucketPlace]:
        return bucket_places(self.layouts())
