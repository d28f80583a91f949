"""torchtitan 0.3.0's own `Trainer` with our optimizer named in its job config
(`optimizer=MegatronOptimizers.Config(optimizer_config=OptimizerConfig(optimizer="muon", ...))`), on its
llama3 debug model with an SDPA inner attention (tests/torchtitan_on_cpu.py says what else a CPU job
needs), 2 gloo ranks, FSDP2 (`data_parallel_shard_degree=2`) and torchtitan's tensor parallelism
(`tensor_parallel_degree=2`), in one launch of reused worker processes:
- the Trainer's own lr schedule (warm-up, then linear decay) sets every group of ours at every step;
- its own checkpointer (DCP) resumes from step 3 bitwise, with FSDP2 and with TP: parameters (each
  rank's shard) and optimizer state key by key (with TP placed like the 2-D mesh's parameters),
  losses of steps 4-6;
- the groups hold the model's own parameters (DTensors), those torchtitan clips.
TP x FSDP2 against one process: test_torchtitan_tensor_parallel.py.
In one process: the config's build, torchtitan's schedulers and checkpoint form on it, its refusals.
"""

import math
import shutil
import time

import pytest
import torch

STEPS, SAVED_AT, WARMUP, LR = 6, 3, 2, 4e-3


def optimizer_config():
    from megatron_eopt import OptimizerConfig
    from megatron_eopt.integrations.torchtitan import MegatronOptimizers

    return MegatronOptimizers.Config(optimizer_config=OptimizerConfig(
        optimizer="muon", lr=LR, weight_decay=0.1, clip_grad=0.0, muon_fp32_matmul_prec="highest"))


def job(dump_folder: str, **parallelism):
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer
    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.models.llama3 import model_registry
    from torchtitan.trainer import Trainer

    from tests import torchtitan_on_cpu

    model_spec = model_registry("debugmodel")
    torchtitan_on_cpu.sdpa_attention(model_spec)
    tokenizer, data = torchtitan_on_cpu.tokenizer_and_data()
    return Trainer.Config(
        model_spec=model_spec, loss=CrossEntropyLoss.Config(), tokenizer=tokenizer, dataloader=data,
        optimizer=optimizer_config(),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=WARMUP, decay_type="linear"),
        training=TrainingConfig(local_batch_size=2, seq_len=32, steps=STEPS, max_norm=1.0,
                                disable_cuda_graphs=True, mixed_precision_param="float32"),
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor", **parallelism),
        metrics=MetricsProcessor.Config(log_freq=1),
        checkpoint=CheckpointManager.Config(enable=True, interval=SAVED_AT, folder="checkpoint",
                                            last_save_model_only=False),
        dump_folder=dump_folder)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.to_local() if hasattr(tensor, "to_local") else tensor).detach().clone()


def _flat(value, prefix: str = "") -> dict:
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _flat(item, f"{prefix}{key}.").items()}
    if isinstance(value, (list, tuple)):
        return {k: v for i, item in enumerate(value) for k, v in _flat(item, f"{prefix}{i}.").items()}
    return {prefix.rstrip("."): _local(value) if isinstance(value, torch.Tensor) else value}


def _train(dump_folder: str, **parallelism) -> dict:
    from torchtitan.trainer import Trainer

    from tests import torchtitan_on_cpu

    with torchtitan_on_cpu.trainer_on_cpu():
        trainer = Trainer(job(dump_folder, **parallelism))
        ours = trainer.optimizers.optimizers[0]
        lrs, losses = [], {}
        ours.register_step_pre_hook(lambda opt, args, kwargs: lrs.append([g["lr"] for g in opt.param_groups]))
        log = trainer.metrics_processor.log
        trainer.metrics_processor.log = lambda step, loss, *a, **k: (losses.__setitem__(step, loss), log(step, loss, *a, **k))
        try:
            trainer.train()
            model = trainer.model_parts[0]
            model_params = {id(p) for p in model.parameters()}
            placements = {name: str(p.placements) for name, p in model.named_parameters()}
            return {"losses": losses, "lrs": lrs, "base_lrs": [g["initial_lr"] for g in ours.param_groups],
                    "placements": placements,
                    "groups_hold_model_params": all(id(p) in model_params for g in ours.param_groups for p in g["params"]),
                    "grouped": sum(len(g["params"]) for g in ours.param_groups), "model_params": len(model_params),
                    "params": {name: _local(p) for name, p in model.named_parameters()},
                    "optimizer_state": _flat(ours.state_dict()), "type": type(ours).__name__}
        finally:
            trainer.close()


def _whole_and_resumed(rank: int, folder: str, **parallelism) -> dict:
    whole = _train(f"{folder}/whole", **parallelism)
    if rank == 0:  # the resumed job's folder holds step 3 of the whole run only: it resumes from there
        shutil.copytree(f"{folder}/whole/checkpoint/step-{SAVED_AT}", f"{folder}/resumed/checkpoint/step-{SAVED_AT}")
    torch.distributed.barrier()
    return {"whole": whole, "resumed": _train(f"{folder}/resumed", **parallelism)}


def _fsdp_and_tensor_parallel(rank: int, world_size: int, folder: str) -> dict:
    started = time.process_time()
    fsdp = _whole_and_resumed(rank, f"{folder}/fsdp", data_parallel_shard_degree=world_size)
    tensor_parallel = _whole_and_resumed(rank, f"{folder}/tp", tensor_parallel_degree=world_size)
    return {**fsdp, "tensor_parallel": tensor_parallel, "cpu_seconds": time.process_time() - started}


def linear_warmup_then_decay(step: int) -> float:
    """torchtitan's LRSchedulersContainer without decay_ratio: warm-up over WARMUP steps to the full
    lr, then linear decay to 0 at the step after the last."""
    if step < WARMUP:
        return (step + 1) / WARMUP
    return 1.0 - (step - WARMUP) / (STEPS - WARMUP)


@pytest.fixture(scope="module")
def runs(run_distributed, tmp_path_factory) -> list[dict]:
    folder = str(tmp_path_factory.mktemp("torchtitan"))
    # torchtitan's TP Trainer leaves 2 groups of its meshes held where no cleanup reaches (measured:
    # the same with its own AdamW instead of ours): the world is replaced afterwards.
    results = run_distributed(_fsdp_and_tensor_parallel, world_size=2, args=(folder,), timeout=600, leaves_groups=True)
    print(f"CPU seconds per rank (four Trainer runs): {[round(r['cpu_seconds'], 1) for r in results]}")
    return results


def test_the_trainers_schedule_sets_every_group(runs) -> None:
    for rank, result in enumerate(runs):
        whole = result["whole"]
        assert len(whole["lrs"]) == STEPS, (rank, whole["lrs"])
        for step, lrs in enumerate(whole["lrs"]):
            assert lrs == pytest.approx([base * linear_warmup_then_decay(step) for base in whole["base_lrs"]],
                                        rel=1e-12, abs=0.0), (rank, step, lrs)


def test_the_groups_hold_the_models_parameters(runs) -> None:
    for rank, result in enumerate(runs):
        whole = result["whole"]
        assert whole["groups_hold_model_params"] and whole["grouped"] == whole["model_params"], (rank, whole["type"])


def _check_resumed_bitwise(rank: int, result: dict) -> None:
    whole, resumed = result["whole"], result["resumed"]
    assert sorted(resumed["losses"]) == list(range(SAVED_AT + 1, STEPS + 1)), (rank, resumed["losses"])
    assert all(resumed["losses"][step] == whole["losses"][step] for step in resumed["losses"]), (rank, result)
    for label in ("params", "optimizer_state"):
        saved, continued = whole[label], resumed[label]
        assert saved.keys() == continued.keys(), (rank, label, sorted(saved.keys() ^ continued.keys()))
        for key, value in saved.items():
            same = torch.equal(value, continued[key]) if isinstance(value, torch.Tensor) else value == continued[key]
            assert same, (rank, label, key)


def test_torchtitans_checkpointer_resumes_bitwise(runs) -> None:
    for rank, result in enumerate(runs):
        _check_resumed_bitwise(rank, result)


def test_torchtitans_tensor_parallel_trains_and_resumes_bitwise(runs) -> None:
    """TP=2 alone: the parameters on torchtitan's (fsdp=1, tp=2) mesh, placed as TP places them."""
    for rank, result in enumerate(runs):
        placements = result["tensor_parallel"]["whole"]["placements"]
        row_parallel = [name for name in placements if name.endswith("attention.wo.weight")]
        assert row_parallel and placements[row_parallel[0]] == "(Shard(dim=0), Shard(dim=1))", (rank, placements)
        losses = result["tensor_parallel"]["whole"]["losses"]
        assert sorted(losses) == list(range(1, STEPS + 1)) and all(map(math.isfinite, losses.values())), (rank, losses)
        assert losses == runs[0]["tensor_parallel"]["whole"]["losses"], rank  # TP ranks share the batch and loss
        _check_resumed_bitwise(rank, result["tensor_parallel"])


# In one process, no Trainer: what torchtitan's Trainer does with the config's build.


def test_the_config_builds_torchtitans_container_around_ours() -> None:
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer

    from megatron_eopt import OptimizerConfig, get_megatron_optimizer
    from megatron_eopt.integrations.torchtitan import MegatronOptimizers
    from tests import routing_models

    config = OptimizerConfig(optimizer="muon", lr=LR, clip_grad=0.0, muon_fp32_matmul_prec="highest")
    model = routing_models.torchtitan_llama3()
    optimizers = MegatronOptimizers.Config(optimizer_config=config).build(model_parts=[model])
    assert isinstance(optimizers, OptimizersContainer) and len(optimizers) == 1
    ours = optimizers.optimizers[0]
    assert type(ours) is type(get_megatron_optimizer(config, [routing_models.torchtitan_llama3()]))
    schedulers = LRSchedulersContainer.Config(warmup_steps=WARMUP).build(optimizers=optimizers, training_steps=STEPS)
    container_hook_calls = []  # torchtitan's MoE load balancing hooks the container's step
    optimizers.register_step_pre_hook(lambda *args: container_hook_calls.append(args))
    routing_models.synthetic_gradients(model, seed=1)
    optimizers.step()
    schedulers.step()
    assert len(container_hook_calls) == 1
    assert [g["lr"] for g in ours.param_groups] == pytest.approx([LR * linear_warmup_then_decay(1)] * len(ours.param_groups))
    # torchtitan's checkpoint form of ours, keyed by parameter name, loads into a fresh container.
    saved = optimizers.state_dict()
    names = [name for name, _ in model.named_parameters()]
    assert all(f"param_groups.{name}.lr" in saved and any(k.startswith(f"state.{name}.") for k in saved) for name in names)
    fresh = MegatronOptimizers.Config(optimizer_config=config).build(model_parts=[routing_models.torchtitan_llama3()])
    LRSchedulersContainer.Config(warmup_steps=WARMUP).build(optimizers=fresh, training_steps=STEPS)  # as the Trainer
    fresh.load_state_dict(saved)
    loaded = fresh.state_dict()
    assert loaded.keys() == saved.keys(), sorted(loaded.keys() ^ saved.keys())[:8]
    assert all(torch.equal(v, loaded[k]) if isinstance(v, torch.Tensor) else v == loaded[k] for k, v in saved.items())


@pytest.mark.parametrize("fields, named", [({}, "optimizer_config="), ({"param_groups": ["x"]}, "param_groups"),
                                           ({"implementation": "foreach"}, "implementation")])
def test_the_config_refuses_what_it_would_not_read(fields: dict, named: str) -> None:
    from megatron_eopt import OptimizerConfig
    from megatron_eopt.integrations.torchtitan import MegatronOptimizers
    from tests import routing_models

    if fields:
        fields = {"optimizer_config": OptimizerConfig(optimizer="muon"), **fields}
    with pytest.raises(ValueError, match=named):
        MegatronOptimizers.Config(**fields).build(model_parts=[routing_models.torchtitan_llama3()])
