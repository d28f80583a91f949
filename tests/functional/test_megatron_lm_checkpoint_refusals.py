"""Every checkpoint refusal of ours in Megatron-LM's loop comes before any work (issue 83.3).

Before, `--optimizer muon_hyperball` with Megatron-LM's default `--ckpt-format torch_dist` trained
to its first `--save-interval` and ended there on every rank (its per-weight radius has no place in
megatron-core's sharded format): the training was lost. Each row of
megatron_eopt/integrations/megatron_lm_checkpoints.py's CHECKPOINT_REFUSALS runs here in the loop
(2 gloo ranks, tests/megatron_lm_in_process.py) with `--save` and `--save-interval 1`: status 2
on every rank, one `error:` line on rank 0 that names the refused flags, and no iteration before
it (what the loop handed its logger). A row refused only with `--save`/`--load` also trains
without them. docs/megatron-lm.md lists exactly the table's rows.
"""

import pathlib
import re
import shlex

import pytest

from megatron_eopt.integrations.megatron_lm_checkpoints import CHECKPOINT_REFUSALS
from tests.functional.test_megatron_lm_loop import MODEL
from tests.megatron_lm_in_process import run_megatron_lm_ended

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "megatron-lm.md"
LIST = re.compile(r"<!-- checkpoint refusals: begin -->\n(.*?)<!-- checkpoint refusals: end -->", re.S)
TWO_ITERATIONS = ["--train-iters", "2", "--save-interval", "1"]


def test_the_docs_list_is_the_table() -> None:
    found = LIST.search(DOC.read_text())
    assert found, f"{DOC.name}: no `<!-- checkpoint refusals: begin -->` ... `end -->` list"
    listed = re.findall(r"^- `([^`]+)`", found.group(1), re.M)
    assert sorted(listed) == sorted(row.example for row in CHECKPOINT_REFUSALS), listed


def test_each_refusal_comes_before_the_first_iteration(run_distributed, tmp_path) -> None:
    refused = [MODEL + shlex.split(row.example) + TWO_ITERATIONS + ["--save", str(tmp_path / f"row{i}")]
               for i, row in enumerate(CHECKPOINT_REFUSALS)]
    trained = [MODEL + shlex.split(row.example) + TWO_ITERATIONS for row in CHECKPOINT_REFUSALS if not row.always]
    per_rank = run_distributed(run_megatron_lm_ended, 2, args=(refused + trained,), timeout=600)
    for rank, ended in enumerate(per_rank):
        for row, run in zip(CHECKPOINT_REFUSALS, ended):
            assert run.status == 2 and run.iterations == [], (row.example, rank, run.status, run.iterations,
                                                              run.stderr[-2000:])
            errors = [line for line in run.stderr.splitlines() if "error" in line.lower() or "Traceback" in line]
            if rank == 0:
                assert len(errors) == 1 and errors[0].startswith("pretrain_gpt_megatron_lm.py: error: "), errors
                refused_flag = shlex.split(row.example)[:2]
                assert " ".join(refused_flag) in errors[0] or all(flag in errors[0] for flag in refused_flag), errors
            else:
                assert errors == [], errors
        for row, run in zip([row for row in CHECKPOINT_REFUSALS if not row.always], ended[len(refused):]):
            assert run.status == 0 and run.iterations == [1, 2], (row.example, rank, run.stderr[-2000:])
