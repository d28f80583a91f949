"""Muon on megatron-core's fused projections, per component, at every TP layout (issue 39).

Modules: megatron-core's own MLASelfAttention, SequentialMLP experts, MambaMixer and GatedDeltaNet,
built on CPU (tests/fused_models.py says how; Mamba and GDN with their CUDA-only constructor
calls patched). One Muon step with lr 1, no momentum and no weight decay moves each matrix by
minus its scaled orthogonalized gradient.

Reference, written here from megatron-core's source, never from the code under test: the TP=1
gradient of each fused weight sliced by hand into the components its authors intend (MLA: each
query head; per head the key and the value rows of linear_kv_up_proj; the latent and the shared
rotary key of linear_kv_down_proj. Mamba in_proj: z, x, B, C, dt. GDN in_proj: q, k, v, z,
beta, alpha. A gated fc1, dense or expert: gate and up), each run through emerging_optimizers'
plain `newton_schulz` in fp32 ('highest') and scaled by sqrt(max(rows, cols)) of its own shape.
TP shards of the global gradient and of the reference update are cut by hand too: each part of a
Mamba/GDN in_proj split over the TP ranks, fc1's halves likewise (partition_stride=2), any other
weight contiguously along its partition_dim.

Turbo-Muon (muon_aol_preconditioner) in each TP mode that cuts or sums a matrix, the layer-wise
optimizer and FSDP2, against the same components through test_aol.py's float64 iteration: the
'distributed' mode fixes its orientation by the shard, so it meets matrices sharded along the side
the preconditioner scales (ops/aol.py).

Tolerance 2e-5 on updates of entries about 1: fp32 round-off of a batched against a 2-D
Newton-Schulz (about 1e-6) and, in 'distributed', of Gram matrices summed over ranks.
"""

import math
from unittest import mock

import pytest
import torch

from megatron_eopt import OptimizerConfig, get_megatron_optimizer
from megatron_eopt.params import fused_layouts
from megatron_eopt.params.fused_layouts import FusedBlocks, register_fused_layout
from megatron_eopt.params.groups import ParamRecord, matrix_layout
from megatron_eopt.runtime import once
from tests.fused_models import GDN_PARTS, HEADS, KV_LORA, MAMBA_PARTS, POS, QK, V
from tests.unit.library.ops.test_aol import aol_float64

TOLERANCE = 2e-5


def components(name: str, rows: int) -> list[tuple[int, int]]:
    """(start, end) rows of each component of a TP=1 weight, from megatron-core's layouts."""
    if name.endswith("linear_q_up_proj.weight"):
        return [(h * (QK + POS), (h + 1) * (QK + POS)) for h in range(HEADS)]
    if name.endswith("linear_kv_up_proj.weight"):
        return [part for h in range(HEADS) for part in ((h * (QK + V), h * (QK + V) + QK),
                                                        (h * (QK + V) + QK, (h + 1) * (QK + V)))]
    parts = {"linear_kv_down_proj.weight": (KV_LORA, POS), "mamba.in_proj.weight": MAMBA_PARTS,
             "gdn.in_proj.weight": GDN_PARTS, "linear_fc1.weight": (rows // 2, rows // 2)}
    sizes = next((sizes for suffix, sizes in parts.items() if name.endswith(suffix)), (rows,))
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [(start, start + size) for start, size in zip(starts, sizes)]


def reference_update(name: str, grad: torch.Tensor, aol: bool = False) -> torch.Tensor:
    """Each component orthogonalized alone: emerging_optimizers' `newton_schulz` (quintic x 5), or
    with `aol` Turbo-Muon's iteration as test_aol.py writes it out (quintic x 4), in float64."""
    from emerging_optimizers.orthogonalized_optimizers.muon_utils import newton_schulz

    update = torch.empty_like(grad)
    for start, end in components(name, grad.shape[0]):
        block = grad[start:end]
        orthogonal = aol_float64(block.double(), 4, "quintic").float() if aol else newton_schulz(block, steps=5)
        update[start:end] = orthogonal * math.sqrt(max(block.shape))
    return update


def tp_shard(name: str, full: torch.Tensor, partition_dim: int, rank: int, size: int) -> torch.Tensor:
    """The part of a TP=1 tensor that TP rank `rank` holds, as megatron-core lays it out."""
    if partition_dim < 0 or size == 1:
        return full
    parts = {"mamba.in_proj.weight": MAMBA_PARTS, "gdn.in_proj.weight": GDN_PARTS}
    sizes = next((sizes for suffix, sizes in parts.items() if name.endswith(suffix)), None)
    if name.endswith("linear_fc1.weight"):
        sizes = (full.shape[0] // 2,) * 2
    if sizes is None:
        return full.chunk(size, dim=partition_dim)[rank]
    return torch.cat([part.chunk(size, dim=0)[rank] for part in full.split(list(sizes))])


def is_muon_matrix(name: str, param: torch.Tensor) -> bool:
    return param.dim() == 2 and not any(part in name for part in ("embedding", "output_layer"))


def config(tp_mode: str, **extra) -> OptimizerConfig:
    return OptimizerConfig(optimizer="muon", lr=1.0, min_lr=0.0, weight_decay=0.0, clip_grad=0.0, muon_momentum=0.0,
                           muon_tp_mode=tp_mode, muon_fp32_matmul_prec="highest",
                           muon_tp_hardware_profile="h100" if tp_mode == "auto" else None, **extra)


def global_grads(shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(39)
    return {name: torch.randn(shape, generator=generator) for name, shape in sorted(shapes.items())}


def _step_case(tp: int, tp_mode: str, layout: str, grads: dict, expected: dict, aol: bool = False) -> dict:
    """One Muon step on the hybrid chunk at `tp` (the rest data-parallel); the largest error of
    each Muon matrix's update against the reference's TP shard."""
    from megatron.core import parallel_state
    from torch.distributed.fsdp import fully_shard

    from megatron_eopt.training.model.gpt import destroy_model_parallel, initialize_model_parallel
    from megatron_eopt.training.parallel.fsdp2 import data_parallel_mesh
    from tests.fused_models import HybridChunk

    initialize_model_parallel(tp, seed=3)
    try:
        torch.set_float32_matmul_precision("highest")
        # torch FSDP2 does not take expert parameters yet (distributed/fsdp2.py): a dense model there
        model, rank = HybridChunk(experts=layout != "fsdp2"), parallel_state.get_tensor_model_parallel_rank()
        dims = {n: (p.partition_dim if getattr(p, "tensor_model_parallel", False) else -1)
                for n, p in model.named_parameters()}
        local = {n: tp_shard(n, grads[n], dims[n], rank, tp) for n in dims}
        extra = {"use_layer_wise_distributed_optimizer": True} if layout == "layer_wise" else {}
        if aol:
            extra["muon_aol_preconditioner"] = True
        if layout == "fsdp2":
            fully_shard(model, mesh=data_parallel_mesh(parallel_state.get_data_parallel_group(), torch.device("cpu")))
        optimizer = get_megatron_optimizer(config(tp_mode, **extra), [model])
        before = {n: _local_value(p).clone() for n, p in model.named_parameters()}
        for n, p in model.named_parameters():
            p.grad = _like(p, local[n])
        optimizer.step()
        return {n: (_local_value(p) - before[n] + tp_shard(n, expected[n], dims[n], rank, tp)).abs().max().item()
                for n, p in model.named_parameters() if n in expected}
    finally:
        destroy_model_parallel()


def _local_value(param: torch.Tensor) -> torch.Tensor:
    return param.full_tensor().detach() if hasattr(param, "full_tensor") else param.detach()


def _like(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    if hasattr(param, "device_mesh"):  # FSDP2's DTensor: each rank its own chunk of the same copy
        from torch.distributed.tensor import Shard, distribute_tensor

        return distribute_tensor(value, param.device_mesh, [Shard(0)], src_data_rank=None)
    return value.clone()


CASES = ((1, "duplicated", "plain"), (2, "duplicated", "plain"), (2, "distributed", "plain"), (2, "sharded", "plain"),
         (2, "auto", "plain"), (4, "duplicated", "plain"), (4, "distributed", "plain"), (4, "sharded", "plain"),
         (2, "duplicated", "layer_wise"), (2, "sharded", "layer_wise"), (2, "duplicated", "fsdp2"),
         (2, "distributed", "fsdp2"))
# Turbo-Muon (the AOL preconditioner): each TP mode that cuts or sums a matrix, and both owners.
AOL_CASES = ((1, "duplicated", "plain"), (2, "distributed", "plain"), (2, "sharded", "plain"),
             (4, "distributed", "plain"), (2, "duplicated", "layer_wise"), (2, "distributed", "fsdp2"))


def _exactness_body(rank: int, world_size: int) -> dict:
    from megatron_eopt.training.model.gpt import destroy_model_parallel, initialize_model_parallel
    from tests.fused_models import HybridChunk

    torch.set_float32_matmul_precision("highest")
    references = {}
    initialize_model_parallel(1, seed=3)
    try:
        for experts in (True, False):
            params = dict(HybridChunk(experts).named_parameters())
            grads = global_grads({n: p.shape for n, p in params.items()})
            for aol in (False, True):
                references[experts, aol] = grads, {n: reference_update(n, grads[n], aol) for n, p in params.items()
                                                   if is_muon_matrix(n, p)}
    finally:
        destroy_model_parallel()
    results = {case: _step_case(*case, *references[case[2] != "fsdp2", False]) for case in CASES}
    results.update({("aol", *case): _step_case(*case, *references[case[2] != "fsdp2", True], aol=True)
                    for case in AOL_CASES})
    grads, expected = references[True, False]
    results["whole"] = {n: (whole_update(grads[n]) - expected[n]).abs().max().item()  # the reference discriminates
                        for n in expected if len(components(n, grads[n].shape[0])) > 1}
    return results


def whole_update(grad: torch.Tensor) -> torch.Tensor:
    from emerging_optimizers.orthogonalized_optimizers.muon_utils import newton_schulz

    return newton_schulz(grad, steps=5) * math.sqrt(max(grad.shape))


def test_fused_weights_equal_per_component_reference_at_every_tp_layout(run_distributed) -> None:
    """TP=1, 2 and 4 in every exact TP mode, the layer-wise optimizer and FSDP2 (TP=2 x DP=2), with
    and without Turbo-Muon: every Muon matrix's update, fused or not, equals the per-component reference."""
    for per_rank in run_distributed(_exactness_body, world_size=4, timeout=900):
        whole = per_rank.pop("whole")  # orthogonalized whole, each fused weight is far from the reference
        assert len(whole) >= 8 and min(whole.values()) > 0.05, whole
        for case, errors in per_rank.items():
            fused = [n for n in errors if any(s in n for s in ("q_up", "kv_up", "kv_down", "in_proj", "fc1"))]
            assert len(fused) >= 8, (case, sorted(errors))  # 2 layers x 3 MLA, fc1 (dense, experts), mamba, gdn
            bad = {n: e for n, e in errors.items() if e > TOLERANCE}
            assert not bad, (case, bad)


# --- single process: the table, and what it refuses or warns about -------------------------


def _record(name: str, param: torch.Tensor, partition_dim: int = 0) -> ParamRecord:
    return ParamRecord(fqn=name, name=name, param=param, group_key="muon/dense/default", is_expert_parallel=False,
                       tensor_model_parallel=partition_dim >= 0, partition_dim=partition_dim, is_shared=False,
                       optimizer_name="muon")


class Custom(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.packed = torch.nn.Linear(8, 12, bias=False)


def test_register_fused_layout_splits_a_custom_module() -> None:
    owner = Custom()
    record = _record("packed.weight", owner.packed.weight, -1)
    with mock.patch.dict(fused_layouts._TABLE):
        register_fused_layout(Custom, "packed", lambda weight: FusedBlocks((4, 8)))
        layout = matrix_layout(record, None, 1, True, owner=owner, attribute="packed")
    assert layout.global_block_shapes() == [(4, 8), (8, 8)]
    assert matrix_layout(record, None, 1, True, owner=owner, attribute="packed").global_block_shapes() == [(12, 8)]
    with pytest.raises(TypeError, match=r"register_fused_layout takes a class .* got 'Custom'"):
        register_fused_layout("Custom", "packed", lambda weight: FusedBlocks((4, 8)))


def test_unknown_fused_weight_warns_once_naming_it() -> None:
    owner = Custom()
    owner.packed.weight.partition_stride = 3
    record = _record("layers.0.packed.weight", owner.packed.weight)
    with mock.patch.object(once, "_GIVEN", set()):
        with pytest.warns(UserWarning, match=r"'layers\.0\.packed\.weight' as one matrix, but it has partition_stride=3"):
            layout = matrix_layout(record, None, 1, True, owner=owner, attribute="packed")
        matrix_layout(record, None, 1, True, owner=owner, attribute="packed")  # once: no second warning
    assert layout.global_block_shapes() == [(12, 8)]


def test_known_module_missing_its_facts_warns() -> None:
    class GatedDeltaNetLike(torch.nn.Module):  # registered by qualified name: a stand-in of that name
        pass

    GatedDeltaNetLike.__module__, GatedDeltaNetLike.__qualname__ = "megatron.core.ssm.gated_delta_net.common", "_GDNBase"
    owner = GatedDeltaNetLike()
    owner.in_proj = torch.nn.Linear(8, 12, bias=False)
    with mock.patch.object(once, "_GIVEN", set()), pytest.warns(UserWarning, match=r"'in_proj\.weight' as one matrix, "
                                                                                  r"but its GatedDeltaNetLike lacks the facts"):
        layout = matrix_layout(_record("in_proj.weight", owner.in_proj.weight), None, 1, True, owner=owner,
                               attribute="in_proj")
    assert layout.row_blocks == ()


def _whole_matrix_body(rank: int, world_size: int) -> dict:
    """Whole-matrix optimizers (mop, polargrad, scion) gather MLA's per-head and cut weights."""
    from megatron_eopt.ops.splits import MatrixLayout
    from megatron_eopt.ops.whole_matrix import gather_whole_matrix, local_part

    group = torch.distributed.group.WORLD
    full = torch.arange(32 * 5, dtype=torch.float32).view(32, 5)
    shard = full.chunk(2)[rank]  # column-parallel: whole heads (or contiguous rows) per rank
    layouts = {"per_head": MatrixLayout("kv_up", (16, 5), 0, 2, 2, (6, 2), per_group=True),
               "cut": MatrixLayout("kv_down", (16, 5), 0, 2, row_blocks=(20, 12), tp_contiguous=True)}
    return {name: (torch.equal(gather_whole_matrix(shard, layout, group), full),
                   torch.equal(local_part(full, layout, group), shard)) for name, layout in layouts.items()}


def test_whole_matrix_gathers_per_head_and_cut_layouts(run_distributed) -> None:
    for per_rank in run_distributed(_whole_matrix_body, world_size=2, timeout=300):
        assert per_rank == {"per_head": (True, True), "cut": (True, True)}


def test_cut_shard_splits_where_the_parts_cut_it_and_bad_layouts_raise() -> None:
    """'blockwise' on MLA's kv_down_proj at TP=2 (latent 10 rows, rotary key 6): rank 0 holds 8
    latent rows, rank 1 the other 2 and the rotary key."""
    from megatron_eopt.ops.splits import MatrixLayout, shard_layout, split_blocks

    layout = MatrixLayout("kv_down", (8, HEADS), 0, 2, row_blocks=(10, 6), tp_contiguous=True)
    assert layout.cut_by_tp and layout.global_block_shapes() == [(10, HEADS), (6, HEADS)]
    assert [shard_layout(layout, rank).row_blocks for rank in (0, 1)] == [(8,), (2, 6)]
    with pytest.raises(ValueError, match=r"'kv_down': its TP shard cuts through its blocks"):
        split_blocks(torch.zeros(8, HEADS), layout)
    with pytest.raises(ValueError, match=r"'kv_down': tp_contiguous needs .* sum to the global rows \(16\)"):
        MatrixLayout("kv_down", (8, HEADS), 0, 2, row_blocks=(10, 4), tp_contiguous=True)
    with pytest.raises(ValueError, match=r"'kv_up': per_group splits whole row groups"):
        MatrixLayout("kv_up", (16, HEADS), 0, 2, 2, (6, 2), head_rows=2, per_group=True)
