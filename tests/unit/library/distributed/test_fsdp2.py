"""get_megatron_optimizer on models sharded with torch FSDP2 (`fully_shard`, DTensor Shard(0)).

Reference: our own unsharded get_megatron_optimizer (tested elsewhere against torch and
megatron-core) on an unsharded copy of the same model, stepped with the same global gradients.
The FSDP2 model gets those gradients as DTensors (each rank its Shard(0) rows), so both runs
see exactly the same numbers; after 3 steps every parameter's full tensor must match within
1e-5 (fp32, muon_fp32_matmul_prec='highest': the Newton-Schulz is the same batched call on the
owner; what differs is the order in which the gradient norm's squares are summed, so the match
is at round-off level, about 1e-7). Optimizers: muon, adam, and adaptive_muon with normuon
(whole-matrix means and norms summed over the FSDP group). The routing (which
optimizer and param group each parameter gets) must equal the unsharded model's, although
fully_shard dropped megatron-core's parameter attributes. World sizes 3 and 4 give uneven
shards and, for the 5x7 matrix at 4 ranks, a rank with no rows.
"""

import copy
import dataclasses
import tempfile
import time

import pytest
import torch

from megatron_eopt import OptimizerConfig, get_megatron_optimizer
from megatron_eopt.training.model.gpt import GPTModelSettings, build_gpt_model, destroy_model_parallel, initialize_model_parallel
from megatron_eopt.training.parallel.fsdp2 import data_parallel_mesh
from tests.newton_schulz_precision import fp32_newton_schulz
from tests.refusals import error_of

SETTINGS = GPTModelSettings(num_layers=2, hidden_size=32, num_attention_heads=8, num_query_groups=4,
                            ffn_hidden_size=48, swiglu=True, vocab_size=64, seq_length=16)
TOLERANCE = 1e-5
STEPS = 3


OPTIMIZERS = ("muon", "adam", "adaptive_muon")
# Whole-matrix optimizers (orthogonalize is a function of the whole momentum matrix): each
# matrix orthogonalized on its owner, as Muon's FSDP2 path does.
WHOLE_MATRIX_OPTIMIZERS = ("polargrad", "scion", "mop")


def config_for(optimizer: str) -> OptimizerConfig:
    # adaptive_muon with normuon: its row/column means and Frobenius norms are whole-matrix
    # statistics, summed over the FSDP group.
    return OptimizerConfig(optimizer=optimizer, lr=1e-3 if optimizer == "adam" else 0.02, min_lr=0.0,
                           weight_decay=0.05, clip_grad=1.0, muon_momentum=0.9,
                           muon_fp32_matmul_prec="highest", adaptive_muon_moment2_method="normuon")


def global_grads(model: torch.nn.Module, step: int) -> dict[str, torch.Tensor]:
    """Deterministic full gradients, the same on every rank (std 1: clipping at 1.0 is active)."""
    return grads_of_shapes({name: p.shape for name, p in model.named_parameters()}, step)


def grads_of_shapes(shapes: dict[str, torch.Size], step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    return {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}


def set_grads(reference: torch.nn.Module, sharded: torch.nn.Module, grads: dict) -> None:
    for name, p in reference.named_parameters():
        p.grad = grads[name].clone()
    set_sharded_grads(sharded, grads)


def set_sharded_grads(sharded: torch.nn.Module, grads: dict) -> None:
    """Each DTensor's rows of `grads` (of this TP rank's part) as its gradient: FSDP2's by
    torch.chunk, Megatron-FSDP's (names under `module.`) as its shard holds them."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    for name, p in sharded.named_parameters():
        if name.startswith("module."):
            rows = _held_rows(p, grads[name.removeprefix("module.")])
            p.grad = DTensor.from_local(rows.contiguous(), p.device_mesh, p.placements, shape=p.shape,
                                        stride=p.stride())
            continue
        # src_data_rank=None: each rank keeps its own part of its own (identical) copy.
        p.grad = distribute_tensor(grads[name], p.device_mesh, p.placements, src_data_rank=None)


def routing_of(optimizer) -> list[tuple[str, list[str]]]:
    return [(g["group_key"], list(g["param_fqns"])) for g in optimizer.param_groups]


def state_numel(optimizer) -> int:
    return sum(t.numel() for child in optimizer.chained_optimizers for s in child.state.values()
               for t in s.values() if torch.is_tensor(t) and t.dim() > 0)


def step_both(reference: torch.nn.Module, sharded: torch.nn.Module, config: OptimizerConfig) -> dict:
    """Build both optimizers, take STEPS steps with the same gradients, compare everything."""
    reference_opt = get_megatron_optimizer(config, [reference], pg_collection=_single_process())
    start = time.perf_counter()
    sharded_opt = get_megatron_optimizer(config, [sharded])  # no pg_collection, no parallel_state
    build_s = time.perf_counter() - start
    results, step_s = [], 0.0
    for step in range(STEPS):
        set_grads(reference, sharded, global_grads(reference, step))
        expected = reference_opt.step()
        start = time.perf_counter()
        got = sharded_opt.step()
        step_s += time.perf_counter() - start
        results.append((expected, got))
    full = dict(reference.named_parameters())
    errors = {name: (p.full_tensor() - full[name]).abs().max().item() for name, p in sharded.named_parameters()}
    return {
        "errors": errors, "results": results, "build_s": build_s, "step_s": step_s / STEPS,
        "routing": (routing_of(reference_opt), routing_of(sharded_opt)),
        "state": (state_numel(reference_opt), state_numel(sharded_opt)),
    }


def _single_process():
    from megatron_eopt.runtime.process_groups import ParallelGroups

    return ParallelGroups.single_process()  # the reference is one unsharded replica


def _mesh(world_size: int):
    """Over all the world's ranks, a mesh of its own (fsdp2.data_parallel_mesh says why)."""
    import torch.distributed as dist

    assert dist.get_world_size() == world_size
    return data_parallel_mesh(dist.group.WORLD, torch.device("cpu"))


def build_gpt(copies: int = 1):
    """megatron-core's GPTModel, the same on every call and rank (seeded); parallel_state is
    set up only to build it and torn down again: the FSDP2 optimizer must not need it. With
    `copies` > 1, a tuple of that many equal models built on one set of groups."""
    initialize_model_parallel(1, seed=11)
    try:
        models = tuple(build_gpt_model(SETTINGS) for _ in range(copies))
    finally:
        destroy_model_parallel()
    return models[0] if copies == 1 else models


def _gpt_body(rank: int, world_size: int, optimizers: tuple[str, ...] = OPTIMIZERS) -> dict:
    mesh = _mesh(world_size)
    return {optimizer: _gpt_run(optimizer, mesh) for optimizer in optimizers}


def _gpt_run(optimizer: str, mesh) -> dict:
    """One optimizer's run; its models (and the groups they hold) go when it returns."""
    from torch.distributed.fsdp import fully_shard

    model, sharded = build_gpt(copies=2)  # megatron's modules hold process groups: no deepcopy
    for layer in sharded.decoder.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    with fp32_newton_schulz(optimizer):  # tests/newton_schulz_precision.py says why
        return step_both(model, sharded, config_for(optimizer))


class Plain(torch.nn.Module):
    """Matrices of 30x16, 72x20 and 5x7 (fewer rows than 4 ranks get one each), a bias, a norm."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 30, bias=False)
        self.b = torch.nn.Linear(20, 72)
        self.c = torch.nn.Linear(7, 5, bias=False)
        self.norm = torch.nn.LayerNorm(16)


def _plain_body(rank: int, world_size: int, optimizers: tuple[str, ...] = OPTIMIZERS) -> dict:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(3)
    reference = Plain()
    mesh = _mesh(world_size)
    runs = {}
    for optimizer in optimizers:
        model, sharded = copy.deepcopy(reference), copy.deepcopy(reference)
        fully_shard(sharded, mesh=mesh)
        runs[optimizer] = step_both(model, sharded, config_for(optimizer))
        runs[optimizer]["local_rows"] = {n: p.to_local().shape[0] for n, p in sharded.named_parameters()}
        runs[optimizer]["skip"] = _nan_on_one_rank(sharded, config_for(optimizer))
    return runs


def _nan_on_one_rank(sharded: torch.nn.Module, config: OptimizerConfig) -> dict:
    """A NaN in rank 0's shard only: every rank skips, and no parameter changes."""
    optimizer = get_megatron_optimizer(config, [sharded])
    set_sharded_grads(sharded, global_grads(sharded, 99))
    if torch.distributed.get_rank() == 0:
        sharded.c.weight.grad.to_local()[0, 0] = float("nan")
    before = {n: p.to_local().clone() for n, p in sharded.named_parameters()}
    result = optimizer.step()
    changed = [n for n, p in sharded.named_parameters() if not torch.equal(p.to_local(), before[n])]
    return {"result": result, "changed": changed}


def _bad_input_body(rank: int, world_size: int) -> dict:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = _mesh(world_size)
    config = config_for("muon")
    messages = {}

    mixed = Plain()
    fully_shard(mixed.a, mesh=mesh)  # b, c and norm stay plain tensors
    messages["mixed"] = error_of(lambda: get_megatron_optimizer(config, [mixed]))
    for name, placement, optimizer in (("shard1", Shard(1), "muon"), ("replicate", Replicate(), "muon"),
                                       ("shard1_mop", Shard(1), "mop")):
        # Placements FSDP2's default does not give: the placed path (ops/placed_matrices.py).
        torch.manual_seed(3)
        reference = Plain()
        model = copy.deepcopy(reference)
        for module in (model.a, model.b, model.c, model.norm):
            for pname, p in list(module.named_parameters()):
                value = distribute_tensor(p.detach(), mesh, [placement if p.dim() == 2 else Shard(0)])
                setattr(module, pname, torch.nn.Parameter(value))
        messages[name] = step_both(reference, model, config_for(optimizer))
        if name == "replicate":  # our checkpoint files store Shard(0) parameters only
            from megatron_eopt.checkpointing import save_checkpoint

            messages["save"] = error_of(lambda: save_checkpoint(tempfile.mkdtemp(), 1, [model]))
    sharded = Plain()
    fully_shard(sharded, mesh=mesh)
    messages["soap"] = error_of(lambda: get_megatron_optimizer(OptimizerConfig(optimizer="soap", lr=0.01), [sharded]))
    return messages


def check_run(run: dict, label: str) -> None:
    bad = {name: e for name, e in run["errors"].items() if not e <= TOLERANCE}
    assert not bad, (label, bad)
    assert run["routing"][0] == run["routing"][1], (label, run["routing"])
    for expected, got in run["results"]:
        assert expected[0] and got[0], (label, expected, got)
        assert abs(expected[1] - got[1]) <= 1e-5 * expected[1], (label, expected, got)


@pytest.mark.parametrize("world_size", [2, 3])
def test_gpt_fsdp2_steps_equal_unsharded(run_distributed, world_size: int) -> None:
    for rank, runs in enumerate(run_distributed(_gpt_body, world_size=world_size, timeout=600)):
        for optimizer, run in runs.items():
            check_run(run, (world_size, rank, optimizer))
        muon_groups = [g for g, _ in runs["muon"]["routing"][1] if g.startswith("muon/")]
        routed = {f for g, fqns in runs["muon"]["routing"][1] for f in fqns if g.startswith("muon/")}
        assert muon_groups and "output_layer.weight" not in routed  # the LM head went to Adam
        assert "decoder.layers.0.self_attention.linear_qkv.weight" in routed


@pytest.mark.parametrize("world_size", [3, 4])
def test_plain_model_uneven_shards(run_distributed, world_size: int) -> None:
    per_rank = run_distributed(_plain_body, world_size=world_size, timeout=600)
    for rank, runs in enumerate(per_rank):
        for optimizer, run in runs.items():
            check_run(run, (world_size, rank, optimizer))
            full_state, local_state = run["state"]
            assert local_state < full_state, (optimizer, rank, run["state"])
            skip = run["skip"]
            assert skip["result"] == (False, None, None) and not skip["changed"], (optimizer, rank, skip)
    # The shards' state adds up to the full state (adaptive_muon's normuon keeps a small
    # replicated column-mean buffer for wide matrices, so only "smaller" holds for it).
    for optimizer in ("muon", "adam"):
        assert sum(r[optimizer]["state"][1] for r in per_rank) == per_rank[0][optimizer]["state"][0]
    if world_size == 4:
        assert per_rank[3]["muon"]["local_rows"]["c.weight"] == 0  # 5 rows: 2, 2, 1, 0


@pytest.mark.parametrize("world_size", [2, 3])
def test_gpt_fsdp2_whole_matrix_optimizers_equal_unsharded(run_distributed, world_size: int) -> None:
    """polargrad, scion and mop on the GQA + SwiGLU GPT: each matrix's whole momentum goes to its
    owner, which runs the class's own orthogonalize; 1e-5 as for muon (the same fp32 matrices,
    the gradient norm summed in another order)."""
    start = time.perf_counter()
    per_rank = run_distributed(_gpt_body, world_size=world_size, args=(WHOLE_MATRIX_OPTIMIZERS,), timeout=600)
    print(f"FSDP={world_size} whole-matrix optimizers: {time.perf_counter() - start:.1f} s")
    for rank, runs in enumerate(per_rank):
        assert sorted(runs) == sorted(WHOLE_MATRIX_OPTIMIZERS)
        for optimizer, run in runs.items():
            check_run(run, (world_size, rank, optimizer))
            print(rank, optimizer, "max error", max(run["errors"].values()))
            routed = {f for g, fqns in run["routing"][1] for f in fqns if g.startswith(f"{optimizer}/")}
            assert "decoder.layers.0.mlp.linear_fc1.weight" in routed, (optimizer, run["routing"][1])


def test_plain_model_whole_matrix_optimizer_empty_shard(run_distributed) -> None:
    """FSDP=4: the 5x7 matrix leaves rank 3 without rows; a NaN on one rank skips everywhere.
    mop only: the owners' exchange is the same for the three (each is compared at FSDP=2 and 3)."""
    per_rank = run_distributed(_plain_body, world_size=4, args=(("mop",),), timeout=600)
    for rank, runs in enumerate(per_rank):
        for optimizer, run in runs.items():
            check_run(run, (4, rank, optimizer))
            assert run["state"][1] < run["state"][0], (optimizer, rank, run["state"])
            skip = run["skip"]
            assert skip["result"] == (False, None, None) and not skip["changed"], (optimizer, rank, skip)
    assert per_rank[3]["mop"]["local_rows"]["c.weight"] == 0
    assert sum(r["mop"]["state"][1] for r in per_rank) == per_rank[0]["mop"]["state"][0]  # shards add up


def test_bad_input_and_other_placements(run_distributed) -> None:
    """A plain parameter beside DTensors and SOAP are refused; matrices placed Shard(1) or
    Replicate() on the 1-D mesh (the rest Shard(0)) step as one process does (muon, and mop's
    whole-matrix orthogonalize), the replicated ones counted once in the clipped gradient norm."""
    per_rank = run_distributed(_bad_input_body, world_size=2, timeout=300)
    messages = per_rank[0]
    kind, text = messages["mixed"]
    assert kind == "TypeError" and "'b.weight'" in text and "DTensor" in text, messages["mixed"]
    for rank, runs in enumerate(per_rank):
        for name in ("shard1", "replicate", "shard1_mop"):
            check_run(runs[name], (name, rank))
    kind, text = messages["save"]
    assert kind == "ValueError" and "'a.weight'" in text and "Replicate()" in text and "DCP" in text, messages["save"]
    kind, text = messages["soap"]
    assert kind == "ValueError" and "FSDP2" in text and "'soap'" in text, messages["soap"]


# --- TP x FSDP2 (2-D): megatron-core TP layers, each TP rank's shards split by rows over its DP mesh ---

# (optimizer, muon_tp_mode, reference): "tp1" is the unsharded TP=1 model in one process;
# "tp2" a plain TP=2 model (no FSDP2), for blockwise, whose update depends on the TP degree.
# No ("muon", "sharded"): at TP x FSDP2 the duplicated mode runs as sharded (the same code), and
# the count of Newton-Schulz calls below shows it. "per_head": muon_split_qkv_per_head.
TP_FSDP_CASES = (("muon", "duplicated", "tp1"), ("muon", "distributed", "tp1"), ("muon", "auto", "tp1"),
                 ("muon", "blockwise", "tp2"), ("adam", "duplicated", "tp1"), ("adaptive_muon", "duplicated", "tp1"),
                 ("muon", "duplicated", "tp1", "per_head"))
# The same on Megatron-FSDP's (dp, tp) mesh (Megatron-LM's --use-megatron-fsdp at TP=2): Muon's
# default mode and Adam here, every TP mode and every optimizer with `yes` in the FSDP column in
# the slow test below.
MEGATRON_FSDP = "megatron_fsdp"
TP_MEGATRON_FSDP_CASES = (("muon", "duplicated", "tp1", "", MEGATRON_FSDP), ("adam", "duplicated", "tp1", "", MEGATRON_FSDP))
TP_MEGATRON_FSDP_SLOW_CASES = tuple(
    case + ("",) * (4 - len(case)) + (MEGATRON_FSDP,) for case in TP_FSDP_CASES + (("muon", "sharded", "tp1", ""),)
    if case[:2] not in (("muon", "duplicated"), ("adam", "duplicated")) or case[3:] == ("per_head",)) + tuple(
    (name, "duplicated", "tp1", "", MEGATRON_FSDP) for name in ("polargrad", "scion", "mop", "lion", "laprop", "sgd"))
TP = 2


def _tp_splits(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """name -> (partition_dim or -1, partition_stride), read before fully_shard drops them."""
    return {name: (p.partition_dim if getattr(p, "tensor_model_parallel", False) else -1,
                   getattr(p, "partition_stride", 1)) for name, p in model.named_parameters()}


def _tp_shards(values: dict[str, torch.Tensor], splits: dict, tp_rank: int) -> dict[str, torch.Tensor]:
    from tests.gpt_training import local_shard

    return {name: local_shard(values[name], *splits[name], tp_rank, TP) for name in splits}


def _tp2_model(full: dict[str, torch.Tensor]) -> tuple[torch.nn.Module, dict]:
    """The GPT at TP=2 (parallel_state must be initialized so), holding the TP shards of `full`."""
    from megatron.core import parallel_state

    model = build_gpt_model(SETTINGS)
    splits = _tp_splits(model)
    with torch.no_grad():
        for name, shard in _tp_shards(full, splits, parallel_state.get_tensor_model_parallel_rank()).items():
            dict(model.named_parameters())[name].copy_(shard)
    return model, splits


class NewtonSchulzCount:
    """Counts the matrices this process orthogonalizes (a batch of B counts B)."""

    def __enter__(self):
        from megatron_eopt.ops.newton_schulz import NewtonSchulzSettings

        self.matrices, self._original = 0, NewtonSchulzSettings.orthogonalize

        def counted(settings, x, **kwargs):
            self.matrices += x.shape[0] if x.dim() == 3 else 1
            return self._original(settings, x, **kwargs)

        NewtonSchulzSettings.orthogonalize = counted
        return self

    def __exit__(self, *exc):
        from megatron_eopt.ops.newton_schulz import NewtonSchulzSettings

        NewtonSchulzSettings.orthogonalize = self._original


def _tp_fsdp_case(optimizer: str, tp_mode: str, reference_kind: str, variant: str = "",
                  engine: str = "fsdp2") -> dict:
    """3 steps of the TP=2 x FSDP=2 GPT against its reference, with the same global gradients;
    `engine` 'megatron_fsdp': the TP=2 model wrapped by Megatron-FSDP over its (dp, tp) mesh."""
    import dataclasses

    from megatron.core import parallel_state

    # 'auto' with a named profile: no calibration cached in the reused workers.
    profile = "h100" if tp_mode == "auto" else None
    config = dataclasses.replace(config_for(optimizer), muon_tp_mode=tp_mode, muon_tp_hardware_profile=profile,
                                 muon_split_qkv_per_head=variant == "per_head")
    reference = build_gpt()  # TP=1; its values are the start of every layout
    full = {name: p.detach().clone() for name, p in reference.named_parameters()}
    initialize_model_parallel(TP, seed=11)
    try:
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        if reference_kind == "tp2":
            reference, _ = _tp2_model(full)
        reference_opt = get_megatron_optimizer(config, [reference],
                                               pg_collection=None if reference_kind == "tp2" else _single_process())
        sharded, splits = _tp2_model(full)
        sharded = (_megatron_fsdp if engine == "megatron_fsdp" else _fully_shard)(sharded)
        # The TP group from parallel_state (as pretrain_gpt builds it), or from a pg_collection.
        pg_collection = None
        if optimizer == "adam":
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        sharded_opt = get_megatron_optimizer(config, [sharded], pg_collection=pg_collection)
        results, counts = [], [0, 0]
        for step in range(STEPS):
            grads = grads_of_shapes({name: value.shape for name, value in full.items()}, step)
            reference_grads = grads if reference_kind == "tp1" else _tp_shards(grads, splits, tp_rank)
            for name, p in reference.named_parameters():
                p.grad = reference_grads[name].clone()
            set_sharded_grads(sharded, _tp_shards(grads, splits, tp_rank))
            with NewtonSchulzCount() as counted:
                expected = reference_opt.step()
            counts[0] += counted.matrices
            with NewtonSchulzCount() as counted:
                got = sharded_opt.step()
            counts[1] += counted.matrices
            results.append((expected, got))
        reference_values = {name: p.detach() for name, p in reference.named_parameters()}
        if reference_kind == "tp1":
            reference_values = _tp_shards(reference_values, splits, tp_rank)
        errors = {name: _max_error(p.to_local(), _held_rows(p, reference_values[name.removeprefix("module.")]))
                  for name, p in sharded.named_parameters()}
        skip = _nan_on_last_rank(sharded, sharded_opt) if tp_mode == "duplicated" and engine == "fsdp2" else None
        routing = [(key, [fqn.removeprefix("module.") for fqn in fqns]) for key, fqns in routing_of(sharded_opt)]
        refused = _checkpoint_refusals(sharded, sharded_opt) if engine == MEGATRON_FSDP else {}
        return {"errors": errors, "results": results, "ns_counts": counts, "skip": skip,
                "routing": (routing_of(reference_opt), routing), "refused": refused}
    finally:
        destroy_model_parallel()


def _fully_shard(model: torch.nn.Module) -> torch.nn.Module:
    """Each TP rank's model over its data-parallel group with torch FSDP2, each layer a unit."""
    from megatron.core import parallel_state
    from torch.distributed.fsdp import fully_shard

    mesh = data_parallel_mesh(parallel_state.get_data_parallel_group(), torch.device("cpu"))
    for layer in model.decoder.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _megatron_fsdp(model: torch.nn.Module) -> torch.nn.Module:
    """The TP=2 model wrapped by Megatron-FSDP (ZeRO-3) over its (dp, tp) mesh, as Megatron-LM's
    --use-megatron-fsdp wraps it: parameters TP splits on the 2-D mesh, the rest on its dp mesh."""
    from megatron.core import parallel_state

    from megatron_eopt.training.parallel.megatron_fsdp import megatron_fsdp_gpt

    groups = (parallel_state.get_data_parallel_group(), parallel_state.get_tensor_model_parallel_group())
    return megatron_fsdp_gpt(model, torch.device("cpu"), dp_tp_groups=groups)


def _checkpoint_refusals(model: torch.nn.Module, optimizer) -> dict[str, tuple[str, str]]:
    """TP x Megatron-FSDP checkpoints through DTensor state (state_dict(), fsdp_dtensor: the Megatron-LM
    loop's tests); our own save_checkpoint refuses it in one line (before any collective)."""
    import tempfile

    from megatron_eopt.checkpointing import save_checkpoint

    directory = [tempfile.mkdtemp() if torch.distributed.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(directory)
    return {"save_checkpoint": error_of(lambda: save_checkpoint(directory[0], 1, [model], optimizer, save_rng=False))}


def _max_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return (got - expected).abs().max().item() if got.numel() else 0.0  # an empty shard holds nothing


def _held_rows(param, value: torch.Tensor) -> torch.Tensor:
    """The rows of `value` (this TP rank's part) that `param`'s shard holds: its data-parallel
    group's row counts gathered (test-side; Megatron-FSDP's splits are uneven)."""
    group = param.device_mesh.get_group(0)
    counts = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(counts, param.to_local().shape[0], group=group)
    first = sum(counts[:torch.distributed.get_rank(group)])
    return value[first:first + counts[torch.distributed.get_rank(group)]]


def _nan_on_last_rank(sharded: torch.nn.Module, optimizer) -> dict:
    """A NaN in the last rank's rows of one matrix only: every rank skips, nothing changes."""
    set_sharded_grads(sharded, global_grads(sharded, 99))  # a DTensor's shape: this TP rank's shard
    if torch.distributed.get_rank() == torch.distributed.get_world_size() - 1:
        sharded.decoder.layers[1].mlp.linear_fc2.weight.grad.to_local()[0, 0] = float("nan")
    before = {n: p.to_local().clone() for n, p in sharded.named_parameters()}
    result = optimizer.step()
    changed = [n for n, p in sharded.named_parameters() if not torch.equal(p.to_local(), before[n])]
    return {"result": result, "changed": changed}


def _tp_fsdp_body(rank: int, world_size: int, cases: tuple = TP_FSDP_CASES + TP_MEGATRON_FSDP_CASES,
                  refusals: bool = True) -> dict:
    runs = {case: _tp_fsdp_case(*case) for case in cases}
    runs.update(_tp_group_errors() if refusals else {})
    return runs


def _tp_group_errors() -> dict[str, tuple[str, str]]:
    """A model built at TP=2 given the DP group as its TP group, or (parallel_state torn down)
    no TP group at all: both refused, naming a parameter. QK-clip at TP x FSDP2: refused."""
    from megatron.core import parallel_state
    from torch.distributed.fsdp import fully_shard

    from megatron_eopt.runtime.process_groups import ParallelGroups

    initialize_model_parallel(TP, seed=11)
    try:
        model = build_gpt_model(SETTINGS)
        # The data-parallel ranks in a group of the test's own: the mesh outlives parallel_state's groups.
        dp_ranks = torch.distributed.get_process_group_ranks(parallel_state.get_data_parallel_group())
        dp_group = _own_data_parallel_group(dp_ranks)
        fully_shard(model, mesh=data_parallel_mesh(dp_group, torch.device("cpu")))
        wrong = ParallelGroups.from_groups(tp=dp_group, mp=dp_group)
        errors = {"wrong_tp_group": error_of(lambda: get_megatron_optimizer(config_for("muon"), [model],
                                                                             pg_collection=wrong))}
        clipped = dataclasses.replace(config_for("muon"), qk_clip=True)  # TP from parallel_state
        errors["qk_clip_at_tp2"] = error_of(lambda: get_megatron_optimizer(clipped, [model]))
    finally:
        destroy_model_parallel()
    errors["no_tp_group"] = error_of(lambda: get_megatron_optimizer(config_for("muon"), [model]))
    return errors


def _own_data_parallel_group(dp_ranks: list[int]):
    """A new group of `dp_ranks`; every rank makes each TP rank's data-parallel group, as
    torch.distributed.new_group requires, and keeps its own."""
    world = torch.distributed.get_world_size()
    groups = {t: torch.distributed.new_group([r for r in range(world) if r % TP == t]) for t in range(TP)}
    return groups[dp_ranks[0] % TP]


def test_tp2_x_fsdp2_equals_tp1(run_distributed) -> None:
    """TP=2 x FSDP=2 on 4 ranks (GQA + SwiGLU GPTModel, megatron-core TP layers) takes the TP=1
    steps: muon in the duplicated (run as sharded), distributed and auto modes, adam, adaptive_muon (normuon); muon
    blockwise takes the plain TP=2 steps. 1e-5 (fp32, 'highest'): the TP=1 reference
    orthogonalizes whole matrices in one process, the 2-D run the same blocks after two
    exchanges, and the gradient norm sums its squares in another order. Also Muon and Adam on
    Megatron-FSDP's (dp, tp) mesh, where each TP rank's part is split by rows over dp (measured
    up to 1.1e-7 from TP=1)."""
    start = time.perf_counter()
    per_rank = run_distributed(_tp_fsdp_body, world_size=4, timeout=600)
    print(f"TP=2 x FSDP=2 cases: {time.perf_counter() - start:.1f} s")
    for rank, runs in enumerate(per_rank):
        kind, text = runs.pop("no_tp_group")
        assert kind == "ValueError" and "no tensor-parallel group was given" in text and "2 TP ranks" in text, text
        kind, text = runs.pop("wrong_tp_group")
        assert kind == "ValueError" and "the tensor-parallel group given has ranks" in text, text
        kind, text = runs.pop("qk_clip_at_tp2")
        assert kind == "ValueError" and "TP x torch FSDP2" in text and "TP=1" in text and "\n" not in text, text
        for case, run in runs.items():
            check_run(run, (rank,) + case)
            print(rank, case, "max error", max(run["errors"].values()))
            for what, (kind, text) in run["refused"].items():
                assert kind == "ValueError" and "TP x Megatron-FSDP" in text and "TP=1" in text \
                    and "\n" not in text, (what, text)
            if case[0] == "muon" and case[1] == "duplicated" and case[4:] != (MEGATRON_FSDP,):
                skip = run["skip"]
                assert skip["result"] == (False, None, None) and not skip["changed"], (rank, skip)
    # Default mode: every block orthogonalized exactly once over the 4 ranks, as by TP=1 alone;
    # per head too (each TP rank of a matrix's owners does its own heads).
    for case in (("muon", "duplicated", "tp1"), ("muon", "duplicated", "tp1", "per_head"), TP_MEGATRON_FSDP_CASES[0]):
        counts = [runs[case]["ns_counts"] for runs in per_rank]
        assert sum(sharded for _, sharded in counts) == counts[0][0] > 0, (case, counts)


@pytest.mark.slow
def test_tp2_x_megatron_fsdp_every_tp_mode_and_optimizer_equals_tp1(run_distributed) -> None:
    """As above on Megatron-FSDP's (dp, tp) mesh: Muon in the distributed, auto, sharded and blockwise
    modes and per head, adaptive_muon, and the other optimizers with `yes` in the FSDP column
    (polargrad, scion, mop: whole matrices through the owners' TP all-gather; lion, laprop, sgd
    elementwise). Measured up to 1.7e-7 from TP=1 (~45 s on 4 gloo ranks)."""
    per_rank = run_distributed(_tp_fsdp_body, world_size=4, args=(TP_MEGATRON_FSDP_SLOW_CASES, False), timeout=600)
    for rank, runs in enumerate(per_rank):
        assert set(runs) == set(TP_MEGATRON_FSDP_SLOW_CASES)
        for case, run in runs.items():
            check_run(run, (rank,) + case)
            print(rank, case, "max error", max(run["errors"].values()))


def _tp_fsdp_whole_matrix_body(rank: int, world_size: int) -> dict:
    # polargrad only: the owners' TP all-gather is the same for the three classes.
    return {"polargrad": _tp_fsdp_case("polargrad", "duplicated", "tp1")}


def test_tp2_x_fsdp2_whole_matrix_optimizers_equal_tp1(run_distributed) -> None:
    """polargrad at TP=2 x FSDP=2: each owner gathers its TP shard's rows, the
    owners of a matrix (one TP group) all-gather the TP=1 matrix and orthogonalize it; the TP=1
    steps to 1e-5, and a NaN on one rank skips the step on all."""
    start = time.perf_counter()
    per_rank = run_distributed(_tp_fsdp_whole_matrix_body, world_size=4, timeout=600)
    print(f"TP=2 x FSDP=2 whole-matrix optimizers: {time.perf_counter() - start:.1f} s")
    for rank, runs in enumerate(per_rank):
        for optimizer, run in runs.items():
            check_run(run, (rank, optimizer))
            print(rank, optimizer, "max error", max(run["errors"].values()))
            skip = run["skip"]
            assert skip["result"] == (False, None, None) and not skip["changed"], (rank, optimizer, skip)


PRETRAIN_ARGV = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
                 "--group-query-attention", "--num-query-groups", "2", "--swiglu",
                 "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "20", "--lr", "1e-2",
                 "--log-interval", "1", "--eval-iters", "0", "--optimizer", "muon",
                 "--muon-fp32-matmul-prec", "highest"]


def test_pretrain_gpt_fsdp2_equals_layer_wise(run_distributed):
    """scripts/pretrain_gpt.py --use-torch-fsdp2 against the layer-wise distributed optimizer (an
    independent layout of the same math): same seed, data and global batch, fp32, 20 iterations."""
    from tests.pretrain_gpt_in_process import run_pretrain_gpt

    fsdp2 = run_distributed(run_pretrain_gpt, 2, args=(PRETRAIN_ARGV + ["--use-torch-fsdp2"],), timeout=600)
    layer_wise = run_distributed(run_pretrain_gpt, 2, args=(PRETRAIN_ARGV + ["--use-distributed-optimizer"],),
                                 timeout=600)
    expected = [r["loss"] for r in layer_wise[0]]
    assert len(expected) == 20 and expected[-1] < expected[0]
    for records in fsdp2:
        assert [r["loss"] for r in records] == pytest.approx(expected, rel=1e-5)


def _pretrain_tp2_body(rank: int, world_size: int, iterations: int) -> dict:
    """Both command lines in one call (each builds its groups and FSDP2 mesh anew)."""
    from tests.pretrain_gpt_in_process import run_pretrain_gpt

    argv = PRETRAIN_ARGV + ["--train-iters", str(iterations), "--tensor-model-parallel-size", "2"]
    return {"fsdp2": run_pretrain_gpt(rank, world_size, argv + ["--use-torch-fsdp2"]),
            "ddp": run_pretrain_gpt(rank, world_size, argv)}


def test_pretrain_gpt_tp2_fsdp2_equals_tp2_dp2(run_distributed):
    """scripts/pretrain_gpt.py --tensor-model-parallel-size 2 --use-torch-fsdp2 on 4 ranks (each TP
    rank's shards over its DP pair) against TP=2 x DP=2 with all-reduced gradients: same seed,
    data and global batch, fp32, muon; losses to 1e-5 relative."""
    iterations = 10
    for result in run_distributed(_pretrain_tp2_body, 4, args=(iterations,), timeout=600):
        expected = [r["loss"] for r in result["ddp"]]
        assert len(expected) == iterations and expected[-1] < expected[0]
        got = [r["loss"] for r in result["fsdp2"]]
        print("TP=2 x FSDP2=2 vs TP=2 x DP=2: max relative loss difference",
              max(abs(g - e) / abs(e) for g, e in zip(got, expected)))
        assert got == pytest.approx(expected, rel=1e-5)


def _pretrain_bf16_body(rank: int, world_size: int, iterations: int) -> list[dict]:
    from tests.pretrain_gpt_in_process import run_pretrain_gpt
    from tests.unit.library.distributed.test_megatron_fsdp import BF16, QK_CLIP

    return run_pretrain_gpt(rank, world_size, PRETRAIN_ARGV + ["--train-iters", str(iterations), "--use-torch-fsdp2"]
                            + BF16 + QK_CLIP)


def test_pretrain_gpt_fsdp2_bf16_equals_one_process(run_distributed):
    """scripts/pretrain_gpt.py --use-torch-fsdp2 --bf16 (fp32 shards stepped, bf16 forward and
    backward through FSDP2's MixedPrecisionPolicy, gradients reduced in fp32) at DP=2 against the
    same precision in one process: same seed, data and global batch, QK-clip clipping from iteration 3,
    no gradient clipping (test_megatron_fsdp's BF16 says why); losses to 1e-5 relative."""
    iterations = 6
    reference = run_distributed(_pretrain_bf16_body, 1, args=(iterations,), timeout=600)[0]
    expected = [r["loss"] for r in reference]
    assert len(expected) == iterations and expected[-1] < expected[0], expected
    assert max(r["max_attention_logit"] for r in reference) > 0.08, reference  # QK-clip clips
    for records in run_distributed(_pretrain_bf16_body, 2, args=(iterations,), timeout=600):
        got = [r["loss"] for r in records]
        print("FSDP2 bf16 DP=2 vs one process: max relative loss difference",
              max(abs(g - e) / abs(e) for g, e in zip(got, expected)))
        assert got == pytest.approx(expected, rel=1e-5)


# --- Precision-aware state (docs/memory.md): bf16 moments on the local shards ---

BF16_MOMENTS = dict(use_precision_aware_optimizer=True, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)


def _moments_by_fqn(optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """fqn -> the state tensors of that parameter (an FSDP2 run's: its rows)."""
    return {p.fqn: {k: v.clone() for k, v in p.state.items() if torch.is_tensor(v) and v.dim() > 0}
            for child in optimizer.chained_optimizers for p in child.checkpoint_params()}


def _bf16_moments_body(rank: int, world_size: int) -> dict:
    """Plain model (uneven rows; at 4 ranks the 5x7 matrix splits 2, 2, 1, 0): FSDP2 and one process,
    both with bf16 moments, STEPS steps with the same gradients. No clipping: the moments are then
    elementwise the same fp32 arithmetic on the same numbers in both layouts, so they must be
    bitwise equal; the parameters match as test_plain_model_uneven_shards's do."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(3)
    reference = Plain()
    mesh = _mesh(world_size)
    runs = {}
    for optimizer in ("muon", "adam"):
        config = dataclasses.replace(config_for(optimizer), clip_grad=0.0, **BF16_MOMENTS)
        model, sharded = copy.deepcopy(reference), copy.deepcopy(reference)
        fully_shard(sharded, mesh=mesh)
        reference_opt = get_megatron_optimizer(config, [model], pg_collection=_single_process())
        sharded_opt = get_megatron_optimizer(config, [sharded])
        for step in range(STEPS):
            set_grads(model, sharded, global_grads(model, step))
            assert reference_opt.step()[0] and sharded_opt.step()[0]
        full = dict(model.named_parameters())
        runs[optimizer] = {
            "errors": {name: (p.full_tensor() - full[name]).abs().max().item() for name, p in sharded.named_parameters()},
            "moments": (_moments_by_fqn(reference_opt), _moments_by_fqn(sharded_opt)),
        }
    return runs


# bf16 DTensor parameters, as Megatron-LM's --use-torch-fsdp2 --bf16 hands them over (Float16Module, then
# fully_shard): fp32 main shards, and with the precision-aware optimizer's defaults the main weight held
# as the bf16 parameter plus a 16-bit remainder (store_param_remainders), bf16 moments.
BF16_PARAMETERS = {"muon": dict(bf16=True), "adam": dict(bf16=True),
                   "muon remainders": dict(bf16=True, store_param_remainders=True, **BF16_MOMENTS)}


def _bf16_parameters_run(reference: torch.nn.Module, mesh, name: str) -> dict:
    """One process (bf16 parameters, MixedPrecisionOptimizer) and FSDP2 (bf16 DTensor parameters),
    STEPS steps with the same bf16 gradients, no clipping: the fp32 main weights and the bf16
    parameters of each rank's rows, against the one-process run's."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    config = dataclasses.replace(config_for(name.split()[0]), clip_grad=0.0, **BF16_PARAMETERS[name])
    model = copy.deepcopy(reference).to(torch.bfloat16)
    sharded = copy.deepcopy(model)
    fully_shard(sharded, mesh=mesh)
    reference_opt = get_megatron_optimizer(config, [model], pg_collection=_single_process())
    sharded_opt = get_megatron_optimizer(config, [sharded])
    for step in range(STEPS):
        grads = {n: g.to(torch.bfloat16) for n, g in global_grads(model, step).items()}
        for n, p in model.named_parameters():
            p.grad = grads[n].clone()
        for n, p in sharded.named_parameters():
            p.grad = distribute_tensor(grads[n], p.device_mesh, [Shard(0)], src_data_rank=None)
        assert reference_opt.step()[0] and sharded_opt.step()[0]
    refusal = error_of(lambda: sharded_opt.sharded_state_dict({}, metadata={"distrib_optim_sharding_type": "fsdp_dtensor"}))
    mains = {p.fqn: main for child in reference_opt.chained_optimizers
             for p, main in zip(child.checkpoint_params(), child.fp32_main_params())}
    rank, size = mesh.get_local_rank(), mesh.size()
    main_errors, param_errors = {}, {}
    for child in sharded_opt.chained_optimizers:
        for p, main in zip(child.checkpoint_params(), child.fp32_main_params()):
            rows = mains[p.fqn].chunk(size)
            expected = rows[rank] if rank < len(rows) else mains[p.fqn][:0]
            main_errors[p.fqn] = (main - expected).abs().max().item() if main.numel() else 0.0
            local = p.model.to_local()
            assert local.dtype == torch.bfloat16 and main.dtype == torch.float32, (name, p.fqn)
            param_errors[p.fqn] = torch.equal(local, main.to(torch.bfloat16))  # the step rounded its main back
    full = dict(model.named_parameters())
    ulps = {n: ((p.full_tensor().float() - full[n].float()).abs() / full[n].float().abs().clamp_min(1e-30)).max().item()
            for n, p in sharded.named_parameters()}
    return {"main_errors": main_errors, "rounded_back": param_errors, "relative_param_errors": ulps, "refusal": refusal,
            "children": sorted({type(c).__name__ for c in sharded_opt.chained_optimizers}),
            "changed": any(not torch.equal(p.float(), q.float()) for p, q in zip(model.parameters(), reference.parameters()))}


def _bf16_moments_and_parameters_body(rank: int, world_size: int) -> dict:
    torch.manual_seed(3)
    reference = Plain()
    mesh = _mesh(world_size)
    return {"moments": _bf16_moments_body(rank, world_size),
            "parameters": {name: _bf16_parameters_run(reference, mesh, name) for name in BF16_PARAMETERS}}


@pytest.mark.parametrize("world_size", [4])
def test_fsdp2_bf16_moments_and_parameters_equal_one_process(run_distributed, world_size: int) -> None:
    """At FSDP=4 (uneven rows; the 5x7 matrix splits 2, 2, 1, 0): bf16 moments bitwise equal to one
    process's rows; bf16 parameters (Megatron-LM's --use-torch-fsdp2 --bf16) stepped through fp32 main
    shards whose values equal one process's mixed-precision run to 1e-5, rounded back into the bf16
    shards after every step (so the bf16 parameters differ from one process's by at most one bf16
    rounding, 2^-8 relative)."""
    results = run_distributed(_bf16_moments_and_parameters_body, world_size=world_size, timeout=600)
    for rank, result in enumerate(results):
        for name, run in result["parameters"].items():
            assert run["changed"], name
            assert run["children"] == ["FullyShardedMixedPrecisionOptimizer"], (name, run["children"])
            bad = {fqn: e for fqn, e in run["main_errors"].items() if not e <= TOLERANCE}
            assert not bad, (rank, name, bad)
            assert all(run["rounded_back"].values()), (rank, name, run["rounded_back"])
            worst = max(run["relative_param_errors"].values())
            assert worst <= 2 ** -8, (rank, name, run["relative_param_errors"])
            kind, message = run["refusal"]  # fp32 main rows have no place in megatron-core's fsdp_dtensor layout
            assert kind == "ValueError" and "has no place for" in message and "torch_dcp" in message, run["refusal"]
            assert "\n" not in message, message
    _check_bf16_moments([result["moments"] for result in results], world_size)


def _check_bf16_moments(per_rank: list[dict], world_size: int) -> None:
    for rank, runs in enumerate(per_rank):
        for optimizer, run in runs.items():
            bad = {name: e for name, e in run["errors"].items() if not e <= TOLERANCE}
            assert not bad, (rank, optimizer, bad)
            expected, got = run["moments"]
            assert set(expected) == set(got), (rank, optimizer)
            compared = 0
            for fqn, state in expected.items():
                for key, value in state.items():
                    rows = value.chunk(world_size)[rank] if rank < len(value.chunk(world_size)) else value[:0]
                    assert got[fqn][key].dtype == torch.bfloat16 == value.dtype, (rank, optimizer, fqn, key)
                    assert torch.equal(got[fqn][key], rows), (rank, optimizer, fqn, key)
                    compared += 1
            keys = {key for state in expected.values() for key in state}
            assert keys == ({"momentum_buffer", "exp_avg", "exp_avg_sq"} if optimizer == "muon"
                            else {"exp_avg", "exp_avg_sq"}), (optimizer, keys)
            assert compared >= len(expected), (rank, optimizer, compared)


def test_a_torch_whose_fsdp2_sums_gradients_on_gloo_is_refused() -> None:
    from megatron_eopt.placement.fully_sharded_layout import check_fsdp2_averages

    cpu = torch.device("cpu")
    with pytest.raises(RuntimeError, match=r"^torch 2\.8\.0\+cpu's FSDP2 sums gradients over gloo .* use torch>=2\.9"):
        check_fsdp2_averages(cpu, "2.8.0+cpu")
    for fixed in ("2.9.1", "2.10.0", torch.__version__):  # make test-compat runs the FSDP2 tests on the floor
        check_fsdp2_averages(cpu, fixed)
    check_fsdp2_averages(torch.device("cuda"), "2.8.0")  # NCCL averages


# --- Megatron-LM's own path: validate_args and the optimizer's build with --use-torch-fsdp2 ---

def _megatron_lm_body(rank: int, world_size: int) -> dict:
    """Megatron-LM's parse_args + validate_args (as its pretrain_gpt.py runs them) with --use-torch-fsdp2
    and muon, without and with megatron_lm.install(); with it, the optimizer Megatron-LM's setup builds
    on an FSDP2 GPT, for --ckpt-format torch_dcp (works), torch_dist (trains: nothing saved) and torch_dist
    with --save (refused in validate_args, before any model: checkpointing/refusals.py)."""
    from megatron.training import global_vars
    from torch.distributed.fsdp import fully_shard

    from megatron_eopt.integrations import megatron_lm
    from tests.unit.library.distributed.test_megatron_fsdp import _parse_megatron_lm, megatron_lm_alone
    from tests.unit.library.integrations.test_megatron_lm_args import MODEL_FLAGS, build_through_megatron_lm

    result = {}
    runs = {"torch_dcp": "torch_dcp", "torch_dist": "torch_dist",
            "torch_dist, saving": "torch_dist --save unwritten --save-interval 1"}
    for name, format_flags in runs.items():
        argv = (f"{MODEL_FLAGS} --optimizer muon --lr 0.02 --use-torch-fsdp2 --ckpt-format {format_flags} "
                "--no-gradient-accumulation-fusion --untie-embeddings-and-output-weights")
        result[f"without {name}"] = megatron_lm_alone(argv, rank, world_size)
        with megatron_lm.installed():
            try:
                args = _parse_megatron_lm(argv, rank, world_size)
                model = build_gpt()
                fully_shard(model, mesh=_mesh(world_size))
                optimizer = build_through_megatron_lm(args, model)
                result[name] = sorted(type(c).__name__ for c in optimizer.chained_optimizers)
            except ValueError as error:
                result[name] = str(error)
            finally:
                global_vars.set_args(None)
    return result


def test_megatron_lm_accepts_emerging_optimizers_on_fsdp2_with_torch_dcp(run_distributed) -> None:
    for result in run_distributed(_megatron_lm_body, 2, timeout=600):
        assert "Torch-FSDP2" in result["without torch_dcp"], result  # refused without install()
        assert result["torch_dcp"] == ["FullyShardedFP32Optimizer"] * 2, result  # muon and adam children
        assert result["torch_dist"] == ["FullyShardedFP32Optimizer"] * 2, result  # nothing to save in it
        refusal = result["torch_dist, saving"]  # accepted by Megatron-LM with FSDP2, refused by ours at start-up
        assert "--ckpt-format torch_dist" in refusal and "use --ckpt-format torch_dcp" in refusal, result
        assert "\n" not in refusal, result
