"""`make gpu-check` without a GPU: benchmarks/gpu_check.py in dry-run mode builds what every check
would run (models, optimizers, pretrain_gpt's flags through its own parser) and writes a JSON and
a Markdown table that mark each check skipped with the reason. Small sizes keep it fast."""

import importlib.util
import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SMALL = ["--hidden", "64", "--layers", "1", "--heads", "4", "--groups", "2", "--reference-size", "16",
         "--seq-length", "16", "--micro-batch-size", "2"]


def load_gpu_check():
    if str(ROOT / "benchmarks") not in sys.path:  # its sibling modules, as when it runs as a script
        sys.path.insert(0, str(ROOT / "benchmarks"))
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
    assert len(names) == 11 and any("GPU-tier tests" in n for n in names)
    assert sum("--optimizer-cpu-offload" in n for n in names) == 2  # Adam's and Muon's
    assert any("bf16 ('medium')" in n for n in names) and any("fp32 ('highest')" in n for n in names)
    for row in record["checks"]:
        assert row["status"] == "skipped" and row["reason"] == reason, row
        assert f"| {row['check']} | skipped: {reason} |" in table
    steps = next(row for row in record["checks"] if row["check"].startswith("Muon step"))
    assert steps["matrix_parameters"] > 0 and steps["built_on"] == "cpu"  # the optimizers were built
    pretrain = next(row for row in record["checks"] if row["check"].startswith("pretrain_gpt"))
    assert "--use-distributed-optimizer" in pretrain["flags"]["muon_layer_wise@4"]
    megatron_lm = next(row for row in record["checks"] if row["check"].startswith("Megatron-LM"))
    assert "--megatron-core-optimizer" in megatron_lm["flags"]["muon_core"]  # parsed by Megatron-LM's parser
    assert "--ckpt-step 25" in megatron_lm["flags"]["muon_resumed"]
    megatron_fsdp = next(row for row in record["checks"] if "--use-megatron-fsdp" in row["check"])
    assert "--data-parallel-sharding-strategy optim_grads_params" in megatron_fsdp["flags"]  # parsed by the trainer
    deepseek = next(row for row in record["checks"] if row["check"].startswith("DeepSeek"))
    assert "--multi-latent-attention" in deepseek["flags"]["muon_resumed"]  # parsed by Megatron-LM's parser


LINE = ("[2026-11-22 21:30:00] iteration {i:8d}/      50 | consumed samples: {s:10d} | elapsed time per "
        "iteration (ms): {t:.1f} | learning rate: 1.000000E-04 | global batch size:    16 | lm loss: {loss:.6E} | "
        "loss scale: 1.0 | grad norm: 1.000 | number of skipped iterations:   0 | number of nan iterations:   0 |")


def megatron_lm_output(losses: list[float], first: int = 1) -> str:
    return "\n".join(LINE.format(i=i, s=16 * i, t=100.0 + i % 3, loss=loss) for i, loss in enumerate(losses, first))


def test_megatron_lm_comparison_reads_megatron_lm_lines() -> None:
    """Losses and times come from Megatron-LM's iteration lines; the resumed run's second
    iteration logs the mean of its first two (Megatron-LM does not reset its averages after a
    run's first iteration), and that alone is not a difference; anything else is."""
    gpu_check = load_gpu_check()
    straight = [5.0 / (1 + 0.1 * i) for i in range(50)]
    resumed = straight[25:]
    resumed[1] = (resumed[0] + resumed[1]) / 2
    logs = {name: gpu_check.megatron_lm_log(megatron_lm_output(straight)) for name in
            ("adam_ours", "adam_core", "muon_ours")}
    logs["muon_core"] = gpu_check.megatron_lm_log(megatron_lm_output([x * (1 + 5e-3) for x in straight]))
    logs["adam_resumed"] = logs["muon_resumed"] = gpu_check.megatron_lm_log(megatron_lm_output(resumed, 26))
    result = gpu_check.compare_megatron_lm(logs, half=25)
    assert result["status"] == "ran", result["failures"]
    assert result["loss_relative_difference"]["muon"] == pytest.approx(5e-3 / 1.005, rel=1e-3)  # printed to 7 digits
    assert result["resume_relative_difference"] == {"adam": 0.0, "muon": 0.0}
    assert result["ratio"] == {"adam": 1.0, "muon": 1.0}

    resumed[5] *= 1.001  # a real difference after the restart
    logs["muon_resumed"] = gpu_check.megatron_lm_log(megatron_lm_output(resumed, 26))
    logs["adam_core"] = gpu_check.megatron_lm_log(megatron_lm_output([x * 1.01 for x in straight]))
    result = gpu_check.compare_megatron_lm(logs, half=25)
    assert result["status"] == "failed"
    assert any(f.startswith("adam: losses differ by 9.90e-03") for f in result["failures"]), result["failures"]
    assert any(f.startswith("muon: resumed losses differ by 1.00e-03") for f in result["failures"]), result["failures"]


def test_bad_size_is_a_clear_error(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        load_gpu_check().main(["--dry-run", "--hidden", "0"])
    assert exit_info.value.code == 2
    assert "--hidden must be >= 1; got 0" in capsys.readouterr().err
