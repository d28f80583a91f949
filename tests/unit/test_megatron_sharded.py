"""`optimizer.sharded_state_dict(model.sharded_state_dict(), is_loading)` in megatron-core's format.

On CPU megatron-core's `dist_checkpointing.save` cannot run (its torch_dist strategy calls
torch.cuda.synchronize), so this checks everything before and after the write, at TP=2 x DP=2
on a GPTModel with a gated fc1 (a ShardedTensorFactory):
- megatron-core's own `save_preprocess` accepts the model's and the optimizer's sharded state
  together, including its sharding-integrity validation (every shard of every key written by
  exactly one main replica, the layer-wise owners' included), and the common part is the same
  on every rank;
- the sharded dict made for loading (`is_loading=True`, on a fresh optimizer with no state yet)
  has the same keys, shapes and offsets as the saved one, and filling it with the saved values
  (what `load` returns at the same layout) and calling `load_state_dict` restores the optimizer
  state key by key.
"""

import torch.distributed as dist

from tests.unit.checkpoint_runs import GPTRun, Layout
from tests.unit.test_checkpoint import _differences


def _walk(node, path=()):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _walk(value, (*path, key))
    else:
        yield path, node


def _signature(sharded) -> dict:
    """key path -> (type, megatron key, global shape, offset, replica id) of sharded leaves."""
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    return {path: (type(leaf).__name__, leaf.key, getattr(leaf, "global_shape", None),
                   getattr(leaf, "global_offset", None), leaf.replica_id)
            for path, leaf in _walk(sharded) if isinstance(leaf, ShardedBase)}


def _as_loaded(load_side, save_side):
    """What megatron-core's load returns at the same layout: the saved local values."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase

    if isinstance(load_side, dict):
        return {key: _as_loaded(value, save_side[key]) for key, value in load_side.items()}
    if isinstance(load_side, LocalNonpersistentObject):
        return load_side.unwrap()
    if isinstance(save_side, ShardedBase):
        return save_side.data.clone()
    return save_side


def _sharded_body(rank: int, world_size: int, layout: Layout) -> dict:
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess

    saved = GPTRun(layout)
    for step in range(2):
        saved.train_step(step)
    save_side = saved.optimizer.sharded_state_dict(saved.model.sharded_state_dict())
    expected = saved.optimizer.state_dict()
    saved.close()
    fresh = GPTRun(layout)
    load_side = fresh.optimizer.sharded_state_dict(fresh.model.sharded_state_dict(), is_loading=True)
    same_signature = _signature(load_side) == _signature(save_side)
    fresh.optimizer.load_state_dict(_as_loaded(load_side, save_side))
    differences = _differences(expected, fresh.optimizer.state_dict())
    fresh.close()

    validation_error = None
    try:  # megatron-core's checks before writing (its checkpoint format, its integrity rules)
        _, common = save_preprocess({"optimizer": save_side}, validate_access_integrity=True)
    except Exception as error:  # report any failure to the test, with its message
        validation_error, common = f"{type(error).__name__}: {error}", None
    commons = [None] * world_size
    dist.all_gather_object(commons, repr(common))
    return {"same_signature": same_signature, "differences": differences, "validation_error": validation_error,
            "common_same_on_all_ranks": len(set(commons)) == 1,
            "sharded_leaves": len(_signature(save_side))}


def test_sharded_state_dict_passes_megatron_validation_and_round_trips(run_distributed) -> None:
    for layout in (Layout("muon", tp=2, layer_wise=True), Layout("adam", tp=2, bf16=True)):
        for rank, result in enumerate(run_distributed(_sharded_body, world_size=4, args=(layout,))):
            assert result["validation_error"] is None, (layout, rank, result["validation_error"])
            assert result["same_signature"], (layout, rank)
            assert not result["differences"], (layout, rank, result["differences"][:5])
            assert result["common_same_on_all_ranks"], (layout, rank)
            assert result["sharded_leaves"] > 0, (layout, rank)


def _unsupported_state_body(rank: int, world_size: int) -> str:
    run = GPTRun(Layout("normuon"))  # its second moment is (rows, 1) or (1, cols)
    try:
        run.train_step(0)
        run.optimizer.sharded_state_dict(run.model.sharded_state_dict())
        return "no error"
    except ValueError as error:
        return str(error)
    finally:
        run.close()


def test_state_megatron_format_cannot_hold_is_refused_by_name(run_distributed) -> None:
    [message] = run_distributed(_unsupported_state_body, world_size=1)
    assert "moment2_buffer" in message and "parameter-shaped" in message and "save_checkpoint" in message
