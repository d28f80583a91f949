"""torch's DCP state-dict helpers on our optimizer, as AReaL's FSDP engine and torchtitan call them.

A Hugging Face `transformers` model we did not build, with 3-D parameters (Qwen3-MoE's experts:
`mlp.experts.gate_up_proj` [E, 2F, H], `down_proj` [E, H, F]), sharded by torch FSDP2 over 2 gloo
ranks, trained by Muon (its scalar optimizer, Adam, for the rest). Checkpointed through
`get_optimizer_state_dict(model, optimizer)` / `set_optimizer_state_dict(model, optimizer, state)`
with `get_model_state_dict` / `set_model_state_dict` and `dcp.save` / `dcp.load`, nested
(`flatten_optimizer_state_dict=False`, AReaL's `get_state_dict`) and flattened (`=True`, torchtitan
before 0.3 and AReaL's torchtitan-based engine), and through torchtitan 0.3's own flat helpers over
`[optimizer]`. Each resumes into a fresh model and optimizer and continues; the reference is the
run that went on without the save: parameters and optimizer state equal bitwise.

In the same launch, torchtitan's Qwen3 MoE (tests/routing_models.py; GroupedExperts
`w1_EFD`/`w3_EFD` [E, F, D], `w2_EDF` [E, D, F]) through the flattened helpers: its forward runs no
backward on CPU, so its steps take synthetic gradients (the same full tensor on every rank, each
rank its shard); bitwise equal too, and the experts' saved state is Muon's momentum.

One launch checks all of it, and that a load missing a state says so (ValueError) instead of
restarting it from zero.
"""

import torch
import torch.distributed as dist

from megatron_eopt import OptimizerConfig, get_megatron_optimizer

STEPS = 2  # before the save, and after it
VOCAB = 64
LAYOUTS = ("nested", "flattened", "torchtitan")


def build(mesh, **config):
    """The same tiny Qwen3-MoE on every rank and call (no download), each layer then the root sharded
    over `mesh` (one for the whole run: a parameter loads only from a DTensor on the same mesh);
    `config`: OptimizerConfig fields beyond the test's."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config_fields = config
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
                            tie_word_embeddings=False)
    model = Qwen3MoeForCausalLM(config)
    return _shard_and_optimize(model, model.model.layers, mesh, **config_fields)


def build_torchtitan(mesh):
    """torchtitan's Qwen3 MoE (tests/routing_models.py: GroupedExperts w1_EFD [4, 64, 32] ...), each
    layer then the root sharded over `mesh`."""
    from tests import routing_models

    model = routing_models.torchtitan_qwen3_moe()
    return _shard_and_optimize(model, model.layers.values(), mesh)


def _shard_and_optimize(model, layers, mesh, **fields):
    from torch.distributed.fsdp import fully_shard

    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    config = OptimizerConfig(optimizer="muon", lr=1e-2, weight_decay=0.01, muon_momentum=0.9,
                             muon_fp32_matmul_prec="highest", **fields)
    return model, get_megatron_optimizer(config, [model])


def take_steps(model, optimizer, first: int) -> None:
    for step in range(first, first + STEPS):
        generator = torch.Generator().manual_seed(100 * step + dist.get_rank())
        tokens = torch.randint(0, VOCAB, (2, 9), generator=generator)
        model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss.backward()
        assert optimizer.step()[0]
        optimizer.zero_grad()


def take_synthetic_steps(model, optimizer, first: int) -> None:
    """torchtitan's model runs no forward with gradients on CPU (tests/routing_models.py)."""
    from tests import routing_models

    for step in range(first, first + STEPS):
        routing_models.synthetic_gradients(model, seed=step)
        assert optimizer.step()[0]
        optimizer.zero_grad()


def options(layout: str):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=layout == "flattened")


def optimizer_state(model, optimizer, layout: str) -> dict:
    """What the layout's caller saves, and loads into."""
    if layout == "torchtitan":
        from torchtitan.components.optimizer.utils import get_flat_optim_state_dict, init_optim_state

        flat = {}
        for each in [optimizer]:  # as OptimizersContainer.state_dict does over its optimizers
            init_optim_state(each)
            flat.update(get_flat_optim_state_dict(each))
        return flat
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=options(layout))


def load_optimizer_state(model, optimizer, state: dict, layout: str) -> None:
    if layout == "torchtitan":
        from torchtitan.components.optimizer.utils import init_optim_state, load_flat_optim_state_dict

        for each in [optimizer]:
            init_optim_state(each)
            load_flat_optim_state_dict(each, state)
        return
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=options(layout))


def save(model, optimizer, layout: str, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    dcp.save({"model": get_model_state_dict(model), "optimizer": optimizer_state(model, optimizer, layout)},
             checkpoint_id=path)


def resume(mesh, layout: str, path: str, build=build):
    """A fresh model and optimizer, their state from `path` through the layout's calls. DCP reads into
    another fresh pair's state: the helpers' state dicts hold the live tensors, as torch optimizers'
    do, and a load into them alone would not show whether `set_optimizer_state_dict` loads."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    target_model, target_optimizer = build(mesh)
    state = {"model": get_model_state_dict(target_model),
             "optimizer": optimizer_state(target_model, target_optimizer, layout)}
    dcp.load(state, checkpoint_id=path)
    model, optimizer = build(mesh)
    set_model_state_dict(model, state["model"])
    load_optimizer_state(model, optimizer, state["optimizer"], layout)
    return model, optimizer, state["optimizer"]


def whole(tree, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a state dict by its path, DTensors gathered."""
    from torch.distributed.tensor import DTensor

    if isinstance(tree, dict):
        return {path: tensor for key, value in tree.items() for path, tensor in whole(value, f"{prefix}/{key}").items()}
    if isinstance(tree, DTensor):
        return {prefix: tree.full_tensor().detach().clone()}
    return {prefix: tree.detach().clone()} if torch.is_tensor(tree) else {}


def snapshot(model, optimizer) -> dict[str, dict[str, torch.Tensor]]:
    return {"parameters": {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()},
            "optimizer": whole(optimizer.state_dict())}


def expert_state(state: dict, layout: str, name: str = "model.layers.0.mlp.experts.gate_up_proj") -> list[tuple[int, ...]]:
    """The shapes of the saved state of layer 0's 3-D expert weight (Qwen3-MoE's gate_up_proj)."""
    if layout == "nested":
        entries = state["state"][name].values()
    else:
        entries = [value for key, value in state.items() if key.startswith(f"state.{name}.")]
    return sorted(tuple(value.shape) for value in entries if torch.is_tensor(value) and value.dim() > 0)


def refuses_missing_state(model, optimizer, loaded: dict) -> str:
    """A flattened state dict without one state of one parameter: torch's helpers fill it with {}."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    key = next(key for key in loaded if key.startswith("state.") and key.endswith(".exp_avg"))
    partial = {k: v for k, v in loaded.items() if k != key}
    try:
        set_optimizer_state_dict(model, optimizer, partial, options=options("flattened"))
    except ValueError as error:
        return str(error)
    return "loaded"


def _helpers_body(rank: int, world_size: int, directory: str) -> dict:
    from megatron_eopt.training.parallel.fsdp2 import data_parallel_mesh

    torch.set_float32_matmul_precision("highest")
    mesh = data_parallel_mesh(dist.group.WORLD, torch.device("cpu"))
    model, optimizer = build(mesh)
    take_steps(model, optimizer, 0)
    for layout in LAYOUTS:
        save(model, optimizer, layout, f"{directory}/{layout}")
    saved = snapshot(model, optimizer)
    take_steps(model, optimizer, STEPS)
    straight = snapshot(model, optimizer)
    result = {}
    for layout in LAYOUTS:
        model, optimizer, loaded = resume(mesh, layout, f"{directory}/{layout}")
        restored = snapshot(model, optimizer)
        if layout == "flattened":
            result["refusal"] = refuses_missing_state(model, optimizer, loaded)
        take_steps(model, optimizer, STEPS)
        result[layout] = {"restored": restored, "resumed": snapshot(model, optimizer),
                          "experts": expert_state(loaded, layout)}
    return {"saved": saved, "straight": straight, **result, "torchtitan moe": _torchtitan_body(mesh, directory),
            "routing change": _routing_change_body(mesh, directory)}


# The case (checkpointable/optimizer_change.py): saved when the experts were on AdamW and
# lm_head on Muon, loaded under today's routing, which moved both.
OLD_ROUTING = {"muon_exclude_params": "model.layers.*.mlp.experts.*", "muon_include_params": "lm_head.weight"}
ROUTING_LAYOUTS = ("state_dict", "flattened")  # dcp of optimizer.state_dict(); torch's flattened helpers


def _moved(name: str) -> bool:
    return ".mlp.experts." in name or name == "lm_head.weight"


def state_by_parameter(optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """{parameter: {state name: its whole value}}, whichever child holds it (torch's layout: by position,
    named in the groups)."""
    state = optimizer.state_dict()
    return {name: {key: value.full_tensor().clone() if hasattr(value, "full_tensor") else value.clone()
                   for key, value in state["state"][position].items()}
            for group in state["param_groups"] for position, name in zip(group["params"], group["param_names"])
            if position in state["state"]}


def _routing_change_body(mesh, directory: str) -> dict:
    import torch.distributed.checkpoint as dcp

    model, optimizer = build(mesh, **OLD_ROUTING)
    take_steps(model, optimizer, 0)
    dcp.save({"optim": optimizer.state_dict()}, checkpoint_id=f"{directory}/routing_state_dict")
    save(model, optimizer, "flattened", f"{directory}/routing_flattened")
    result = {"saved": state_by_parameter(optimizer)}
    for layout in ROUTING_LAYOUTS:
        for allowed in (False, True):
            result[layout, allowed] = _load_under_todays_routing(mesh, layout, allowed, f"{directory}/routing_{layout}")
    return result


def _load_under_todays_routing(mesh, layout: str, allowed: bool, path: str):
    """The refusal's line, or each parameter's state once loaded with the opt-in."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from megatron_eopt.checkpointing import optimizer_load_planner

    model, optimizer = build(mesh, allow_optimizer_change_on_load=allowed)
    state = ({"optim": optimizer.state_dict(is_loading=True)} if layout == "state_dict" else
             {"model": get_model_state_dict(model), "optimizer": optimizer_state(model, optimizer, layout)})
    try:
        planner = optimizer_load_planner(optimizer, state, path)
    except ValueError as error:
        return str(error)
    dcp.load(state, checkpoint_id=path, planner=planner)
    if layout == "state_dict":
        optimizer.load_state_dict(state["optim"])
        return state_by_parameter(optimizer)
    model, optimizer = build(mesh, allow_optimizer_change_on_load=True)  # the helpers load into a fresh pair
    load_optimizer_state(model, optimizer, state["optimizer"], layout)
    return state_by_parameter(optimizer)


TITAN_EXPERTS = "layers.0.moe.routed_experts.inner_experts.w1_EFD"


def _torchtitan_body(mesh, directory: str) -> dict:
    """torchtitan's Qwen3 MoE through the flattened helpers, stepped with synthetic gradients."""
    import time

    started = time.perf_counter()
    model, optimizer = build_torchtitan(mesh)
    take_synthetic_steps(model, optimizer, 0)
    save(model, optimizer, "flattened", f"{directory}/torchtitan_moe")
    saved = snapshot(model, optimizer)
    take_synthetic_steps(model, optimizer, STEPS)
    straight = snapshot(model, optimizer)
    model, optimizer, loaded = resume(mesh, "flattened", f"{directory}/torchtitan_moe", build=build_torchtitan)
    restored = snapshot(model, optimizer)
    take_synthetic_steps(model, optimizer, STEPS)
    return {"saved": saved, "straight": straight, "restored": restored, "resumed": snapshot(model, optimizer),
            "experts": expert_state(loaded, "flattened", TITAN_EXPERTS),
            "expert keys": sorted(key for key in loaded if key.startswith(f"state.{TITAN_EXPERTS}.")), "seconds": time.perf_counter() - started}


def _unequal(expected: dict, actual: dict) -> list[str]:
    assert set(expected) == set(actual), sorted(set(expected) ^ set(actual))
    return [key for key in expected if not torch.equal(expected[key], actual[key])]


def test_torch_state_dict_helpers_resume_bitwise(run_distributed, tmp_path) -> None:
    replies = run_distributed(_helpers_body, world_size=2, args=(str(tmp_path),), timeout=600)
    for reply in replies:
        for layout in LAYOUTS:
            for part in ("parameters", "optimizer"):
                assert not _unequal(reply["saved"][part], reply[layout]["restored"][part]), (layout, part)
                assert not _unequal(reply["straight"][part], reply[layout]["resumed"][part]), (layout, part)
            # the 3-D expert weight's state is saved whole: its moments (Adam) or momentum (Muon)
            assert (4, 32, 32) in reply[layout]["experts"], (layout, reply[layout]["experts"])
        assert "restores no ['exp_avg']" in reply["refusal"], reply["refusal"]
        titan = reply["torchtitan moe"]
        print(f"torchtitan Qwen3 MoE save/resume took {titan['seconds']:.2f} s")
        for part in ("parameters", "optimizer"):
            assert not _unequal(titan["saved"][part], titan["restored"][part]), ("torchtitan", part)
            assert not _unequal(titan["straight"][part], titan["resumed"][part]), ("torchtitan", part)
        assert (4, 64, 32) in titan["experts"], titan["experts"]  # GroupedExperts' w1_EFD state, whole
        # Muon's state, not Adam's exp_avg / exp_avg_sq: the experts tensor went to Muon
        assert titan["expert keys"] == [f"state.{TITAN_EXPERTS}.momentum_buffer"], titan["expert keys"]
        _check_routing_change(reply["routing change"])


def _check_routing_change(result: dict) -> None:
    """Refused in one line naming the moved parameters and the opt-in; with it their state is fresh
    (zeros), every other parameter's the saved one, bitwise."""
    saved = result["saved"]
    moved = sorted(name for name in saved if _moved(name))
    assert "lm_head.weight" in moved and len(moved) == 5, moved  # and 2 layers' gate_up_proj, down_proj
    for layout in ROUTING_LAYOUTS:
        line = result[layout, False]
        assert isinstance(line, str) and "\n" not in line, (layout, line)
        assert "allow_optimizer_change_on_load" in line and all(f"{name} (" in line for name in moved), line
        loaded = result[layout, True]
        assert set(loaded) == set(saved), (layout, sorted(set(loaded) ^ set(saved)))
        for name, state in loaded.items():
            if _moved(name):
                assert state and not any(value.any() for value in state.values()), (layout, name)
                assert saved[name].keys() != state.keys(), (layout, name)  # another optimizer's state
            else:
                assert state.keys() == saved[name].keys(), (layout, name)
                assert all(torch.equal(state[key], saved[name][key]) for key in state), (layout, name)

