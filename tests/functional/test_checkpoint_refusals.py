"""Every checkpoint refusal of ours comes before any work (issue 83.3), in both loops.

Before, `--optimizer muon_hyperball` with Megatron-LM's default `--ckpt-format torch_dist`, normuon
on TP x Megatron-FSDP, and normuon on our trainer's sharded engines trained to the first
`--save-interval` and ended there on every rank: the training was lost. Each row of
megatron_eopt/checkpointing/refusals.py's CHECKPOINT_REFUSALS runs in its loop (2 gloo ranks:
Megatron-LM's, tests/megatron_lm_in_process.py; our trainer's, tests/pretrain_gpt_in_process.py)
with `--save` and `--save-interval 1`: status 2 on every rank, one `error:` line on rank 0 that
names the refused flag, and no iteration before it (Megatron-LM's: what its loop handed its
logger; ours: no iteration line, which rank 0 prints). A row refused only with `--save`/`--load` trains
without them (slow tier). docs/megatron-lm.md and docs/trainer.md list exactly the table's rows.
"""

import pathlib
import re
import shlex

import pytest

from megatron_eopt.checkpointing.refusals import CHECKPOINT_REFUSALS
from tests.functional.test_megatron_lm_loop import MODEL
from tests.functional.test_pretrain_gpt import MODEL_FLAGS
from tests.megatron_lm_in_process import run_megatron_lm_ended
from tests.pretrain_gpt_in_process import run_pretrain_gpt_many
from tests.refusals import assert_one_error_line

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"
LIST = re.compile(r"<!-- checkpoint refusals: begin -->\n(.*?)<!-- checkpoint refusals: end -->", re.S)
LOOPS = {"megatron_lm": ("megatron-lm.md", "pretrain_gpt_megatron_lm.py"), "trainer": ("trainer.md", "pretrain_gpt.py")}
TWO_ITERATIONS = {"megatron_lm": MODEL + ["--train-iters", "2"],
                  "trainer": MODEL_FLAGS + ["--train-iters", "2", "--lr-warmup-iters", "0"]}


def _rows(loop: str) -> list:
    return [row for row in CHECKPOINT_REFUSALS if row.loop == loop]


@pytest.mark.parametrize("loop", LOOPS)
def test_the_docs_list_is_the_table(loop: str) -> None:
    doc = DOCS / LOOPS[loop][0]
    found = LIST.search(doc.read_text())
    assert found, f"{doc.name}: no `<!-- checkpoint refusals: begin -->` ... `end -->` list"
    listed = [" ".join(example.split()) for example in re.findall(r"^- `([^`]+)`", found.group(1), re.M)]
    assert sorted(listed) == sorted(row.example for row in _rows(loop)), listed


def _ended(run_distributed, loop: str, argvs: list[list[str]]) -> list[list[tuple[int, str, list]]]:
    """Per rank, per command line: (exit status, stderr, the iterations that ran)."""
    if loop == "megatron_lm":
        per_rank = run_distributed(run_megatron_lm_ended, 2, args=(argvs,), timeout=600)
        return [[(run.status, run.stderr, run.iterations) for run in runs] for runs in per_rank]
    per_rank = run_distributed(run_pretrain_gpt_many, 2, args=(argvs,), timeout=600)
    return [[(run.returncode, run.stderr, re.findall(r"\biteration +(\d+)/", run.stdout)) for run in runs]
            for runs in per_rank]


@pytest.mark.parametrize("loop", LOOPS)
def test_each_refusal_comes_before_the_first_iteration(run_distributed, tmp_path, loop: str) -> None:
    rows = _rows(loop)
    argvs = [TWO_ITERATIONS[loop] + shlex.split(row.example) + ["--save", str(tmp_path / f"row{i}"),
                                                                 "--save-interval", "1"] for i, row in enumerate(rows)]
    for rank, ended in enumerate(_ended(run_distributed, loop, argvs)):
        for row, (status, stderr, iterations) in zip(rows, ended):
            assert status == 2 and not iterations, (row.example, rank, status, iterations, stderr[-2000:])
            # the line names the refused flag
            assert_one_error_line(stderr, rank, LOOPS[loop][1], shlex.split(row.example)[0], row.example)


@pytest.mark.slow
@pytest.mark.parametrize("loop", LOOPS)
def test_without_save_or_load_the_rows_train(run_distributed, loop: str) -> None:
    """Every row trains without --save and --load: the refusal is about checkpoints."""
    rows = _rows(loop)
    argvs = [TWO_ITERATIONS[loop] + shlex.split(row.example) for row in rows]
    for rank, ended in enumerate(_ended(run_distributed, loop, argvs)):
        for row, (status, stderr, iterations) in zip(rows, ended):
            assert status == 0, (row.example, rank, stderr[-2000:])
            assert rank > 0 or [int(i) for i in iterations] == [1, 2], (row.example, iterations)  # rank 0 logs


# The guard over the matrix: every optimizer on each engine and checkpoint format of Megatron-LM's
# loop, saving at iteration 1. Each either trains and saves or is refused before its first
# iteration; none fails after one (as muon_hyperball's torch_dist save did before its row).
ENGINES = {
    "DDP, torch_dist": [],
    "DDP, torch": ["--ckpt-format", "torch"],
    "distributed optimizer, torch_dist": ["--use-distributed-optimizer"],
    "torch FSDP2, torch_dcp": ["--use-torch-fsdp2", "--untie-embeddings-and-output-weights",
                               "--ckpt-format", "torch_dcp"],
    "Megatron-FSDP, fsdp_dtensor": ["--use-megatron-fsdp", "--untie-embeddings-and-output-weights",
                                    "--ckpt-format", "fsdp_dtensor"],
}
RUNS_PER_CALL = 6  # the workers' thread budget: a sharded engine's groups go at the end of a call


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
def test_no_save_fails_after_an_iteration(run_distributed, tmp_path, engine: str) -> None:
    from megatron_eopt.registry import list_optimizers

    names = list_optimizers()
    argvs = [TWO_ITERATIONS["megatron_lm"] + ENGINES[engine] + ["--optimizer", name, "--save", str(tmp_path / name),
                                                                "--save-interval", "1", "--exit-interval", "1"]
             for name in names]
    ended = []
    for start in range(0, len(argvs), RUNS_PER_CALL):
        ended += run_distributed(run_megatron_lm_ended, 2, args=(argvs[start:start + RUNS_PER_CALL],), timeout=600)[0]
    after_an_iteration = {name: run.stderr.strip().splitlines()[-1:] for name, run in zip(names, ended)
                          if run.status != 0 and run.iterations}
    assert not after_an_iteration, after_an_iteration
    assert all(run.iterations == [1] for run in ended if run.status == 0)
