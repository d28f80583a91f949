"""LayerWiseDistributedOptimizer through get_megatron_optimizer on hand-built models (CPU, gloo).

Each data-parallel rank owns whole parameters, keeps state (and fp32 main copies) only for
them, steps them and broadcasts them. Checked here against the non-distributed optimizer:
expert parameters sharded over the expert DP group, inf/NaN on one rank, missing gradients,
a rank that owns nothing, state-dict round trips, bf16.

Exactness: gradients are k/64 with |k| <= 8, so every sum and average over <= 4 ranks is exact
in fp32 and bf16, whatever order gloo sums in. With clipping off the layer-wise step therefore
does exactly the non-distributed step's arithmetic on each parameter, and parameters are
compared BITWISE. Newton-Schulz runs in fp32 (`highest`): in bf16 an owner orthogonalizes other
batches than the single process (its own matrices only), and native bf16 kernels (AMX, GPUs)
choose their summation order by batch count, so bf16 layouts agree to bf16 round-off only.
Gradient norms differ in the last bits (squared norms are summed per owner, then over ranks),
hence 1e-6 relative for norms and for parameters of runs that clip.
"""

import io
from typing import Optional

import pytest
import torch
import torch.distributed as dist

from megatron_eopt import OptimizerConfig, ParallelGroups, get_megatron_optimizer

CONFIG = dict(optimizer="muon", lr=0.01, min_lr=0.0, weight_decay=0.1, clip_grad=0.0, muon_momentum=0.9,
              adam_beta2=0.99, muon_fp32_matmul_prec="highest")  # layouts compared bitwise: fp32
# Muon takes the hidden matrices, Adam the embedding (a lookup table) and the 1-D parameters.
SHAPES = {
    "embedding.weight": (24, 16),
    "layers.0.in_proj.weight": (32, 16),
    "layers.0.out_proj.weight": (16, 32),
    "layers.0.norm.weight": (16,),
    "layers.0.norm.bias": (16,),
    "layers.1.in_proj.weight": (32, 16),
    "layers.1.out_proj.weight": (16, 32),
    "layers.1.norm.weight": (16,),
    "head.weight": (24, 16),
}
MATRICES = [n for n, s in SHAPES.items() if len(s) == 2 and n != "embedding.weight"]


# Models and gradients ------------------------------------------------------------------------

def build_model(shapes: dict = SHAPES, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Module:
    """Parameters named as in `shapes`, the same on every rank for the same seed."""
    generator = torch.Generator().manual_seed(seed)
    root = torch.nn.Module()
    for name, shape in shapes.items():
        *path, attribute = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        value = torch.randn(shape, generator=generator) * 0.5
        module.register_parameter(attribute, torch.nn.Parameter(value.to(dtype)))
    if "embedding.weight" in shapes:
        root.get_parameter("embedding.weight").is_embedding_or_output_parameter = True
    return root


def dyadic(shape, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, shape, generator=generator).float() / 64


def rank_grads(shapes: dict, step: int, rank: int) -> dict[str, torch.Tensor]:
    """This rank's own gradients (as before a data-parallel reduction)."""
    return {name: dyadic(shape, 10_000 * step + 100 * rank + i) for i, (name, shape) in enumerate(shapes.items())}


def averaged_grads(shapes: dict, step: int, ranks: list[int]) -> dict[str, torch.Tensor]:
    """The data-parallel average of `ranks`' gradients (exact, see the module docstring)."""
    per_rank = [rank_grads(shapes, step, r) for r in ranks]
    return {name: sum(g[name] for g in per_rank) / len(ranks) for name in shapes}


def set_grads(model: torch.nn.Module, grads: dict[str, torch.Tensor], skip: tuple = ()) -> None:
    for name, param in model.named_parameters():
        param.grad = None if name in skip else grads[name].to(param.dtype)


# Optimizers and what they hold ---------------------------------------------------------------

def reference_optimizer(model: torch.nn.Module, **overrides):
    return get_megatron_optimizer(OptimizerConfig(**{**CONFIG, **overrides}), model,
                                  pg_collection=ParallelGroups.single_process())


def layer_wise_optimizer(model: torch.nn.Module, dp_group, reduce_grads: bool, **overrides):
    config = OptimizerConfig(**{**CONFIG, **overrides}, use_layer_wise_distributed_optimizer=True,
                             layer_wise_reduce_grads=reduce_grads)
    groups = ParallelGroups.from_groups(tp=None, mp=None, dp_cp=dp_group)
    return get_megatron_optimizer(config, model, pg_collection=groups)


def names_of(model: torch.nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def owned_names(optimizer, model: torch.nn.Module) -> set[str]:
    names = names_of(model)
    return {names[id(p)] for shard in optimizer.shards for p in shard.owned}


def state_names(optimizer) -> set[str]:
    """The parameters (by fqn) this rank holds optimizer state for."""
    state = optimizer.state_dict()  # torch's layout: state by position, named in the groups
    return {name for group in state["param_groups"] for position, name in zip(group["params"], group["param_names"])
            if state["state"].get(position)}


def state_bytes_by_param(optimizer, model: torch.nn.Module) -> dict[str, int]:
    """Bytes of the state tensors of every parameter with state, read child by child."""
    names = names_of(model)
    result = {}
    for child in optimizer.chained_optimizers:
        main_to_model = {id(main): model_param for model_param, main in zip(child.model_params, child.main_params)}
        for key, state in child.state.items():
            if state:
                result[names[id(main_to_model[id(key)])]] = sum(
                    t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t))
    return result


def flatten(obj, prefix: str = "") -> dict:
    """Nested dicts/lists -> {path: leaf}, tensors cloned."""
    if isinstance(obj, dict):
        return {k: v for key, value in obj.items() for k, v in flatten(value, f"{prefix}/{key}").items()}
    if isinstance(obj, (list, tuple)):
        return {k: v for i, value in enumerate(obj) for k, v in flatten(value, f"{prefix}[{i}]").items()}
    return {prefix: obj.detach().clone() if torch.is_tensor(obj) else obj}


def same(a: dict, b: dict) -> list[str]:
    """Keys whose values differ (tensors bitwise), plus keys in only one of them."""
    differ = sorted(set(a) ^ set(b))
    for key in set(a) & set(b):
        x, y = a[key], b[key]
        if torch.is_tensor(x) != torch.is_tensor(y):
            differ.append(key)
        elif torch.is_tensor(x):
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
                differ.append(key)
        elif x != y:
            differ.append(key)
    return differ


def params_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def dp_groups_of_4(rank: int) -> dict[int, dist.ProcessGroup]:
    """On 4 ranks: DP=2 over {0,1} and {2,3} (every rank creates both), DP=4 over all."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    return {2: pairs[rank // 2], 4: dist.group.WORLD}


def _run_equal_to_reference(model_shapes: dict, dp_group, reduce_grads: bool, steps: int,
                            no_grad: Optional[dict[int, tuple]] = None, **overrides) -> dict:
    """Layer-wise and non-distributed runs on the same (averaged) gradients, step by step.

    `no_grad`: step -> names of the parameters without a gradient in that step (on every rank).
    """
    no_grad = no_grad or {}
    ranks = dist.get_process_group_ranks(dp_group)
    model, reference_model = build_model(model_shapes), build_model(model_shapes)
    optimizer = layer_wise_optimizer(model, dp_group, reduce_grads, **overrides)
    reference = reference_optimizer(reference_model, **overrides)
    norms, mismatches, max_errors, frozen_ok = [], [], [], True
    for step in range(steps):
        skip = no_grad.get(step, ())
        before = params_of(model)
        optimizer.zero_grad()
        own = rank_grads(model_shapes, step, dist.get_rank())
        set_grads(model, own if reduce_grads else averaged_grads(model_shapes, step, ranks), skip)
        set_grads(reference_model, averaged_grads(model_shapes, step, ranks), skip)
        result, expected = optimizer.step(), reference.step()
        assert result[0] and expected[0], (result, expected)
        norms.append((expected[1], result[1]))
        after, reference_after = params_of(model), params_of(reference_model)
        mismatches.append([n for n in after if not torch.equal(after[n], reference_after[n])])
        max_errors.append(max((after[n] - reference_after[n]).abs().max().item() for n in after))
        frozen_ok &= all(torch.equal(before[n], after[n]) for n in skip)
    return {"norms": norms, "mismatches": mismatches, "max_errors": max_errors, "frozen_ok": frozen_ok,
            "owned": sorted(owned_names(optimizer, model)), "state": sorted(state_names(optimizer)),
            "state_bytes": optimizer.optimizer_state_bytes(), "dp_ranks": ranks,
            "params": {n: p.numpy().tobytes() for n, p in params_of(model).items()}}


def assert_norms_close(norms: list, context) -> None:
    for expected, got in norms:
        assert got == pytest.approx(expected, rel=1e-6), (context, norms)


def assert_replicas_bitwise_equal(results: list[dict], context) -> None:
    for rank, result in enumerate(results):
        for other in result["dp_ranks"]:
            assert results[other]["params"] == result["params"], (context, rank, other)


# 3. Owner-only state --------------------------------------------------------------------------

def _owner_only_state_body(rank: int, world_size: int) -> dict:
    reference_model = build_model()
    reference = reference_optimizer(reference_model)
    set_grads(reference_model, rank_grads(SHAPES, 0, 0))
    assert reference.step()[0]
    per_param = state_bytes_by_param(reference, reference_model)
    result = {"reference": per_param}
    for dp_size, group in dp_groups_of_4(rank).items():
        model = build_model()
        optimizer = layer_wise_optimizer(model, group, reduce_grads=True)
        set_grads(model, rank_grads(SHAPES, 0, rank))
        assert optimizer.step()[0]
        result[dp_size] = {"bytes": optimizer.optimizer_state_bytes(), "owned": owned_names(optimizer, model),
                           "state": set(state_bytes_by_param(optimizer, model)), "state_dict": state_names(optimizer),
                           "ranks": dist.get_process_group_ranks(group)}
    return result


def test_state_lives_on_owners_only(run_distributed) -> None:
    results = run_distributed(_owner_only_state_body, world_size=4, timeout=120)
    per_param = results[0]["reference"]
    assert set(per_param) == set(SHAPES)  # the reference holds state for every parameter
    total, largest = sum(per_param.values()), max(per_param.values())
    for dp_size in (2, 4):
        for rank, result in enumerate(results):
            mine = result[dp_size]
            group = [results[r][dp_size] for r in mine["ranks"]]
            assert mine["state"] == mine["owned"] == mine["state_dict"], (dp_size, rank)
            # The DP group's ranks own every parameter exactly once, so their state adds up.
            owned_lists = [name for r in group for name in r["owned"]]
            assert sorted(owned_lists) == sorted(SHAPES), (dp_size, owned_lists)
            assert sum(r["bytes"] for r in group) == total, dp_size
            assert mine["bytes"] == sum(per_param[n] for n in mine["owned"])
            # At DP=4, balancing matrices and the rest each from rank 0 gave rank 0 the largest
            # matrix and the embedding: 6660 of 13200 bytes, above this bound (6376).
            assert mine["bytes"] <= total / dp_size + largest, (dp_size, rank, mine["bytes"], total)
            assert mine["owned"] and any(n in MATRICES for n in mine["owned"])  # 5 matrices, <= 4 ranks


# 4. Expert parameters -------------------------------------------------------------------------

EXPERT_SHAPES = {
    "dense.column.weight": (16, 8),  # tensor-parallel, rows split over 2 ranks
    "dense.norm.weight": (8,),  # replicated over TP
    **{f"mlp.experts.{i}.weight": (8 + 4 * i, 8) for i in range(4)},
    **{f"mlp.experts.{i}.bias": (8,) for i in range(4)},
}


def expert_model(rank: int, tp_size: int) -> torch.nn.Module:
    """The full model on one process (tp_size 1) or this rank's TP shard of it."""
    model = build_model(EXPERT_SHAPES)
    column = model.get_parameter("dense.column.weight")
    if tp_size > 1:
        column.data = column.data.chunk(tp_size)[rank].clone()
        column.tensor_model_parallel, column.partition_dim = True, 0
    for name, param in model.named_parameters():
        if ".experts." in name:
            param.allreduce = False  # megatron-core's tag for expert parameters
    return model


def expert_grads(step: int, rank: int, tp_size: int) -> dict[str, torch.Tensor]:
    """Dense: the full gradient's TP shard, the same on every DP replica. Experts: this rank's own."""
    grads = rank_grads(EXPERT_SHAPES, step, rank)
    dense = rank_grads(EXPERT_SHAPES, step, 0)
    grads["dense.norm.weight"] = dense["dense.norm.weight"]
    column = dense["dense.column.weight"]
    grads["dense.column.weight"] = column.chunk(tp_size)[rank] if tp_size > 1 else column
    return grads


def _expert_body(rank: int, world_size: int, steps: int) -> dict:
    """TP=2 for dense parameters (dense DP 1), expert TP 1 with expert DP 2 (the world)."""
    world = dist.group.WORLD
    model = expert_model(rank, world_size)
    groups = ParallelGroups.from_groups(tp=world, mp=world, dp_cp=None, expt_tp=None, expt_mp=None, expt_dp=world)
    config = OptimizerConfig(**{**CONFIG, "clip_grad": 0.5}, use_layer_wise_distributed_optimizer=True,
                             layer_wise_reduce_grads=True)
    optimizer = get_megatron_optimizer(config, model, pg_collection=groups)
    reference_model = expert_model(0, 1)
    reference = reference_optimizer(reference_model, clip_grad=0.5)
    names = names_of(model)
    norms, hand_norms = [], []
    for step in range(steps):
        optimizer.zero_grad()
        set_grads(model, expert_grads(step, rank, world_size))
        # Experts: summed over the expert DP group and divided by the dense DP size, 1 here
        # (megatron-core DDP's expert scaling: each rank's expert saw only its own tokens' share).
        full = {n: sum(expert_grads(step, r, 1)[n] for r in range(world_size)) for n in EXPERT_SHAPES}
        for name in ("dense.column.weight", "dense.norm.weight"):
            full[name] = expert_grads(step, 0, 1)[name]
        set_grads(reference_model, full)
        hand_norms.append(sum(g.double().square().sum().item() for g in full.values()) ** 0.5)
        result, expected = optimizer.step(), reference.step()
        assert result[0] and expected[0]
        norms.append((expected[1], result[1]))
    reference_params = params_of(reference_model)
    reference_params["dense.column.weight"] = reference_params["dense.column.weight"].chunk(world_size)[rank]
    errors = {n: (p - reference_params[n]).abs().max().item() for n, p in params_of(model).items()}
    shards = [(shard.group is None, [[names[id(p)] for p in owner] for owner in shard.params_by_owner])
              for shard in optimizer.shards]
    return {"norms": norms, "hand_norms": hand_norms, "errors": errors, "shards": shards,
            "owned": owned_names(optimizer, model), "state": state_names(optimizer),
            "experts": {n: p.numpy().tobytes() for n, p in params_of(model).items() if ".experts." in n}}


def test_expert_parameters_are_sharded_over_the_expert_group(run_distributed) -> None:
    results = run_distributed(_expert_body, world_size=2, args=(3,), timeout=120)
    dense = {n for n in EXPERT_SHAPES if n.startswith("dense.")}
    experts = set(EXPERT_SHAPES) - dense
    for rank, result in enumerate(results):
        (dense_local, dense_owners), (expert_local, expert_owners) = result["shards"]
        assert dense_local and dense_owners == [sorted(dense, key=list(EXPERT_SHAPES).index)]  # dense DP 1
        assert not expert_local and len(expert_owners) == 2 and all(expert_owners)
        assert sorted(n for owner in expert_owners for n in owner) == sorted(experts)  # each exactly once
        assert result["owned"] == dense | set(expert_owners[rank]) == result["state"]
        # The norm counts every gradient once: the replicated norm weight on one TP rank, each
        # expert on its owner; expert state is not replicated (the sqrt(2) failure).
        for (expected, got), by_hand in zip(result["norms"], result["hand_norms"]):
            assert got == pytest.approx(by_hand, rel=1e-6) and expected == pytest.approx(by_hand, rel=1e-6)
        assert min(result["hand_norms"]) > 0.5  # clipping active
        bad = {n: e for n, e in result["errors"].items() if e > 1e-6}  # clipped: round-off of the norm
        assert not bad, (rank, bad)
        assert result["experts"] == results[0]["experts"]  # expert replicas bitwise equal


# 5. inf/NaN on one rank -----------------------------------------------------------------------

def _nan_body(rank: int, world_size: int) -> dict:
    world, poisoner = dist.group.WORLD, world_size - 1
    outcomes = {}
    for reduce_grads in (True, False):
        for poison_owned in (True, False):
            model = build_model()
            optimizer = layer_wise_optimizer(model, world, reduce_grads, clip_grad=0.5)
            set_grads(model, rank_grads(SHAPES, 0, rank) if reduce_grads else averaged_grads(SHAPES, 0, [0, 1]))
            assert optimizer.step()[0]  # creates state
            # The poisoner's choice, broadcast so that every rank knows it.
            mine = owned_names(optimizer, model)
            candidates = sorted(n for n in MATRICES if (n in mine) == poison_owned)
            choice = [candidates[0] if rank == poisoner else None]
            dist.broadcast_object_list(choice, src=poisoner)
            params_before, state_before = params_of(model), flatten(optimizer.state_dict())
            optimizer.zero_grad()
            set_grads(model, rank_grads(SHAPES, 1, rank) if reduce_grads else averaged_grads(SHAPES, 1, [0, 1]))
            if rank == poisoner:
                model.get_parameter(choice[0]).grad.view(-1)[3] = float("nan")
            result = optimizer.step()
            unchanged_params = not [n for n, p in params_of(model).items() if not torch.equal(p, params_before[n])]
            unchanged_state = not same(state_before, flatten(optimizer.state_dict()))
            optimizer.zero_grad()  # training goes on after the skipped step
            set_grads(model, rank_grads(SHAPES, 2, rank) if reduce_grads else averaged_grads(SHAPES, 2, [0, 1]))
            recovered = optimizer.step()[0]
            outcomes[(reduce_grads, poison_owned)] = {
                "result": result, "unchanged": unchanged_params and unchanged_state, "poisoned": choice[0],
                "recovered": recovered, "params": {n: p.numpy().tobytes() for n, p in params_of(model).items()},
                "state_entries": len(state_before),
            }
    return outcomes


def test_nan_on_one_rank_skips_the_step_everywhere(run_distributed) -> None:
    results = run_distributed(_nan_body, world_size=2, timeout=120)
    for case in results[0]:
        for rank, per_rank in enumerate(results):
            outcome = per_rank[case]
            assert outcome["result"] == (False, None, None), (case, rank, outcome["result"])
            assert outcome["unchanged"] and outcome["state_entries"] > 0, (case, rank)
            assert outcome["recovered"], (case, rank)
            assert outcome["params"] == results[0][case]["params"], (case, rank)


# 6. Missing gradients; a rank that owns nothing -----------------------------------------------

NO_GRAD = {1: ("layers.1.in_proj.weight", "embedding.weight"), 2: ("layers.0.norm.weight",),
           3: ("layers.1.in_proj.weight",)}


def _missing_grads_body(rank: int, world_size: int) -> dict:
    results = {}
    for dp_size, group in dp_groups_of_4(rank).items():
        for reduce_grads in (True, False):
            results[(dp_size, reduce_grads)] = _run_equal_to_reference(SHAPES, group, reduce_grads, steps=5,
                                                                       no_grad=NO_GRAD)
    return results


def test_missing_gradients_equal_non_distributed(run_distributed) -> None:
    results = run_distributed(_missing_grads_body, world_size=4, timeout=120)
    for case in results[0]:
        per_case = [r[case] for r in results]
        for rank, result in enumerate(per_case):
            assert all(not m for m in result["mismatches"]), (case, rank, result["mismatches"], result["max_errors"])
            assert result["frozen_ok"], (case, rank)  # a parameter without gradient does not move
            assert_norms_close(result["norms"], case)
        assert_replicas_bitwise_equal(per_case, case)


ONE_MATRIX = {"proj.weight": (12, 8)}


def _owns_nothing_body(rank: int, world_size: int) -> dict:
    return {reduce_grads: _run_equal_to_reference(ONE_MATRIX, dist.group.WORLD, reduce_grads, steps=3,
                                                  no_grad={1: ("proj.weight",)}, clip_grad=0.5)
            for reduce_grads in (True, False)}


def test_ranks_that_own_nothing(run_distributed) -> None:
    # A hang here would be a collective that only the owner joins: fail fast.
    results = run_distributed(_owns_nothing_body, world_size=4, timeout=60)
    for reduce_grads in (True, False):
        per_case = [r[reduce_grads] for r in results]
        owners = [rank for rank, r in enumerate(per_case) if r["owned"]]
        assert owners == [0] and per_case[0]["owned"] == ["proj.weight"] == per_case[0]["state"]
        for rank, result in enumerate(per_case):
            if rank:
                assert result["state"] == [] and result["state_bytes"] == 0, rank
            assert max(result["max_errors"]) <= 1e-6, (reduce_grads, rank, result["max_errors"])  # clipped
            assert result["frozen_ok"]
            assert_norms_close(result["norms"], reduce_grads)
        assert_replicas_bitwise_equal(per_case, reduce_grads)


# 7. State-dict round trip ---------------------------------------------------------------------

def _train(model, optimizer, steps: range, rank: int) -> None:
    for step in steps:
        optimizer.zero_grad()
        set_grads(model, rank_grads(SHAPES, step, rank))
        assert optimizer.step()[0]


def _round_trip_body(rank: int, world_size: int) -> dict:
    world = dist.group.WORLD
    straight_model = build_model()
    straight = layer_wise_optimizer(straight_model, world, reduce_grads=True, clip_grad=0.5)
    _train(straight_model, straight, range(6), rank)

    model = build_model()
    optimizer = layer_wise_optimizer(model, world, reduce_grads=True, clip_grad=0.5)
    _train(model, optimizer, range(3), rank)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    del model, optimizer
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=False)
    resumed_model = build_model(seed=1)  # other initial values, replaced by the checkpoint's
    resumed_model.load_state_dict(checkpoint["model"])
    resumed = layer_wise_optimizer(resumed_model, world, reduce_grads=True, clip_grad=0.5)
    resumed.load_state_dict(checkpoint["optimizer"])
    _train(resumed_model, resumed, range(3, 6), rank)

    # Each rank's checkpoint holds its own parameters' state: another rank's does not load.
    others = [None] * world_size
    dist.all_gather_object(others, checkpoint["optimizer"])
    foreign = None
    try:
        resumed.load_state_dict(others[(rank + 1) % world_size])
    except ValueError as error:
        foreign = str(error)
    return {
        "param_diff": same(flatten(params_of(straight_model)), flatten(params_of(resumed_model))),
        "state_diff": same(flatten(straight.state_dict()), flatten(resumed.state_dict())),
        "foreign": foreign,
        "params": {n: p.numpy().tobytes() for n, p in params_of(resumed_model).items()},
        "state": sorted(state_names(resumed)),
    }


def test_state_dict_round_trip_resumes_exactly(run_distributed) -> None:
    results = run_distributed(_round_trip_body, world_size=4, timeout=120)
    for rank, result in enumerate(results):
        assert result["param_diff"] == [] and result["state_diff"] == [], (rank, result)
        assert result["state"], rank  # every rank owns something here: the comparison is not empty
        assert result["params"] == results[0]["params"], rank  # no rank kept stale parameters
        assert result["foreign"] is not None and "saved param group holds" in result["foreign"], rank


# 8. bf16 --------------------------------------------------------------------------------------

def _bf16_body(rank: int, world_size: int) -> dict:
    results = {}
    for dp_size, group in dp_groups_of_4(rank).items():
        ranks = dist.get_process_group_ranks(group)
        model = build_model(dtype=torch.bfloat16)
        initial = params_of(model)
        optimizer = layer_wise_optimizer(model, group, reduce_grads=True, bf16=True)
        reference_model = build_model(dtype=torch.bfloat16)
        reference = reference_optimizer(reference_model, bf16=True)
        for step in range(3):
            optimizer.zero_grad()
            reference.zero_grad()
            set_grads(model, rank_grads(SHAPES, step, rank))
            set_grads(reference_model, averaged_grads(SHAPES, step, ranks))
            assert optimizer.step()[0] and reference.step()[0]
        names = names_of(model)
        mains = []
        for child in optimizer.chained_optimizers:
            for model_param, main in zip(child.model_params, child.main_params):
                mains.append((names[id(model_param)], main.dtype, main is not model_param, main.numel() * 4))
        expected = params_of(reference_model)
        results[dp_size] = {
            "owned": owned_names(optimizer, model), "mains": mains, "dp_ranks": ranks,
            "state_bytes": optimizer.optimizer_state_bytes(),
            "optimizer_state": sum(state_bytes_by_param(optimizer, model).values()),
            "moved": all(not torch.equal(p, initial[n]) for n, p in params_of(model).items()),
            "dtypes": {p.dtype for p in model.parameters()},
            "mismatches": [n for n, p in params_of(model).items() if not torch.equal(p, expected[n])],
            "params": {n: p.view(torch.int16).numpy().tobytes() for n, p in params_of(model).items()},
        }
    return results


def test_bf16_keeps_fp32_main_copies_on_owners_only(run_distributed) -> None:
    results = run_distributed(_bf16_body, world_size=4, timeout=120)
    for dp_size in (2, 4):
        per_case = [r[dp_size] for r in results]
        for rank, result in enumerate(per_case):
            assert result["dtypes"] == {torch.bfloat16} and result["moved"], (dp_size, rank)
            assert result["mismatches"] == [], (dp_size, rank, result["mismatches"])  # = non-distributed bf16
            main_names = [name for name, *_ in result["mains"]]
            assert sorted(main_names) == sorted(result["owned"]), (dp_size, rank)
            assert all(dtype == torch.float32 and separate for _, dtype, separate, _ in result["mains"])
            main_bytes = sum(nbytes for *_, nbytes in result["mains"])
            assert result["state_bytes"] == result["optimizer_state"] + main_bytes, (dp_size, rank)
        for result in per_case:  # each DP group owns every parameter exactly once
            assert sorted(n for r in result["dp_ranks"] for n in per_case[r]["owned"]) == sorted(SHAPES)
        assert_replicas_bitwise_equal(per_case, dp_size)
