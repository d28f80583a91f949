"""LayerWiseDistributedOptimizer: each data-parallel rank owns whole parameters.

Muon needs whole matrices, so instead of ZeRO's byte shards every parameter has one owner in its
data-parallel group (the expert data-parallel group for experts), assigned on every rank alike by
Newton-Schulz cost (ops/ownership.py). Only the owner keeps optimizer state and fp32 main copies
and runs the update; then it broadcasts the new values in buckets.

A step: (1) with `reduce_grads`, gradients are averaged onto each owner by `reduce`, else they
were all-reduced already; expert gradients are summed over the expert data-parallel group and
divided by the dense data-parallel size, as megatron-core's DDP does; (2) megatron-core's step
recipe (wrappers/base.py) over the owned parameters, the norm and the inf/NaN verdict reduced over
data- and model-parallel groups (the norm in megatron-core's order: layer_wise_norm_order.py); (3) the broadcasts, waited on in step() or, with
`overlap_param_gather`, by a forward pre-hook of each module (launched after each chained
optimizer's step with `overlap_param_gather_with_optimizer_step`). Whatever reads or replaces
parameters or state calls `finish_param_sync()` first (docs/layer-wise.md).
"""

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_eopt.runtime.process_groups import ProcessGroup, group_rank, group_size
from megatron_eopt.ops.collectives import wait_bounded
from megatron_eopt.wrappers.base import (ArrangeStats, MegatronOptimizer, SteppableChild, StepResult, prepared_stats,
                                         take_step, timed)
from megatron_eopt.wrappers.chained import ChainedOptimizer
from megatron_eopt.wrappers.fp32 import model_grad
from megatron_eopt.wrappers.grad_stats import NONFINITE, STATS_SIZE, LocalStats, unscale_and_count_nonfinite
from megatron_eopt.wrappers.qk_clip import QKClip, qk_clip_step

DEFAULT_BUCKET_BYTES = 64 * 2**20


@dataclass
class DataParallelShards:
    """The parameters of one data-parallel group, by owner (index = rank within the group)."""

    group: Optional[ProcessGroup]  # None: size 1, this rank owns everything
    params_by_owner: list[list[torch.nn.Parameter]] = field(default_factory=list)
    # With reduce_grads: the summed gradients are divided by this. None: the group's size (a
    # mean); experts: the dense data-parallel size.
    grad_divisor: Optional[int] = None

    @property
    def divisor(self) -> int:
        return group_size(self.group) if self.grad_divisor is None else self.grad_divisor

    @property
    def owned(self) -> list[torch.nn.Parameter]:
        return self.params_by_owner[group_rank(self.group)]

    def global_rank(self, owner: int) -> int:
        return dist.get_global_rank(self.group, owner)


class _NonOwnedGradCheck(SteppableChild):
    """Counts inf/NaN in the gradients this rank does not own (its local copies)."""

    grad_scaler = None
    name = "non_owned"

    def __init__(self, params: list[torch.nn.Parameter], groups: Sequence[Optional[ProcessGroup]], device: torch.device) -> None:
        self.params, self.groups, self.device = params, tuple(groups), device

    def grad_stats(self, count_zeros: bool) -> LocalStats:
        stats = torch.zeros(STATS_SIZE, dtype=torch.float32, device=self.device)
        grads = [g for g in map(model_grad, self.params) if g is not None]
        if grads:  # "unscaling" by 1 leaves every value as it is
            stats[NONFINITE] = unscale_and_count_nonfinite(grads, torch.ones(1, device=self.device))
        return LocalStats(stats, None, self.groups)  # no part in the norm

    def current_grad_stats(self, count_zeros: bool) -> LocalStats:
        return LocalStats(torch.zeros(STATS_SIZE, dtype=torch.float32, device=self.device), None, ())

    def main_grads(self, grad_norm_group: Optional[str] = None) -> list[torch.Tensor]:
        return []

    def step_with_ready_grads(self) -> bool:
        return True

    def check_state_dict(self, state_dict: dict) -> None:
        pass


@dataclass(frozen=True)
class _SyncBucket:
    """Parameters one owner broadcasts in one message (one dtype, device and chained optimizer)."""

    params: list[torch.nn.Parameter]
    group: ProcessGroup
    source: int  # the owner's global rank
    is_owner: bool  # this rank owns (and so already holds) the values
    phase: int  # index of the chained optimizer that updates these parameters


@dataclass
class _InFlight:
    """A launched broadcast: the handle and the buffer it writes, both kept until waited on."""

    work: Any
    flat: torch.Tensor


class _LaunchAfterStep(SteppableChild):
    """A chained optimizer that, once it has stepped, launches the broadcast of what it updated."""

    def __init__(self, child: SteppableChild, launch: Any) -> None:
        self.child, self.launch = child, launch
        self.grad_scaler = child.grad_scaler
        self.name = getattr(child, "name", "")

    def grad_stats(self, count_zeros: bool) -> LocalStats:
        return self.child.grad_stats(count_zeros)

    def current_grad_stats(self, count_zeros: bool) -> LocalStats:
        return self.child.current_grad_stats(count_zeros)

    def main_grads(self, grad_norm_group: Optional[str] = None) -> list[torch.Tensor]:
        return self.child.main_grads(grad_norm_group)

    def step_with_ready_grads(self) -> bool:
        self.child.step_with_ready_grads()
        self.launch()
        return True

    def check_state_dict(self, state_dict: dict) -> None:
        self.child.check_state_dict(state_dict)


class LayerWiseDistributedOptimizer(ChainedOptimizer):
    """Steps owned parameters with `chained_optimizers`, then broadcasts them (module docstring).

    Args:
        chained_optimizers: FP32Optimizer/MixedPrecisionOptimizer children over the parameters
            this rank owns (every rank has the same children, some possibly empty); their
            norm groups must include the data-parallel group.
        shards: one DataParallelShards per data-parallel group (dense, expert).
        all_params: every trainable parameter of the model on this rank, in forward
            (registration) order.
        check_groups: groups over which the inf/NaN check of non-owned gradients is summed
            (together they must span every rank).
        reduce_grads: average this rank's own gradients onto the owners (True) or take them
            as already all-reduced (False).
        bucket_bytes: upper size of one broadcast/reduce buffer.
        overlap_param_gather: step() only launches the broadcasts; forward pre-hooks on
            `model_chunks` wait for each module's buckets.
        overlap_param_gather_with_optimizer_step: launch each chained optimizer's buckets as
            soon as it has stepped (needs overlap_param_gather).
        model_chunks: the modules whose forward pre-hooks wait (needed with overlap).
        phase_of: id(parameter) -> index in `chained_optimizers` of the optimizer that steps
            it (on its owner); parameters not in it count as stepped by the last one.
        qk_clip: QK-clip or max-logit logging (wrappers/qk_clip.py), the one the children got, or None.
        norm_order: rearranges the children's gradient statistics before they are summed
            (layer_wise_norm_order.py: megatron-core's order), or None.
    """

    owner_is_main_replica = True  # only the owner holds a parameter's state

    def __init__(
        self,
        chained_optimizers: list[MegatronOptimizer],
        shards: list[DataParallelShards],
        all_params: list[torch.nn.Parameter],
        check_groups: Sequence[Optional[ProcessGroup]],
        reduce_grads: bool = False,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        overlap_param_gather: bool = False,
        overlap_param_gather_with_optimizer_step: bool = False,
        model_chunks: Sequence[torch.nn.Module] = (),
        phase_of: Optional[Mapping[int, int]] = None,
        qk_clip: Optional[QKClip] = None,
        norm_order: Optional[ArrangeStats] = None,
    ) -> None:
        super().__init__(chained_optimizers, qk_clip=qk_clip)
        self.arrange_stats = norm_order
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1; got {bucket_bytes}.")
        if overlap_param_gather_with_optimizer_step and not overlap_param_gather:
            raise ValueError("overlap_param_gather_with_optimizer_step=True needs overlap_param_gather=True "
                             "(as in Megatron-LM: the forward pre-hooks are what wait for the broadcasts).")
        if overlap_param_gather and not model_chunks:
            raise ValueError("overlap_param_gather=True needs the model_chunks whose forward pre-hooks "
                             "wait for the parameter broadcasts; got none.")
        self.shards = shards
        self.all_params = all_params
        self.reduce_grads = reduce_grads
        self.bucket_bytes = bucket_bytes
        self.overlap_param_gather = overlap_param_gather
        self.overlap_param_gather_with_optimizer_step = overlap_param_gather_with_optimizer_step
        owned = {id(p) for shard in shards for p in shard.owned}
        device = all_params[0].device if all_params else torch.device("cpu")
        self._non_owned_check = _NonOwnedGradCheck([p for p in all_params if id(p) not in owned], check_groups, device)
        last_phase = len(self.chained_optimizers) - 1
        phases = {id(p): (phase_of or {}).get(id(p), last_phase) for p in all_params}
        self._sync_buckets = _plan_sync_buckets(shards, all_params, phases, bucket_bytes)
        self._bucket_of = {id(p): index for index, bucket in enumerate(self._sync_buckets) for p in bucket.params}
        self._in_flight: dict[int, _InFlight] = {}  # bucket index -> its launched broadcast
        self._hook_handles = []
        if overlap_param_gather:
            self._register_forward_pre_hooks(model_chunks)

    # The step.
    def step(self) -> StepResult:
        self._gradients_to_owners()
        with qk_clip_step(self.qk_clip):  # owners clip their main copies; the broadcast spreads them
            self.grad_norms_by_group = {}
            result = take_step(self._stepping_children() + [self._non_owned_check], self.config,
                               self.grad_norms_by_group, self.arrange_stats)
        if result[0]:
            self._sync_params()
        return result

    # megatron-core's phases (wrappers/step_phases.py): the gradients reach their owners first, and
    # the stepped parameters go from them to every rank last.
    def prepare_grads(self) -> bool:
        self._gradients_to_owners()
        return prepared_stats(list(self.chained_optimizers) + [self._non_owned_check], self.config,
                              self.arrange_stats)[0]

    def step_with_ready_grads(self) -> bool:
        with qk_clip_step(self.qk_clip):
            for child in self._stepping_children():
                child.step_with_ready_grads()
        self._sync_params()
        return True

    def _gradients_to_owners(self) -> None:
        self.finish_param_sync()  # the last step's broadcasts, where no forward waited for them
        if self.reduce_grads:
            self._reduce_grads_to_owners()

    def _stepping_children(self) -> list[SteppableChild]:
        children = list(self.chained_optimizers)
        if self.overlap_param_gather_with_optimizer_step:
            children = [_LaunchAfterStep(child, lambda phase=phase: self._start_param_sync(phase))
                        for phase, child in enumerate(children)]
        return children

    def _sync_params(self) -> None:
        with timed(self.config, "params-all-gather"):  # megatron-core's name for the parameter sync
            self._start_param_sync()
            if not self.overlap_param_gather:
                self.finish_param_sync()

    def finish_param_sync(self) -> None:
        """Wait for every launched parameter broadcast and copy the values in (megatron-core
        DDP's name). With overlap_param_gather, call it before reading or changing parameters
        outside a forward pass; this optimizer's own methods and checkpointing call it."""
        for index in list(self._in_flight):
            self._finish_bucket(index)

    @property
    def param_sync_in_flight(self) -> bool:
        """Whether some parameter broadcast has been launched and not yet waited for."""
        return bool(self._in_flight)

    # Everything that reads or replaces parameters or state waits first.
    def state_dict(self, is_loading: bool = False) -> dict:
        self.finish_param_sync()
        return super().state_dict(is_loading)

    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool = False,
                           metadata: Optional[dict] = None) -> dict:
        self.finish_param_sync()
        return super().sharded_state_dict(model_sharded_state_dict, is_loading, metadata)

    def load_state_dict(self, state_dict: dict) -> None:
        self.finish_param_sync()  # a later bucket copy must not overwrite what is loaded
        super().load_state_dict(state_dict)

    def reload_model_params(self, state_dict: Optional[dict] = None) -> None:
        self.finish_param_sync()
        super().reload_model_params(state_dict)

    def prepare_model_params_for_param_sync(self) -> None:
        """Megatron-LM calls this before it forces a parameter sync: finish ours."""
        self.finish_param_sync()

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)  # gradients only: no need to wait for the broadcasts
        for param in self.all_params:  # the children only know the owned parameters
            if param.grad is not None:
                if set_to_none:
                    param.grad = None
                else:
                    param.grad.detach_().zero_()

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state (and fp32 main copies) held on this rank."""
        total = 0
        for child in self.chained_optimizers:
            for state in child.state.values():
                total += sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t))
            total += child.main_param_bytes()  # fp32 copies, or 16-bit remainders (main_param_storage.py)
        return total

    # Communication.
    def _reduce_grads_to_owners(self) -> None:
        """Sum gradients over each data-parallel group onto the owners (async reduces), divided
        by the shard's divisor."""
        pending = []
        for shard in self.shards:
            size = group_size(shard.group)
            if size == 1:
                _divide_own_grads(shard.owned, shard.divisor)
                continue
            for owner, params in enumerate(shard.params_by_owner):
                for bucket in _buckets(params, self.bucket_bytes):
                    # One flag per parameter: whether any rank had a gradient for it.
                    flat = torch.cat([_grad_or_zeros(p).reshape(-1).float() for p in bucket]
                                     + [torch.tensor([float(model_grad(p) is not None) for p in bucket], device=bucket[0].device)])
                    work = dist.reduce(flat, dst=shard.global_rank(owner), op=dist.ReduceOp.SUM, group=shard.group, async_op=True)
                    pending.append((work, flat, bucket, owner == group_rank(shard.group), shard.divisor, shard, owner))
        received = []
        for work, flat, bucket, is_owner, divisor, shard, owner in pending:
            wait_bounded(work, shard.group, f"torch.distributed reduce of the layer-wise gradient bucket of "
                                            f"{_describe_params(bucket)} onto rank {shard.global_rank(owner)}")
            if is_owner:
                received.append((flat, bucket, divisor))
        if not received:
            return
        # Which parameters had a gradient anywhere decides grad None or not, a host decision:
        # one device-to-host copy for all of them, not one synchronizing read per parameter.
        had_grad = torch.cat([flat[-len(bucket):] for flat, bucket, _ in received]).tolist()
        start = 0
        for flat, bucket, divisor in received:
            _write_averaged_grads(flat, bucket, divisor, had_grad[start:start + len(bucket)])
            start += len(bucket)

    def _start_param_sync(self, phase: Optional[int] = None) -> None:
        """Launch the owners' broadcasts of `phase`'s buckets (all when None) not yet launched."""
        for index, bucket in enumerate(self._sync_buckets):
            if (phase is None or bucket.phase == phase) and index not in self._in_flight:
                flat = torch.cat([p.detach().reshape(-1) for p in bucket.params])
                work = dist.broadcast(flat, src=bucket.source, group=bucket.group, async_op=True)
                self._in_flight[index] = _InFlight(work, flat)

    def _finish_bucket(self, index: int) -> None:
        in_flight = self._in_flight[index]  # stays referenced until the wait returned
        bucket = self._sync_buckets[index]
        wait_bounded(in_flight.work, bucket.group, f"torch.distributed broadcast of layer-wise parameter bucket "
                                                   f"{index} ({_describe_params(bucket.params)}) from rank {bucket.source}")
        del self._in_flight[index]
        if not bucket.is_owner:
            _unflatten_into(in_flight.flat, bucket.params)

    def _register_forward_pre_hooks(self, model_chunks: Sequence[torch.nn.Module]) -> None:
        for chunk in model_chunks:
            for module in chunk.modules():
                buckets = sorted({self._bucket_of[id(p)] for p in module.parameters(recurse=False)
                                  if id(p) in self._bucket_of})
                if buckets:
                    self._hook_handles.append(module.register_forward_pre_hook(self._waiter(buckets)))

    def _waiter(self, buckets: list[int]) -> Any:
        """A forward pre-hook that waits for `buckets`, the ones holding the module's parameters."""

        def wait_for_own_buckets(module: torch.nn.Module, args: Any) -> None:
            for index in buckets:
                if index in self._in_flight:
                    self._finish_bucket(index)

        return wait_for_own_buckets


def _plan_sync_buckets(shards: list[DataParallelShards], all_params: list[torch.nn.Parameter],
                       phase_of: Mapping[int, int], bucket_bytes: int) -> list[_SyncBucket]:
    """The broadcast buckets, in the order they are launched: by first parameter's forward position.

    Each holds consecutive parameters (in forward order) of one owner and one phase.
    """
    position = {id(p): i for i, p in enumerate(all_params)}
    planned = []
    for shard in shards:
        if group_size(shard.group) == 1:
            continue
        for owner, params in enumerate(shard.params_by_owner):
            ordered = sorted(params, key=lambda p: position[id(p)])
            for phase in sorted({phase_of[id(p)] for p in ordered}):
                for members in _buckets([p for p in ordered if phase_of[id(p)] == phase], bucket_bytes):
                    planned.append(_SyncBucket(members, shard.group, shard.global_rank(owner),
                                               owner == group_rank(shard.group), phase))
    return sorted(planned, key=lambda b: position[id(b.params[0])])


def _buckets(params: list[torch.nn.Parameter], bucket_bytes: int) -> list[list[torch.nn.Parameter]]:
    """Consecutive parameters of one dtype and device, at most `bucket_bytes` (or one) each."""
    buckets: list[list[torch.nn.Parameter]] = []
    size = 0
    for param in params:
        nbytes = param.numel() * param.element_size()
        last = buckets[-1] if buckets else None
        if last and last[0].dtype == param.dtype and last[0].device == param.device and size + nbytes <= bucket_bytes:
            last.append(param)
            size += nbytes
        else:
            buckets.append([param])
            size = nbytes
    return buckets


def _describe_params(params: list[torch.nn.Parameter]) -> str:
    """E.g. `3 parameters, 4,160 elements, shapes 64x32, 32x32, 32`."""
    shapes = ", ".join("x".join(map(str, p.shape)) or "scalar" for p in params[:4]) + (", ..." if len(params) > 4 else "")
    return f"{len(params)} parameter{'s' * (len(params) != 1)}, {sum(p.numel() for p in params):,} elements, shapes {shapes}"


def _grad_or_zeros(param: torch.nn.Parameter) -> torch.Tensor:
    grad = model_grad(param)
    return torch.zeros_like(param, dtype=torch.float32) if grad is None else grad


def _divide_own_grads(params: list[torch.nn.Parameter], divisor: int) -> None:
    """A group of one: nothing to sum, only the division (experts at expert DP 1, dense DP > 1)."""
    if divisor == 1:
        return
    for param in params:
        grad = model_grad(param)
        if grad is not None:
            grad.div_(divisor)


def _write_averaged_grads(flat: torch.Tensor, bucket: list[torch.nn.Parameter], divisor: int,
                          had_grad: list[float]) -> None:
    offset = 0
    for param, flag in zip(bucket, had_grad):
        averaged = flat[offset:offset + param.numel()].view(param.shape) / divisor
        offset += param.numel()
        if flag == 0:
            continue  # no rank had a gradient: the parameter is not stepped
        if hasattr(param, "main_grad"):
            param.main_grad.copy_(averaged)
        elif param.grad is None:
            param.grad = averaged.to(param.dtype)
        else:
            param.grad.copy_(averaged)


def _unflatten_into(flat: torch.Tensor, bucket: list[torch.nn.Parameter]) -> None:
    offset = 0
    with torch.no_grad():
        for param in bucket:
            param.copy_(flat[offset:offset + param.numel()].view(param.shape))
            offset += param.numel()
