"""Checkpoints without torch.distributed (one plain process): the same API, the same guarantees.

Also the directory rules: one saving run at a time (a second is refused naming the first), no
`latest` for a checkpoint that does not verify, a warning when `latest` moves back, and a load
without `latest` takes the newest checkpoint that verifies and says so.
"""

import copy
import os
import threading

import pytest
import torch

from megatron_eopt import OptimizerConfig, get_megatron_optimizer, list_optimizers
from megatron_eopt.checkpointing import (
    CheckpointError,
    has_checkpoints,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)


def _model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return model, get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2), [model])


def _step(model, optimizer, step: int) -> None:
    generator = torch.Generator().manual_seed(step)
    optimizer.zero_grad()
    model(torch.randn(32, 8, generator=generator)).square().mean().backward()
    assert optimizer.step()[0]


def test_resume_without_torch_distributed_is_exact(tmp_path) -> None:
    assert not torch.distributed.is_initialized()
    model, optimizer = _model_and_optimizer(0)
    for step in range(6):
        _step(model, optimizer, step)
    expected = [p.detach().clone() for p in model.parameters()]

    model, optimizer = _model_and_optimizer(0)
    for step in range(3):
        _step(model, optimizer, step)
    save_checkpoint(str(tmp_path), 3, model, optimizer, extra={"consumed_samples": 96})
    model, optimizer = _model_and_optimizer(1)  # other initial values: all must come from the file
    loaded = load_checkpoint(str(tmp_path), model, optimizer)
    assert (loaded.iteration, loaded.extra) == (3, {"consumed_samples": 96})
    for step in range(3, 6):
        _step(model, optimizer, step)
    for value, reference in zip(model.parameters(), expected):
        assert torch.equal(value, reference)
    assert os.path.basename(latest_checkpoint(str(tmp_path))) == "iter_0000003"


def test_bad_arguments_are_named(tmp_path) -> None:
    model, optimizer = _model_and_optimizer(0)
    with pytest.raises(ValueError, match="iteration must be an int >= 0"):
        save_checkpoint(str(tmp_path), -1, model, optimizer)
    with pytest.raises(TypeError, match="extra must be JSON-serialisable"):
        save_checkpoint(str(tmp_path), 1, model, optimizer, extra={"x": object()})
    with pytest.raises(TypeError, match="returned by get_megatron_optimizer"):
        save_checkpoint(str(tmp_path), 1, model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(CheckpointError, match="no checkpoint for iteration 7"):
        load_checkpoint(str(tmp_path), model, optimizer, iteration=7)


def _differences(expected, actual, path: str = "") -> list[str]:
    """Where two nested state dicts differ (tensors bitwise, lists element by element)."""
    if isinstance(expected, dict):
        if set(expected) != set(actual):
            return [f"{path}: keys {sorted(set(expected) ^ set(actual))}"]
        return [d for k in expected for d in _differences(expected[k], actual[k], f"{path}/{k}")]
    if isinstance(expected, (list, tuple)) and any(torch.is_tensor(v) for v in expected):
        if len(expected) != len(actual):
            return [f"{path}: length {len(expected)} != {len(actual)}"]
        return [d for i, (e, a) in enumerate(zip(expected, actual)) for d in _differences(e, a, f"{path}[{i}]")]
    if torch.is_tensor(expected):
        return [] if torch.equal(expected, actual) else [f"{path}: tensors differ"]
    return [] if expected == actual else [f"{path}: {expected!r} != {actual!r}"]


def _state_layouts(optimizer) -> list[tuple]:
    """(strides, storage offset, storage bytes, address mod 64) of every inner state tensor, in
    parameter order: a fresh tensor has (row-major, 0, its own bytes, 0)."""
    return [(key, value.stride(), value.storage_offset(), value.untyped_storage().nbytes(), value.data_ptr() % 64)
            for child in optimizer.chained_optimizers for group in child.param_groups for param in group["params"]
            for key, value in sorted(child.state.get(param, {}).items()) if torch.is_tensor(value) and value.dim()]


def _model_for(name: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    if name == "sinkhorn_muon":  # it takes only Sinkhorn-normalized matrices (constant 1/min(m, n))
        with torch.no_grad():
            for param in model.parameters():
                if param.dim() == 2:
                    param.copy_(torch.full_like(param, 1 / min(param.shape)) + 1e-3 * torch.rand_like(param))
    return model


@pytest.mark.parametrize("name", list_optimizers())
def test_every_registered_optimizer_round_trips(name: str, tmp_path) -> None:
    # Uncompiled (emerging_optimizers_compile=False): what is saved and loaded is the same, and the
    # compiled updates are other tests' subject (test_compiled_step.py, test_emerging_factory.py,
    # test_optimizer_support.py); compiling them for this toy model took 90 s here with an empty
    # compile cache (a fresh machine), 60 s of it PSGD-Pro's.
    config = OptimizerConfig(optimizer=name, lr=1e-3, sgd_momentum=0.9, emerging_optimizers_compile=False)
    model = _model_for(name, 0)
    optimizer = get_megatron_optimizer(config, [model])
    for step in range(2):
        _step(model, optimizer, step)
    save_checkpoint(str(tmp_path), 2, model, optimizer)
    saved_state = copy.deepcopy(optimizer.state_dict())  # the live state changes in the next step
    _step(model, optimizer, 2)  # continue first: psgd_pro draws from the RNG, which the load restores
    fresh_model = _model_for(name, 1)
    fresh = get_megatron_optimizer(config, [fresh_model])
    load_checkpoint(str(tmp_path), fresh_model, fresh)
    assert not _differences(saved_state, fresh.state_dict())
    # The same values in the same memory layout: MKL's results depend on it (SOAP's eigenbases).
    assert _state_layouts(fresh) == _state_layouts(optimizer)
    _step(fresh_model, fresh, 2)
    for value, other in zip(model.parameters(), fresh_model.parameters()):
        assert torch.equal(value, other)
    # A fresh optimizer's state_dict() is a complete target: filled in place, as torch DCP's load fills
    # it, and loaded, it holds the saved state (torch's Adam makes its state only at its first step).
    target_optimizer = get_megatron_optimizer(config, [_model_for(name, 2)])
    target = target_optimizer.state_dict()
    target_optimizer.load_state_dict(_filled_in_place(target, saved_state))
    assert not _differences(saved_state, target_optimizer.state_dict())


def _filled_in_place(target, saved, path: str = ""):
    """`target` with each tensor overwritten in place by `saved`'s (refusing a missing or misshapen
    one, where DCP would load nothing or fail) and every other value taken from `saved`."""
    if isinstance(saved, dict):
        assert isinstance(target, dict) and set(target) == set(saved), (path, sorted(set(target) ^ set(saved)))
        return {key: _filled_in_place(target[key], value, f"{path}/{key}") for key, value in saved.items()}
    if torch.is_tensor(saved):
        assert torch.is_tensor(target) and target.shape == saved.shape and target.dtype == saved.dtype, path
        return target.copy_(saved)
    return saved


def test_killed_while_replacing_the_same_iteration_still_loads(tmp_path) -> None:
    model, optimizer = _model_and_optimizer(0)
    _step(model, optimizer, 0)
    save_checkpoint(str(tmp_path), 1, model, optimizer)
    expected = [p.detach().clone() for p in model.parameters()]
    # What a save of iteration 1 again leaves when killed between its two renames.
    os.rename(tmp_path / "iter_0000001", tmp_path / "iter_0000001.replaced")
    model, optimizer = _model_and_optimizer(1)
    assert load_checkpoint(str(tmp_path), model, optimizer).iteration == 1
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), expected))
    _step(model, optimizer, 1)
    save_checkpoint(str(tmp_path), 1, model, optimizer)  # a later save cleans up
    assert sorted(os.listdir(tmp_path)) == [".save_lock", "iter_0000001", "latest"]


# ------------------------------------------------------------------------------------------------
# One run per directory; `latest` only after verification; a missing `latest`
# ------------------------------------------------------------------------------------------------


def test_a_second_run_saving_into_the_same_directory_is_refused(tmp_path) -> None:
    """Two savers at once (threads: flock conflicts between open files, as between processes)."""
    first_model, first_optimizer = _model_and_optimizer(0)
    second_model, second_optimizer = _model_and_optimizer(1)
    in_commit, may_commit = threading.Event(), threading.Event()
    outcome = {}

    def pause(path: str) -> None:
        in_commit.set()
        may_commit.wait(timeout=60)

    def first_run() -> None:
        outcome["first"] = save_checkpoint(str(tmp_path), 2, first_model, first_optimizer, before_commit=pause)

    thread = threading.Thread(target=first_run)
    thread.start()
    assert in_commit.wait(timeout=120)
    try:
        with pytest.raises(CheckpointError) as refused:
            save_checkpoint(str(tmp_path), 2, second_model, second_optimizer)
    finally:
        may_commit.set()
        thread.join(timeout=120)
    message = str(refused.value)
    assert f"another run is saving into {tmp_path}" in message and f"pid {os.getpid()} on host" in message, message
    assert "give this one its own --save" in message
    assert os.path.basename(outcome["first"]) == "iter_0000002"
    expected = [p.detach().clone() for p in first_model.parameters()]
    model, optimizer = _model_and_optimizer(2)
    assert load_checkpoint(str(tmp_path), model, optimizer).iteration == 2  # verifies every file
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), expected))
    save_checkpoint(str(tmp_path), 4, second_model, second_optimizer)  # the lock was released


def test_a_save_that_does_not_verify_is_not_reported_and_latest_stays(tmp_path) -> None:
    model, optimizer = _model_and_optimizer(0)
    save_checkpoint(str(tmp_path), 1, model, optimizer)

    def overwritten_by_someone_else(path: str) -> None:
        data_file = os.path.join(path, sorted(n for n in os.listdir(path) if n.endswith(".distcp"))[0])
        with open(data_file, "ab") as f:
            f.write(b"another run's bytes")

    with pytest.raises(CheckpointError, match="does not match its manifest after writing .*has .* bytes"):
        save_checkpoint(str(tmp_path), 2, model, optimizer, before_commit=overwritten_by_someone_else)
    assert os.path.basename(latest_checkpoint(str(tmp_path))) == "iter_0000001"


def test_latest_moving_back_warns(tmp_path) -> None:
    model, optimizer = _model_and_optimizer(0)
    save_checkpoint(str(tmp_path), 10, model, optimizer)
    with pytest.warns(UserWarning, match="moves back from iter_0000010 to iter_0000006"):
        save_checkpoint(str(tmp_path), 6, model, optimizer)
    assert os.path.basename(latest_checkpoint(str(tmp_path))) == "iter_0000006"


def test_without_latest_the_newest_verified_checkpoint_loads_and_says_so(tmp_path) -> None:
    model, optimizer = _model_and_optimizer(0)
    assert not has_checkpoints(str(tmp_path / "missing")) and not has_checkpoints(str(tmp_path))
    saved = {}
    for iteration in (3, 6, 9):
        _step(model, optimizer, iteration)
        save_checkpoint(str(tmp_path), iteration, model, optimizer)
        saved[iteration] = [p.detach().clone() for p in model.parameters()]
    os.remove(tmp_path / "latest")  # a crash between the rename of iter_9 and the marker update
    (tmp_path / "iter_0000009" / "megatron_eopt.json").write_text("{")  # and iter_9 is damaged
    assert has_checkpoints(str(tmp_path))
    fresh, fresh_optimizer = _model_and_optimizer(1)
    loaded = load_checkpoint(str(tmp_path), fresh, fresh_optimizer)
    assert loaded.iteration == 6
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), saved[6]))
    [note] = loaded.messages
    assert "has no 'latest' marker" in note and "loading the newest complete checkpoint, iter_0000006" in note
    assert "skipped iter_0000009" in note and "is corrupt" in note
    with pytest.raises(CheckpointError, match="no checkpoint for iteration 7"):
        load_checkpoint(str(tmp_path), fresh, fresh_optimizer, iteration=7)
    for iteration in (3, 6):
        os.remove(tmp_path / f"iter_{iteration:07d}" / "megatron_eopt.json")
    with pytest.raises(CheckpointError, match="none of its iter_\\* directories verifies"):
        load_checkpoint(str(tmp_path), fresh, fresh_optimizer)


def test_one_process_job_saves_and_loads_without_torchs_single_process_warning(tmp_path) -> None:
    """torch.distributed initialised with this process alone (the trainer, docs/checkpoints.md):
    no "torch.distributed is disabled ... assuming ... single process" warning on save or load,
    synchronous or in the background; and the state round-trips."""
    import warnings

    from megatron_eopt.checkpointing import start_save_checkpoint

    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        model, optimizer = _model_and_optimizer(0)
        _step(model, optimizer, 0)
        saved = [p.detach().clone() for p in model.parameters()]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            save_checkpoint(str(tmp_path), 1, model, optimizer)
            start_save_checkpoint(str(tmp_path), 2, model, optimizer).wait()
            model, optimizer = _model_and_optimizer(1)
            assert load_checkpoint(str(tmp_path), model, optimizer, iteration=1).iteration == 1
    finally:
        torch.distributed.destroy_process_group()
    assert [str(w.message) for w in caught if "single process" in str(w.message)] == []
    assert all(torch.equal(value, reference) for value, reference in zip(model.parameters(), saved))
