"""`make gpu-check` without a GPU: benchmarks/gpu_check.py in dry-run mode builds what every check
would run (models, optimizers, pretrain_gpt's flags through its own parser) and writes a JSON and
a Markdown table that mark each check skipped with the reason. Small sizes keep it fast."""

import importlib.util
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SMALL = ["--hidden", "64", "--layers", "1", "--heads", "4", "--groups", "2", "--reference-size", "16",
         "--seq-length", "16", "--micro-batch-size", "2"]


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dry_run_builds_everything_and_reports_every_check_skipped(tmp_path) -> None:
    gpu_check = load_gpu_check()
    gpu_check.main(["--dry-run", "--out", str(tmp_path), *SMALL])
    record = json.loads((tmp_path / "gpu_check.json").read_text())
    table = (tmp_path / "gpu_check.md").read_text()
    reason = gpu_check.cuda_skip_reason(dry_run=True)
    assert record["dry_run"] and record["skip_reason"] == reason
    names = [row["check"] for row in record["checks"]]
    assert len(names) == 5 and any("GPU-tier tests" in n for n in names)
    assert any("bf16 ('medium')" in n for n in names) and any("fp32 ('highest')" in n for n in names)
    for row in record["checks"]:
        assert row["status"] == "skipped" and row["reason"] == reason, row
        assert f"| {row['check']} | skipped: {reason} |" in table
    steps = next(row for row in record["checks"] if row["check"].startswith("Muon step"))
    assert steps["matrix_parameters"] > 0 and steps["built_on"] == "cpu"  # the optimizers were built
    pretrain = next(row for row in record["checks"] if row["check"].startswith("pretrain_gpt"))
    assert "--use-distributed-optimizer" in pretrain["flags"]["muon_layer_wise"]


def test_bad_size_is_a_clear_error(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        load_gpu_check().main(["--dry-run", "--hidden", "0"])
    assert exit_info.value.code == 2
    assert "--hidden must be >= 1; got 0" in capsys.readouterr().err
