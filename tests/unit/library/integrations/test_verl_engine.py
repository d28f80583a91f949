"""verl 0.9.1's FSDP engine holds our optimizer as it holds torch's (docs/engines.md, "verl"):
`FSDPEngineWithLMHead` with only `_build_optimizer` overridden to return ours (Muon for the hidden
matrices, Adam for the rest), FSDP2 on 2 gloo ranks, a tiny Qwen3, verl's SFT loss, and everything
else verl's own:
- its lr scheduler (`_build_lr_scheduler`: cosine with warm-up, a torch LambdaLR over our
  param_groups): every inner group's lr is the one verl's scheduler set, and the first step, at
  warm-up's lr 0, leaves every parameter as it was (the lr reached both inner optimizers);
- its clipping (`fsdp2_clip_grad_norm_` on the model's parameters; ours is set not to clip);
- `optimizer_offload=True`: verl's `offload_fsdp_optimizer` / `load_fsdp_optimizer` walk
  `optimizer.state[p]` for every p in `param_groups` around each step. The walk must reach every tensor
  the inner optimizers keep: run once more with a dtype in the device's place (`.to(torch.float64)`,
  visible on CPU), every inner state tensor, Muon's momentum included, comes out float64;
- `save_checkpoint` / `load_checkpoint` (its FSDPCheckpointManager: `torch.save(optimizer.state_dict())`
  per rank, the scheduler, the rng): an engine built afresh that loads the checkpoint of step 2
  continues bitwise like the run that was never interrupted (parameters and optimizer state key by key).
The reference is the engine's own uninterrupted run; a resumed run that lost any state differs from it.
"""

import tempfile

import torch

from tests import rl_engines_on_cpu

STEPS, SAVED_AT, WARMUP, LR = 4, 2, 1, 1e-2


def _engine(model_path: str, checkpoint_config=None):
    from megatron_eopt import OptimizerConfig, get_megatron_optimizer
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    class MuonEngine(FSDPEngineWithLMHead):
        def _build_optimizer(self, module):
            # clip_grad=0: verl clips (optimizer_config.clip_grad); ours would clip the clipped gradients again.
            config = OptimizerConfig(optimizer="muon", lr=self.optimizer_config.lr, weight_decay=0.1, clip_grad=0.0,
                                     muon_fp32_matmul_prec="highest")
            return get_megatron_optimizer(config, [module])

    model = HFModelConfig(path=model_path, load_tokenizer=False, use_remove_padding=False,
                          enable_gradient_checkpointing=False, override_config={"attn_implementation": "sdpa"})
    fp32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    engine_config = FSDPEngineConfig(strategy="fsdp2", forward_only=False, optimizer_offload=True,
                                     use_torch_compile=False, mixed_precision=fp32)
    optimizer_config = FSDPOptimizerConfig(lr=LR, clip_grad=0.5, total_training_steps=STEPS, lr_warmup_steps=WARMUP,
                                           lr_scheduler_type="cosine")
    engine = MuonEngine(model, engine_config, optimizer_config, checkpoint_config or CheckpointConfig())
    engine.initialize()
    return engine


def _train(engine, steps, rank: int) -> list[dict]:
    from functools import partial

    from verl.workers.utils.losses import sft_loss

    seen = []
    for step in steps:
        params_before = rl_engines_on_cpu.plain(dict(engine.module.named_parameters()))
        with engine.train_mode():
            output = engine.train_batch(rl_engines_on_cpu.verl_sft_batch(rank, step), loss_function=partial(sft_loss, config=None))
        inner_lrs = [g["lr"] for child in engine.optimizer.chained_optimizers for g in child.param_groups]
        params_after = rl_engines_on_cpu.plain(dict(engine.module.named_parameters()))
        seen.append({"inner_lrs": inner_lrs, "grad_norm": output["metrics"]["grad_norm"], "params": len(params_after),
                     "moved": len(rl_engines_on_cpu.differences(params_before, params_after))})
        engine.lr_scheduler_step()
    return seen


def _body(rank: int, world_size: int, model_path: str, checkpoint_dir: str) -> dict:
    rl_engines_on_cpu.use_verl_cpu_platform()
    engine = _engine(model_path)
    assert isinstance(engine.optimizer, torch.optim.Optimizer)
    scheduler = engine.lr_scheduler
    factors = [scheduler.lr_lambdas[0](step) for step in range(STEPS)]  # verl's cosine with warm-up
    steps = _train(engine, range(SAVED_AT), rank)
    engine.save_checkpoint(checkpoint_dir, global_step=SAVED_AT)
    steps += _train(engine, range(SAVED_AT, STEPS), rank)
    uninterrupted = rl_engines_on_cpu.snapshot(engine.module, engine.optimizer)

    from verl.utils.fsdp_utils import load_fsdp_optimizer

    load_fsdp_optimizer(engine.optimizer, torch.float64)  # verl's walk, a dtype in the device's place
    walked = {name: tensor.dtype for name, tensor in rl_engines_on_cpu.inner_state_tensors(engine.optimizer).items()}

    resumed = _engine(model_path)
    resumed.load_checkpoint(checkpoint_dir)
    _train(resumed, range(SAVED_AT, STEPS), rank)
    return {"steps": steps, "factors": factors, "walked": walked,
            "resume_differences": rl_engines_on_cpu.differences(
                uninterrupted, rl_engines_on_cpu.snapshot(resumed.module, resumed.optimizer))}


def test_verl_fsdp_engine_with_our_optimizer_schedules_offloads_and_resumes_bitwise(run_distributed) -> None:
    with tempfile.TemporaryDirectory() as directory:
        model_path = rl_engines_on_cpu.save_tiny_qwen3(f"{directory}/model")
        results = run_distributed(_body, 2, args=(model_path, f"{directory}/checkpoint"), timeout=600)
    for rank, result in enumerate(results):
        steps, factors = result["steps"], result["factors"]
        assert factors[0] == 0.0 and len(set(factors)) > 2  # warm-up from 0, then the cosine moves the lr
        for step, seen in enumerate(steps):
            assert seen["inner_lrs"] == [LR * factors[step]] * len(seen["inner_lrs"]), (rank, step, seen)
        assert steps[0]["moved"] == 0, "at lr 0 a parameter moved: the lr did not reach the inner optimizers"
        assert steps[1]["moved"] == steps[1]["params"], steps[1]  # then every parameter moves
        assert any("momentum_buffer" in name for name in result["walked"]), result["walked"]
        assert {dtype for dtype in result["walked"].values()} == {torch.float64}, result["walked"]
        assert result["resume_differences"] == [], (rank, result["resume_differences"])
