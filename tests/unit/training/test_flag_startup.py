"""--help and flag errors come before torch and megatron-core are imported, in one line."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# Runs pretrain_gpt.py's entry in a fresh interpreter and reports, after it exits, its status
# and which heavy modules it imported.
PROBE = """
import json, runpy, sys
sys.argv = ["pretrain_gpt.py", *json.loads(sys.argv[1])]
try:
    runpy.run_path("scripts/pretrain_gpt.py", run_name="__main__")
    code = 0
except SystemExit as exit:
    code = exit.code
heavy = sorted(name for name in ("torch", "megatron.core", "transformer_engine") if name in sys.modules)
sys.__stdout__.write("\\nPROBE " + json.dumps({"code": code, "heavy": heavy}) + "\\n")
"""


def _probe(argv: list[str]) -> tuple[dict, str, str]:
    result = subprocess.run([sys.executable, "-c", PROBE, json.dumps(argv)], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, env={**os.environ, "RANK": "0", "WORLD_SIZE": "1"})
    report = json.loads(result.stdout.rsplit("PROBE ", 1)[1])
    return report, result.stdout.rsplit("PROBE ", 1)[0], result.stderr


def test_help_imports_neither_torch_nor_megatron_core() -> None:
    report, stdout, _ = _probe(["--help"])
    assert report == {"code": 0, "heavy": []}
    assert "--num-experts" in stdout and "--optimizer" in stdout and "--no-rope-fusion" in stdout


@pytest.mark.parametrize("argv,message", [
    (["--lr", "abc"], "pretrain_gpt.py: error: argument --lr: invalid float value: 'abc'; see pretrain_gpt.py --help."),
    (["--lrr", "1"], "pretrain_gpt.py: error: unrecognized arguments: --lrr 1 (did you mean --lr?); see "
                     "pretrain_gpt.py --help."),
    (["--muon-tp-mode", "dup"], "pretrain_gpt.py: error: argument --muon-tp-mode: invalid choice: 'dup' (choose from "
                                "'blockwise', 'duplicated', 'distributed', 'sharded'); did you mean duplicated?; see "
                                "pretrain_gpt.py --help."),
    (["--normalization", "rmsnorm"], "did you mean RMSNorm?"),
], ids=["bad-type", "unknown-flag", "bad-choice", "close-choice"])
def test_flag_errors_are_one_line_without_torch(argv, message) -> None:
    report, stdout, stderr = _probe(argv)
    assert report == {"code": 2, "heavy": []}
    assert stdout.strip() == "" and len(stderr.strip().splitlines()) == 1, stderr
    assert message in stderr
