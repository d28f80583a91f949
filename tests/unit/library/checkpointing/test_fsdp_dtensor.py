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

import torch

from megatron_eopt import get_megatron_optimizer
from megatron_eopt.training.model.gpt import gpt_loss
from tests.unit.library.distributed.test_megatron_fsdp import SETTINGS, _full_state, config_for, megatron_fsdp_gpt

STEPS = 2  # before the save, and after it
GLOBAL_BATCH = 6  # sequences per step: 3 per rank at DP=2, 2 at DP=3
TOLERANCE = 1e-5
OPTIMIZERS = ("muon", "adam")


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
    model = megatron_fsdp_gpt()
    return model, get_megatron_optimizer(config_for(name), [model])


def save(model, optimizer, directory: str, megatron_fsdp_preprocess: bool) -> None:
    """Megatron-LM's save: generate_state_dict, preprocess_fsdp_dtensor_state_dict's uneven step, DCP.
    Without `megatron_fsdp_preprocess`, that step runs on the model's part only (as in `load`)."""
    import torch.distributed.checkpoint as dcp
    from megatron_fsdp.uneven_dtensor import preprocess_state_dict_for_uneven_dtensor

    state_dict = {"model": model.state_dict()}
    state_dict["optimizer"] = optimizer.sharded_state_dict(state_dict, metadata=metadata())
    preprocess_state_dict_for_uneven_dtensor(state_dict if megatron_fsdp_preprocess else state_dict["model"])
    dcp.save(state_dict, checkpoint_id=directory)


def load(model, optimizer, directory: str, megatron_fsdp_preprocess: bool = True) -> dict:
    """Megatron-LM's load. Without `megatron_fsdp_preprocess`, Megatron-FSDP's uneven-DTensor step
    runs on the model's part only: the optimizer's DTensors carry their chunks themselves."""
    import torch.distributed.checkpoint as dcp
    from megatron_fsdp.uneven_dtensor import preprocess_state_dict_for_uneven_dtensor

    from megatron_eopt.distributed.megatron_fsdp_model import refresh_compute_weights

    state_dict = {"model": model.state_dict()}
    state_dict["optimizer"] = optimizer.sharded_state_dict(state_dict, is_loading=True, metadata=metadata())
    preprocess_state_dict_for_uneven_dtensor(state_dict if megatron_fsdp_preprocess else state_dict["model"])
    dcp.load(state_dict, checkpoint_id=directory)
    model.load_state_dict(state_dict["model"])
    refresh_compute_weights([model])
    optimizer.load_state_dict(state_dict["optimizer"])
    return state_dict


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
        save(model, optimizer, f"{directory}/{name}", megatron_fsdp_preprocess=name == "muon")
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
    return result


def refusals(adam_model, adam_optimizer, muon_state: dict) -> dict:
    """One-line errors; a refused load changes no state."""
    before = _full_state(adam_model, adam_optimizer)
    messages = {"torch_dist": _error_of(lambda: adam_optimizer.sharded_state_dict({}, metadata={})),
                "muon into adam": _error_of(lambda: adam_optimizer.load_state_dict(muon_state))}
    messages["unchanged"] = differing(before, _full_state(adam_model, adam_optimizer))
    return messages


def _error_of(call) -> tuple[str, str]:
    try:
        call()
    except (TypeError, ValueError) as error:
        return type(error).__name__, str(error)
    return "none", ""


def _dp3_body(rank: int, world_size: int, directory: str) -> dict:
    """The DP=2 checkpoints loaded at DP=3 (other, uneven shards; DCP reads the optimizer's rows by
    our chunks alone), then stepped on: against the saved state and the DP=2 run continued."""
    torch.set_float32_matmul_precision("highest")
    result = {}
    for name in OPTIMIZERS:
        expected = torch.load(f"{directory}/{name}.pt")
        model, optimizer = built(name)
        load(model, optimizer, f"{directory}/{name}", megatron_fsdp_preprocess=False)
        result[f"{name} loaded"] = differing(expected["saved"], _full_state(model, optimizer))
        take_steps(model, optimizer, STEPS, rank, world_size)
        continued = _full_state(model, optimizer)
        result[name] = max((continued[k] - v).abs().max().item() for k, v in expected["straight"].items())
        result[f"{name} keys"] = sorted(continued.keys() ^ expected["straight"].keys())
    return result


def test_megatron_fsdp_sharded_state_dict_resumes_exactly_and_loads_at_dp3(run_distributed, tmp_path) -> None:
    for result in run_distributed(_dp2_body, world_size=2, args=(str(tmp_path),), timeout=600):
        assert result["muon"] == [] and result["adam"] == [], result  # bitwise
        assert result["muon steps"] == result["adam steps"] == [2 * STEPS], result
        kind, text = result["refusals"]["torch_dist"]
        assert kind == "ValueError" and "fsdp_dtensor" in text and "save_checkpoint" in text and "\n" not in text, text
        kind, text = result["refusals"]["muon into adam"]
        assert kind == "ValueError" and "\n" not in text, text
        assert result["refusals"]["unchanged"] == [], result["refusals"]
    for result in run_distributed(_dp3_body, world_size=3, args=(str(tmp_path),), timeout=600):
        print("fsdp_dtensor DP=2 -> DP=3, continued vs DP=2 continued, max abs difference:",
              {name: result[name] for name in OPTIMIZERS})
        for name in OPTIMIZERS:
            assert result[f"{name} loaded"] == [] and result[f"{name} keys"] == [], result
            assert result[name] <= TOLERANCE, result
