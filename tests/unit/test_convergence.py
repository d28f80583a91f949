"""benchmarks/convergence.py without training: a fake trainer process stands in for the runs, so
the resume logic (a finished run is not repeated, a changed one is), the stages' plan and the
report (table, target, plot, the docs' table) are checked against numbers worked out here."""

import importlib.util
import json
import pathlib
import statistics
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCALE_ITERS = 60


@pytest.fixture(scope="module")
def convergence():
    spec = importlib.util.spec_from_file_location("convergence", ROOT / "benchmarks" / "convergence.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fake_popen(validation: list[tuple[int, float]], calls: list):
    class FakeProcess:
        def __init__(self, command, **kwargs):
            calls.append(command)
            rows = [{"iteration": i, "loss": 5.0 - i / 100, "elapsed_ms": 100.0} for i in range(1, SCALE_ITERS + 1)]
            rows += [{"iteration": i, "split": "valid", "final": False, "eval_loss": v, "eval_ppl": 1.0}
                     for i, v in validation]
            rows += [{"iteration": SCALE_ITERS, "split": "valid", "final": True, "eval_loss": 9.0, "eval_ppl": 1.0}]
            pathlib.Path(command[-1]).write_text("".join(json.dumps(row) + "\n" for row in rows))
            self.stdout = [f" validation loss at iteration {i} | lm loss value: {v:.6E} | lm loss PPL: 1 |\n"
                           for i, v in validation]
            self.returncode = 0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    return FakeProcess


def test_a_finished_run_is_not_repeated_and_a_changed_one_is(convergence, tmp_path, monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(convergence.subprocess, "Popen", _fake_popen([(20, 3.5), (40, 3.0), (60, 2.5)], calls))
    scale = convergence.QUICK
    spec = convergence.Spec("muon_lr0.01_seed1", "muon", 0.01, 1, convergence.MUON)
    result, trained = convergence.run_spec(spec, scale, ["--data-path", "x"], str(tmp_path), "[1/1]")
    assert trained and len(calls) == 1 and result["status"] == "done"
    assert result["final_validation_loss"] == 2.5 and result["validation"] == [(20, 3.5), (40, 3.0), (60, 2.5)]
    tokens = scale.seq_length * scale.global_batch
    assert result["tokens_per_second"] == pytest.approx(tokens / 0.1)
    stored = json.loads((tmp_path / "muon_lr0.01_seed1.json").read_text())
    assert stored["command"][0] == "-m" and sys.executable not in stored["command"]

    again, trained = convergence.run_spec(spec, scale, ["--data-path", "x"], str(tmp_path), "[1/1]")
    assert not trained and len(calls) == 1 and again["final_validation_loss"] == 2.5
    _, trained = convergence.run_spec(spec, scale, ["--data-path", "y"], str(tmp_path), "[1/1]")  # other data
    assert trained and len(calls) == 2


def test_a_run_that_stops_early_has_no_final_loss(convergence, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(convergence.subprocess, "Popen", _fake_popen([(20, 3.5), (40, 3.0)], []))
    spec = convergence.Spec("adamw_lr1_seed1", "adamw", 1.0, 1, convergence.ADAMW)
    result, _ = convergence.run_spec(spec, convergence.QUICK, [], str(tmp_path), "[1/1]")
    assert result["final_validation_loss"] is None  # no evaluation at the last iteration


def _result(group: str, lr: float, seed: int, validation: list, final) -> dict:
    return {"name": f"{group}_lr{lr:g}_seed{seed}", "group": group, "lr": lr, "seed": seed, "status": "done",
            "validation": validation, "final_validation_loss": final, "tokens_per_second": 1000.0}


def _results() -> list[dict]:
    curve = lambda *losses: [(20 * (i + 1), loss) for i, loss in enumerate(losses)]  # noqa: E731
    return [
        _result("adamw", 1e-3, 1, curve(4.0, 3.5, 3.2), 3.2),
        _result("adamw", 3e-3, 1, curve(3.8, 3.2, 3.0), 3.0),  # AdamW's best
        _result("adamw", 3e-3, 2, curve(3.9, 3.3, 3.2), 3.2),  # target: mean 3.1
        _result("muon", 1e-2, 1, curve(3.5, 3.0, 2.8), 2.8),  # Muon's best
        _result("muon", 1e-2, 2, curve(3.3, 2.9, 2.7), 2.7),
        _result("muon", 3e-2, 1, curve(3.6, 3.1, 2.9), 2.9),
        {**_result("muon", 1e-1, 1, curve(9.0), None), "status": "failed"},
    ]


def test_later_stages_use_the_best_lrs(convergence) -> None:
    results = {r["name"]: r for r in _results()}
    specs = convergence.later_specs(convergence.QUICK, results)
    names = [s.name for s in specs]
    assert names[:2] == ["adamw_lr0.003_seed2", "muon_lr0.01_seed2"]
    expected = [(v.name, 0.01 * factor) for v in convergence.variants(convergence.QUICK) for factor in v.lr_factors
                for _ in v.seeds]
    assert [s.group for s in specs[2:]] == [name for name, _ in expected]
    assert [s.lr for s in specs[2:]] == pytest.approx([lr for _, lr in expected])  # at Muon's best lr
    gram = [s for s in specs if s.group == "gram_newton_schulz"]
    assert all("--muon-gram-newton-schulz" in s.flags for s in gram)
    assert [s.seed for s in gram] == list(convergence.QUICK.seeds)  # every seed: compared with Muon's spread


def test_report_sweep_target_reach_and_docs_table(convergence, tmp_path) -> None:
    results = _results()
    summary = convergence.summarize(results, convergence.QUICK)
    assert summary["best_lr"] == {"adamw": 3e-3, "muon": 1e-2}
    assert summary["target"] == pytest.approx(3.1)
    # Muon seed 1 crosses 3.1 between (20, 3.5) and (40, 3.0): 20 + 20 * 0.4 / 0.5 = 36;
    # seed 2 between (20, 3.3) and (40, 2.9): 20 + 20 * 0.2 / 0.4 = 30.
    assert summary["muon_reach"]["mean"] == pytest.approx(33.0)
    assert summary["muon_reach"]["std"] == pytest.approx(statistics.stdev([36.0, 30.0]))
    assert summary["muon_reach_fraction"] == pytest.approx(33.0 / SCALE_ITERS) and summary["target_met"]

    table = convergence.markdown(summary)
    assert table.count("\n| ") == 5  # header rule + adamw x2, muon x3 (one failed)
    assert "| **muon** | 0.01 | 1,2 | 2.7500 ± 0.0707" in table
    assert "| muon | 0.1 | 1 | - (1 without a final loss: diverged or stopped)" in table

    doc = tmp_path / "doc.md"
    doc.write_text(f"intro\n{convergence.TABLE_BEGIN}\nold table\n{convergence.TABLE_END}\nafter\n")
    convergence.replace_table(str(doc), table)
    text = doc.read_text()
    assert "old table" not in text and table in text and text.startswith("intro\n") and text.endswith("after\n")

    convergence.plot(results, summary, str(tmp_path / "plot.png"))
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
