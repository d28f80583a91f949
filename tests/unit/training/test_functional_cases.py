"""The functional-test cases' files against Megatron-LM's schema, and the comparison's semantics.

- Every case's model_config.yaml uses only top-level keys Megatron-LM's own case files use
  (MEGATRON_LM_CASE_KEYS: read from NVIDIA/Megatron-LM's tests/functional_tests/test_cases at commit
  d98e8a6, 2026-08-22: ENV_VARS, MODEL_ARGS, TEST_TYPE on all 333, LAUNCHER, METRICS, MODE, ...).
- Every case's MODEL_ARGS pass Megatron-LM's parse_args and validate_args with install()'s extra
  arguments (add_megatron_eopt_args), on as many ranks as the case runs.
- Every golden file holds the schema written in goldens.check_golden (Megatron-LM's GoldenValues:
  metric -> start_step, end_step, step_interval, values), and every case has a CPU golden.
- Bad input (an unknown key, placeholder, TEST_TYPE or check; a missing golden file) raises a
  ValueError naming what is wrong and what is allowed.
- compare: deterministic, approximate with Megatron-LM's allowance of failing steps, iteration-time
  as the median over the steady window.
"""

import json
import pathlib
from typing import Optional

import pytest

from megatron_eopt.training.functional import cases as cases_module
from megatron_eopt.training.functional import goldens
from megatron_eopt.training.functional.cases import Check, RunPaths, case_argv, load_case, load_recipe
from tests.functional import golden_cases

CASES = golden_cases.cases()


def test_there_are_at_least_twelve_cases_each_with_a_cpu_golden() -> None:
    assert len(CASES) >= 12
    reference = golden_cases.cpu_reference_platform()
    for case in CASES.values():
        assert goldens.golden_path(case, reference).is_file(), case.name


@pytest.mark.parametrize("name", sorted(CASES))
def test_case_keys_are_megatron_lms(name: str) -> None:
    import yaml

    config = yaml.safe_load((CASES[name].directory / "model_config.yaml").read_text())
    assert set(config) <= set(cases_module.MEGATRON_LM_CASE_KEYS)
    assert {"ENV_VARS", "MODEL_ARGS", "TEST_TYPE"} <= set(config)


def test_every_golden_file_holds_the_schema() -> None:
    files = sorted(golden_cases.CASES_ROOT.glob("*/golden_values_*.json"))
    assert len(files) >= len(CASES)
    reference = golden_cases.cpu_reference_platform()
    for path in files:
        golden = goldens.load_golden(path)  # raises on a schema error
        case = CASES[path.parent.name]
        if path == goldens.golden_path(case, reference):  # a CPU golden: what a CPU measures
            assert list(golden) == goldens.measured_metrics(case, on_cuda=False), path
        assert set(golden) <= set(case.metrics) and golden["lm loss"]["end_step"] == case.train_iters, path


GPU_RECIPE = golden_cases.ROOT / "tests" / "functional" / "recipes" / "gpt_gpu.yaml"


def test_the_gpu_recipe_runs_the_one_gpu_cases_at_one_rank_each_with_a_gpu_golden() -> None:
    """tests/functional/recipes/gpt_gpu.yaml: data-parallel-only cases at one rank, each with the
    golden file of a GPU holding every metric a GPU measures (the CUDA memory ones too)."""
    recipe = load_recipe(GPU_RECIPE)
    assert len(recipe) >= 8
    for name in recipe:
        case = load_case(golden_cases.CASES_ROOT / name, recipe)
        assert case.world_size == 1, name
        assert not {"--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                    "--expert-model-parallel-size"} & set(case.model_args), name
        gpu_goldens = sorted(case.directory.glob("golden_values_dev_nvidia_*.json"))
        assert gpu_goldens, f"{name}: no GPU golden (tools/gpu_goldens.sh records them)"
        for path in gpu_goldens:
            assert list(goldens.load_golden(path)) == goldens.measured_metrics(case, on_cuda=True), path


def _parse_on_megatron_lm(rank: int, world_size: int, runs: list[tuple[list[str], dict]]) -> list[str]:
    """Megatron-LM's parse_args with install()'s extra arguments, then the validate_args install() puts
    in Megatron-LM's place, in each case's environment (ENV_VARS): each run's --optimizer as parsed."""
    import contextlib
    import io
    import os
    import sys
    from unittest import mock

    from megatron.training.arguments import parse_args

    from megatron_eopt.integrations.megatron_lm import add_megatron_eopt_args, validate_args_for_megatron_eopt
    from tests.megatron_lm_in_process import read_field_docstrings_once

    read_field_docstrings_once()  # help texts only, read from source at every parse otherwise
    parsed, saved_environment, saved_argv = [], dict(os.environ), sys.argv
    try:
        for argv, env_vars in runs:
            os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
            os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank), **env_vars)
            sys.argv = ["pretrain_gpt.py", *argv]
            # validate_args asks the GPU's architecture at TP > 1, and Transformer Engine's version for
            # --qk-clip (>= 2.9): answer as a Hopper with Transformer Engine 2.9 would.
            with contextlib.redirect_stdout(io.StringIO()), mock.patch(
                    "megatron.training.arguments.get_device_arch_version", return_value=9), mock.patch(
                    "megatron.training.arguments.is_te_min_version", return_value=True):
                args = parse_args(extra_args_provider=add_megatron_eopt_args)
                validate_args_for_megatron_eopt(args)
            parsed.append(args.optimizer)
    finally:
        os.environ.clear()
        os.environ.update(saved_environment)
        sys.argv = saved_argv
    return parsed


def test_model_args_pass_megatron_lms_parser_with_install(run_distributed, tmp_path) -> None:
    by_world: dict[int, list] = {}
    for case in CASES.values():
        for run in case.phases():
            by_world.setdefault(case.world_size, []).append((case, case_argv(case, RunPaths(tmp_path), run)))
    for world_size, runs in sorted(by_world.items()):
        payload = [(argv, case.env_vars) for case, argv in runs]
        optimizers = run_distributed(_parse_on_megatron_lm, world_size, args=(payload,))[0]
        assert optimizers == [case.model_args["--optimizer"] for case, _ in runs]


def _write_case(root: pathlib.Path, config: str, recipe: str = "") -> tuple[pathlib.Path, dict]:
    case_dir = root / "a_case"
    case_dir.mkdir(parents=True, exist_ok=True)
    (case_dir / "model_config.yaml").write_text(config)
    recipe_path = root / "recipe.yaml"
    recipe_path.write_text(recipe or "spec:\n  nodes: 1\n  nproc_per_node: 2\n  script: pretrain_gpt.py\n"
                           "  checks:\n    lm loss: {type: approximate, atol: 1.0e-4}\n"
                           "products:\n  - test_case: [a_case]\n")
    return case_dir, load_recipe(recipe_path)


GOOD = "ENV_VARS: {}\nMODEL_ARGS:\n  --train-iters: 4\n  --tensorboard-dir: ${TENSORBOARD_PATH}\nTEST_TYPE: regular\n" \
       "METRICS: [lm loss]\n"


@pytest.mark.parametrize("config,message", [
    (GOOD + "SPEC: x\n", r"unknown key\(s\) 'SPEC'; allowed: ENV_VARS, MODEL_ARGS, TEST_TYPE, METRICS"),
    (GOOD.replace("${TENSORBOARD_PATH}", "${TB_PATH}"),
     r"--tensorboard-dir: unknown placeholder \$\{TB_PATH\}; placeholders: \$\{TENSORBOARD_PATH\}"),
    (GOOD.replace("regular", "frozen-start"), r"TEST_TYPE 'frozen-start' is not one of regular, ckpt-resume"),
    (GOOD.replace("[lm loss]", "[lm-loss]"), r"METRICS: unknown key\(s\) 'lm-loss'; allowed: lm loss, num-zeros"),
    (GOOD.replace("[lm loss]", "[num-zeros]"), r"no check declared for METRICS \['num-zeros'\]"),
    (GOOD.replace("regular", "ckpt-resume"), r"a ckpt-resume case needs --save, --load, --save-interval"),
    (GOOD.replace("  --train-iters: 4\n", ""), r"MODEL_ARGS needs --train-iters"),
])
def test_bad_case_files_are_refused_with_what_is_allowed(tmp_path, config: str, message: str) -> None:
    case_dir, recipe = _write_case(tmp_path, config)
    with pytest.raises(ValueError, match=message):
        load_case(case_dir, recipe)


def test_bad_recipes_and_switches_are_refused(tmp_path) -> None:
    bad_script = "spec:\n  script: train.py\nproducts:\n  - test_case: [a_case]\n"
    case_dir, recipe = _write_case(tmp_path, GOOD, bad_script)
    with pytest.raises(ValueError, match=r"script 'train.py' is not one of pretrain_gpt.py, pretrain_gpt_megatron_lm.py"):
        load_case(case_dir, recipe)
    with pytest.raises(ValueError, match=r"unknown key\(s\) 'gpus'; allowed: test_case, nodes, nproc_per_node"):
        _write_case(tmp_path, GOOD, "spec: {}\nproducts:\n  - {test_case: [a_case], gpus: 8}\n")
    case_dir, recipe = _write_case(tmp_path, GOOD.replace("TEST_TYPE", "  --bf16: false\nTEST_TYPE"))
    with pytest.raises(ValueError, match=r"--bf16: False; write `true` for a switch and leave a flag out"):
        case_argv(load_case(case_dir, recipe), RunPaths(tmp_path))


def test_a_missing_golden_file_names_the_files_there_and_how_to_record(tmp_path) -> None:
    case_dir, recipe = _write_case(tmp_path, GOOD)
    case = load_case(case_dir, recipe)
    (case_dir / "golden_values_dev_nvidia_a100.json").write_text("{}")
    with pytest.raises(ValueError, match=r"no golden file golden_values_dev_nvidia_h100.json for platform "
                                         r"'nvidia_h100' \(present: golden_values_dev_nvidia_a100.json\); record one"):
        goldens.find_golden(case, "nvidia_h100", on_cuda=True, cpu_reference="intel_xeon_processor")


def test_case_argv_is_megatron_lms_reading_of_model_args(tmp_path) -> None:
    case = CASES["gpt_muon_layerwise_dp2_resume"]
    first, second = (case_argv(case, RunPaths(tmp_path), run) for run in (1, 2))
    assert [arg.replace("run_1", "run_2") for arg in first] == second  # the same run; only the events' folder differs
    assert "--exit-interval" not in first  # Megatron-LM's runner trains the whole first run, saving at half
    assert first[first.index("--tensorboard-dir") + 1] == str(tmp_path / "tensorboard" / "run_1")
    assert second[second.index("--tensorboard-dir") + 1] == str(tmp_path / "tensorboard" / "run_2")
    assert "--muon-nesterov" in first and first[first.index("--muon-nesterov") + 1].startswith("--")


def _metric(values: dict) -> dict:
    steps = sorted(values)
    return {"start_step": steps[0], "end_step": steps[-1], "step_interval": 1,
            "values": {str(s): values[s] for s in steps}}


def test_compare_semantics() -> None:
    golden = _metric({s: 1.0 for s in range(1, 21)})
    one_off = _metric({**{s: 1.0 for s in range(1, 21)}, 7: 1.1})
    two_off = _metric({**{s: 1.0 for s in range(1, 21)}, 7: 1.1, 9: 0.9})
    approximate = Check("approximate", atol=1e-3)
    assert goldens.compare_metric("lm loss", approximate, golden, golden).passed
    assert goldens.compare_metric("lm loss", approximate, golden, one_off).passed  # min(max(20 // 100, 1), 50) = 1
    assert not goldens.compare_metric("lm loss", approximate, golden, two_off).passed
    assert not goldens.compare_metric("lm loss", Check("approximate", atol=1e-3, failing_steps=0), golden, one_off).passed
    assert not goldens.compare_metric("num-zeros", Check("deterministic"), golden, one_off).passed
    assert not goldens.compare_metric("lm loss", approximate, golden, _metric({s: "nan" for s in range(1, 21)})).passed
    times = _metric({1: "nan", **{s: 0.1 for s in range(2, 21)}})
    slow_start = _metric({1: "nan", 2: 9.0, 3: 9.0, **{s: 0.2 for s in range(4, 21)}})  # outside steps 5-20
    assert goldens.compare_metric("iteration-time", Check("approximate", atol=0.5), times, slow_start).passed
    assert not goldens.compare_metric("iteration-time", Check("approximate", atol=0.05), times, slow_start).passed


def test_golden_schema_refusals() -> None:
    good = {"lm loss": _metric({1: 4.0, 2: 3.9})}
    goldens.check_golden(good, "x")
    with pytest.raises(ValueError, match=r"unknown metric 'loss'; metrics: lm loss, num-zeros"):
        goldens.check_golden({"loss": good["lm loss"]}, "x")
    with pytest.raises(ValueError, match=r"values must be keyed by steps"):
        goldens.check_golden({"lm loss": {**good["lm loss"], "end_step": 3}}, "x")
    with pytest.raises(ValueError, match=r"must hold exactly start_step, end_step, step_interval, values"):
        goldens.check_golden({"lm loss": {"values": {}}}, "x")
    assert json.loads(json.dumps(good)) == good


@pytest.mark.parametrize("model,platform", [
    ("Intel(R) Xeon(R) Processor", "intel_xeon_processor"),
    ("Intel(R) Xeon(R) Platinum 8480+ CPU @ 2.00GHz", "intel_xeon_platinum_8480"),
    ("AMD EPYC 7B13 64-Core Processor", "amd_epyc_7b13"),
    ("AMD EPYC 9R14 96-Core Processor", "amd_epyc_9r14"),
    ("NVIDIA H100 80GB HBM3", "nvidia_h100_80gb_hbm3"),
])
def test_platform_names_from_the_device(model: str, platform: str) -> None:
    assert goldens.platform_slug(model) == platform


def _launcher():
    import importlib.util

    spec = importlib.util.spec_from_file_location("run_functional_case", golden_cases.ROOT / "tools" / "run_functional_case.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


NODE_ENVIRONMENT = ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_NNODES", "SLURM_JOB_NUM_NODES",
                    "SLURM_NODEID", "SLURM_JOB_NODELIST", "SLURM_NODELIST")


def test_launcher_node_settings_from_flags_then_environment_then_slurm_then_recipe(monkeypatch, tmp_path) -> None:
    launcher = _launcher()
    for name in NODE_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(launcher.shutil, "which", lambda name: None)  # no scontrol: a plain host list
    case = CASES["gpt_muon_layerwise_dp2_resume"]

    def settings(*argv):
        return launcher.node_settings(launcher.parse_args([case.name, *argv]), case)

    alone = settings()
    assert (alone["nnodes"], alone["node_rank"], alone["nproc_per_node"], alone["standalone"]) == (1, 0, 2, True)
    monkeypatch.setenv("SLURM_NNODES", "4")
    monkeypatch.setenv("SLURM_NODEID", "3")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu-a,gpu-b,gpu-c,gpu-d")
    slurm = settings()
    assert (slurm["nnodes"], slurm["node_rank"], slurm["master_addr"], slurm["standalone"]) == (4, 3, "gpu-a", False)
    monkeypatch.setenv("NNODES", "2")
    monkeypatch.setenv("NODE_RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1234")
    usual = settings()
    assert (usual["nnodes"], usual["node_rank"], usual["master_addr"], usual["master_port"]) == (2, 1, "10.0.0.1", 1234)
    flags = settings("--nnodes", "3", "--node-rank", "0", "--master-addr", "h0", "--master-port", "7", "--nproc-per-node", "8")
    assert (flags["nnodes"], flags["node_rank"], flags["master_addr"], flags["master_port"], flags["nproc_per_node"]) == (
        3, 0, "h0", 7, 8)
    second = launcher.torchrun_command(case, RunPaths(tmp_path), 2, flags)
    assert second[second.index("--master-port") + 1] == "8"  # the resume's rendezvous: the port + 1
    assert "--load" in second and "--exit-interval" not in second
    with pytest.raises(ValueError, match=r"--node-rank 5.*0 <= node-rank < nnodes"):
        settings("--node-rank", "5")
    monkeypatch.setenv("NNODES", "two")
    with pytest.raises(ValueError, match=r"environment NNODES='two' is not a valid int"):
        settings("--node-rank", "0")


def _copied_case(root: pathlib.Path, name: str, model_args: Optional[dict] = None, config: Optional[str] = None,
                 golden: Optional[str] = None) -> pathlib.Path:
    """A copy of case `name` (its folder's name, so the recipe knows it) with MODEL_ARGS updated by
    `model_args`, or its model_config.yaml replaced by `config`, or every golden file by `golden`."""
    import shutil

    import yaml

    directory = root / name
    shutil.copytree(golden_cases.CASES_ROOT / name, directory)
    if model_args is not None:
        case = yaml.safe_load((directory / "model_config.yaml").read_text())
        case["MODEL_ARGS"].update(model_args)
        (directory / "model_config.yaml").write_text(yaml.safe_dump(case))
    if config is not None:
        (directory / "model_config.yaml").write_text(config)
    for path in directory.glob("golden_values_*.json") if golden is not None else ():
        path.write_text(golden)
    return directory


@pytest.mark.parametrize("name,change,message", [
    ("gpt_muon_layerwise_dp2", {"config": "ENV_VARS: {}\nMODEL_ARGS: [\n"}, "model_config.yaml: not valid YAML at line 3"),
    ("gpt_muon_layerwise_dp2", {"model_args": {"--no-such-flag": True}},
     "pretrain_gpt.py refuses its MODEL_ARGS (*/model_config.yaml): unrecognized arguments: --no-such-flag"),
    ("gpt_megatron_lm_adam_distributed_optimizer_dp2", {"model_args": {"--lr": "fast"}},
     "pretrain_gpt_megatron_lm.py refuses its MODEL_ARGS (*/model_config.yaml): argument --lr: invalid float value: 'fast'"),
    ("gpt_megatron_lm_adam_distributed_optimizer_dp2", {"model_args": {"--use-torch-fsdp2": True}},
     "pretrain_gpt_megatron_lm.py refuses its MODEL_ARGS (*): --use-torch-fsdp2 is not supported with MCore's distributed"),
    ("gpt_muon_layerwise_dp2", {"golden": '{"lm loss": {'}, "golden_values_dev_*.json: not valid JSON: Expecting"),
], ids=["malformed yaml", "unknown flag", "bad value in Megatron-LM's parser", "Megatron-LM's flag check",
        "malformed golden"])
def test_launcher_refuses_bad_input_in_one_line_before_any_run(name, change, message, tmp_path, monkeypatch,
                                                               capsys) -> None:
    """docs/functional-tests.md: bad input ends the launcher with one line and status 2, checked
    before any run starts (the flags through the entry's own parser, the golden file read)."""
    import fnmatch

    launcher = _launcher()
    monkeypatch.setattr(launcher, "run_case", lambda *args: pytest.fail("a run started"))
    directory = _copied_case(tmp_path / "cases", name, **change)
    status = launcher.main([str(directory), "--output", str(tmp_path / "output")])
    lines = [line for line in capsys.readouterr().err.splitlines() if "No CUDA runtime" not in line]
    assert status == 2 and len(lines) == 1, lines
    assert lines[0].startswith("run_functional_case.py: error: ") and fnmatch.fnmatch(lines[0], f"*{message}*"), lines


def test_a_missing_golden_of_a_copied_case_says_to_record_into_the_copy(tmp_path, monkeypatch, capsys) -> None:
    """The hint names the folder given, not the repository's case of the same name (issue #84)."""
    launcher = _launcher()
    monkeypatch.setattr(launcher, "run_case", lambda *args: pytest.fail("a run started"))
    directory = _copied_case(tmp_path / "cases", "gpt_muon_layerwise_dp2")
    for path in directory.glob("golden_values_*.json"):
        path.unlink()
    status = launcher.main([str(directory), "--environment", "lts", "--output", str(tmp_path / "output")])
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "No CUDA runtime" not in line]
    assert status == 2 and line.startswith("run_functional_case.py: error: "), line
    assert line.endswith(f"record one with `python tools/run_functional_case.py {directory} --environment lts "
                         f"--record`"), line
