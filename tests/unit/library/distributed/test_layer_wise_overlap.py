"""overlap_param_gather for the layer-wise distributed optimizer (CPU, gloo, DP=2).

The overlapped parameter sync must not change any value: the broadcasts copy the owners'
values, so parameters and optimizer state must be BITWISE equal to the run that waits at the
end of step() (the independent reference: the same optimizer with the sync not overlapped),
also across a save_checkpoint taken while broadcasts are in flight and a load_checkpoint done
while the next step's broadcasts are in flight (a bucket copied in after the load would undo it).
A slow-broadcast test shows the first layer's forward waits only for the buckets holding its own
parameters, the rest still in flight.
"""

import functools
import time

import pytest
import torch
import torch.distributed as dist

from megatron_eopt import OptimizerConfig, get_megatron_optimizer
from megatron_eopt.checkpointing import load_checkpoint, save_checkpoint
from megatron_eopt.training.model.gpt import build_gpt_model, destroy_model_parallel, gpt_loss, initialize_model_parallel
from tests.gpt_training import train_steps
from tests.unit.library.distributed.test_layer_wise_gpt import MUON, SEED, SETTINGS, dp_slice

STEPS = 10
SAVE_AFTER = 4  # save after this step, take one more step, then load it back
SMALL_BUCKET_BYTES = 8 * 1024  # several buckets per owner for the small GPT
MODES = {"plain": {}, "overlap": {"overlap_param_gather": True},
         "overlap+step": {"overlap_param_gather": True, "overlap_param_gather_with_optimizer_step": True}}


def _small_buckets():
    """Build the layer-wise optimizer with small buckets (the factory uses the 64 MiB default)."""
    from megatron_eopt import factory
    from megatron_eopt.distributed.layer_wise import LayerWiseDistributedOptimizer

    factory.LayerWiseDistributedOptimizer = functools.partial(LayerWiseDistributedOptimizer,
                                                              bucket_bytes=SMALL_BUCKET_BYTES)
    return lambda: setattr(factory, "LayerWiseDistributedOptimizer", LayerWiseDistributedOptimizer)


def _build(mode: str, optimizer_name: str = "muon"):
    model = build_gpt_model(SETTINGS)
    config = OptimizerConfig(**{**MUON, "optimizer": optimizer_name}, use_layer_wise_distributed_optimizer=True,
                             layer_wise_reduce_grads=True, **MODES[mode])
    return model, get_megatron_optimizer(config, [model])


def _train_step(model, optimizer, step: int) -> None:
    # zero_grad before the forward, as Megatron-LM's loop does (train_steps does): must not wait
    train_steps(model, optimizer, dp_slice(step, dist.get_rank(), dist.get_world_size()), range(step, step + 1))


def _tensors(tree, prefix=""):
    """Every tensor of a nested state dict, by path."""
    if torch.is_tensor(tree):
        return {prefix: tree.detach().clone()}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    return {path: t for key, value in items for path, t in _tensors(value, f"{prefix}/{key}").items()}


def _run_with_checkpoint(mode: str, checkpoint_dir: str, optimizer_name: str) -> dict:
    initialize_model_parallel(1, seed=SEED)
    try:
        model, optimizer = _build(mode, optimizer_name)
        in_flight_at_save = None
        for step in range(STEPS):
            _train_step(model, optimizer, step)
            if step == SAVE_AFTER:
                in_flight_at_save = optimizer.param_sync_in_flight
                save_checkpoint(checkpoint_dir, step, [model], optimizer)
            if step == SAVE_AFTER + 1:  # broadcasts of this step in flight: load must finish them first
                in_flight_at_load = optimizer.param_sync_in_flight
                load_checkpoint(checkpoint_dir, [model], optimizer)  # back to after step SAVE_AFTER
                _train_step(model, optimizer, step)
        optimizer.finish_param_sync()
        with torch.no_grad():  # an evaluation forward after the last step goes through the hooks
            model.eval()
            eval_loss = gpt_loss(model, dp_slice(0, dist.get_rank(), dist.get_world_size())).item()
        return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
                "state": _tensors(optimizer.state_dict()), "eval_loss": eval_loss,
                "in_flight": (in_flight_at_save, in_flight_at_load)}
    finally:
        destroy_model_parallel()


def _equality_body(rank: int, world_size: int, checkpoint_root: str, optimizer_name: str) -> dict:
    restore = _small_buckets()
    try:
        return {mode: _run_with_checkpoint(mode, f"{checkpoint_root}/{mode}", optimizer_name) for mode in MODES}
    finally:
        restore()


@pytest.mark.parametrize("optimizer_name", ["muon", "adam"])
def test_overlapped_sync_is_bitwise_equal_to_the_waiting_sync(run_distributed, tmp_path, optimizer_name) -> None:
    results = run_distributed(_equality_body, world_size=2, args=(str(tmp_path), optimizer_name), timeout=300)
    for rank, per_mode in enumerate(results):
        reference = per_mode["plain"]
        assert reference["in_flight"] == (False, False)
        for mode in ("overlap", "overlap+step"):
            run = per_mode[mode]
            assert run["in_flight"] == (True, True), (rank, mode)  # save and load did meet a sync in flight
            assert run["params"].keys() == reference["params"].keys()
            for name, value in run["params"].items():
                assert torch.equal(value, reference["params"][name]), (rank, mode, name)
            assert run["state"].keys() == reference["state"].keys() and run["state"], (rank, mode)
            for path, value in run["state"].items():
                assert torch.equal(value, reference["state"][path]), (rank, mode, path)
            assert run["eval_loss"] == reference["eval_loss"], (rank, mode)
    for name, value in results[0]["overlap"]["params"].items():  # the replicas agree bitwise
        assert torch.equal(value, results[1]["overlap"]["params"][name]), name


class _SlowWork:
    """A broadcast handle whose wait() takes DELAY_S longer, and says when it was waited on."""

    DELAY_S = 0.05

    def __init__(self, work, log: list) -> None:
        self.work, self.log = work, log

    def wait(self, *args, **kwargs):
        time.sleep(self.DELAY_S)
        result = self.work.wait(*args, **kwargs)
        self.log.append(self)
        return result


def _slow_broadcast_body(rank: int, world_size: int) -> dict:
    restore_buckets = _small_buckets()
    real_broadcast = dist.broadcast
    waited: list = []
    dist.broadcast = lambda *args, **kwargs: _SlowWork(real_broadcast(*args, **kwargs), waited)
    initialize_model_parallel(1, seed=SEED)
    try:
        model, optimizer = _build("overlap")
        first_layer = model.embedding.word_embeddings
        seen_at_first_layer = []
        # Registered after the optimizer's hook, so it runs right after it, before the forward.
        first_layer.register_forward_pre_hook(lambda *_: seen_at_first_layer.append(list(waited)))
        _train_step(model, optimizer, 0)
        _train_step(model, optimizer, 1)  # its forward waits for step 0's broadcasts
        waited.clear()
        seen_at_first_layer.clear()
        in_flight_after_step = len(optimizer._in_flight)
        bucket_of_work = {id(f.work): index for index, f in optimizer._in_flight.items()}
        started = time.perf_counter()
        optimizer.zero_grad()
        loss = gpt_loss(model, dp_slice(2, rank, world_size))
        forward_s = time.perf_counter() - started
        own = sorted({optimizer._bucket_of[id(p)] for p in first_layer.parameters(recurse=False)})
        at_first_layer = [bucket_of_work[id(w)] for w in seen_at_first_layer[0]]
        waited_in_forward = [bucket_of_work[id(w)] for w in waited]
        loss.backward()
        optimizer.finish_param_sync()
        in_flight_after = {}  # what each entry point leaves in flight after an overlapped step
        saved = optimizer.state_dict()
        for name, call in (("state_dict", optimizer.state_dict),
                           ("load_state_dict", lambda: optimizer.load_state_dict(saved)),
                           ("reload_model_params", optimizer.reload_model_params),
                           ("finish_param_sync", optimizer.finish_param_sync),
                           ("zero_grad", optimizer.zero_grad)):
            _train_step(model, optimizer, 3)
            call()
            in_flight_after[name] = optimizer.param_sync_in_flight
        optimizer.finish_param_sync()
        return {"buckets": len(optimizer._sync_buckets), "in_flight_after_step": in_flight_after_step,
                "in_flight_after": in_flight_after,
                "own": own, "at_first_layer": at_first_layer, "waited_in_forward": waited_in_forward,
                "first_position": optimizer._sync_buckets[0].params[0] is next(model.parameters()),
                "forward_s": forward_s}
    finally:
        dist.broadcast = real_broadcast
        restore_buckets()
        destroy_model_parallel()


def test_first_layer_waits_only_for_its_own_bucket(run_distributed) -> None:
    for rank, result in enumerate(run_distributed(_slow_broadcast_body, world_size=2, timeout=300)):
        assert result["buckets"] >= 4 and result["in_flight_after_step"] == result["buckets"], result
        assert result["first_position"]  # buckets are launched in forward order
        assert result["at_first_layer"] == result["own"] and len(result["own"]) == 1, (rank, result)
        # The forward waited for every bucket (each holds a parameter it uses), later ones later.
        assert sorted(result["waited_in_forward"]) == list(range(result["buckets"])), (rank, result)
        assert result["waited_in_forward"][0] == result["own"][0], (rank, result)
        # Everything that reads or replaces parameters or state waits; zero_grad (gradients only,
        # called just before the forward) does not.
        assert result["in_flight_after"] == {"state_dict": False, "load_state_dict": False,
                                             "reload_model_params": False, "finish_param_sync": False,
                                             "zero_grad": True}, (rank, result)


def _host_reads_body(rank: int, world_size: int) -> int:
    """Host reads of tensors (bool/item/tolist) while the gradients are reduced onto owners."""
    initialize_model_parallel(1, seed=SEED)
    counted = {"reads": 0}
    patched = {name: getattr(torch.Tensor, name) for name in ("__bool__", "item", "tolist")}

    def counting(original):
        def read(self, *args, **kwargs):
            counted["reads"] += 1
            return original(self, *args, **kwargs)
        return read

    try:
        model, optimizer = _build("plain")
        gpt_loss(model, dp_slice(0, rank, world_size)).backward()
        for name, original in patched.items():
            setattr(torch.Tensor, name, counting(original))
        try:
            optimizer._reduce_grads_to_owners()
        finally:
            for name, original in patched.items():
                setattr(torch.Tensor, name, original)
        return counted["reads"]
    finally:
        destroy_model_parallel()


def test_reducing_grads_reads_the_device_once_not_per_parameter(run_distributed) -> None:
    # Before: one `flags[index] == 0` read per owned parameter (about half of the GPT's ~20).
    assert run_distributed(_host_reads_body, world_size=2, timeout=300) == [1, 1]


def test_overlap_needs_a_distributed_optimizer() -> None:
    with pytest.raises(ValueError, match=r"overlap_param_gather=True needs the distributed optimizer"):
        OptimizerConfig(overlap_param_gather=True)
    with pytest.raises(ValueError, match=r"overlap_param_gather_with_optimizer_step=True needs overlap_param_gather"):
        OptimizerConfig(use_distributed_optimizer=True, overlap_param_gather_with_optimizer_step=True)
    OptimizerConfig(use_distributed_optimizer=True, overlap_param_gather=True,
                    overlap_param_gather_with_optimizer_step=True)  # accepted
