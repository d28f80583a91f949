"""Expert parallelism on the fully sharded engines: EP=2 x FSDP=2 on 4 ranks equals one process.

The model is megatron-core's MoE GPT of pp_ep_runs.py (2 layers, 4 SequentialMLP experts with
SwiGLU, so 2 local experts per EP rank and layer), its initial values drawn from each parameter's
global name (its name at EP=1). Each rank shards its routed experts (`mlp.experts`) over its
expert-data-parallel group (2 ranks) and everything else over the data-parallel group (4 ranks).
Reference: the same model at EP=1 in one process (all experts; `ParallelGroups.single_process()`),
stepped by our unsharded optimizer (tested elsewhere against torch and megatron-core) with the
same global gradient. Muon, fp32, muon_fp32_matmul_prec='highest', clipping active in every step.

- torch FSDP2: `fully_shard(layer.mlp.experts)` over the expert-data-parallel mesh, the rest over
  the data-parallel mesh. No forward (pp_ep_runs.py says why): gradients are drawn from the global
  name and the step, each rank's DTensor gradient its rows of the one the reference gets. 3 steps;
  also a resume: save_checkpoint after 2 steps, a fresh model and optimizer load it and take step
  3, bitwise equal to the run that went on, also with the optimizer's state from torch DCP's save
  of `optimizer.state_dict()` (each expert under its global index); Muon's batched path for the
  experts; and the refusals of groups that do not fit the experts' mesh and of groups without
  expert roles.
- Megatron-FSDP: `fully_shard_model(..., expt_device_mesh=...)` (ZeRO-3) on CPU through
  runtime/megatron_fsdp_cpu.py, with real forward and backward passes (the trainer's CPU MoE
  layer, allgather dispatcher): each rank its own micro-batch; the reference steps the mean of
  the 4 micro-batches' gradients. 2 steps.

Every global parameter within 1e-5 of the reference, as the other FSDP tests: each matrix's
Newton-Schulz is the same fp32 batched computation on its owner; what differs is the order of
sums (the gradient norm's squares: dense over 4 ranks, experts over their mesh then over EP;
Megatron-FSDP's reduce-scatter against the reference's sum of 4 backward passes). Measured: 0 on
FSDP2, below 1e-6 on Megatron-FSDP. The norm each step reports must match within 1e-5 relative
too. Summing the experts' squares over their mesh alone (missing the other EP rank's experts)
moves the FSDP2 parameters by 9.5e-5, so the test fails then (measured).
"""

import itertools
import zlib

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from megatron_eopt import OptimizerConfig, ParallelGroups, get_megatron_optimizer
from megatron_eopt.checkpointing import load_checkpoint, save_checkpoint
from megatron_eopt.checkpointing.global_names import global_parameter_names
from megatron_eopt.checkpointing.storage import read_manifest
from megatron_eopt.training.model.gpt import (
    build_gpt_model,
    destroy_model_parallel,
    gpt_loss,
    initialize_model_parallel,
)
from megatron_eopt.training.parallel.fsdp2 import data_parallel_mesh
from tests.newton_schulz_calls import recording_newton_schulz_calls
from tests.refusals import error_of
from tests.unit.library.checkpointing.pp_ep_runs import MOE, OPTIMIZERS, SEED

EP = 2
STEPS = 3
SAVED_STEPS = 2
MEGATRON_FSDP_STEPS = 2
TOLERANCE = 1e-5
CONFIG = OptimizerConfig(**OPTIMIZERS["muon"])
MEGATRON_FSDP_PREFIX = "module."  # fully_shard_model's wrapper holds the model as `module`
_MESH_NUMBERS = itertools.count()  # torch caches equal meshes; the harness reuses its workers


def _global_tensor(key: str, shape: torch.Size, scale: float) -> torch.Tensor:
    generator = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    return torch.randn(shape, generator=generator) * scale


def _micro_batch(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, MOE.vocab_size, (2, MOE.seq_length + 1),
                         generator=torch.Generator().manual_seed(100 * step + rank))


class _Run:
    """One model and its optimizer, in the parallel_state the caller initialized: whole (EP=1,
    one process), or EP=2 sharded by `engine` ('fsdp2' or 'megatron_fsdp')."""

    def __init__(self, engine: str = "", expert_tp: int = 1) -> None:
        from megatron.core import parallel_state

        model = build_gpt_model(MOE)
        self.names = global_parameter_names([model])
        with torch.no_grad():
            for fqn, param in model.named_parameters():
                value = _global_tensor(f"init/{self.names[fqn]}", _joined_shape(fqn, param), 0.05)
                param.copy_(_expert_tp_shard(fqn, param, value))
        if engine == "fsdp2":
            _fully_shard(model, parallel_state.get_data_parallel_group(),
                         parallel_state.get_expert_data_parallel_group())
        elif engine == "megatron_fsdp":
            model = _megatron_fsdp(model, expert_tp)
            self.names = {MEGATRON_FSDP_PREFIX + fqn: name for fqn, name in self.names.items()}
        self.model, self.engine = model, engine
        # Sharded: the expert groups come from parallel_state; one process: none at all.
        groups = ParallelGroups.single_process() if not engine else None
        self.optimizer = get_megatron_optimizer(CONFIG, [model], pg_collection=groups)

    def set_gradients(self, step: int) -> None:
        from torch.distributed.tensor import DTensor, Shard, distribute_tensor

        for fqn, param in self.model.named_parameters():
            grad = _global_tensor(f"grad/{step}/{self.names[fqn]}", param.shape, 0.01)
            # src_data_rank=None: each rank keeps its own rows of its own (identical) copy.
            param.grad = (distribute_tensor(grad, param.device_mesh, [Shard(0)], src_data_rank=None)
                          if isinstance(param, DTensor) else grad)

    def global_params(self) -> dict[str, torch.Tensor]:
        """{global name: whole tensor} (a collective over each DTensor's mesh)."""
        from megatron_fsdp.uneven_dtensor import uneven_dtensor_to_full_tensor
        from torch.distributed.tensor import DTensor

        # Megatron-FSDP's shards are uneven: its own all_gather (padded on gloo by the patch).
        gather = uneven_dtensor_to_full_tensor if self.engine == "megatron_fsdp" else DTensor.full_tensor
        return {self.names[fqn]: (_expert_tp_joined(p) if isinstance(p, DTensor) and p.device_mesh.ndim == 2
                                  else gather(p) if isinstance(p, DTensor) else p).detach().clone()
                for fqn, p in self.model.named_parameters()}


def _expert_tp_split(fqn: str, param: torch.Tensor) -> tuple[int, int, int]:
    """(partition dim, stride, expert TP size) of a routed expert's parameter; (-1, 1, 1) if not split."""
    from megatron.core import parallel_state

    size = parallel_state.get_expert_tensor_parallel_world_size()
    if size == 1 or ".experts." not in fqn or not getattr(param, "tensor_model_parallel", False):
        return -1, 1, 1
    return param.partition_dim, getattr(param, "partition_stride", 1), size


def _joined_shape(fqn: str, param: torch.Tensor) -> torch.Size:
    dim, _, size = _expert_tp_split(fqn, param)
    return param.shape if dim < 0 else param.shape[:dim] + (param.shape[dim] * size,) + param.shape[dim + 1:]


def _expert_tp_shard(fqn: str, param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """This expert TP rank's part of `value` (megatron's layout), or `value` if `param` is not split."""
    from megatron.core import parallel_state

    from tests.gpt_training import local_shard

    dim, stride, size = _expert_tp_split(fqn, param)
    return value if dim < 0 else local_shard(value, dim, stride, parallel_state.get_expert_tensor_parallel_rank(), size)


def _expert_tp_joined(param) -> torch.Tensor:
    """The whole tensor of a DTensor on Megatron-FSDP's 2-D expert mesh, its expert data-parallel
    size 1 here (EP x expert TP = 4 ranks): the TP parts all-gathered and put in place."""
    mesh, dim = param.device_mesh, param.placements[1].dim
    assert mesh.size(0) == 1, mesh
    stride = getattr(param, "partition_stride", 1)
    parts = [torch.empty_like(param.to_local()) for _ in range(mesh.size(1))]
    dist.all_gather(parts, param.to_local().contiguous(), group=mesh.get_group(1))
    blocks = [part.chunk(stride, dim=dim) for part in parts]  # each part: its share of each stride block
    return torch.cat([torch.cat([b[k] for b in blocks], dim=dim) for k in range(stride)], dim=dim)


def _fully_shard(model: torch.nn.Module, dp_group, expert_dp_group) -> None:
    from torch.distributed.fsdp import fully_shard

    dense_mesh = data_parallel_mesh(dp_group, torch.device("cpu"))
    expert_mesh = data_parallel_mesh(expert_dp_group, torch.device("cpu"))
    for layer in model.decoder.layers:
        experts = fully_shard(layer.mlp.experts, mesh=expert_mesh)
        # Averaged over all data-parallel ranks, as megatron-core's DDP scales expert gradients
        # (torchtitan does the same); not exercised here, where gradients are set directly.
        experts.set_gradient_divide_factor(float(dist.get_world_size(dp_group)))
        fully_shard(layer, mesh=dense_mesh)
    fully_shard(model, mesh=dense_mesh)


def _megatron_fsdp(model: torch.nn.Module, expert_tp: int = 1) -> torch.nn.Module:
    """ZeRO-3 over all ranks, each TransformerLayer a unit, the experts over expert data parallel;
    with `expert_tp` > 1 each expert's layers TP-split over the mesh's tp dimension."""
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from torch.distributed.device_mesh import init_device_mesh

    from megatron_eopt.placement.megatron_fsdp_model import hold_gradient_hooks_weakly
    from megatron_eopt.runtime import megatron_fsdp_cpu

    megatron_fsdp_cpu.install()
    from megatron_fsdp import fully_shard_model

    number = next(_MESH_NUMBERS)
    dp, ep, tp = (f"experts_{dim}{number}" for dim in ("dp", "ep", "tp"))
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=(dp, tp))
    # EP varies fastest, as megatron-core's parallel_state orders its ranks: the dp dimension's
    # groups are parallel_state's expert-data-parallel groups.
    expert_mesh = init_device_mesh("cpu", (world // (EP * expert_tp), EP, expert_tp), mesh_dim_names=(dp, ep, tp))
    wrapped = fully_shard_model(model, device_mesh=mesh, dp_shard_dim=dp, tp_dim=tp, expt_device_mesh=expert_mesh,
                                fsdp_unit_modules=[TransformerLayer], zero_dp_strategy="optim_grads_params",
                                device=torch.device("cpu"))
    hold_gradient_hooks_weakly(wrapped)
    return wrapped


def _reference(steps: int, step_gradients) -> tuple[list[float], dict[str, torch.Tensor]]:
    """(norms, global params) of the EP=1 model in one process after `steps` steps."""
    initialize_model_parallel(1, seed=SEED)
    try:
        run = _Run()
        norms = []
        for step in range(steps):
            step_gradients(run, step)
            norms.append(run.optimizer.step()[1])
        return norms, run.global_params()
    finally:
        destroy_model_parallel()


def _mean_of_micro_batches(run: _Run, step: int) -> None:
    run.model.zero_grad()
    for source in range(dist.get_world_size()):
        gpt_loss(run.model, _micro_batch(step, source)).backward()
    for param in run.model.parameters():
        param.grad /= dist.get_world_size()


def _fsdp2(directory: str) -> dict:
    expected_norms, expected = _reference(STEPS, _Run.set_gradients)
    initialize_model_parallel(1, seed=SEED, expert_model_parallel_size=EP)
    try:
        run, norms = _Run("fsdp2"), []
        for step in range(STEPS):
            if step == SAVED_STEPS:
                saved = save_checkpoint(directory, SAVED_STEPS, [run.model], run.optimizer, save_rng=False)
                dcp.save({"optimizer": run.optimizer.state_dict()}, checkpoint_id=f"{directory}/dcp")
            run.set_gradients(step)
            with recording_newton_schulz_calls() as calls:
                norms.append(run.optimizer.step()[1])
        got = run.global_params()
        after_load, after_dcp = (_resumed(directory, through_dcp) for through_dcp in (False, True))
        children = [child.name for child in run.optimizer.chained_optimizers]
        refusals = _refusals(run)
        saved_ep = read_manifest(saved)["expert_parallel_size"]
        dcp_names = [key for key in dcp.FileSystemReader(f"{directory}/dcp").read_metadata().state_dict_metadata
                     if ".experts." in key]
    finally:
        destroy_model_parallel()
    return {"errors": {name: (value - expected[name]).abs().max().item() for name, value in got.items()},
            "norms": (expected_norms, norms), "names": (sorted(expected), sorted(got)), "calls": calls,
            "children": children, "resume_diffs": [n for n, v in got.items() if not torch.equal(v, after_load[n])],
            "dcp_resume_diffs": [n for n, v in got.items() if not torch.equal(v, after_dcp[n])],
            "dcp_names": dcp_names, "refusals": refusals, "saved_ep": saved_ep}


def _resumed(directory: str, through_dcp: bool) -> dict[str, torch.Tensor]:
    """A fresh model and optimizer load the checkpoint taken after SAVED_STEPS (the optimizer's
    state from save_checkpoint's files, or from torch DCP's of `optimizer.state_dict()`) and take
    the remaining steps: the global parameters then."""
    resumed = _Run("fsdp2")
    start = load_checkpoint(directory, [resumed.model], resumed.optimizer, load_rng=False,
                            load_optimizer=not through_dcp).iteration
    if through_dcp:
        state = {"optimizer": resumed.optimizer.state_dict(is_loading=True)}
        dcp.load(state, checkpoint_id=f"{directory}/dcp")
        resumed.optimizer.load_state_dict(state["optimizer"])
    for step in range(start, STEPS):
        resumed.set_gradients(step)
        resumed.optimizer.step()
    return resumed.global_params()


def _refusals(run: _Run) -> dict[str, tuple[str, str]]:
    """Each raises before any collective, on every rank."""
    # Groups that leave out expert parallelism: the experts' mesh (2 ranks) x EP (1) is not the 4-rank dense mesh.
    without_ep = ParallelGroups.from_groups(tp=None, mp=None, dp_cp=None, expt_tp=None, expt_mp=None, expt_dp=None)
    # Groups without any expert role: the experts' gradient norm has no expert model-parallel group.
    dense_only = ParallelGroups.from_groups(tp=None, mp=None, dp_cp=None)
    return {"grid": error_of(lambda: get_megatron_optimizer(CONFIG, [run.model], pg_collection=without_ep)),
            "no expert groups": error_of(lambda: get_megatron_optimizer(CONFIG, [run.model], pg_collection=dense_only))}


def _megatron_fsdp_run(rank: int) -> dict:
    """EP=2 x expert data parallel 2, and EP=2 x expert TP=2 (expert data parallel 1; Megatron-FSDP's
    2-D expert mesh), each against the same one-process run."""
    expected_norms, expected = _reference(MEGATRON_FSDP_STEPS, _mean_of_micro_batches)
    return {engine: _megatron_fsdp_against(rank, expected_norms, expected, expert_tp)
            for engine, expert_tp in (("megatron_fsdp", 1), ("megatron_fsdp expert tp 2", 2))}


def _megatron_fsdp_against(rank: int, expected_norms: list, expected: dict, expert_tp: int) -> dict:
    initialize_model_parallel(1, seed=SEED, expert_model_parallel_size=EP, expert_tensor_parallel_size=expert_tp)
    try:
        run, norms = _Run("megatron_fsdp", expert_tp), []
        for step in range(MEGATRON_FSDP_STEPS):
            gpt_loss(run.model, _micro_batch(step, rank)).backward()
            run.model.finish_grad_sync()  # Megatron-FSDP's protocol: attaches the .grad shards
            norms.append(run.optimizer.step()[1])
            run.model.zero_grad_buffer()
        got = run.global_params()
        children = [child.name for child in run.optimizer.chained_optimizers]
    finally:
        destroy_model_parallel()
    return {"errors": {name: (value - expected[name]).abs().max().item() for name, value in got.items()},
            "norms": (expected_norms, norms), "names": (sorted(expected), sorted(got)), "children": children}


def _experts_body(rank: int, world_size: int, directory: str) -> dict:
    torch.set_float32_matmul_precision("highest")
    return {"fsdp2": _fsdp2(directory), **_megatron_fsdp_run(rank)}


def _check_equal_to_one_process(per_rank: list[dict], engine: str) -> None:
    # Every global parameter is on some rank: each EP rank holds its 2 of the 4 experts.
    expected_names = set(per_rank[0][engine]["names"][0])
    assert set().union(*(result[engine]["names"][1] for result in per_rank)) == expected_names, engine
    assert any(".experts.local_experts.3." in name for name in expected_names)
    for rank, results in enumerate(per_rank):
        result = results[engine]
        worst = max(result["errors"].values())
        print(f"{engine} rank {rank}: max |EP=2 x FSDP=2 - one process| = {worst:.2e}")
        assert worst <= TOLERANCE, (engine, rank, {n: e for n, e in result["errors"].items() if e > TOLERANCE})
        for expected_norm, norm in zip(*result["norms"]):
            assert abs(norm - expected_norm) <= 1e-5 * expected_norm, (engine, rank, result["norms"])
        # The experts (all matrices: no biases) in a child of their own, as megatron-core splits them.
        assert result["children"] == ["muon/dense", "adam/dense", "muon/expert"], (engine, rank, result["children"])


def test_expert_parallel_fully_sharded_muon_equals_one_process(run_distributed, tmp_path) -> None:
    per_rank = run_distributed(_experts_body, world_size=4, args=(str(tmp_path),), timeout=600)
    for engine in ("fsdp2", "megatron_fsdp", "megatron_fsdp expert tp 2"):
        _check_equal_to_one_process(per_rank, engine)
    for rank, results in enumerate(per_rank):
        result = results["fsdp2"]
        assert not result["resume_diffs"], (rank, result["resume_diffs"])
        # The manifest's layout, although the engines drop megatron-core's `allreduce=False`.
        assert result["saved_ep"] == EP, result["saved_ep"]
        # Each expert-data-parallel rank owns 2 of its EP rank's 4 expert fc1 [96, 32] (gate and up
        # 48 x 32 apart) and 2 of its 4 fc2 [32, 48]: one batched call for each shape.
        gate_up = [shape for shape in result["calls"] if shape[-2:] == (48, 32)]
        fc2 = [shape for shape in result["calls"] if shape[-2:] == (32, 48)]
        assert gate_up == [(4, 48, 32)] and fc2 == [(2, 32, 48)], (rank, result["calls"])
        refusals = result["refusals"]
        assert refusals["grid"][0] == "ValueError" and "expert model-parallel group" in refusals["grid"][1], refusals
        assert refusals["no expert groups"][0] == "ValueError" and "'expt_tp'" in refusals["no expert groups"][1], \
            refusals
        # torch DCP of optimizer.state_dict(): each expert under its global index (this EP rank's 2 of
        # 4 per layer), and a resume from it bitwise equal to the run that went on.
        assert not result["dcp_resume_diffs"], (rank, result["dcp_resume_diffs"])
        assert {int(name.split(".local_experts.")[1].split(".")[0]) for name in result["dcp_names"]} == {0, 1, 2, 3}
