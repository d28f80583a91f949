"""AReaL 1.0.4's FSDP engine holds our optimizer as it holds torch's (docs/engines.md, "AReaL"):
`areal.engine.fsdp_engine.FSDPEngine` with `_create_optimizer` overridden to build ours (Muon for the
hidden matrices, Adam for the rest) and AReaL's own cosine schedule over it, FSDP2 on 2 gloo ranks
(`backend="fsdp:d2"`, AReaL's CPU platform), a tiny Qwen3, an SFT loss, and everything else AReaL's own:
- its schedule: every inner group's lr is the one AReaL's LambdaLR set, and the first step, at
  warm-up's lr 0, leaves every parameter as it was (the lr reached both inner optimizers);
- its clipping (`fsdp2_clip_grad_norm` on the model's parameters; ours is set not to clip);
- its `dcp` save and load with the optimizer (torch's `get_state_dict`/`set_state_dict` on the model
  and ours, then `dcp.save`/`dcp.load`): an engine built afresh that loads the checkpoint of step 2
  continues bitwise like the run that was never interrupted (parameters and optimizer state key by
  key). AReaL's recover checkpoint holds no scheduler (with torch's AdamW too): the test hands the
  scheduler's state over as a trainer that keeps it would.
The reference is the engine's own uninterrupted run.
"""

import tempfile

import torch

from tests import rl_engines_on_cpu

STEPS, SAVED_AT, LR = 4, 2, 1e-2
TRAIN_BATCH, DATASET = 4, 4 * STEPS  # AReaL's FinetuneSpec: STEPS optimizer steps, a quarter of them warm-up


def _engine(model_path: str):
    from areal.api.cli_args import OptimizerConfig as ArealOptimizerConfig
    from areal.api.cli_args import TrainEngineConfig
    from areal.api.io_struct import FinetuneSpec
    from areal.engine.fsdp_engine import FSDPEngine
    from areal.engine.fsdp_utils import get_cosine_schedule_with_warmup

    from megatron_eopt import OptimizerConfig, get_megatron_optimizer

    class MuonEngine(FSDPEngine):
        def _create_optimizer(self, ft_spec: FinetuneSpec) -> None:
            settings = self.optimizer_config
            # clip_grad=0: AReaL clips (gradient_clipping); ours would clip the clipped gradients again.
            config = OptimizerConfig(optimizer="muon", lr=settings.lr, weight_decay=settings.weight_decay,
                                     clip_grad=0.0, muon_fp32_matmul_prec="highest")
            self.optimizer = get_megatron_optimizer(config, [self.model])
            total = ft_spec.total_train_steps
            self.lr_scheduler = get_cosine_schedule_with_warmup(
                self.optimizer, int(settings.warmup_steps_proportion * total), total,
                min_lr_ratio=settings.min_lr_ratio)

    optimizer = ArealOptimizerConfig(lr=LR, weight_decay=0.1, gradient_clipping=0.5, warmup_steps_proportion=0.25,
                                     lr_scheduler_type="cosine")
    config = TrainEngineConfig(experiment_name="test", trial_name="muon", path=model_path, backend="fsdp:d2",
                               attn_impl="sdpa", init_from_scratch=True, dtype="float32", optimizer=optimizer)
    engine = MuonEngine(config)
    engine.create_process_group()
    engine.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=DATASET, train_batch_size=TRAIN_BATCH))
    return engine


def _train(engine, steps, rank: int) -> list[dict]:
    seen = []
    for step in steps:
        before = rl_engines_on_cpu.plain(dict(engine.model.named_parameters()))
        engine.train()
        stats = engine.train_batch(rl_engines_on_cpu.areal_sft_batch(rank, step), loss_fn=rl_engines_on_cpu.areal_sft_loss,
                                   loss_weight_fn=lambda batch: batch["loss_mask"].count_nonzero())
        after = rl_engines_on_cpu.plain(dict(engine.model.named_parameters()))
        seen.append({"inner_lrs": [g["lr"] for c in engine.optimizer.chained_optimizers for g in c.param_groups],
                     "reported_lr": stats["lr"], "params": len(after),
                     "moved": len(rl_engines_on_cpu.differences(before, after))})
        engine.lr_scheduler_step()
    return seen


def _body(rank: int, world_size: int, model_path: str, checkpoint_dir: str) -> dict:
    from areal.api.io_struct import SaveLoadMeta

    engine = _engine(model_path)
    assert isinstance(engine.optimizer, torch.optim.Optimizer)
    factors = [engine.lr_scheduler.lr_lambdas[0](step) for step in range(STEPS)]  # AReaL's cosine with warm-up
    steps = _train(engine, range(SAVED_AT), rank)
    engine.save(SaveLoadMeta(path=checkpoint_dir, weight_format="dcp", with_optim=True))
    scheduler_state = engine.lr_scheduler.state_dict()
    steps += _train(engine, range(SAVED_AT, STEPS), rank)
    uninterrupted = rl_engines_on_cpu.snapshot(engine.model, engine.optimizer)
    engine.destroy()

    resumed = _engine(model_path)
    resumed.load(SaveLoadMeta(path=checkpoint_dir, weight_format="dcp", with_optim=True))
    resumed.lr_scheduler.load_state_dict(scheduler_state)
    _train(resumed, range(SAVED_AT, STEPS), rank)
    differences = rl_engines_on_cpu.differences(uninterrupted,
                                                rl_engines_on_cpu.snapshot(resumed.model, resumed.optimizer))
    resumed.destroy()
    return {"steps": steps, "factors": factors, "resume_differences": differences}


def test_areal_fsdp_engine_with_our_optimizer_schedules_and_resumes_from_dcp_bitwise(run_distributed) -> None:
    with tempfile.TemporaryDirectory() as directory:
        model_path = rl_engines_on_cpu.save_tiny_qwen3(f"{directory}/model")
        # AReaL's engine makes process groups of its own (its CPU group, its device mesh's) and leaves
        # them to whoever made the default group: the world is replaced afterwards.
        results = run_distributed(_body, 2, args=(model_path, f"{directory}/checkpoint"), timeout=600,
                                  leaves_groups=True)
    for rank, result in enumerate(results):
        steps, factors = result["steps"], result["factors"]
        assert factors[0] == 0.0 and len(set(factors)) > 2  # warm-up from 0, then the cosine moves the lr
        for step, seen in enumerate(steps):
            assert seen["inner_lrs"] == [LR * factors[step]] * len(seen["inner_lrs"]), (rank, step, seen)
            assert seen["reported_lr"] == LR * factors[step]
        assert steps[0]["moved"] == 0, "at lr 0 a parameter moved: the lr did not reach the inner optimizers"
        assert steps[1]["moved"] == steps[1]["params"], steps[1]  # then every parameter moves
        assert result["resume_differences"] == [], (rank, result["resume_differences"])
