"""`optimizer.sharded_state_dict(model.sharded_state_dict(), is_loading)` through megatron-core's
dist_checkpointing, to disk and back, at TP=2 x DP=2 on a GPTModel with a gated fc1 (a
ShardedTensorFactory), layer-wise Muon and bf16 Adam.

Save: megatron-core's own pipeline. `dist_checkpointing.save` itself cannot run without CUDA in
megatron-core 0.19: its only strategy (torch_dist, `TorchDistSaveShardedStrategy.save`) stages
the tensors with `FileSystemWriterAsync.preload_tensors`, which calls `torch.cuda.synchronize()`
(non_blocking=True is hard-wired), and its finalize step broadcasts a flag allocated on
`torch.cuda.current_device()`. So on CPU `_megatron_save` runs every step of `save` up to that
writer (factories, `save_preprocess` with its sharding-integrity validation, the common state as
a ShardedObject, the translation to torch ShardedTensors) and writes with torch's synchronous
`FileSystemWriter` under megatron-core's `MCoreSavePlanner`: the same torch_dist files
(`FileSystemWriterAsync` subclasses `FileSystemWriter`), and megatron-core's `metadata.json`.
`dist_checkpointing.save` itself is run by the GPU tier (tests/unit/library/test_gpu.py).

Load: megatron-core's `dist_checkpointing.load` as it is (CPU and gloo work), into a fresh model
and optimizer (`is_loading=True`, no optimizer state yet); `load_state_dict` must then restore
the model's parameters and the optimizer's state key by key, bitwise.
"""

import os
import warnings

import torch.distributed as dist

from tests.unit.library.checkpointing.checkpoint_runs import GPTRun, Layout
from tests.unit.library.checkpointing.test_checkpoint import _differences


def _megatron_save(sharded_state_dict: dict, directory: str) -> None:
    """megatron-core's `dist_checkpointing.save` (torch_dist format) with a synchronous writer in
    place of its CUDA-only one (see the module docstring)."""
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )
    from torch.distributed.checkpoint import FileSystemWriter, save

    sharded, common = save_preprocess(sharded_state_dict, validate_access_integrity=True)
    sharded["common_state"] = ShardedObject("common_state", common, global_shape=(1,), global_offset=(0,),
                                            replica_id=dist.get_rank())
    sharded, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded, keep_only_main_replica=True)
    save(mcore_to_pyt_state_dict(sharded, is_loading=False), storage_writer=FileSystemWriter(directory),
         planner=MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False,
                                  flatten_sharded_tensors=False))
    if dist.get_rank() == 0:
        strategy = TorchDistSaveShardedStrategy()
        save_config(CheckpointingConfig(strategy.backend, strategy.version), directory)
    dist.barrier()


def _sharded(run: GPTRun, is_loading: bool = False) -> dict:
    model = run.model.sharded_state_dict()
    return {"model": model, "optimizer": run.optimizer.sharded_state_dict(model, is_loading=is_loading)}


def _parameters(run: GPTRun) -> dict:
    return {name: param.detach().clone() for name, param in run.model.named_parameters()}


def _round_trip_body(rank: int, world_size: int, layout: Layout, directory: str) -> dict:
    from megatron.core import dist_checkpointing

    saved = GPTRun(layout)
    for step in range(2):
        saved.train_step(step)
    expected_state, expected_params = saved.optimizer.state_dict(), _parameters(saved)
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            _megatron_save(_sharded(saved), directory)
    finally:
        saved.close()

    fresh = GPTRun(layout)
    try:
        untouched = _differences(expected_params, _parameters(fresh))  # the load has something to do
        loaded = dist_checkpointing.load(_sharded(fresh, is_loading=True), directory)
        fresh.model.load_state_dict(loaded["model"])
        fresh.optimizer.load_state_dict(loaded["optimizer"])
        return {"files": sorted(os.listdir(directory)), "fresh_differed": bool(untouched),
                "said": [str(w.message) for w in said if "megatron-core drops" in str(w.message) or
                         "megatron-core's optimizer does not read" in str(w.message)],
                "parameters": _differences(expected_params, _parameters(fresh)),
                "optimizer": _differences(expected_state, fresh.optimizer.state_dict())}
    finally:
        fresh.close()


def test_megatron_dist_checkpointing_round_trip_through_disk(run_distributed, tmp_path) -> None:
    """NorMuon's second moment ((rows, 1) or (1, cols)) and SOAP's factors have no megatron-core key:
    they keep their own (`eopt_own_state`), round trip, and the save says megatron-core drops them."""
    dropping = {"normuon": "moment2_buffer", "soap": "'Q_L'"}
    for layout in (Layout("muon", tp=2, layer_wise=True), Layout("adam", tp=2, bf16=True), Layout("normuon", tp=2),
                   Layout("soap", layer_wise=True)):  # SOAP has no tensor parallelism
        directory = tmp_path / layout.describe(4).replace(" ", "_")
        directory.mkdir()
        for rank, result in enumerate(run_distributed(_round_trip_body, world_size=4, args=(layout, str(directory)))):
            assert "metadata.json" in result["files"] and ".metadata" in result["files"], (layout, result["files"])
            assert result["fresh_differed"], (layout, rank)
            assert not result["parameters"], (layout, rank, result["parameters"][:5])
            assert not result["optimizer"], (layout, rank, result["optimizer"][:5])
            dropped = [m for m in result["said"] if "megatron-core drops it" in m]
            assert bool(dropped) == (layout.optimizer in dropping) and "\n" not in "".join(dropped), result["said"]
            assert all(dropping[layout.optimizer] in m for m in dropped), dropped
