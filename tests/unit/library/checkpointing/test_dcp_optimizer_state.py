"""`optimizer.state_dict()` of a DTensor-sharded model through torch DCP, as torchtitan and Megatron-LM's
`--ckpt-format torch_dcp` use it: `dcp.save({"model": ..., "optimizer": optimizer.state_dict()})`, then a
fresh model and optimizer, the load target from `optimizer.state_dict(is_loading=True)` (Megatron-LM's
call) or from plain `state_dict()` before the first step, `dcp.load`, and `load_state_dict`.

Two models: rows that split evenly over 2 ranks, and rows that do not (30 = 15 + 15 but 5 = 3 + 2 under
FSDP2; Megatron-FSDP's bucket split gives other uneven and empty shards). adam (whose state torch makes at
its first step), muon and adaptive_muon, on torch FSDP2 and Megatron-FSDP.

The uneven Muon cases also go through `torch.save(optimizer.state_dict())` and `torch.load` into a fresh
pair (what verl and the Hugging Face Trainer do per rank): the state dict pickles, DTensors and all.

References, never golden values: the run continued without the save (bitwise at FSDP=2), the state that
was saved (bitwise, at FSDP=3 too), and the FSDP=2 run continued (at FSDP=3: 1e-6, the ranks sum the
same global batch's gradient in another order).
"""

import itertools

import torch
import torch.distributed as dist

from megatron_eopt import OptimizerConfig, get_megatron_optimizer

OPTIMIZERS = ("adam", "muon", "adaptive_muon")
MODELS = {"even": (16, 32, 4), "uneven": (16, 30, 5)}
ENGINES = ("fsdp2", "megatron_fsdp")
CASES = {f"{engine}-{model}-{optimizer}": (engine, model, optimizer)
         for engine, model, optimizer in itertools.product(ENGINES, MODELS, OPTIMIZERS)}
STEPS = 3  # before the save, and after it
GLOBAL_BATCH = 6  # rows per step: 3 per rank at FSDP=2, 2 at FSDP=3
TOLERANCE = 1e-6


def config_for(optimizer: str) -> OptimizerConfig:
    return OptimizerConfig(optimizer=optimizer, lr=1e-2, min_lr=0.0, weight_decay=0.01, muon_momentum=0.9,
                           muon_fp32_matmul_prec="highest", adaptive_muon_moment2_method="normuon")


def sharded_model(engine: str, model: str) -> torch.nn.Module:
    """Two bias-free matrices, the same on every rank and call, sharded by `engine` over all ranks."""
    inputs, hidden, outputs = MODELS[model]
    torch.manual_seed(7)
    module = torch.nn.Sequential(torch.nn.Linear(inputs, hidden, bias=False), torch.nn.Tanh(),
                                 torch.nn.Linear(hidden, outputs, bias=False))
    if engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        from megatron_eopt.training.parallel.fsdp2 import data_parallel_mesh

        fully_shard(module, mesh=data_parallel_mesh(dist.group.WORLD, torch.device("cpu")))
        return module
    from megatron_fsdp import fully_shard_model

    from megatron_eopt.placement.megatron_fsdp_model import hold_gradient_hooks_weakly
    from megatron_eopt.runtime import megatron_fsdp_cpu

    megatron_fsdp_cpu.install()
    wrapped = fully_shard_model(module, fsdp_unit_modules=[torch.nn.Linear], zero_dp_strategy="optim_grads_params",
                                device=torch.device("cpu"))
    hold_gradient_hooks_weakly(wrapped)
    return wrapped


def take_steps(model, optimizer, first: int, engine: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    inputs = MODELS["even"][0]
    for step in range(first, first + STEPS):
        batch = torch.randn(GLOBAL_BATCH, inputs, generator=torch.Generator().manual_seed(100 + step))
        rows = batch.chunk(world)[rank]
        model(rows).square().mean().backward()
        if engine == "megatron_fsdp":
            model.finish_grad_sync()
        optimizer.step()
        if engine == "megatron_fsdp":
            model.install_optimized_model_weights()
            model.zero_grad_buffer()
        else:
            optimizer.zero_grad()


def full_params(model) -> dict[str, torch.Tensor]:
    return {name.removeprefix("module."): p.full_tensor().detach().clone() for name, p in model.named_parameters()}


def full_state(state_dict: dict) -> dict[str, torch.Tensor]:
    """Every tensor of an optimizer `state_dict()`, whole (DTensors gathered)."""
    from torch.distributed.tensor import DTensor

    found = {}

    def walk(value, path):
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{path}/{key}")
        elif isinstance(value, DTensor):
            found[path] = value.full_tensor().detach().clone()
        elif torch.is_tensor(value):
            found[path] = value.detach().clone()

    for group in state_dict["param_groups"]:  # torch's layout: state by position, named in the groups
        for position, name in zip(group["params"], group["param_names"]):
            walk(state_dict["state"].get(position, {}), f"/{name}")
    return {path.replace("module.", ""): tensor for path, tensor in found.items()}


def fresh(engine: str, model_name: str, optimizer_name: str, target: str):
    """A new model and optimizer, and the load target: `is_loading` (Megatron-LM) or plain (torchtitan)."""
    model = sharded_model(engine, model_name)
    optimizer = get_megatron_optimizer(config_for(optimizer_name), [model])
    state = optimizer.state_dict(is_loading=True) if target == "is_loading" else optimizer.state_dict()
    return model, optimizer, {"model": model.state_dict(), "optimizer": state}


def load(engine: str, model_name: str, optimizer_name: str, path: str, target: str):
    import torch.distributed.checkpoint as dcp

    model, optimizer, state = fresh(engine, model_name, optimizer_name, target)
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return model, optimizer


def _save_body(rank: int, world_size: int, directory: str) -> dict:
    """FSDP=2: for each case, STEPS steps, save, STEPS more; and the same STEPS more after a load into a
    fresh model and optimizer (the target from `is_loading` for adam, plain `state_dict()` for the others)."""
    import torch.distributed.checkpoint as dcp

    torch.set_float32_matmul_precision("highest")
    results = {}
    for case, (engine, model_name, optimizer_name) in CASES.items():
        path = f"{directory}/{case}"
        model = sharded_model(engine, model_name)
        optimizer = get_megatron_optimizer(config_for(optimizer_name), [model])
        take_steps(model, optimizer, 0, engine)
        dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint_id=path)
        saved = full_state(optimizer.state_dict())
        pickled = pickle_round_trip(model, optimizer) if case in PICKLED else None
        take_steps(model, optimizer, STEPS, engine)
        straight = full_params(model)
        del model, optimizer
        target = "is_loading" if optimizer_name == "adam" else "plain"
        model, optimizer = load(engine, model_name, optimizer_name, path, target)
        loaded = full_state(optimizer.state_dict())
        take_steps(model, optimizer, STEPS, engine)
        results[case] = {"saved": saved, "loaded": loaded, "straight": straight, "resumed": full_params(model)}
        if pickled is not None:  # the pickled state, loaded into a fresh pair, continues the same way
            model, optimizer = unpickled(engine, model_name, optimizer_name, path, pickled)
            results[case]["unpickled"] = full_state(optimizer.state_dict())
            take_steps(model, optimizer, STEPS, engine)
            results[case]["unpickled resumed"] = full_params(model)
        del model, optimizer
    return results


PICKLED = ("fsdp2-uneven-muon", "megatron_fsdp-uneven-muon")


def pickle_round_trip(model, optimizer) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    return buffer.getvalue()


def unpickled(engine: str, model_name: str, optimizer_name: str, path: str, pickled: bytes):
    """A fresh pair: the model from the DCP save (a pickled DTensor keeps its mesh, a fresh model has
    another), the optimizer from the pickled state dict alone."""
    import io

    import torch.distributed.checkpoint as dcp

    model = sharded_model(engine, model_name)
    optimizer = get_megatron_optimizer(config_for(optimizer_name), [model])
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(torch.load(io.BytesIO(pickled), weights_only=False))
    return model, optimizer


def _load_at_three_body(rank: int, world_size: int, directory: str) -> dict:
    """FSDP=3: what FSDP=2 saved, loaded and continued."""
    torch.set_float32_matmul_precision("highest")
    results = {}
    for case, (engine, model_name, optimizer_name) in CASES.items():
        model, optimizer = load(engine, model_name, optimizer_name, f"{directory}/{case}", "is_loading")
        loaded = full_state(optimizer.state_dict())
        take_steps(model, optimizer, STEPS, engine)
        results[case] = {"loaded": loaded, "resumed": full_params(model)}
        del model, optimizer
    return results


def _differences(expected: dict, actual: dict) -> dict[str, float]:
    assert set(expected) == set(actual), sorted(set(expected) ^ set(actual))
    return {key: (expected[key].float() - actual[key].float()).abs().max().item() if expected[key].numel() else 0.0
            for key in expected}


def test_dcp_resumes_exactly_at_fsdp2_and_loads_at_fsdp3(run_distributed, tmp_path) -> None:
    at_two = run_distributed(_save_body, world_size=2, args=(str(tmp_path),), timeout=600)
    at_three = run_distributed(_load_at_three_body, world_size=3, args=(str(tmp_path),), timeout=600)
    assert set(at_two[0]) == set(at_three[0]) == set(CASES)
    for case, result in at_two[0].items():
        optimizer_name = CASES[case][2]
        # Every state tensor the optimizer keeps is in the checkpoint: adam's moments and step too.
        names = {path.rsplit("/", 1)[-1] for path in result["saved"]}
        expected_names = {"adam": {"exp_avg", "exp_avg_sq", "step"}}.get(optimizer_name, {"momentum_buffer"})
        assert expected_names <= names, (case, names)
        for reply in at_two:  # FSDP=2 -> FSDP=2: the state as saved, the run as if never stopped
            assert not any(_differences(reply[case]["saved"], reply[case]["loaded"]).values()), case
            assert not any(_differences(reply[case]["straight"], reply[case]["resumed"]).values()), case
            if case in PICKLED:
                assert not any(_differences(reply[case]["saved"], reply[case]["unpickled"]).values()), case
                assert not any(_differences(reply[case]["straight"], reply[case]["unpickled resumed"]).values()), case
        for reply in at_three:  # FSDP=2 -> FSDP=3: the same state, the same run within round-off
            assert not any(_differences(result["saved"], reply[case]["loaded"]).values()), case
            worst = max(_differences(result["straight"], reply[case]["resumed"]).values())
            assert worst <= TOLERANCE, (case, worst)
