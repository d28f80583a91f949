"""benchmarks/convergence.py without training: a fake trainer process stands in for the runs, so
the resume logic (a finished run is not repeated, a changed one is), the stages' plan and the
report (table, target, plot, the docs' table) are checked against numbers worked out here. The
same for benchmarks/convergence_range.py (the range study): its plan's stages and lr extensions,
the crossing budget, the noise from disjoint halves, edge flags, the table with pending cells, the
held-out size, resume across checkouts; and its corpora and the trainer's --final-eval-iters."""

import gzip
import importlib.util
import json
import pathlib
import random
import statistics
import struct
import sys
import types

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


# ------------------------------------------------------------------------------------------------
# benchmarks/convergence_range.py: the range study (docs/convergence.md), without training
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def study_module():
    """The script's names and those of the plan it imports (_convergence_range_plan.py); `script` is
    the script itself, whose globals its functions read."""
    sys.path.insert(0, str(ROOT / "benchmarks"))  # it imports convergence.py, as a script beside it does
    try:
        spec = importlib.util.spec_from_file_location("convergence_range", ROOT / "benchmarks" / "convergence_range.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return types.SimpleNamespace(**{**vars(sys.modules["_convergence_range_plan"]), **vars(module)}, script=module)


def test_crossing_interpolates_between_budgets_and_names_the_bounds(study_module) -> None:
    crossing = study_module.crossing
    # 0.5 -> 3.2, 0.75 -> 2.9: the target 3.0 lies 2/3 of the way: 0.5 + 0.25 * 2/3.
    assert crossing([0.25, 0.5, 0.75, 1.0], [3.5, 3.2, 2.9, 2.8], 3.0) == (pytest.approx(0.5 + 0.25 * 2 / 3), "")
    assert crossing([0.25, 0.5, 0.75, 1.0], [2.9, 2.8, 2.7, 2.6], 3.0) == (None, "below")
    assert crossing([0.25, 0.5, 0.75, 1.0], [3.5, 3.4, 3.3, 3.1], 3.0) == (None, "never")
    # Not monotone: the first budget at or below the target, from the one before it.
    assert crossing([0.25, 0.5, 0.75, 1.0], [3.4, 3.0, 3.1, 2.9], 3.2)[0] == pytest.approx(0.25 + 0.25 * 0.5)


def test_noise_from_disjoint_halves_pooled_over_runs(study_module) -> None:
    se = study_module.halves_standard_error
    assert se([1.0, 1.2, 2.0, 2.2], bisections=1) == pytest.approx(0.5)  # first half 1.1, second 2.1
    assert se([1.0, 1.0, 1.0, 1.0, 9.0]) == 0.0  # an odd batch is left out
    # Four batches have three bisections: {1.0, 1.2} | {2.0, 2.2} (0.5), {1.0, 2.0} | {1.2, 2.2}
    # (0.1), {1.0, 2.2} | {1.2, 2.0} (0.0): random ones give an RMS between 0 and 0.5.
    assert 0.1 < se([1.0, 1.2, 2.0, 2.2]) < 0.5
    # Many iid batches: the halves agree with the batches' spread, std / sqrt(n).
    rng = random.Random(1)
    batches = [rng.gauss(2.0, 0.2) for _ in range(2000)]
    assert se(batches) == pytest.approx(statistics.stdev(batches) / 2000 ** 0.5, rel=0.25)
    runs = [{"batch_losses": [1.0, 1.2, 2.0, 2.2]}, {"batch_losses": [1.0, 1.0, 1.0, 1.2]},
            {"batch_losses": None}, {"batch_losses": [float("nan"), 1.0]}]
    noise = study_module.noise(runs)
    assert noise["runs"] == 2 and noise["batches_per_evaluation"] == 4
    assert noise["halves"] == pytest.approx((se(runs[0]["batch_losses"]) ** 2 / 2
                                             + se(runs[1]["batch_losses"]) ** 2 / 2) ** 0.5)
    assert noise["batches"] == pytest.approx((statistics.stdev([1.0, 1.2, 2.0, 2.2]) / 2
                                              + statistics.stdev([1.0, 1.0, 1.0, 1.2]) / 2) / 2)
    assert study_module.noise([{"batch_losses": None}]) is None


def _store(m, results: dict, setting, iterations: int, seed: int, loss: float, validation=None) -> None:
    run = m.Run(setting, iterations, seed, "test")
    results[run.name] = {"name": run.name, "setting": vars(setting), "iterations": iterations, "seed": seed,
                         "final_loss": loss, "validation": validation or [(iterations, loss)],
                         "batch_losses": [loss - 0.01, loss + 0.01], "wall_s": 10.0}


def _tiny_study(m, momenta=(0.95,)):
    return m.Study(cells=(m.Cell("stdlib", m.TINY, 40),), seq_length=32, global_batch=4, eval_iters=2, evaluations=4,
                   corpus_bytes=1, adamw_lrs=(1e-3, 2e-3, 4e-3), adamw_beta2s=(0.95, 0.999), adamw_warmups=(0.05,),
                   adamw_weight_decays=(0.0, 0.1), muon_lrs=(5e-3, 1e-2, 2e-2), muon_adam_lr_factors=(1.0, 2.0),
                   muon_momenta=momenta, budgets=(0.5, 1.0), seeds=(1, 2))


def _sweep(m, study, cell, adamw_loss, muon_loss) -> dict:
    results = {}
    for run in m.sweep_runs(study, cell):
        s = run.setting
        loss = adamw_loss(s) if s.optimizer == "adamw" else muon_loss(s)
        _store(m, results, s, run.iterations, 1, loss)
    return results


def test_plan_walks_the_stages_and_extends_an_lr_at_the_edge(study_module) -> None:
    m = study_module
    study = _tiny_study(m)
    cell = study.cells[0]
    assert [r.stage for r in m.plan(study, cell, {})] == ["sweep"] * (3 * 2 + 3 * 2)
    # AdamW best in the middle (2e-3, beta2 0.95); Muon best at the top lr (2e-2, factor 2): extended.
    results = _sweep(m, study, cell, lambda s: abs(s.lr - 2e-3) * 100 + (0 if s.beta2 == 0.95 else 0.1),
                     lambda s: 3.0 - s.lr - 0.01 * s.adam_lr_factor)
    # each optimizer on its own: AdamW's weight decay beside Muon's first extension
    *_, decay_0, decay_1, step = m.plan(study, cell, results)
    decay = [decay_0, decay_1]
    assert step.stage == "lr extension" and step.setting == m.Setting("muon", 4e-2, adam_lr_factor=2.0)
    assert [r.stage for r in decay] == ["weight decay"] * 2
    assert [r.setting.weight_decay for r in decay] == [0.0, 0.1] and decay[0].setting.beta2 == 0.95
    for run in decay:
        _store(m, results, run.setting, 40, 1, 5.0)  # worse than 0.01
    _store(m, results, step.setting, 40, 1, 2.0)  # better again: a second extension
    later = [r for r in m.plan(study, cell, results) if r.stage not in ("sweep", "weight decay")]
    assert {(r.setting.optimizer, r.stage) for r in later} == {("adamw", "budget"), ("muon", "lr extension")}
    assert later[-1].setting.lr == pytest.approx(8e-2) and later[-1].stage == "lr extension"
    _store(m, results, later[-1].setting, 40, 1, 1.9)  # still better, but LR_EXTENSIONS (2) are spent
    budgets = [r for r in m.plan(study, cell, results) if r.stage == "budget"]
    assert {(r.setting.optimizer, r.iterations, r.seed) for r in budgets} == {
        (o, i, s) for o in ("adamw", "muon") for i in (20, 40) for s in (1, 2)}
    assert [r.setting.lr for r in budgets if r.setting.optimizer == "muon"] == pytest.approx([8e-2] * 4)
    best = m.Setting(**results[m.Run(m.best_setting(results, "muon", 40), 40, 1, "").name]["setting"])
    assert m.edges(results, best, cell) == ["lr 0.08 at the high end of [0.005, 0.01, 0.02, 0.04, 0.08]"]
    adamw = m.best_setting(results, "adamw", 40)
    assert adamw.lr == 2e-3 and m.edges(results, adamw, cell) == []
    assert m.at_edge(1.0, [1.0]) is None and m.at_edge(0.5, [0.5, 1.0, 2.0]) == "low"
    assert m.at_edge(0.0, [0.0, 0.01, 0.1]) == "low" and m.at_edge(0.0, [0.0, 0.01, 0.1], floor=0.0) is None
    _store(m, results, m.replace(adamw, weight_decay=0.0), 40, 1, 0.0)  # weight decay 0 wins: no edge to widen
    assert m.edges(results, m.best_setting(results, "adamw", 40), cell) == []


def test_a_complete_cell_gives_its_ratio_and_an_incomplete_one_is_pending(study_module, tmp_path) -> None:
    m = study_module
    study = _tiny_study(m)
    cell = study.cells[0]
    results = _sweep(m, study, cell, lambda s: 3.0 + abs(s.lr - 2e-3) * 100 + (0 if s.beta2 == 0.95 else 0.1),
                     lambda s: 3.0 + abs(s.lr - 1e-2) * 10 + (0 if s.adam_lr_factor == 1.0 else 0.1))
    assert m.summarize_cell(study, cell, results)["complete"] is False
    adamw, muon = m.Setting("adamw", 2e-3, beta2=0.95, warmup=0.05), m.Setting("muon", 1e-2)
    for wd in study.adamw_weight_decays:
        _store(m, results, m.replace(adamw, weight_decay=wd), 40, 1, 9.0)
    pending = m.summarize_cell(study, cell, results)
    assert not pending["complete"] and pending["runs_done"] == 14 and pending["runs_expected"] == 14 + 6
    table = m.markdown([pending], study)
    assert "| stdlib | tiny | 40 | pending | pending | 0.95 (megatron-core's default), **best** | pending |" in table
    assert "14 of 20" in table and "no cell is complete yet (0 of 1)" in table
    # AdamW at 40 iterations: 3.0 (seed 1, the sweep) and 3.2: target 3.1. Muon: mean 3.3 at 20, 2.9 at 40:
    # 3.1 is half-way: budget 0.75. Per seed: seed 1 3.2 -> 2.9 (... 0.5 + 0.5 / 3), seed 2 3.4 -> 2.9.
    curve = [(10, 4.0), (20, 3.5), (30, 3.2), (40, 3.0)]
    _store(m, results, adamw, 40, 1, 3.0, curve)
    _store(m, results, adamw, 40, 2, 3.2, [(10, 4.0), (20, 3.5), (30, 3.2), (40, 3.2)])  # periodic target 3.1
    _store(m, results, adamw, 20, 1, 3.3)
    _store(m, results, adamw, 20, 2, 3.3)
    _store(m, results, muon, 40, 1, 2.9, [(10, 3.5), (20, 3.0), (30, 2.95), (40, 2.9)])  # reaches 3.1 at 18
    _store(m, results, muon, 40, 2, 2.9, [(10, 3.3), (20, 3.1), (30, 2.95), (40, 2.9)])  # at 20
    _store(m, results, muon, 20, 1, 3.2)
    _store(m, results, muon, 20, 2, 3.4)
    summary = m.summarize_cell(study, cell, results)
    assert summary["complete"] and summary["target"] == pytest.approx(3.1)
    [muon_summary] = summary["muon"]
    assert muon_summary["ratio"] == pytest.approx(0.75) and muon_summary["best"]
    assert muon_summary["ratio_per_seed"] == pytest.approx([0.5 + 0.5 / 3, 0.5 + 0.5 * 0.6])
    assert muon_summary["ratio_standard_error"] == pytest.approx(abs(0.3 - 0.5 / 3) / 2)  # std / sqrt(2) of two
    assert muon_summary["mid_curve"]["fraction"]["mean"] == pytest.approx((18 + 20) / 2 / 40)
    table = m.markdown([summary, pending], study)
    assert "| **0.75** (seeds: 0.67-0.80, std 0.09, standard error 0.067)" in table
    assert "- At momentum 0.95 (megatron-core's default): range over the 1 complete cells of 2: 0.75 to 0.75" in table
    below = {**summary, "muon": [{**muon_summary, "ratio": None, "ratio_note": "below"}]}
    never = {**summary, "muon": [{**muon_summary, "ratio": None, "ratio_note": "never",
                                  "ratio_per_seed": [None, 0.9], "ratio_per_seed_notes": ["never", ""]}]}
    text = m.range_text([summary, below, never, pending], study)
    assert text[0] == ("- At momentum 0.95 (megatron-core's default): range over the 3 complete cells of 4: "
                       "≤ 0.50 to > 1.00 (seeds 0.67 to > 1.00).")
    assert "standard error 0.0100 (disjoint halves" in table
    m.plot_cell(summary, str(tmp_path / "cell.png"))
    assert (tmp_path / "cell.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_stored_runs_are_the_plans_runs_at_megatron_cores_momentum(study_module) -> None:
    """The runs stored before Muon's momentum was swept (0.95, named without it) are the plan's 0.95
    runs, name and command alike, so none runs again; the shipped default's runs are new and first."""
    m = study_module
    assert (m.SHIPPED_MOMENTUM, m.STORED_MOMENTUM) == (0.9, 0.95)  # Megatron-LM's parser, megatron-core's config
    stored = json.loads((ROOT / "benchmarks/results/convergence-range/runs/stdlib_1.0M_1000"
                         / "muon_lr0.005_b20.999_wu0.05_wd0.01_it1000_seed1.json").read_text())
    command, cell = stored["command"], m.FULL.cells[0]
    data_flags = command[command.index("--data-path"):command.index("--seq-length")]
    final_eval_iters = int(command[command.index("--final-eval-iters") + 1])
    run = m.Run(m.setting_of(stored), 1000, 1, "sweep")
    assert "momentum" not in stored["setting"] and run.setting.momentum == 0.95 and run.name == stored["name"]
    assert m.portable(m.command_key(m.run_command(run, cell, m.FULL, data_flags, final_eval_iters, "x"))) == command
    shipped = m.Run(m.replace(run.setting, momentum=0.9), 1000, 1, "sweep")
    assert shipped.name == "muon_lr0.005_b20.999_wu0.05_wd0.01_mom0.9_it1000_seed1"
    assert m.run_command(shipped, cell, m.FULL, data_flags, final_eval_iters, "x")[-4:-2] == ["--muon-momentum", "0.9"]
    muon = [r.setting.momentum for r in m.sweep_runs(m.FULL, cell) if r.setting.optimizer == "muon"]
    assert muon == [0.9] * 12 + [0.95] * 12


def test_each_momentum_sweeps_on_its_own_and_the_best_extends_outward(study_module) -> None:
    m = study_module
    study = _tiny_study(m, momenta=(0.9, 0.95))
    cell = study.cells[0]
    # 0.95 done as the stored cells are: AdamW's and Muon's sweeps at 0.95 only; the plan asks for 0.9's
    # sweep. Muon's best lr: 1e-2 at 0.9 (the middle), 2e-2 at 0.95 (the top: extended at 0.95 alone).
    results = _sweep(m, study, cell, lambda s: 3.0 + abs(s.lr - 2e-3) * 100,
                     lambda s: 3.0 + abs(s.lr - (1e-2 if s.momentum == 0.9 else 3e-2)) * 10 + s.momentum - 0.9)
    shipped = {r.name for r in m.sweep_runs(study, cell) if r.setting.optimizer == "muon" and r.setting.momentum == 0.9}
    at_stored = {name: r for name, r in results.items() if name not in shipped}
    assert {r.name for r in m.plan(study, cell, at_stored) if r.name not in at_stored} == shipped
    muon = m.muon_plan(study, cell, results)
    assert [(r.stage, r.setting.lr, r.setting.momentum) for r in muon] == [
        *[("budget", 1e-2, 0.9)] * 4, ("lr extension", 4e-2, 0.95)]  # no momentum extension before it ends
    _store(m, results, muon[-1].setting, 40, 1, 5.0)  # worse: 0.95 keeps 2e-2
    muon = m.muon_plan(study, cell, results)
    assert [(r.stage, r.setting.momentum) for r in muon if r.stage != "budget"] == [
        ("momentum extension", 0.85)]  # 0.9 wins, at the low end: 0.85 next
    assert muon[-1].setting == m.Setting("muon", 1e-2, momentum=0.85)
    _store(m, results, muon[-1].setting, 40, 1, 2.9)  # better: 0.8, the ladder's end
    _store(m, results, m.Setting("muon", 1e-2, momentum=0.8), 40, 1, 2.8)
    muon = m.muon_plan(study, cell, results)
    assert not [r for r in muon if r.stage == "momentum extension"]  # none beyond the ladder's end
    assert [(r.iterations, r.seed) for r in muon if r.setting.momentum == 0.8] == [(20, 1), (20, 2), (40, 1), (40, 2)]
    best = m.best_setting(results, "muon", 40)
    assert m.edges(results, best, cell) == ["momentum 0.8 at the low end of [0.8, 0.85, 0.9, 0.95]"]
    # The other way: 0.95 best at the high end, 0.975 next; a one-momentum study never extends it.
    results = _sweep(m, study, cell, lambda s: 3.0, lambda s: 3.0 + abs(s.lr - 1e-2) - s.momentum)
    assert m.momentum_extension(results, cell).setting == m.Setting("muon", 1e-2, momentum=0.975)
    one = _tiny_study(m)
    assert m.momentum_extension(_sweep(m, one, cell, lambda s: 3.0, lambda s: 3.0), cell) is None


def test_held_out_batches_from_an_index_file(study_module, tmp_path) -> None:
    lengths = [100, 200, 300, 400, 1000, 1001, 999, 2000]
    header = struct.pack("<9sQBQQ", b"MMIDIDX\x00\x00", 1, 4, len(lengths), len(lengths) + 1)
    (tmp_path / "x.idx").write_bytes(header + struct.pack(f"<{len(lengths)}i", *lengths))
    assert study_module.sequence_lengths(str(tmp_path / "x")) == lengths
    # 40% held out: documents round(0.6 * 8) = 5 on: 1001 + 999 + 2000 tokens; (4000 - 1) // 64 = 62
    # samples, 7 whole batches of 8.
    assert study_module.SPLIT == (0.6, 0.4)
    assert study_module.held_out_batches(lengths, 64, 8) == (4000, 7)
    (tmp_path / "y.idx").write_bytes(b"NOTANIDX" + header[8:])
    with pytest.raises(ValueError, match="not a Megatron indexed dataset"):
        study_module.sequence_lengths(str(tmp_path / "y"))


def test_the_prose_and_roff_corpora_keep_licences_indexes_and_c_manuals_out(tmp_path) -> None:
    from megatron_eopt.training import corpus

    info = tmp_path / "info"
    info.mkdir()
    manual = ("preamble\n\x1f\nFile: sed.info,  Node: Top,  Next: Intro\n\nTop text\n"
              "\x1f\nFile: sed.info,  Node: Intro,  Up: Top\n\nSed is a stream editor.\n"
              "\x1f\nFile: sed.info,  Node: GNU Free Documentation License\n\nlicence text\n"
              "\x1f\nFile: sed.info,  Node: Concept Index\n\nindex\n\x1f\nTag Table:\nNode: Top\x7f1\n")
    (info / "sed.info.gz").write_bytes(gzip.compress(manual.encode()))
    (info / "nettle.info.gz").write_bytes(gzip.compress(b"\x1f\nFile: nettle.info,  Node: Top\n\nC API\n"))
    assert [(d.name, d.text) for d in corpus.info_nodes(str(info))] == [
        ("sed.info.gz#Top", "Top text\n"), ("sed.info.gz#Intro", "Sed is a stream editor.\n")]
    man = tmp_path / "man"
    for section in ("man1", "man3"):
        (man / section).mkdir(parents=True)
    (man / "man1" / "ls.1.gz").write_bytes(gzip.compress(b".TH LS 1\nlist\n"))
    (man / "man1" / "dir.1.gz").write_bytes(gzip.compress(b".so man1/ls.1\n"))
    (man / "man1" / "gcloud_x.1.gz").write_bytes(gzip.compress(b".TH GCLOUD 1\n"))
    (man / "man1" / "vdir.1.gz").symlink_to(man / "man1" / "ls.1.gz")
    (man / "man3" / "printf.3.gz").write_bytes(gzip.compress(b".TH PRINTF 3\nint printf(...);\n"))
    assert [d.name for d in corpus.man_pages(str(man))] == ["man1/ls.1.gz"]
    documents = [corpus.Document(f"d{i}", "x" * 10) for i in range(10)]
    chosen = corpus.choose_documents(documents, 35)
    assert len(chosen) == 3 and chosen == corpus.choose_documents(list(reversed(documents)), 35)
    with pytest.raises(ValueError, match="corpus must be one of"):
        corpus.prepare_corpus("wikipedia", str(tmp_path))


def test_final_eval_iters_sizes_the_validation_split_and_is_checked() -> None:
    import argparse

    from megatron_eopt.training.arguments.loop import check_eval_flags
    from megatron_eopt.training.data.datasets import SampleCounts

    # 100 iterations, evaluations every 10 (10 + the final one) of 2 batches of 8: 176 samples;
    # a final evaluation of 50 batches needs 400.
    assert SampleCounts.for_run(100, 8, 10, 2).valid == 176
    assert SampleCounts.for_run(100, 8, 10, 2, final_eval_iters=50).valid == 400
    assert SampleCounts.for_run(100, 8, 10, 2, final_eval_iters=5).valid == 176
    flags = dict(eval_interval=10, eval_iters=2, skip_train=False)
    check_eval_flags(argparse.Namespace(**flags, final_eval_iters=50))
    with pytest.raises(ValueError, match="--final-eval-iters must be >= 1"):
        check_eval_flags(argparse.Namespace(**flags, final_eval_iters=0))
    with pytest.raises(ValueError, match="with --eval-iters 0"):
        check_eval_flags(argparse.Namespace(**{**flags, "eval_iters": 0}, final_eval_iters=5))


def test_a_range_run_is_not_repeated_in_another_checkout_and_a_changed_one_is(study_module, tmp_path,
                                                                            monkeypatch) -> None:
    m = study_module
    calls = []

    def fake_run(command, **kwargs):
        calls.append(command)
        rows = [{"iteration": i, "loss": 3.0, "elapsed_ms": 50.0} for i in (1, 2, 3, 4)]
        rows += [{"iteration": 4, "split": "valid", "final": False, "eval_loss": 2.9, "eval_ppl": 1.0},
                 {"iteration": 4, "split": "valid", "final": True, "eval_loss": 2.5, "eval_ppl": 1.0,
                  "batch_losses": [2.4, 2.6]}]
        pathlib.Path(command[-1]).write_text("".join(json.dumps(row) + "\n" for row in rows))
        return m.subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(m.subprocess, "run", fake_run)
    study = _tiny_study(m)
    cell = m.Cell("stdlib", m.TINY, 4)
    run = m.Run(m.Setting("muon", 1e-2), 4, 1, "sweep")
    absolute = ["--data-path", str(ROOT / "data" / "x_text_document")]
    result, trained = m.run_one(run, cell, study, absolute, 7, str(tmp_path), "[1]")
    assert trained and result["final_loss"] == 2.5 and result["batch_losses"] == [2.4, 2.6]
    assert result["validation"] == [(4, 2.9)]
    assert result["seconds_per_iteration"] == pytest.approx(0.05)
    assert "data/x_text_document" in result["command"] and str(ROOT) not in " ".join(result["command"])
    assert not (tmp_path / f"{run.name}.jsonl").exists()  # the result keeps what the report reads
    _, trained = m.run_one(run, cell, study, ["--data-path", "data/x_text_document"], 7, str(tmp_path), "[1]")
    assert not trained and len(calls) == 1  # the same run seen from another checkout
    assert set(m.current_results(m.read_results(str(tmp_path)), cell, study, absolute, 7)) == {run.name}
    assert m.current_results(m.read_results(str(tmp_path)), cell, study, absolute, 8) == {}  # other eval size
    _, trained = m.run_one(run, cell, study, absolute, 8, str(tmp_path), "[1]")
    assert trained and len(calls) == 2


def test_a_crashed_range_run_is_not_recorded_and_a_diverged_one_is(study_module, tmp_path, monkeypatch) -> None:
    m = study_module
    said = {"text": "", "code": 1}

    def fake_run(command, **kwargs):  # the trainer ends before its final evaluation
        kwargs["stdout"].write(said["text"])
        return m.subprocess.CompletedProcess(command, said["code"])

    monkeypatch.setattr(m.subprocess, "run", fake_run)
    study, cell = _tiny_study(m), m.Cell("stdlib", m.TINY, 4)
    run = m.Run(m.Setting("muon", 1e-2), 4, 1, "sweep")
    flags = ["--data-path", "data/x_text_document"]
    said["text"] = "torch.OutOfMemoryError: CUDA out of memory.\n"
    result, trained = m.run_one(run, cell, study, flags, 7, str(tmp_path), "[1]")
    assert trained and result is None and not (tmp_path / f"{run.name}.json").exists()
    said["code"] = 0  # no final loss with exit code 0: still no result
    assert m.run_one(run, cell, study, flags, 7, str(tmp_path), "[1]") == (None, True)
    said.update(text=f"error: iteration 3: {m.NAN_STOP} loss\n", code=1)
    result, trained = m.run_one(run, cell, study, flags, 7, str(tmp_path), "[1]")
    assert trained and result["final_loss"] is None and m.final_loss(result) == m.math.inf
    assert result["device"] == "cpu" and (tmp_path / f"{run.name}.json").exists()
    assert m.spread([1.0, m.math.inf])["std"] == m.math.inf  # a diverged seed's spread


def test_a_cell_runs_through_its_stages_and_stops_on_a_failed_run(study_module, tmp_path, monkeypatch) -> None:
    m = study_module
    crash, started = {"on": True, "name": None}, []

    def fake_run(command, **kwargs):  # final loss: lower for a lower lr, a longer run and Muon's lower momentum
        flags = dict(zip(command[::2], command[1::2])) | dict(zip(command[1::2], command[2::2]))
        log, iterations = pathlib.Path(kwargs["stdout"].name), int(flags["--train-iters"])
        started.append(log.stem)
        if crash["on"] and flags["--weight-decay"] == "0":  # AdamW's weight decay 0 crashes
            crash["name"] = log.stem
            return m.subprocess.CompletedProcess(command, 1)
        loss = 3.0 + float(flags["--lr"]) - iterations / 100 + ("--decoupled-lr" in flags) * 0.01
        if "muon" in command:
            loss += -0.15 + (float(flags["--muon-momentum"]) - 0.9) * 0.2
        rows = [{"iteration": iterations, "loss": loss, "elapsed_ms": 5.0},
                {"iteration": iterations, "split": "valid", "final": True, "eval_loss": loss, "eval_ppl": 1.0,
                 "batch_losses": [loss, loss]}]
        pathlib.Path(command[-1]).write_text("".join(json.dumps(row) + "\n" for row in rows))
        return m.subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(m.subprocess, "run", fake_run)
    monkeypatch.setattr(m.script, "prepare_corpus", lambda *a: m.argparse.Namespace(prefix="data/x", documents=1,
                                                                                     bytes=1))
    monkeypatch.setattr(m.script, "sequence_lengths", lambda prefix: [100] * 10)
    study = _tiny_study(m, momenta=(0.9, 0.95))
    args = m.argparse.Namespace(corpus_dir="data", out=str(tmp_path), jobs=2, threads=1)
    cell = study.cells[0]
    with pytest.raises(SystemExit, match=r"1 runs failed without a result \(adamw_\S+_wd0_it40_seed1\)"):
        m.run_cell(study, cell, args)
    # Muon went on to its budgets beside the crash; AdamW stopped before its own
    results = m.read_results(str(tmp_path / "runs" / cell.key))
    assert crash["name"] not in results and started.count(crash["name"]) == 1
    assert {r["setting"]["optimizer"] for r in results.values() if r["stage"] == "budget"} == {"muon"}
    crash["on"] = False
    results = m.run_cell(study, cell, args)  # resumed: the failed run again, then AdamW's budgets
    assert started.count(crash["name"]) == 2
    assert all(r.name in results for r in m.plan(study, cell, results))
    summary = m.summarize_cell(study, cell, results)
    assert summary["complete"] and len(started) == len(set(started)) + 1
    # Each momentum's lr went down to 1.25e-3 (two extensions), then momentum down the ladder to its end
    # (0.85, 0.8), whose schedules ran too. AdamW's target (lr 2.5e-4, 40 iterations): 2.60025. Muon at
    # momentum 0.9: 2.65125 at 20, 2.45125 at 40: 0.5 + 0.5 x 0.051 / 0.2; 0.95 and 0.8 are +0.01 and -0.02.
    assert summary["target"] == pytest.approx(2.60025) and summary["best_momentum"] == 0.8
    entries = {e["momentum"]: e for e in summary["muon"]}
    assert list(entries) == [0.9, 0.95, 0.8] and [e["best"] for e in entries.values()] == [False, False, True]
    assert {e["setting"]["lr"] for e in entries.values()} == {1.25e-3}
    for momentum, loss_at_20 in ((0.9, 2.65125), (0.95, 2.66125), (0.8, 2.63125)):
        ratio = 0.5 + 0.5 * (loss_at_20 - 2.60025) / 0.2
        assert entries[momentum]["ratio"] == pytest.approx(ratio)
        assert entries[momentum]["ratio_per_seed"] == pytest.approx([ratio, ratio])
    table = m.markdown([summary], study)
    assert "| 0.9 (the shipped default) | lr 0.00125, Adam lr x1 ⚠ edge | " in table
    assert "| 0.8, **best** | lr 0.00125, Adam lr x1 ⚠ edge | " in table
    assert "momentum 0.8 at the low end of [0.8, 0.85, 0.9, 0.95]" in table
    assert "- At momentum 0.9 (the shipped default): range over the 1 complete cells of 1: 0.63 to 0.63" in table
    assert "- At momentum 0.95 (megatron-core's default): range over the 1 complete cells of 1: 0.65 to 0.65" in table
    assert "- At each cell's best momentum (its lowest seed-1 final loss at the longest budget): range over the 1 " \
           "complete cells of 1: 0.58 to 0.58 (seeds 0.58-0.58)." in table


def test_time_projection_from_the_runs_medians(study_module) -> None:
    m = study_module
    study = _tiny_study(m)  # one cell, 40 iterations: 12 sweep + 2 weight decay runs at 40, budgets 20 and 40
    cell = study.cells[0]
    assert sorted(m.cell_iterations(study, cell)) == sorted([40] * 14 + [20, 20, 40, 20, 20, 40])
    runs = {"a": {"wall_s": 14.0, "seconds_per_iteration": 0.1, "iterations": 40},  # 4 s of overhead
            "b": {"wall_s": 1000.0, "seconds_per_iteration": 0.1, "iterations": 40},  # paused: not the median
            "c": {"wall_s": 12.0, "seconds_per_iteration": 0.1, "iterations": 20}}  # 10 s
    timing = m.projected_seconds(study, {cell.key: runs})
    cost = cell.model.cost  # the tiny model's (0.1): times are given for the 1.0M model, cost 1
    assert timing["seconds_per_iteration"] == pytest.approx(0.1 / cost)
    assert timing["overhead_s"] == pytest.approx(10.0 / cost)
    assert timing["total_s"] == pytest.approx(20 * 10 + 0.1 * (16 * 40 + 4 * 20))
    assert timing["remaining_s"] == pytest.approx(timing["total_s"] - (3 * 10 + 0.1 * 100))
    gpu = {"wall_s": 2.0, "seconds_per_iteration": 0.01, "iterations": 40, "device": "NVIDIA H200"}
    with_gpu = m.projected_seconds(study, {cell.key: {**runs, "d": gpu}})  # done, but not a CPU time
    assert with_gpu["overhead_s"] == timing["overhead_s"] and with_gpu["runs"] == 3
    assert with_gpu["remaining_s"] == pytest.approx(timing["remaining_s"] - (10 + 0.1 * 40))
    assert m.projected_seconds(study, {}) is None


def test_the_readme_quotes_the_committed_study_range() -> None:
    """The README's headline is the committed summary's range (ratio and per-seed, two decimals) at
    the shipped default momentum once every cell has it, and then at each cell's best momentum where
    that differs; until then at a momentum every cell has, said not to be the shipped default, with
    the shipped default's measurement in progress. Other numbers fail here until the README follows."""
    summary = json.loads((ROOT / "benchmarks/results/convergence-range/summary.json").read_text())
    shipped, cells = summary["shipped_momentum"], summary["cells"]
    readme = (ROOT / "README.md").read_text()

    def quoted_range(chosen) -> str:  # over every cell, or '' when a cell lacks it
        entries = [e for c in cells for e in c["muon"] if chosen(e) and e["complete"]]
        if len(entries) != len(cells):
            return ""
        ratios, seeds = [e["ratio"] for e in entries], [r for e in entries for r in e["ratio_per_seed"]]
        return (f"{min(ratios):.2f}-{max(ratios):.2f} of AdamW's iterations "
                f"({min(seeds):.2f}-{max(seeds):.2f} over 3 seeds)")

    cells_link = f"the range over [all {len(cells)} cells of a study]"
    if at_shipped := quoted_range(lambda e: e["momentum"] == shipped):
        quoted = f"Muon reaches AdamW's final held-out loss in {at_shipped} at the shipped default momentum, " \
                 f"{shipped:g}"
        assert f"{quoted}: {cells_link}" in readme, quoted
        if any(e["best"] and e["momentum"] != shipped for c in cells for e in c["muon"]):
            best = f"at each cell's best momentum: {quoted_range(lambda e: e['best'])}"
            assert best in readme, best
        return
    measured = sorted({e["momentum"] for c in cells for e in c["muon"]
                       if quoted_range(lambda x, m=e["momentum"]: x["momentum"] == m)})
    assert measured, "no momentum has every cell complete: nothing for the README to quote"
    quoted = (f"Muon reaches AdamW's final held-out loss in {quoted_range(lambda e: e['momentum'] == measured[-1])} "
              f"at `--muon-momentum {measured[-1]:g}`, not the shipped default ({shipped:g}): {cells_link}")
    assert quoted in readme, quoted
    assert f"The measurement at the shipped default, {shipped:g}, is in progress" in readme
