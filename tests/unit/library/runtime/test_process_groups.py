"""ParallelGroups from each source the trainer may have, and their failure modes.

Multi-rank cases check that every source yields groups with the same ranks as megatron-core's
parallel_state, and that the optimizer built from them gives the TP=1 gradient norm.
"""

import pytest
import torch
import torch.distributed as dist

from megatron_eopt import OptimizerConfig, ParallelGroups, get_megatron_optimizer
from megatron_eopt.runtime.process_groups import resolve_parallel_groups


def test_single_process_without_torch_distributed() -> None:
    assert not dist.is_initialized()
    groups = resolve_parallel_groups(None)
    assert groups == ParallelGroups.single_process()
    assert groups.require("tp", "test") is None  # size 1, provided


def test_explicit_groups_reject_unknown_roles_and_non_groups() -> None:
    with pytest.raises(ValueError, match=r"unknown process-group roles \['tensor'\]"):
        ParallelGroups.from_groups(tensor=None)
    with pytest.raises(TypeError, match="must be a torch.distributed.ProcessGroup or None"):
        ParallelGroups(tp="world")


def test_pg_collection_without_tp_is_an_error() -> None:
    class Collection:
        mp = None

    with pytest.raises(ValueError, match="pg_collection has no 'tp' or 'mp' process group"):
        ParallelGroups.from_pg_collection(Collection())


def ranks_of(group) -> list[int]:
    return [0] if group is None else dist.get_process_group_ranks(group)


def _sources_body(rank: int, world_size: int) -> dict:
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from torch.distributed.device_mesh import init_device_mesh

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    from_state = ParallelGroups.from_parallel_state()
    from_collection = ParallelGroups.from_pg_collection(ProcessGroupCollection.use_mpu_process_groups())
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    from_mesh = ParallelGroups.from_device_mesh(mesh)
    flat_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    from_flat_mesh = ParallelGroups.from_device_mesh(flat_mesh, dp_dim=None)
    try:
        ParallelGroups.from_device_mesh(mesh, tp_dim="model")
        mesh_error = None
    except ValueError as error:
        mesh_error = str(error)
    # A TP-sharded weight plus a replicated one, through the mesh's groups.
    column = torch.nn.Linear(2, 2, bias=False)
    column.weight.data.fill_(1.0)
    column.weight.tensor_model_parallel, column.weight.partition_dim = True, 0
    replicated = torch.nn.Linear(2, 2, bias=False)
    model = torch.nn.ModuleDict({"column": column, "replicated": replicated})
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=0.1), model, pg_collection=from_mesh)
    column.weight.grad = torch.full((2, 2), float(rank + 1))  # shards differ
    replicated.weight.grad = torch.full((2, 2), 3.0)  # identical copies: count once
    norm = optimizer.step()[1]
    return {
        "tp": [ranks_of(g.tp) for g in (from_state, from_collection, from_mesh)],
        "mp": [ranks_of(g.mp) for g in (from_state, from_collection, from_mesh)],
        "dp": [ranks_of(g.dp_cp) for g in (from_state, from_collection, from_mesh)],
        # All ranks of the job (for checkpoints): known to parallel_state and a 1-D mesh; a 2-D
        # mesh does not hand out a group over all its ranks, so it is left to the caller.
        "tp_dp_cp": [ranks_of(g.tp_dp_cp) for g in (from_state, from_collection, from_flat_mesh)],
        "tp_dp_cp_from_2d_mesh": "tp_dp_cp" in from_mesh.provided,
        "mesh_error": mesh_error,
        "norm": norm,
    }


def test_every_source_gives_the_same_groups(run_distributed) -> None:
    expected_norm = (4 * 1.0 + 4 * 4.0 + 4 * 9.0) ** 0.5
    for result in run_distributed(_sources_body, world_size=2):
        assert result["tp"] == [[0, 1]] * 3
        assert result["mp"] == [[0, 1]] * 3
        assert result["dp"] == [[0]] * 3  # size 1 -> None, reported as this rank alone
        assert result["tp_dp_cp"] == [[0, 1]] * 3
        assert result["tp_dp_cp_from_2d_mesh"] is False
        assert "DeviceMesh has no dimension 'model'" in result["mesh_error"]
        assert result["norm"] == pytest.approx(expected_norm, rel=1e-6)
