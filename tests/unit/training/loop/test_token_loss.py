"""--eod-mask-loss and --calculate-per-token-loss (megatron_eopt/training/loop/token_loss.py).

References: the gradient of the loss written out from megatron's per-token losses (the model's
own forward with labels) and the end-of-document mask, by autograd, at one process and at DP 2
(where the reference sees both ranks' micro-batches); the trainer's runs at DP 2 and PP 2 against
one process.
"""

import pytest

EOD = 5


def _micro_batches(rank: int, count: int = 2):
    """Micro-batches of 2 x (16 + 1) tokens with end-of-document tokens at rank-dependent places,
    so the micro-batches' counted tokens differ."""
    import torch

    batches = []
    for i in range(count):
        tokens = torch.randint(6, 64, (2, 17), generator=torch.Generator().manual_seed(100 * rank + i))
        tokens[0, 3 + 2 * i + rank] = EOD
        tokens[1, 1: 4 + 3 * i + rank] = EOD  # a run of them: many masked labels
        batches.append(tokens)
    return batches


def _reference_loss(model, micro_batches, per_token: bool, mask: bool):
    """Megatron-LM's loss for the step, written out: per micro-batch the masked mean, averaged;
    or the masked sum over all micro-batches over their count."""
    import torch

    sums, counts = [], []
    for tokens in micro_batches:
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        positions = torch.arange(inputs.size(1)).expand_as(inputs)
        losses = model(input_ids=inputs, position_ids=positions, attention_mask=None, labels=labels).float()
        keep = (labels != EOD).float() if mask else torch.ones_like(losses)
        sums.append((losses * keep).sum())
        counts.append(keep.sum())
    if per_token:
        return torch.stack(sums).sum() / torch.stack(counts).sum()
    return torch.stack([s / c for s, c in zip(sums, counts)]).mean()


def _gradients_against_reference(rank: int, world_size: int) -> list[dict]:
    """For each rule: SingleStage's gradients (averaged over DP, as the trainer does) and the
    reference loss's, on the same model."""
    import torch
    import torch.distributed as dist

    from megatron_eopt.training.model.gpt import GPTModelSettings, build_gpt_model, destroy_model_parallel, initialize_model_parallel
    from megatron_eopt.training.parallel.pipeline import SingleStage
    from megatron_eopt.training.loop.token_loss import TokenLoss

    initialize_model_parallel(1, 1234)
    results = []
    try:
        model = build_gpt_model(GPTModelSettings(seq_length=16, vocab_size=64))
        params = [p for p in model.parameters() if p.requires_grad]
        mine = _micro_batches(rank)
        everyone = [batch for r in range(world_size) for batch in _micro_batches(r)]
        for per_token, mask in ((False, True), (True, True), (True, False)):
            model.zero_grad()
            token_loss = TokenLoss(EOD if mask else None, per_token=per_token, dp_group=dist.group.WORLD)
            logged = SingleStage(model, token_loss).forward_backward(mine, lambda loss: loss)
            grads = [p.grad.clone() for p in params]
            for grad in grads:
                dist.all_reduce(grad)
                grad /= world_size
            dist.all_reduce(logged)
            if per_token:  # the DP average of every rank's micro-batches is the global per-token loss
                reference = _reference_loss(model, everyone, per_token, mask)
            else:  # each rank's step follows its own micro-batches; DP averages the gradients
                reference = sum(_reference_loss(model, _micro_batches(r), per_token, mask)
                                for r in range(world_size)) / world_size
            expected = torch.autograd.grad(reference, params)
            results.append({"rule": (per_token, mask), "logged": float(logged) / world_size,
                            "reference": float(reference),
                            "grad_diff": max(float((g - e).abs().max()) for g, e in zip(grads, expected))})
    finally:
        destroy_model_parallel()
    return results


@pytest.mark.parametrize("world_size", [1, 2], ids=["one-process", "dp2"])
def test_gradients_follow_megatron_lms_loss(run_distributed, world_size: int) -> None:
    """fp32, tolerance 1e-6 on the logged loss and every gradient element."""
    for results in run_distributed(_gradients_against_reference, world_size):
        for result in results:
            assert abs(result["logged"] - result["reference"]) <= 1e-6, result
            assert result["grad_diff"] <= 1e-6, result


def test_per_token_rule_differs_from_the_mean_of_means_when_masked(run_distributed) -> None:
    """The test above could not tell the rules apart if the masks gave equal counts."""
    (results,) = run_distributed(_gradients_against_reference, 1)
    by_rule = {r["rule"]: r["reference"] for r in results}
    assert abs(by_rule[(False, True)] - by_rule[(True, True)]) > 1e-4, by_rule


MOCK = ["--optimizer", "adam", "--lr", "1e-3", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--train-iters", "3", "--log-interval", "1", "--mock-data", "--eval-iters", "1", "--eval-interval", "3",
        "--log-params-norm"]


def test_masked_per_token_runs_equal_across_layouts(run_distributed) -> None:
    """megatron-core's MockGPTDataset puts end-of-document tokens in its samples: with the mask the
    losses and validation change, and DP 2 and PP 2 give the one-process run's losses and
    validation losses (1e-5; evaluation counts the same tokens through the pipeline)."""
    from tests.unit.training.parallel.test_pretrain_gpt_pipeline import run_training

    masked = MOCK + ["--eod-mask-loss", "--calculate-per-token-loss"]
    (plain,) = run_distributed(run_training, 1, args=(MOCK,))
    (single,) = run_distributed(run_training, 1, args=(masked,))
    assert abs(plain["loss"][0] - single["loss"][0]) > 1e-4 and len(single["validation"]) == 3, (plain, single)
    assert abs(plain["validation"][0] - single["validation"][0]) > 1e-4, (plain, single)
    for layout in ([], ["--pipeline-model-parallel-size", "2"]):  # DP 2, PP 2
        other = run_distributed(run_training, 2, args=(masked + layout,))[0]
        for curve in ("loss", "validation", "params_norm"):
            assert other[curve] == pytest.approx(single[curve], rel=1e-5), (layout, curve)


@pytest.mark.parametrize("argv,message", [
    (["--eod-mask-loss"], "--eod-mask-loss needs --data-path or --mock-data"),
    (["--calculate-per-token-loss", "--num-experts", "2", "--disable-bias-linear"],
     "--calculate-per-token-loss with --num-experts is not offered"),
], ids=["eod-without-data", "per-token-moe"])
def test_bad_loss_flags_exit_with_one_line(argv: list[str], message: str, monkeypatch, capsys) -> None:
    from megatron_eopt.training.arguments.parser import parse_args

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit):
        parse_args(["--optimizer", "adam", "--lr", "1e-3"] + argv)
    lines = [line for line in capsys.readouterr().err.splitlines() if "CUDA runtime" not in line]
    assert len(lines) == 1 and message in lines[0], lines
