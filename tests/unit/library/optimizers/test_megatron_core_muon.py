"""TensorParallelMuon and TensorParallelAdaptiveMuon take megatron-core's arguments, and they act.

The expected results are megatron-core's own TensorParallelMuon, stepped on copies of the same
parameters with the same gradients (CPU, fp32): plain matrices must match bitwise; fused QKV
weights split by `split_qkv` and TP shards from `pg_collection` to 1e-6 (our Newton-Schulz
batches the equal-shape k and v blocks and sums TP partial products in another order).
megatron-core 0.19.2's TensorParallelAdaptiveMuon cannot step (AdaptiveMuon's scale reads a
`scale_mode` attribute its __init__ never sets), so the adaptive variant's megatron-core arguments
are checked against the same optimizer given the layouts and TP group explicitly (the layouts
path has its own references in test_tensor_parallel_adaptive_muon.py).
"""

import inspect

import pytest
import torch
import torch.distributed as dist

from megatron_eopt.ops.splits import MatrixLayout
from megatron_eopt.optimizers.muon.tensor_parallel_adaptive_muon import TensorParallelAdaptiveMuon
from megatron_eopt.optimizers.muon.tensor_parallel_muon import TensorParallelMuon

STEPS = 3
Q, KV, GROUPS, HIDDEN = 4, 2, 4, 12  # rows per query group: q 4, k 2, v 2
QKV_SHAPES = [Q, KV, KV]


def _mcore_classes() -> tuple[type, type]:
    from megatron.core.optimizer.emerging_optimizers import TensorParallelAdaptiveMuon as McoreAdaptive
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon as McoreMuon

    return McoreMuon, McoreAdaptive


def _leading_parameters(cls: type, count: int) -> list[tuple[str, object, object]]:
    parameters = list(inspect.signature(cls.__init__).parameters.values())[1 : count + 1]
    return [(p.name, p.default, p.kind) for p in parameters]


@pytest.mark.parametrize("index", [0, 1], ids=["muon", "adaptive_muon"])
def test_signature_is_megatron_cores(index: int) -> None:
    """Same names, order, defaults and kinds as megatron-core's; ours only add keywords after."""
    mcore_cls = _mcore_classes()[index]
    ours_cls = (TensorParallelMuon, TensorParallelAdaptiveMuon)[index]
    count = len(inspect.signature(mcore_cls.__init__).parameters) - 1
    assert _leading_parameters(ours_cls, count) == _leading_parameters(mcore_cls, count)
    extra = list(inspect.signature(ours_cls.__init__).parameters.values())[count + 1 :]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in extra)


def _params(seed: int, shapes: dict[str, tuple[int, int]]) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(*shape, generator=generator) for name, shape in shapes.items()}


def _run(make, initial: dict[str, torch.Tensor], grads: list[dict[str, torch.Tensor]], tag=None) -> dict:
    params = {name: torch.nn.Parameter(value.clone()) for name, value in initial.items()}
    for name, param in params.items():
        (tag or (lambda n, p: None))(name, param)
    optimizer = make(list(params.values()))
    for step_grads in grads:
        for name, param in params.items():
            param.grad = step_grads[name].clone()
        optimizer.step()
    return {name: param.detach() for name, param in params.items()}


SHAPES = {"w": (16, 24), "v": (24, 8)}


@pytest.mark.parametrize("args,kwargs", [
    ((0.01, 0.95, False), {}),  # positional: nesterov=False, not weight_decay=False
    ((), dict(lr=0.01)),  # megatron-core's default nesterov=True
    ((), dict(lr=0.01, use_decoupled_weight_decay=False, weight_decay=0.1, nesterov=False)),
], ids=["positional_nesterov", "defaults", "l2_weight_decay"])
def test_steps_equal_megatron_cores_bitwise(args: tuple, kwargs: dict) -> None:
    McoreMuon, _ = _mcore_classes()
    initial = _params(0, SHAPES)
    grads = [_params(1 + step, SHAPES) for step in range(STEPS)]
    ours = _run(lambda p: TensorParallelMuon(p, *args, **kwargs), initial, grads)
    theirs = _run(lambda p: McoreMuon(p, *args, **kwargs), initial, grads)
    for name in SHAPES:
        assert not torch.equal(ours[name], initial[name])
        assert torch.equal(ours[name], theirs[name]), name


def _is_qkv(param: torch.Tensor) -> bool:
    return getattr(param, "is_qkv", False)


def _tag_qkv(name: str, param: torch.Tensor) -> None:
    param.is_qkv = name == "qkv"


QKV_MATRICES = {"qkv": (GROUPS * sum(QKV_SHAPES), HIDDEN), "proj": (HIDDEN, 16)}


MCORE_ONLY = ("split_qkv", "is_qkv_fn", "qkv_split_shapes", "pg_collection")


def _reference(cls_index: int, kwargs: dict, layouts: dict, tp_group=None):
    """megatron-core's TensorParallelMuon; for the adaptive variant ours with explicit layouts."""
    if cls_index == 0:
        return lambda p: _mcore_classes()[0](p, **kwargs)
    explicit = {k: v for k, v in kwargs.items() if k not in MCORE_ONLY}
    return lambda p: TensorParallelAdaptiveMuon(p, **explicit, layouts=layouts, tp_group=tp_group)


def _qkv_layout(rows: int, partition_dim: int = -1, tp_size: int = 1) -> MatrixLayout:
    return MatrixLayout("<parameter 0>", (rows, HIDDEN), partition_dim, tp_size, rows // sum(QKV_SHAPES),
                        tuple(QKV_SHAPES))


@pytest.mark.parametrize("cls_index", [0, 1], ids=["muon", "adaptive_muon"])
def test_split_qkv_equals_megatron_cores(cls_index: int) -> None:
    """split_qkv + is_qkv_fn + qkv_split_shapes orthogonalize q, k and v apart, as megatron-core does
    (and differently from the unsplit weight, so the split is really taken)."""
    ours_cls = (TensorParallelMuon, TensorParallelAdaptiveMuon)[cls_index]
    kwargs = dict(lr=0.02, split_qkv=True, is_qkv_fn=_is_qkv, qkv_split_shapes=QKV_SHAPES, fp32_matmul_prec="highest")
    initial = _params(0, QKV_MATRICES)
    grads = [_params(1 + step, QKV_MATRICES) for step in range(STEPS)]
    ours = _run(lambda p: ours_cls(p, **kwargs), initial, grads, _tag_qkv)
    reference = _reference(cls_index, kwargs, {"<parameter 0>": _qkv_layout(QKV_MATRICES["qkv"][0])})
    theirs = _run(reference, initial, grads, _tag_qkv)
    unsplit = _run(lambda p: ours_cls(p, **{**kwargs, "split_qkv": False}), initial, grads, _tag_qkv)
    for name in QKV_MATRICES:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=1e-6)
    assert (unsplit["qkv"] - theirs["qkv"]).abs().max() > 1e-3


def _tp_body(rank: int, size: int, cls_index: int) -> dict:
    """TP=size shards of qkv (column-parallel) and proj (row-parallel), with megatron-core's
    `partition_dim` and a ProcessGroupCollection whose tp group is WORLD."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    ours_cls = (TensorParallelMuon, TensorParallelAdaptiveMuon)[cls_index]
    pg_collection = ProcessGroupCollection(tp=dist.group.WORLD)
    dims = {"qkv": 0, "proj": 1}

    def shard(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {n: t.chunk(size, dim=dims[n])[rank].contiguous() for n, t in full.items()}

    def tag(name: str, param: torch.Tensor) -> None:
        _tag_qkv(name, param)
        param.tensor_model_parallel, param.partition_dim = True, dims[name]

    kwargs = dict(lr=0.02, split_qkv=True, is_qkv_fn=_is_qkv, qkv_split_shapes=QKV_SHAPES,
                  fp32_matmul_prec="highest", pg_collection=pg_collection)
    initial = shard(_params(0, QKV_MATRICES))
    grads = [shard(_params(1 + step, QKV_MATRICES)) for step in range(STEPS)]
    ours = _run(lambda p: ours_cls(p, **kwargs), initial, grads, tag)
    layouts = {"<parameter 0>": _qkv_layout(initial["qkv"].shape[0], 0, size),
               "<parameter 1>": MatrixLayout("<parameter 1>", tuple(initial["proj"].shape), 1, size)}
    theirs = _run(_reference(cls_index, kwargs, layouts, dist.group.WORLD), initial, grads, tag)
    blockwise = _run(lambda p: ours_cls(p, **kwargs, tp_mode="blockwise"), initial, grads, tag)
    return {
        "error": max((ours[n] - theirs[n]).abs().max().item() for n in QKV_MATRICES),
        "blockwise_difference": max((blockwise[n] - theirs[n]).abs().max().item() for n in QKV_MATRICES),
    }


@pytest.mark.parametrize("cls_index", [0, 1], ids=["muon", "adaptive_muon"])
def test_pg_collection_gives_the_tp_group(run_distributed, cls_index: int) -> None:
    """At TP=2 through megatron-core's pg_collection, the update is megatron-core's ('duplicated':
    the whole q, k, v and proj matrices), not the per-shard one."""
    for result in run_distributed(_tp_body, world_size=2, args=(cls_index,)):
        assert result["error"] < 1e-6, result
        assert result["blockwise_difference"] > 1e-3, result


@pytest.mark.parametrize("kwargs,message", [
    (dict(split_qkv=True), r"split_qkv=True needs is_qkv_fn.*got None"),
    (dict(split_qkv=True, is_qkv_fn=lambda p: True), r"has no qkv_split_shapes .*got None"),
    (dict(split_qkv=True, is_qkv_fn=lambda p: True, qkv_split_shapes=[5, 2, 2]),
     r"'<parameter 0>': 16 rows on this TP rank is not 1 group\(s\) of the split total 9"),
    (dict(use_decoupled_weight_decay=False, weight_decay_method="decoupled"),
     r"use_decoupled_weight_decay=False means weight_decay_method='l2'"),
    (dict(pg_collection=object()), r"pg_collection has no 'tp' group"),
])
def test_bad_megatron_core_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TensorParallelMuon([torch.nn.Parameter(torch.zeros(16, 8))], **kwargs)
