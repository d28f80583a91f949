"""megatron-core 0.19.2's DistributedOptimizer `dp_reshardable` checkpoints (Megatron-LM's default
with --use-distributed-optimizer), read by ours (issue 46).

Its state is keyed by DDP bucket, so reading it needs megatron-core's bucket layout, which
megatron_core_formats/distributed_optimizer.py computes from the model. The reference is megatron-core's code,
run on gloo with tests/megatron_core_on_cpu.py's patches:
- the layout: each buffer's parameter ranges, bucket bounds and unpadded sizes against its DDP's
  buffers, and each DP rank's shard of each parameter against its DistributedOptimizer's ranges,
  at DP=2 with small buckets (several per buffer, parameters cut between ranks), with and without
  pad_buckets_for_high_nccl_busbw;
- continuing: its DDP + DistributedOptimizer (Adam, fp32, those small buckets, overlap_grad_reduce)
  trains at DP=2 (the same batch on both ranks) and saves dp_reshardable; ours (plain, and layer-wise
  distributed) loads at DP=2, and ours loads at DP=1 (megatron-core's loader allows a DP change: it
  checks only the unpadded bucket sizes, which do not depend on DP), and continues, equal bitwise to
  megatron-core continuing itself without the save (the same batch on both ranks: DP changes nothing).

megatron-core's own DistributedOptimizer reloading this checkpoint is no reference on CPU: with
torch's Adam (no TE/Apex) its load gives every parameter one shared `step` tensor, which Adam then
advances once per parameter, and dp_reshardable's per-parameter `step` is the loading optimizer's own
(a LocalNonpersistentObject copied over the checkpoint's); its reload drifts from its own run (1.2e-2
after two steps). Megatron-LM's GPU runs (TE's FusedAdam, the step in the param groups) are not hit.
"""

import io
from typing import Optional

import torch

from tests.gpt_training import model_parallel, step_loss, token_batch
from tests.megatron_core_on_cpu import cuda_named_types, distributed_optimizer_loads_on_cpu, megatron_core_ddp_on_cpu
from tests.unit.library.megatron_core_formats.test_megatron_core_checkpoints import (
    FIELDS,
    MORE_STEPS,
    SAVED_STEPS,
    SETTINGS,
    _differences,
    _optimizer_keys,
)
from tests.unit.library.megatron_core_formats.test_dist_checkpointing import _megatron_save

BUCKET_SIZE = 3000  # elements: several buckets in the small GPT model
METADATA = {"distrib_optim_sharding_type": "dp_reshardable", "chained_optim_avoid_prefix": True,
            "singleton_local_shards": False}


def _ddp_config(**changes):
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(**{"use_distributed_optimizer": True, "grad_reduce_in_fp32": True,
                                            "overlap_grad_reduce": True, "bucket_size": BUCKET_SIZE, **changes})


class CoreRun:
    """megatron-core's DDP + DistributedOptimizer (Adam) over a GPTModel, stepped as megatron-core
    steps less its CUDA-only gradient norm (nothing is clipped)."""

    def __init__(self, seed: int, **ddp_changes) -> None:
        from megatron.core.distributed import DistributedDataParallel
        from megatron.core.optimizer import OptimizerConfig as CoreConfig
        from megatron.core.optimizer import get_megatron_optimizer as core_get_megatron_optimizer

        from megatron_eopt.training.model.gpt import GPTModelSettings, build_gpt_model

        self.settings = GPTModelSettings(**SETTINGS)
        torch.manual_seed(seed)
        self.model = build_gpt_model(self.settings)
        self.ddp = DistributedDataParallel(self.model.config, _ddp_config(**ddp_changes), self.model)
        with cuda_named_types():
            self.optimizer = core_get_megatron_optimizer(CoreConfig(**FIELDS["adam"], use_distributed_optimizer=True),
                                                         [self.ddp])

    def train(self, steps: range) -> None:
        for step in steps:
            self.ddp.zero_grad_buffer()
            self.optimizer.zero_grad()
            step_loss(self.ddp, token_batch(self.settings, batch=4, seed=100 + step)).backward()
            self.ddp.finish_grad_sync()
            self.take_step()

    def take_step(self) -> None:
        for child in self.optimizer.chained_optimizers:
            assert not child.prepare_grads() and child.step_with_ready_grads()

    def sharded(self, is_loading: bool = False, metadata: Optional[dict] = None) -> dict:
        """`metadata`: handed over itself (Megatron-LM saves what the optimizer left in it)."""
        model = self.model.sharded_state_dict()
        metadata = dict(METADATA) if metadata is None else metadata
        return {"model": model, "optimizer": self.optimizer.sharded_state_dict(model, is_loading=is_loading,
                                                                                metadata=metadata)}

    def params(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in self.model.named_parameters()}


class OursRun(CoreRun):
    """Ours over a bare GPTModel carrying the DDP config the megatron-core job ran with."""

    def __init__(self, seed: int, layer_wise: bool, optimizer: str = "adam", bf16: bool = False) -> None:
        from megatron_eopt import OptimizerConfig, get_megatron_optimizer
        from megatron_eopt.training.model.gpt import GPTModelSettings, build_gpt_model

        self.settings = GPTModelSettings(**SETTINGS, bf16=bf16)
        torch.manual_seed(seed)
        self.model = self.ddp = build_gpt_model(self.settings)
        # as Megatron-LM builds it for ours: DDP all-reduces whole gradients (use_distributed_optimizer=False)
        self.model.ddp_config = _ddp_config(use_distributed_optimizer=False)
        config = OptimizerConfig(**FIELDS[optimizer], bf16=bf16, use_distributed_optimizer=layer_wise)
        self.optimizer = get_megatron_optimizer(config, [self.model])

    def train(self, steps: range) -> None:
        for step in steps:
            self.optimizer.zero_grad()
            step_loss(self.model, token_batch(self.settings, batch=4, seed=100 + step)).backward()
            assert self.optimizer.step()[0]


def _loaded_and_continued(run: CoreRun, directory: str, metadata: Optional[dict] = None) -> dict[str, torch.Tensor]:
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load(run.sharded(is_loading=True, metadata=dict(metadata or METADATA)), directory)
    run.model.load_state_dict(state["model"])
    run.optimizer.load_state_dict(state["optimizer"])
    run.train(range(SAVED_STEPS, SAVED_STEPS + MORE_STEPS))
    return run.params()


# ------------------------------------------------------------------------------------------------
# The layout against megatron-core's DDP buffers and DistributedOptimizer ranges
# ------------------------------------------------------------------------------------------------


def _layout_mismatches(core: CoreRun, dp_size: int, dp_rank: int) -> list[str]:
    """What of our layout differs from megatron-core's buffers and its optimizer's shard ranges."""
    from megatron_eopt.megatron_core_formats.distributed_optimizer import distributed_optimizer_buffers, shard_ranges

    ours = distributed_optimizer_buffers([core.ddp], dp_size)
    distributed = core.optimizer.chained_optimizers[0]
    mismatches = [] if len(ours) == len(core.ddp.buffers) else [f"{len(ours)} buffers, megatron-core {len(core.ddp.buffers)}"]
    for index, (layout, buffer) in enumerate(zip(ours, core.ddp.buffers)):
        theirs = {id(p): tuple(r) for p, r in buffer.param_index_map.items()}
        if layout.ranges != theirs:
            mismatches.append(f"buffer {index}: parameter ranges")
        if [(b.start, b.end) for b in layout.buckets] != [tuple(b) for b in buffer.bucket_indices]:
            mismatches.append(f"buffer {index}: buckets {layout.buckets} vs {buffer.bucket_indices}")
        if [b.numel_unpadded for b in layout.buckets] != [b.numel_unpadded for b in buffer.buckets]:
            mismatches.append(f"buffer {index}: unpadded bucket sizes")
        (ranges_by_bucket,) = distributed.gbuf_ranges[index].values()
        theirs = {id(p): (bucket, r["param"].start, r["param"].end) for bucket, ranges in enumerate(ranges_by_bucket)
                  for p, r in ranges["param_map"].items()}
        if shard_ranges(layout, dp_size, dp_rank) != theirs:
            mismatches.append(f"buffer {index}: rank {dp_rank}'s shard ranges")
    return mismatches


def _layout_body(rank: int, world_size: int) -> dict:
    results = {}
    with model_parallel(1, seed=3), megatron_core_ddp_on_cpu():
        for name, changes in {"buckets": {}, "high_nccl_busbw": {"pad_buckets_for_high_nccl_busbw": True},
                              "one_bucket": {"overlap_grad_reduce": False}}.items():
            core = CoreRun(seed=1, **changes)
            results[name] = (_layout_mismatches(core, world_size, rank),
                             [len(b.buckets) for b in core.ddp.buffers])
    return results


# ------------------------------------------------------------------------------------------------
# megatron-core saves at DP=2; ours loads at DP=2 and at DP=1
# ------------------------------------------------------------------------------------------------


def _save_and_continue_body(rank: int, world_size: int, directory: str, mirror_directory: str) -> dict:
    """DP=2: megatron-core trains, saves, continues; ours (plain, layer-wise) loads and continues.
    And the mirror."""
    with model_parallel(1, seed=3), megatron_core_ddp_on_cpu():
        mirror = _mirror(mirror_directory)
        core = CoreRun(seed=1)
        core.train(range(SAVED_STEPS))
        _megatron_save(core.sharded(), directory)
        core.train(range(SAVED_STEPS, SAVED_STEPS + MORE_STEPS))
        expected = core.params()
        results = {"buckets": [len(b.buckets) for b in core.ddp.buffers], "keys": _optimizer_keys(directory),
                   "expected": expected, "mirror": mirror}
        for layer_wise in (False, True):
            ours = OursRun(seed=2, layer_wise=layer_wise)
            fresh_differs = bool(_differences(expected, ours.params()))
            results[f"layer_wise={layer_wise}"] = (fresh_differs, _differences(expected, _loaded_and_continued(ours, directory)))
    return results


def _mirror(directory: str) -> dict:
    """Ours, layer-wise as Megatron-LM runs it with --use-distributed-optimizer, trains and saves with
    Megatron-LM's metadata (dp_reshardable asked for); megatron-core's DistributedOptimizer and our
    plain optimizer load with the metadata we left and continue: against ours continuing itself."""
    ours = OursRun(seed=1, layer_wise=True)
    ours.train(range(SAVED_STEPS))
    written = dict(METADATA)
    _megatron_save(ours.sharded(metadata=written), directory)
    ours.train(range(SAVED_STEPS, SAVED_STEPS + MORE_STEPS))
    expected = ours.params()
    core = CoreRun(seed=2)
    core.train(range(-1, 0))  # its sharded_state_dict reads the step from the state (torch's Adam)
    with distributed_optimizer_loads_on_cpu():
        core_continued = _loaded_and_continued(core, directory, written)
    ours_continued = _loaded_and_continued(OursRun(seed=2, layer_wise=False), directory, written)
    return {"written": written, "keys": _optimizer_keys(directory), "core": _differences(expected, core_continued),
            "ours": _differences(expected, ours_continued)}


def _other_dp_size_body(rank: int, world_size: int, directory: str, expected: dict) -> dict:
    """DP=1: ours loads the DP=2 checkpoint and continues, against megatron-core continuing itself."""
    with model_parallel(1, seed=3):
        ours = _loaded_and_continued(OursRun(seed=2, layer_wise=False), directory)
        refusal = _refusal()
    return {"differences": _differences(expected, ours), "refusal": refusal}


def _refusal() -> tuple[str, bool]:
    """A DistributedOptimizer format we do not read: one line, and the optimizer untouched."""
    ours = OursRun(seed=2, layer_wise=False)
    ours.train(range(1))
    before = _serialized(ours.optimizer.state_dict())
    try:
        model = ours.model.sharded_state_dict()
        ours.optimizer.sharded_state_dict(model, is_loading=True, metadata={
            **METADATA, "distrib_optim_sharding_type": "dp_zero_gather_scatter"})
        message = "accepted"
    except ValueError as error:
        message = str(error)
    return message, before == _serialized(ours.optimizer.state_dict())


def _serialized(state_dict: dict) -> bytes:
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    return buffer.getvalue()


def test_megatron_core_distributed_optimizer_checkpoints_both_ways(run_distributed, tmp_path) -> None:
    layouts = run_distributed(_layout_body, world_size=2, timeout=600)
    for rank, results in enumerate(layouts):
        for name, (mismatches, buckets) in results.items():
            assert not mismatches, (rank, name, mismatches)
        assert max(results["buckets"][1]) > 1 and results["one_bucket"][1] == [1], results

    directory, mirror_directory = tmp_path / "core", tmp_path / "ours"
    directory.mkdir()
    mirror_directory.mkdir()
    directory, mirror_directory = str(directory), str(mirror_directory)
    for rank, results in enumerate(run_distributed(_save_and_continue_body, world_size=2,
                                                   args=(directory, mirror_directory), timeout=600)):
        mirror = results["mirror"]
        assert mirror["written"]["distrib_optim_sharding_type"] == "fully_reshardable", mirror["written"]
        assert mirror["written"]["eopt_optimizer_layout"] == "megatron_core_distributed", mirror["written"]
        assert any(k.startswith("optimizer.state.param.") for k in mirror["keys"]), mirror["keys"][:5]
        assert not mirror["core"] and not mirror["ours"], (rank, mirror["core"][:5], mirror["ours"][:5])
        assert max(results["buckets"]) > 1, results["buckets"]
        assert any(".bucket_idx_1.exp_avg" in key for key in results["keys"]), results["keys"][:5]
        for case in ("layer_wise=False", "layer_wise=True"):
            fresh_differs, differences = results[case]
            assert fresh_differs and not differences, (rank, case, differences[:5])

    (result,) = run_distributed(_other_dp_size_body, world_size=1, args=(directory, results["expected"]), timeout=600)
    assert not result["differences"], result["differences"][:5]
    message, untouched = result["refusal"]
    assert "'dp_zero_gather_scatter' format, which megatron_eopt cannot read" in message, message
    assert "\n" not in message and untouched, message
