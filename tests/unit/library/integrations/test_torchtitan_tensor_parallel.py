"""torchtitan's tensor parallelism x FSDP2 (TP=2 x FSDP=2, 4 gloo ranks), its parameters placed by
torchtitan's own `parallelize` on its llama3 debug model (fused wqkv) on the 2-D (fsdp, tp) mesh:
(_StridedShard(0), Shard(0)) column-parallel, (Shard(0), Shard(1)) row-parallel, (Shard(0),
Replicate()) norms. Ours steps them on the placed path (ops/placed_matrices.py). In one launch:
- two Muon steps (Adam for the norms, embeddings and head) equal one process's steps of the same
  model unsharded with the same gradients (synthetic, drawn whole), Muon's q/k/v blocks of the
  fused wqkv orthogonalized each at full size, within float32 rounding; the gradient norm equals
  one process's (the norms' copies on both TP ranks counted once);
- the optimizer state is placed like the parameters, and a torch DCP save and load resumes the
  third step bitwise;
- a Partial parameter and AdaptiveMuon on these placements are refused in one line each.
The Trainer's own TP run and checkpointer: test_torchtitan_trainer.py.
"""

import time

import pytest
import torch

LR, STEPS = 0.02, 2
# Every rank orthogonalizes the whole matrix with the same code as one process, and Adam's math is
# elementwise: the same float32 operations on the same values, which only a kernel's vectorized loop
# and its scalar tail (FMA or not; a part's rows end elsewhere than the whole's) may round apart. A
# parameter lies within a few float32 ulps of its largest entry or of its largest change over the
# steps, whichever is larger: 8 * 2**-23 * max(max|p|, max|change|) (measured: 0, bitwise equal).
# The gradient norm sums its float32 squares in another order (over the mesh): relative 1e-5
# (measured 1.1e-6, 6e6 squares; the norms counted twice on the TP ranks would be 2.7e-4 off).
ULPS = 8


def _config(optimizer: str = "muon"):
    from megatron_eopt import OptimizerConfig

    return OptimizerConfig(optimizer=optimizer, lr=LR, weight_decay=0.1, clip_grad=0.0, muon_fp32_matmul_prec="highest")


def _models(tp: int, dp: int):
    """(the model parallelized by torchtitan's parallelize_fn, the same model unsharded)."""
    import types

    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import model_registry

    from tests import torchtitan_on_cpu

    spec = model_registry("debugmodel")
    torchtitan_on_cpu.sdpa_attention(spec)
    parallelism = ParallelismConfig(spmd_backend="partial_dtensor", tensor_parallel_degree=tp,
                                    data_parallel_shard_degree=dp)
    spec.model.update_from_config(config=types.SimpleNamespace(parallelism=parallelism))
    dims = ParallelDims(dp_replicate=1, dp_shard=dp, cp=1, tp=tp, pp=1, ep=1, world_size=tp * dp,
                        spmd_backend="partial_dtensor")
    with torchtitan_on_cpu.trainer_on_cpu():
        with torch.device("meta"):
            model = spec.model.build()
        model = spec.parallelize_fn(model, parallel_dims=dims, training=TrainingConfig(mixed_precision_param="float32"),
                                    parallelism=parallelism, compile_config=CompileConfig(), ac_config=None,
                                    dump_folder="unused")
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        with torch.no_grad():
            model.init_weights(buffer_device=None)
    reference = spec.model.build()
    reference.load_state_dict({name: p.full_tensor() for name, p in model.named_parameters()})
    return model, reference


def _gradients(model, reference, step: int) -> None:
    """The same whole gradient for both: this rank's part of it for the sharded model."""
    from torch.distributed.tensor import distribute_tensor

    sharded = dict(model.named_parameters())
    for index, (name, param) in enumerate(reference.named_parameters()):
        whole = torch.randn(param.shape, generator=torch.Generator().manual_seed(1000 * step + index))
        param.grad = whole
        placed = sharded[name]
        placed.grad = distribute_tensor(whole, placed.device_mesh, placed.placements, src_data_rank=None)


def _state_of(model, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))


def _steps_and_resume(folder: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    from torch.distributed.tensor import DTensor

    from megatron_eopt import ParallelGroups, get_megatron_optimizer

    model, reference = _models(tp=2, dp=2)
    ours = get_megatron_optimizer(_config(), [model])
    one_process = get_megatron_optimizer(_config(), [reference], pg_collection=ParallelGroups.single_process())
    norms, initial = [], {name: p.detach().clone() for name, p in reference.named_parameters()}
    for step in range(STEPS):
        _gradients(model, reference, step)
        ours.prepare_grads(), one_process.prepare_grads()
        norms.append((ours.get_grad_norm(), one_process.get_grad_norm()))
        ours.step(), one_process.step()
    whole = dict(reference.named_parameters())
    scale = {name: max(p.abs().max().item(), (p - initial[name]).abs().max().item()) for name, p in whole.items()}
    errors = {name: (p.full_tensor() - whole[name]).abs().max().item() / scale[name]
              for name, p in model.named_parameters()}  # relative to the largest entry, or change
    state = _state_of(model, ours)
    placed_like = all(value.placements == dict(model.named_parameters())[key[len("state."):].rsplit(".", 1)[0]].placements
                      for key, value in state.items() if isinstance(value, DTensor))
    dcp.save(state, checkpoint_id=folder)
    saved_params = {name: p.detach().to_local().clone() for name, p in model.named_parameters()}
    _gradients(model, reference, STEPS)
    ours.step()
    straight = {name: p.detach().to_local().clone() for name, p in model.named_parameters()}
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.to_local().copy_(saved_params[name])
    fresh = get_megatron_optimizer(_config(), [model])
    target = _state_of(model, fresh)
    dcp.load(target, checkpoint_id=folder)
    set_optimizer_state_dict(model, fresh, target, options=StateDictOptions(flatten_optimizer_state_dict=True))
    _gradients(model, reference, STEPS)
    fresh.step()
    resumed = {name: p.detach().to_local() for name, p in model.named_parameters()}
    return {"errors": errors, "norms": norms, "placed_like": placed_like,
            "placements": {name: str(p.placements) for name, p in model.named_parameters()},
            "unequal_after_resume": [name for name in straight if not torch.equal(straight[name], resumed[name])],
            "dtensor_states": sum(isinstance(v, DTensor) for v in state.values())}


def _refusals() -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    from megatron_eopt import get_megatron_optimizer
    from tests.refusals import error_of

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    linear = torch.nn.Linear(8, 8, bias=False)
    linear.weight = torch.nn.Parameter(DTensor.from_local(torch.zeros(8, 8), mesh, [Partial()], run_check=False))
    model, _ = _models(tp=2, dp=2)
    return {"partial": error_of(lambda: get_megatron_optimizer(_config(), [linear])),
            "adaptive_muon": error_of(lambda: get_megatron_optimizer(_config("adaptive_muon"), [model]))}


def _body(rank: int, world_size: int, folder: str) -> dict:
    torch.set_float32_matmul_precision("highest")
    started = time.process_time()
    result = _steps_and_resume(folder)
    result["refusals"] = _refusals()
    result["cpu_seconds"] = time.process_time() - started
    return result


@pytest.fixture(scope="module")
def runs(run_distributed, tmp_path_factory) -> list[dict]:
    folder = str(tmp_path_factory.mktemp("titan_tp"))
    # torchtitan's ParallelDims and parallelize leave their meshes' groups held where no cleanup
    # reaches (measured: without any optimizer too): the world is replaced afterwards.
    results = run_distributed(_body, world_size=4, args=(folder,), timeout=600, leaves_groups=True)
    print(f"CPU seconds per rank: {[round(r['cpu_seconds'], 1) for r in results]}; "
          f"max |TP x FSDP - one process| / max|p|: {max(max(r['errors'].values()) for r in results):.3g}")
    return results


def test_torchtitans_placements_are_the_2d_ones(runs) -> None:
    placements = runs[0]["placements"]
    assert placements["layers.0.attention.qkv_linear.wqkv.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
    assert placements["layers.0.attention.wo.weight"] == "(Shard(dim=0), Shard(dim=1))"
    assert placements["layers.0.attention_norm.weight"] == "(Shard(dim=0), Replicate())"


def test_steps_equal_one_process(runs) -> None:
    for rank, result in enumerate(runs):
        worst = max(result["errors"], key=result["errors"].get)
        assert result["errors"][worst] <= ULPS * 2.0 ** -23, (rank, worst, result["errors"][worst])
        for ours, one_process in result["norms"]:
            assert ours == pytest.approx(one_process, rel=1e-5), (rank, result["norms"])


def test_state_is_placed_like_the_parameters_and_resumes_bitwise(runs) -> None:
    for rank, result in enumerate(runs):
        assert result["dtensor_states"] > 0 and result["placed_like"], (rank, result["dtensor_states"])
        assert result["unequal_after_resume"] == [], (rank, result["unequal_after_resume"])


def test_partial_and_adaptive_muon_are_refused_in_one_line(runs) -> None:
    refusals = runs[0]["refusals"]
    kind, text = refusals["partial"]
    assert kind == "ValueError" and "Partial" in text and "\n" not in text, refusals["partial"]
    kind, text = refusals["adaptive_muon"]
    assert kind == "ValueError" and "_StridedShard" in text and "\n" not in text, refusals["adaptive_muon"]
