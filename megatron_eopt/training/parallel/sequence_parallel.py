"""megatron-core's sequence parallelism (`--sequence-parallel`), on CPU as well as on CUDA.

Activations outside attention and the MLP are split along the sequence over the TP ranks, so
layer-norm weights and row-parallel biases see only this rank's tokens.
`sum_grads_over_tensor_parallel` sums their gradients over TP after backward, as megatron-core's
`finalize_model_grads` does for parameters tagged `sequence_parallel`.

On CPU this module replaces what allocates on CUDA:
- `install_cpu_sequence_parallel`: megatron's first-dimension all-gather and reduce-scatter
  helpers, allocating where the input is;
- `CPUSequenceParallelColumnLinear`: gathers with megatron's autograd mapping and multiplies
  with `F.linear`.
training/model/norms.py's `LocalTorchNorm` tags the norms' weights, and training/parallel/cpu_rng.py
runs megatron's RNG tracker on the CPU generator.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.tensor_parallel import mappings
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from torch.distributed.tensor import DTensor

from megatron_eopt.ops.collectives import all_gather_single, all_reduce_sum_coalesced, reduce_scatter_single


def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
    """megatron's `_gather_along_first_dim` with its output where the input is."""
    world_size = group.size()
    if world_size == 1:
        return input_
    if output_split_sizes is None:
        output = input_.new_empty((input_.size(0) * world_size, *input_.shape[1:]))
        all_gather_single(output, input_.contiguous(), group=group)
        return output
    output = input_.new_empty((sum(output_split_sizes), *input_.shape[1:]))
    dist.all_gather(list(output.split(output_split_sizes)), input_.contiguous(), group=group)
    return output


def _reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
    """megatron's `_reduce_scatter_along_first_dim` with its output where the input is."""
    world_size = group.size()
    if world_size == 1:
        return input_
    if input_split_sizes is None:
        if input_.size(0) % world_size:
            raise ValueError(f"sequence parallelism: the first dimension ({input_.size(0)}) must be "
                             f"divisible by the tensor-parallel size ({world_size})")
        output = input_.new_empty((input_.size(0) // world_size, *input_.shape[1:]))
        reduce_scatter_single(output, input_.contiguous(), group=group)
        return output
    pieces = list(input_.contiguous().split(input_split_sizes))
    output = torch.empty_like(pieces[group.rank()])
    dist.reduce_scatter(output, pieces, group=group)
    return output


def install_cpu_sequence_parallel() -> None:
    """Make megatron's sequence-parallel mappings allocate where their input is (idempotent).

    The autograd functions of megatron's mappings look these helpers up by module name at call
    time, so replacing them there serves the embedding's scatter, the row-parallel linear's
    reduce-scatter and every gather. For CUDA inputs the result is what megatron computes.
    """
    mappings._gather_along_first_dim = _gather_along_first_dim
    mappings._reduce_scatter_along_first_dim = _reduce_scatter_along_first_dim


class CPUSequenceParallelColumnLinear(ColumnParallelLinear):
    """megatron's ColumnParallelLinear whose sequence-parallel input gather runs on any device:
    megatron's `gather_from_sequence_parallel_region` (all-gather forward, reduce-scatter of the
    input gradient backward), then `F.linear`, whose backward gives the weight gradient from the
    gathered input. Without sequence parallelism megatron's own implementation runs."""

    def _forward_impl(self, input, weight, *args, **kwargs):
        if not kwargs.get("sequence_parallel"):
            return super()._forward_impl(input, weight, *args, **kwargs)
        if kwargs.get("gradient_accumulation_fusion"):
            raise ValueError("sequence parallelism on CPU does not support gradient_accumulation_fusion")
        total_input = mappings.gather_from_sequence_parallel_region(
            input, tensor_parallel_output_grad=True, group=kwargs.get("tp_group"))
        return F.linear(total_input, weight, kwargs.get("bias"))


def use_cpu_sequence_parallel_linears(model: torch.nn.Module) -> None:
    """Swap megatron's column-parallel linears of `model` that use sequence parallelism for
    :class:`CPUSequenceParallelColumnLinear` (same parameters and attributes)."""
    for module in model.modules():
        if type(module) is ColumnParallelLinear and module.sequence_parallel:
            module.__class__ = CPUSequenceParallelColumnLinear


@torch.no_grad()
def sum_grads_over_tensor_parallel(params: list[torch.nn.Parameter], tp_group) -> None:
    """Sum the gradients of `params` (`main_grad` where the trainer accumulates in fp32) over the
    tensor-parallel group, one all-reduce for all of them: afterwards every rank holds the
    gradient of the whole sequence (or of all heads, for the query/key norms), as megatron-core's
    `finalize_model_grads` leaves them.
    Under torch.no_grad: the sum writes into the gradients in place."""
    grads = [getattr(p, "main_grad", None) if getattr(p, "main_grad", None) is not None else p.grad
             for p in params]
    # FSDP2: each TP rank holds the same rows of a norm weight (its DP mesh shards alike), so
    # the local shards are summed.
    all_reduce_sum_coalesced([g.to_local() if isinstance(g, DTensor) else g for g in grads if g is not None],
                             tp_group)
