"""A checkpoint saved under another routing (checkpointable/optimizer_change.py), in one process.

Saved with one routing (Muon taking every matrix, or AdamW taking everything), loaded with another
(`muon_exclude_params` moves `0.weight` to AdamW; Muon takes the AdamW run's matrices). Without
`allow_optimizer_change_on_load` the load is refused in one ValueError naming the moved parameters
and the opt-in, before anything changes; with it the moved parameters' state starts fresh (none
before their first step, as a new optimizer's) and every other state equals the saved one bitwise.
Through the library's checkpoints (save_checkpoint / load_checkpoint) and through torch DCP of
`optimizer.state_dict()` with `optimizer_load_planner`.
"""

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron_eopt import OptimizerConfig, get_megatron_optimizer
from megatron_eopt.checkpointing import load_checkpoint, optimizer_load_planner, save_checkpoint

MOVED = "0.weight"


def _model_and_optimizer(seed: int, **config):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    config = {"optimizer": "muon", "lr": 1e-2, **config}
    return model, get_megatron_optimizer(OptimizerConfig(**config), [model])


def _trained(steps: int = 2, **config):
    model, optimizer = _model_and_optimizer(0, **config)
    for step in range(steps):
        optimizer.zero_grad()
        model(torch.randn(32, 8, generator=torch.Generator().manual_seed(step))).square().mean().backward()
        assert optimizer.step()[0]
    return model, optimizer


def _state_by_name(model, optimizer) -> dict[str, dict]:
    name_of = {id(param): name for name, param in model.named_parameters()}
    states = {}
    for child in optimizer.chained_optimizers:
        for param in child.checkpoint_params():
            states[name_of[id(param.model)]] = {k: v.clone() if torch.is_tensor(v) else v for k, v in param.state.items()}
    return states


def _assert_equal(expected: dict, actual: dict, where: str) -> None:
    assert expected.keys() == actual.keys(), (where, sorted(expected), sorted(actual))
    for key, value in expected.items():
        assert torch.equal(torch.as_tensor(value), torch.as_tensor(actual[key])), (where, key)


def _assert_others_exact(saved: dict, loaded: dict, fresh: dict, moved: set[str]) -> None:
    """The moved parameters' state is a new optimizer's (`fresh`; or none yet, which the optimizer's
    step makes as it makes a new one's), every other one the saved one."""
    for name, state in saved.items():
        if name in moved and not loaded[name]:
            continue
        _assert_equal(fresh[name] if name in moved else state, loaded[name], name)


@pytest.mark.parametrize(("saved_config", "live_config", "moved"), [
    ({}, {"muon_exclude_params": MOVED}, {MOVED}),  # Muon -> AdamW for one matrix
    ({"optimizer": "adam"}, {}, {MOVED, "2.weight"}),  # an AdamW run continued with Muon
], ids=["muon_exclude_params", "adamw_to_muon"])
def test_library_checkpoint_under_another_routing(tmp_path, saved_config, live_config, moved) -> None:
    model, optimizer = _trained(**saved_config)
    saved = _state_by_name(model, optimizer)
    save_checkpoint(str(tmp_path), 2, model, optimizer)

    model, optimizer = _model_and_optimizer(1, **live_config)
    with pytest.raises(ValueError) as refused:
        load_checkpoint(str(tmp_path), model, optimizer)
    line = str(refused.value)
    assert "\n" not in line and "allow_optimizer_change_on_load" in line and "--no-load-optim" in line, line
    assert all(f"{name} (" in line for name in moved), line
    fresh = _state_by_name(*_model_and_optimizer(1, **live_config))
    for name, state in _state_by_name(model, optimizer).items():  # nothing loaded
        _assert_equal(fresh[name], state, name)

    model, optimizer = _model_and_optimizer(1, allow_optimizer_change_on_load=True, **live_config)
    load_checkpoint(str(tmp_path), model, optimizer)
    _assert_others_exact(saved, _state_by_name(model, optimizer), fresh, moved)
    load_checkpoint(str(tmp_path), model, optimizer, load_optimizer=False)  # --no-load-optim: no question


@pytest.mark.parametrize(("saved_config", "live_config", "moved", "line"), [
    ({}, {"muon_exclude_params": MOVED}, {MOVED},
     "0.weight (saved (momentum_buffer) -> adam/dense (exp_avg, exp_avg_sq, step))"),
    ({"optimizer": "adam"}, {}, {MOVED, "2.weight"},  # the biases' AdamW state: from 'dense' into 'adam/dense'
     "2.weight (saved (exp_avg, exp_avg_sq, step) -> muon/dense (momentum_buffer))"),
], ids=["muon_exclude_params", "adamw_to_muon"])
def test_dcp_of_state_dict_under_another_routing(tmp_path, saved_config, live_config, moved, line) -> None:
    """dcp.save of optimizer.state_dict(); dcp.load into state_dict(is_loading=True) with our planner."""
    model, optimizer = _trained(**saved_config)
    saved = _state_by_name(model, optimizer)
    dcp.save({"optim": optimizer.state_dict()}, checkpoint_id=str(tmp_path), no_dist=True)

    model, optimizer = _model_and_optimizer(1, **live_config)
    state = {"optim": optimizer.state_dict(is_loading=True)}
    with pytest.raises(ValueError) as refused:
        optimizer_load_planner(optimizer, state, str(tmp_path))
    assert line in str(refused.value) and "allow_optimizer_change_on_load" in str(refused.value), str(refused.value)

    model, optimizer = _model_and_optimizer(1, allow_optimizer_change_on_load=True, **live_config)
    state = {"optim": optimizer.state_dict(is_loading=True)}
    dcp.load(state, checkpoint_id=str(tmp_path), planner=optimizer_load_planner(optimizer, state, str(tmp_path)),
             no_dist=True)
    optimizer.load_state_dict(state["optim"])
    loaded = _state_by_name(model, optimizer)
    for name in moved:  # zeros: a new optimizer's moments, momentum and step
        assert loaded[name] and all(not torch.is_tensor(v) or not v.any() for v in loaded[name].values()), name
    _assert_others_exact(saved, loaded, {name: loaded[name] for name in moved}, moved)
