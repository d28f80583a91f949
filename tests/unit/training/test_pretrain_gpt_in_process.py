"""scripts/pretrain_gpt.py's `main` run in the harness's workers (tests/pretrain_gpt_in_process.py):
it uses the process group it finds and leaves it usable, so one world runs several command lines.
Compared with itself across layouts: TP=2, DP=2 (layer-wise Muon), TP=2 x DP=2 (Adam) and DP=2
(Muon, gradients all-reduced by the script) equal one process, to 1e-5 relative."""

import pytest

from tests.pretrain_gpt_in_process import run_pretrain_gpt

ARGV = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "5", "--lr", "1e-2",
        "--log-interval", "1", "--eval-iters", "0", "--optimizer", "muon", "--use-distributed-optimizer",
        "--muon-fp32-matmul-prec", "highest"]


def test_main_reuses_the_callers_process_group(run_distributed):
    single = run_distributed(run_pretrain_gpt, 1, args=(ARGV,))[0]
    tensor_parallel = run_distributed(run_pretrain_gpt, 2, args=(ARGV + ["--tensor-model-parallel-size", "2"],))
    data_parallel = run_distributed(run_pretrain_gpt, 2, args=(ARGV,))  # the same world, reused
    losses = [r["loss"] for r in single]
    assert len(losses) == 5 and losses[-1] < losses[0]
    for records in (*tensor_parallel, *data_parallel):
        assert [r["loss"] for r in records] == pytest.approx(losses, rel=1e-5)


@pytest.mark.parametrize("optimizer,world_size,flags", [
    ("adam", 4, ["--tensor-model-parallel-size", "2"]),
    # Without the distributed optimizer: the script all-reduces the gradients (grad_reduction.py)
    # and every DP rank steps every parameter.
    ("muon", 2, []),
])
def test_more_layouts_equal_one_process(optimizer: str, world_size: int, flags: list[str], run_distributed):
    argv = [a for a in ARGV if a != "--use-distributed-optimizer"]
    argv[argv.index("--optimizer") + 1] = optimizer
    reference = [r["loss"] for r in run_distributed(run_pretrain_gpt, 1, args=(argv,))[0]]
    assert reference[-1] < reference[0]
    for records in run_distributed(run_pretrain_gpt, world_size, args=(argv + flags,)):
        assert [r["loss"] for r in records] == pytest.approx(reference, rel=1e-5)


def test_precision_aware_flags_train(run_distributed):
    """Megatron-LM's DeepSeek-V3-style flags: bf16 parameters with remainders and bf16 Adam moments
    train (the loss falls), and differ from the same run with fp32 moments."""
    argv = [a for a in ARGV if a != "--use-distributed-optimizer"]
    argv[argv.index("--optimizer") + 1] = "adam"
    argv += ["--bf16", "--use-precision-aware-optimizer"]
    fp32_state = [r["loss"] for r in run_distributed(run_pretrain_gpt, 1, args=(argv,))[0]]
    bf16_state = [r["loss"] for r in run_distributed(
        run_pretrain_gpt, 1, args=(argv + ["--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"],))[0]]
    assert len(bf16_state) == 5 and bf16_state[-1] < bf16_state[0]
    assert bf16_state != fp32_state
    assert bf16_state == pytest.approx(fp32_state, rel=5e-2)
