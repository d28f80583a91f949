"""Checkpoints of a Megatron-FSDP model through megatron-core's `sharded_state_dict` call, as
Megatron-LM's `--ckpt-format fsdp_dtensor` makes them (megatron/training/checkpointing.py, 0.19):
the model's `state_dict()` and `optimizer.sharded_state_dict(state_dict, is_loading, metadata)`
with `distrib_optim_sharding_type='fsdp_dtensor'`, Megatron-FSDP's
`preprocess_state_dict_for_uneven_dtensor`, torch DCP's save and load, then the model's and the
optimizer's `load_state_dict`.

References, never golden values: the run continued without the save (bitwise), the state that
was saved (bitwise, at DP=3 too), and the DP=2 run continued (at DP=3: 1e-5, since the ranks sum
the same global batch's gradient in another order; Megatron-FSDP's shards are uneven and some empty,
checked in test_megatron_fsdp.py on the same GPT).
"""

import dataclasses

import pytest
import torch

from megatron_eopt import get_megatron_optimizer
from megatron_eopt.training.model.gpt import gpt_loss
from tests.unit.library.distributed.test_megatron_fsdp import SETTINGS, _full_state, config_for, megatron_fsdp_gpt
from tests.refusals import error_of

STEPS = 2  # before the save, and after it
GLOBAL_BATCH = 6  # sequences per step: 3 per rank at DP=2, 2 at DP=3
TOLERANCE = 1e-5
OPTIMIZERS = ("muon", "laprop", "adam")  # laprop keeps its step a Python int; adam last (refusals)


def metadata() -> dict:
    """What Megatron-LM's _build_sharded_state_dict_metadata gives with --use-megatron-fsdp."""
    import torch.distributed as dist

    return {"distrib_optim_sharding_type": "fsdp_dtensor", "singleton_local_shards": False,
            "chained_optim_avoid_prefix": True, "dp_cp_group": dist.group.WORLD}


def micro_batch(step: int, rank: int, world_size: int) -> torch.Tensor:
    """This rank's rows of the step's global batch (the same at every DP size)."""
    tokens = torch.randint(0, SETTINGS.vocab_size, (GLOBAL_BATCH, SETTINGS.seq_length + 1),
                           generator=torch.Generator().manual_seed(500 + step))
    per_rank = GLOBAL_BATCH // world_size
    return tokens[rank * per_rank:(rank + 1) * per_rank]


def take_steps(model, optimizer, first: int, rank: int, world_size: int) -> None:
    for step in range(first, first + STEPS):
        gpt_loss(model, micro_batch(step, rank, world_size)).backward()
        model.finish_grad_sync()
        optimizer.step()
        model.install_optimized_model_weights()
        model.zero_grad_buffer()


def built(name: str):
    """The GPT on Megatron-FSDP and `name`'s optimizer; laprop's update uncompiled (its compile on a
    CPU would cost more than the test; the checkpoint path is the same)."""
    model = megatron_fsdp_gpt()
    config = dataclasses.replace(config_for(name), emerging_optimizers_compile=False)
    return model, get_megatron_optimizer(config, [model])


def save(model, optimizer, directory: str, uneven: str) -> None:
    """Megatron-LM's save: generate_state_dict, preprocess_fsdp_dtensor_state_dict's uneven step
    (over `uneven`: all, the model's part, or none), DCP."""
    import torch.distributed.checkpoint as dcp
    from megatron_fsdp.uneven_dtensor import preprocess_state_dict_for_uneven_dtensor

    state_dict = {"model": model.state_dict()}
    state_dict["optimizer"] = optimizer.sharded_state_dict(state_dict, metadata=metadata())
    _preprocess(state_dict, uneven)
    dcp.save(state_dict, checkpoint_id=directory)


def _preprocess(state_dict: dict, uneven: str) -> None:
    """Megatron-FSDP's uneven-DTensor step over all of `state_dict` (Megatron-LM's), its model's part
    (the optimizer's DTensors carry their chunks themselves), or none (FSDP2: torch.chunk's split)."""
    from megatron_fsdp.uneven_dtensor import preprocess_state_dict_for_uneven_dtensor

    if uneven != "none":
        preprocess_state_dict_for_uneven_dtensor(state_dict if uneven == "all" else state_dict["model"])


def load(model, optimizer, directory: str, uneven: str = "all") -> dict:
    """Megatron-LM's load (`uneven` as in `save`). As there (`_load_base_checkpoint` with --swiglu,
    whose split builds new dicts), DCP loads into other dicts than the ones the optimizer gets back:
    tensors it fills in place, any other value it puts only into the dicts it was given."""
    import torch.distributed.checkpoint as dcp

    from megatron_eopt.placement.megatron_fsdp_model import refresh_compute_weights

    state_dict = {"model": model.state_dict()}
    state_dict["optimizer"] = optimizer.sharded_state_dict(state_dict, is_loading=True, metadata=metadata())
    handed_back = state_dict["optimizer"]
    state_dict["optimizer"] = _dicts_copied(handed_back)
    _preprocess(state_dict, uneven)
    dcp.load(state_dict, checkpoint_id=directory)
    model.load_state_dict(state_dict["model"])
    refresh_compute_weights([model])
    optimizer.load_state_dict(handed_back)
    return {**state_dict, "optimizer": handed_back}


def _dicts_copied(value):
    """`value` with every dict in it a new one, the values in them the same objects."""
    return {k: _dicts_copied(v) for k, v in value.items()} if isinstance(value, dict) else value


def differing(expected: dict, got: dict) -> list[str]:
    assert expected.keys() == got.keys() and any(k.startswith("state/") for k in expected), sorted(expected.keys() ^ got.keys())
    return [k for k in expected if not torch.equal(expected[k], got[k])]


def _dp2_body(rank: int, world_size: int, directory: str) -> dict:
    """Step, save, step on (straight); a fresh model and optimizer load and step (resumed).
    Rank 0 writes the saved and the straight states for the DP=3 run. Muon's checkpoint is written
    as Megatron-LM writes it, Adam's with the optimizer's DTensors carrying their own chunks."""
    torch.set_float32_matmul_precision("highest")
    result, loaded = {}, {}
    for name in OPTIMIZERS:
        model, optimizer = built(name)
        take_steps(model, optimizer, 0, rank, world_size)
        save(model, optimizer, f"{directory}/{name}", uneven="all" if name == "muon" else "model")
        saved = _full_state(model, optimizer)
        take_steps(model, optimizer, STEPS, rank, world_size)
        straight = _full_state(model, optimizer)
        if rank == 0:
            torch.save({"saved": saved, "straight": straight}, f"{directory}/{name}.pt")
        model, optimizer = built(name)
        loaded[name] = load(model, optimizer, f"{directory}/{name}")
        take_steps(model, optimizer, STEPS, rank, world_size)
        result[name] = differing(straight, _full_state(model, optimizer))
        result[f"{name} steps"] = sorted({int(s["step"]) for c in optimizer.chained_optimizers
                                          for s in c.state.values() if "step" in s})
    result["refusals"] = refusals(model, optimizer, loaded["muon"]["optimizer"])
    result["fsdp2"] = _fsdp2_dp2(rank, directory)
    return result


def refusals(adam_model, adam_optimizer, muon_state: dict) -> dict:
    """One-line errors; a refused load changes no state."""
    before = _full_state(adam_model, adam_optimizer)
    messages = {"torch_dist": error_of(lambda: adam_optimizer.sharded_state_dict({}, metadata={})),
                "muon into adam": error_of(lambda: adam_optimizer.load_state_dict(muon_state))}
    messages["unchanged"] = differing(before, _full_state(adam_model, adam_optimizer))
    return messages


def _dp3_body(rank: int, world_size: int, directory: str) -> dict:
    """The DP=2 checkpoints loaded at DP=3 (other, uneven shards; DCP reads the optimizer's rows by
    our chunks alone), then stepped on: against the saved state and the DP=2 run continued."""
    torch.set_float32_matmul_precision("highest")
    result = {}
    for name in OPTIMIZERS:
        expected = torch.load(f"{directory}/{name}.pt")
        model, optimizer = built(name)
        load(model, optimizer, f"{directory}/{name}", uneven="model")
        result[f"{name} loaded"] = differing(expected["saved"], _full_state(model, optimizer))
        take_steps(model, optimizer, STEPS, rank, world_size)
        continued = _full_state(model, optimizer)
        result[name] = max((continued[k] - v).abs().max().item() for k, v in expected["straight"].items())
        result[f"{name} keys"] = sorted(continued.keys() ^ expected["straight"].keys())
    result["fsdp2"] = _fsdp2_dp3(directory)
    return result


# --- torch FSDP2: the same calls (torch.chunk's row split), a small model with gradients set directly ---

def fsdp2_built():
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from tests.unit.library.distributed.test_fsdp2 import Plain, _mesh
    from tests.unit.library.distributed.test_fsdp2 import config_for as fsdp2_config

    torch.manual_seed(3)
    model = Plain()  # 30x16, 72x20 + bias, 5x7, a norm
    fully_shard(model, mesh=_mesh(dist.get_world_size()))
    return model, get_megatron_optimizer(fsdp2_config("muon"), [model])


def fsdp2_steps(model, optimizer, first: int) -> None:
    """Steps with the same whole gradients at any DP size (each rank keeps its rows)."""
    from tests.unit.library.distributed.test_fsdp2 import global_grads, set_sharded_grads

    for step in range(first, first + STEPS):
        set_sharded_grads(model, global_grads(model, step))
        optimizer.step()
        optimizer.zero_grad()


def _fsdp2_dp2(rank: int, directory: str) -> list[str]:
    """Muon on FSDP2 at DP=2: save, continue, and load into a fresh one and continue: bitwise."""
    model, optimizer = fsdp2_built()
    fsdp2_steps(model, optimizer, 0)
    save(model, optimizer, f"{directory}/fsdp2", uneven="none")
    saved = _full_state(model, optimizer)
    fsdp2_steps(model, optimizer, STEPS)
    straight = _full_state(model, optimizer)
    if rank == 0:
        torch.save({"saved": saved, "straight": straight}, f"{directory}/fsdp2.pt")
    model, optimizer = fsdp2_built()
    load(model, optimizer, f"{directory}/fsdp2", uneven="none")
    fsdp2_steps(model, optimizer, STEPS)
    return differing(straight, _full_state(model, optimizer))


def _fsdp2_dp3(directory: str) -> dict:
    expected = torch.load(f"{directory}/fsdp2.pt")
    model, optimizer = fsdp2_built()
    load(model, optimizer, f"{directory}/fsdp2", uneven="none")
    loaded = differing(expected["saved"], _full_state(model, optimizer))
    fsdp2_steps(model, optimizer, STEPS)
    continued = _full_state(model, optimizer)
    return {"loaded": loaded, "continued": max((continued[k] - v).abs().max().item()
                                              for k, v in expected["straight"].items())}


def test_sharded_state_dict_resumes_exactly_and_loads_at_dp3_on_megatron_fsdp_and_fsdp2(run_distributed, tmp_path) -> None:
    for result in run_distributed(_dp2_body, world_size=2, args=(str(tmp_path),), timeout=600):
        assert all(result[name] == [] for name in OPTIMIZERS), result  # bitwise
        assert all(result[f"{name} steps"] == [2 * STEPS] for name in OPTIMIZERS), result
        kind, text = result["refusals"]["torch_dist"]
        assert kind == "ValueError" and "fsdp_dtensor" in text and "save_checkpoint" in text and "\n" not in text, text
        kind, text = result["refusals"]["muon into adam"]
        assert kind == "ValueError" and "\n" not in text, text
        assert result["refusals"]["unchanged"] == [], result["refusals"]
        assert result["fsdp2"] == [], result["fsdp2"]  # bitwise
    for result in run_distributed(_dp3_body, world_size=3, args=(str(tmp_path),), timeout=600):
        print("fsdp_dtensor DP=2 -> DP=3, continued vs DP=2 continued, max abs difference:",
              {name: result[name] for name in OPTIMIZERS})
        for name in OPTIMIZERS:
            assert result[f"{name} loaded"] == [] and result[f"{name} keys"] == [], result
            assert result[name] <= TOLERANCE, result
        print("FSDP2 muon DP=2 -> DP=3, continued vs DP=2 continued:", result["fsdp2"]["continued"])
        assert result["fsdp2"]["loaded"] == [] and result["fsdp2"]["continued"] <= TOLERANCE, result["fsdp2"]


def test_fsdp_dtensor_layout_of_a_model_without_dtensors_is_refused_in_one_line() -> None:
    from megatron_eopt import OptimizerConfig
    from megatron_eopt.runtime.process_groups import ParallelGroups

    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3), [torch.nn.Linear(4, 3)],
                                       pg_collection=ParallelGroups.single_process())
    with pytest.raises(TypeError, match="sharded by torch FSDP2 or Megatron-FSDP") as refused:
        optimizer.sharded_state_dict({}, metadata={"distrib_optim_sharding_type": "fsdp_dtensor"})
    assert "\n" not in str(refused.value)
