"""The Hugging Face Trainer holds our optimizer as it holds torch's: `Trainer(model, args,
optimizers=(ours, None))` on a tiny Llama on CPU, one process, Muon for its hidden matrices and Adam
for the rest (both driven). What stays the Trainer's own is checked against what the Trainer is
documented to do, not against our code:
- its schedule (`lr_scheduler_type="cosine"` with warm-up: transformers' `get_scheduler`, a torch
  `LambdaLR`): every group's lr at every step equals the schedule's formula written out here, and the
  first step, at lr 0, leaves every parameter as it was (the lr reached the optimizers that step);
- its clipping (`max_grad_norm`): the gradients our optimizer steps have the clipped norm;
- its checkpoint (`optimizer.pt`, the scheduler, the rng): `resume_from_checkpoint` from step 3
  continues bitwise: parameters and optimizer state key by key, losses and lrs of steps 4-6.
"""

import math

import pytest
import torch

from megatron_eopt import OptimizerConfig, get_megatron_optimizer
from tests import routing_models

STEPS, SAVED_AT, WARMUP, LR, MAX_GRAD_NORM = 6, 3, 2, 2e-2, 0.05


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, samples: int = 16, length: int = 9) -> None:
        generator = torch.Generator().manual_seed(11)
        self.tokens = torch.randint(0, routing_models.VOCAB, (samples, length), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


def build_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    # clip_grad=0: the Trainer clips (max_grad_norm); ours would clip the clipped gradients again.
    config = OptimizerConfig(optimizer="muon", lr=LR, weight_decay=0.1, clip_grad=0.0,
                             muon_fp32_matmul_prec="highest")
    return get_megatron_optimizer(config, [model])


def cosine_with_warmup(step: int) -> float:
    """transformers' get_cosine_schedule_with_warmup (num_cycles 0.5), the factor at scheduler step `step`."""
    if step < WARMUP:
        return step / WARMUP
    progress = (step - WARMUP) / (STEPS - WARMUP)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


class StepRecorder:
    """Through the optimizer's own step hooks: each group's lr and the gradient norm our step sees,
    and the parameters after each step."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.lrs, self.grad_norms, self.params_after = model, [], [], []
        optimizer.register_step_pre_hook(self._before)
        optimizer.register_step_post_hook(self._after)

    def _before(self, optimizer, args, kwargs) -> None:
        self.lrs.append([group["lr"] for group in optimizer.param_groups])
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        self.grad_norms.append(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item())

    def _after(self, optimizer, args, kwargs) -> None:
        self.params_after.append({name: p.detach().clone() for name, p in self.model.named_parameters()})


def _train(output_dir: str, seed: int, resume_from: str | None = None) -> dict:
    from transformers import Trainer, TrainingArguments

    model = routing_models.llama(tied=False)
    if seed:  # a different start: the checkpoint must bring the saved weights back
        torch.manual_seed(seed)
        model.apply(model._init_weights)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = build_optimizer(model)
    base_lrs = [group["lr"] for group in optimizer.param_groups]
    recorder = StepRecorder(model, optimizer)
    args = TrainingArguments(output_dir=output_dir, max_steps=STEPS, per_device_train_batch_size=2,
                             lr_scheduler_type="cosine", warmup_steps=WARMUP, max_grad_norm=MAX_GRAD_NORM,
                             logging_steps=1, save_strategy="steps", save_steps=SAVED_AT, use_cpu=True,
                             report_to="none", disable_tqdm=True, seed=3)
    trainer = Trainer(model=model, args=args, train_dataset=RandomTokens(), optimizers=(optimizer, None))
    trainer.train(resume_from_checkpoint=resume_from)
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    return {"initial": initial, "base_lrs": base_lrs, "recorder": recorder, "logged": logged,
            "params": {name: p.detach().clone() for name, p in model.named_parameters()},
            "optimizer_state": optimizer.state_dict(), "scheduler": trainer.lr_scheduler}


def _flat(value, prefix: str = "") -> dict:
    """A nested state dict as {dotted key: leaf}."""
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _flat(item, f"{prefix}{key}.").items()}
    if isinstance(value, (list, tuple)):
        return {k: v for i, item in enumerate(value) for k, v in _flat(item, f"{prefix}{i}.").items()}
    return {prefix.rstrip("."): value}


def _assert_same(a, b, label: str) -> None:
    flat_a, flat_b = _flat(a), _flat(b)
    assert flat_a.keys() == flat_b.keys(), (label, sorted(flat_a.keys() ^ flat_b.keys()))
    for key, value in flat_a.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, flat_b[key]), (label, key)
        else:
            assert value == flat_b[key], (label, key, value, flat_b[key])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    directory = tmp_path_factory.mktemp("hf_trainer")
    whole = _train(str(directory / "whole"), seed=0)
    resumed = _train(str(directory / "resumed"), seed=7,
                     resume_from=str(directory / "whole" / f"checkpoint-{SAVED_AT}"))
    return {"whole": whole, "resumed": resumed}


def test_the_trainers_schedule_sets_every_group_and_reaches_the_step(runs) -> None:
    whole = runs["whole"]
    assert len(whole["recorder"].lrs) == STEPS
    for step, lrs in enumerate(whole["recorder"].lrs):
        expected = [base * cosine_with_warmup(step) for base in whole["base_lrs"]]
        assert lrs == pytest.approx(expected, rel=1e-12, abs=0.0), (step, lrs, expected)
    after_first, after_second = whole["recorder"].params_after[:2]
    for name, initial in whole["initial"].items():  # step 1 runs at lr 0: nothing moves
        assert torch.equal(after_first[name], initial), name
    moved = [name for name, initial in whole["initial"].items() if not torch.equal(after_second[name], initial)]
    assert moved == list(whole["initial"]), sorted(set(whole["initial"]) - set(moved))


def test_the_trainer_clips_the_gradients_our_step_sees(runs) -> None:
    whole = runs["whole"]
    for step, (entry, seen) in enumerate(zip(whole["logged"], whole["recorder"].grad_norms)):
        assert entry["grad_norm"] > MAX_GRAD_NORM, (step, entry)  # so the clipping acts
        assert seen == pytest.approx(MAX_GRAD_NORM, rel=1e-4), (step, seen, entry["grad_norm"])


def test_resume_from_checkpoint_continues_bitwise(runs) -> None:
    whole, resumed = runs["whole"], runs["resumed"]
    # The resumed log holds steps 1-3 from the checkpoint's trainer_state.json, then its own 4-6.
    logged = [[(e["step"], e["loss"], e["grad_norm"], e["learning_rate"]) for e in run["logged"]] for run in (whole, resumed)]
    assert logged[1] == logged[0] and len(logged[0]) == STEPS, logged
    assert resumed["recorder"].lrs == whole["recorder"].lrs[SAVED_AT:]
    _assert_same(resumed["params"], whole["params"], "parameters")
    _assert_same(resumed["optimizer_state"], whole["optimizer_state"], "optimizer state")
    assert resumed["scheduler"].last_epoch == whole["scheduler"].last_epoch == STEPS
