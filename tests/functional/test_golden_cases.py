"""The functional-test cases (tests/functional/test_cases/gpt/) against their CPU golden values.

Each case runs its command line (the launcher's, from the same `case_argv`) in the harness's
reused gloo workers (tests/golden_cases_in_process.py: no torchrun, whose imports cost ~20 s a
process), and its TensorBoard events are compared with the case's CPU golden file under the
recipe's per-metric checks (tests/functional/recipes/gpt.yaml). The goldens are regression values
recorded by this code, not proof of correctness: the other tests compare layouts with each other and
with megatron-core. What a golden adds is that a change to the update shows up, and that is tested
here too: Muon with Nesterov off or one Newton-Schulz step fewer fails the Muon goldens, and the
ckpt-resume case fails when the resume drops the momentum. A ckpt-resume case runs as Megatron-LM's
runner runs it: the whole run saving at half, its last checkpoint removed and Megatron-LM's tracker
pointed at half, then the resumed run, checked against the first run's second half. One test runs a
case through the launcher itself as two torchrun nodes of two processes meeting at one endpoint on
this machine, another a Megatron-LM-loop case on a machine without CUDA.
"""

import dataclasses
import os
import pathlib
import subprocess
import sys

import pytest

from megatron_eopt.training.functional import goldens
from megatron_eopt.training.functional.cases import RunPaths
from tests.functional import golden_cases
from tests.ports import free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]
CASES = golden_cases.cases()
MUON_CASES = ("gpt_muon_layerwise_dp2", "gpt_muon_tp2_sharded")
# Checked against its golden in tests/functional/test_megatron_lm_deepseek_case.py, in the same launch
# as its exact resume and its QK-clip.
CHECKED_ELSEWHERE = ("gpt_megatron_lm_deepseek_muon_megatron_fsdp_ep2",)


def _golden(name: str) -> dict:
    case = CASES[name]
    path = goldens.find_golden(case, goldens.platform_name("cpu"), False, golden_cases.cpu_reference_platform())
    return goldens.load_golden(path)


def _verdicts(name: str, runs: list[dict], case=None) -> list[goldens.Verdict]:
    return goldens.check_runs(case or CASES[name], _golden(name), runs, on_cuda=False)


# SLOW_CASES run in `make test-slow` only (~115 s together on 2 cores). These TP modes, sharded included, equal TP=1 to 1e-5 at TP=2 and
# TP=4 in `make test` (test_gpt_muon.py::test_muon_on_gpt_shards_equals_tp1), so a change to their math fails
# there; blockwise, which differs from TP=1 by design, keeps its golden here.
# Lion's first step compiles (17 s at 2 ranks); its update equals emerging_optimizers' in make test
# (test_emerging_factory.py, test_fsdp2.py).
# Also there: the MoE case, which equals one process at TP=2 x EP=2 in make test
# (test_pretrain_gpt_moe.py), and the Megatron-LM-loop cases on
# Megatron-FSDP and in bf16 with precision-aware state, whose runs the parity matrix holds to megatron-core's
# and to their own exact resumes in make test (test_megatron_lm_loop.py); the Megatron-LM-loop case with the
# distributed optimizer keeps its golden here.
SLOW_CASES = ("gpt_muon_tp2_duplicated", "gpt_muon_tp2_distributed", "gpt_muon_tp2_auto", "gpt_muon_tp4_sharded",
              "gpt_lion_dp2", "gpt_muon_moe_tp2_ep2_expert_sharded", "gpt_muon_tp2_sharded",
              "gpt_megatron_lm_muon_megatron_fsdp_dp2", "gpt_megatron_lm_muon_bf16_precision_aware_dp2")


def _params(names, slow=()) -> list:
    return [pytest.param(name, marks=[pytest.mark.slow] if name in slow else []) for name in names]


@pytest.mark.parametrize("name", _params(sorted(set(CASES) - set(CHECKED_ELSEWHERE)), SLOW_CASES))
def test_case_matches_its_cpu_golden(name: str, run_distributed, tmp_path: pathlib.Path) -> None:
    actual = golden_cases.run_and_read(CASES[name], tmp_path, run_distributed)
    verdicts = _verdicts(name, actual)
    assert len(verdicts) == len(CASES[name].phases()) * len(goldens.measured_metrics(CASES[name], on_cuda=False))
    assert {v.metric for v in verdicts} == set(goldens.measured_metrics(CASES[name], on_cuda=False))
    assert all(v.passed for v in verdicts), "\n".join(v.message for v in verdicts)


def test_resumed_golden_equals_the_straight_runs() -> None:
    """The ckpt-resume case is the layer-wise Muon case saved at half and resumed: its recorded losses
    equal that case's at every step (a resume that changed the run would have shown when recording)."""
    straight, resumed = _golden("gpt_muon_layerwise_dp2"), _golden("gpt_muon_layerwise_dp2_resume")
    assert resumed["lm loss"] == straight["lm loss"]
    assert resumed["num-zeros"] == straight["num-zeros"]


def _changed(name: str, drop: tuple[str, ...] = (), add: dict | None = None):
    case = CASES[name]
    model_args = {k: v for k, v in case.model_args.items() if k not in drop} | (add or {})
    return dataclasses.replace(case, model_args=model_args)


# The layer-wise case shows it in `make test`; the TP=2 sharded case (~13 s) in `make test-slow`.
@pytest.mark.parametrize("name", _params(MUON_CASES, slow=("gpt_muon_tp2_sharded",)))
def test_a_deliberate_change_to_muons_update_fails_the_golden(name: str, run_distributed, tmp_path) -> None:
    """Nesterov off, or 4 Newton-Schulz steps instead of 5: the loss leaves the golden's tolerance."""
    for label, changed in (("nesterov off", _changed(name, drop=("--muon-nesterov",))),
                           ("4 Newton-Schulz steps", _changed(name, add={"--muon-num-ns-steps": 4}))):
        actual = golden_cases.run_and_read(changed, tmp_path / label.replace(" ", "_"), run_distributed)
        loss = next(v for v in _verdicts(name, actual, changed) if v.metric == "lm loss")
        assert not loss.passed, f"{label}: {loss.message}"


def test_ckpt_resume_runs_as_megatron_lms_runner_and_a_resume_that_drops_the_momentum_fails(
        run_distributed, tmp_path: pathlib.Path) -> None:
    """Megatron-LM's flow: the first run trains all 20 steps saving at 10 and 20; iter_0000020 is removed
    and latest_checkpointed_iteration.txt says 10; the second run resumes there (it logs steps 11-20 only)
    and saves iter_0000020 again. With the momentum zeroed right after that load, the first run still
    matches the golden at every step, and the resumed run leaves the first run's second half."""
    name = "gpt_muon_layerwise_dp2_resume"
    case = CASES[name]
    first, second = golden_cases.run_and_read(case, tmp_path, run_distributed, drop_momentum=True)
    checkpoints = tmp_path / "checkpoints"
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text().strip() == "10"
    assert sorted(p.name for p in checkpoints.glob("iter_*")) == ["iter_0000010", "iter_0000020"]
    resumed = goldens.read_tensorboard([RunPaths(tmp_path).tensorboard(2)], case.train_iters)["lm loss"]["values"]
    assert [step for step, value in resumed.items() if value != "nan"] == [str(s) for s in range(11, 21)]
    verdicts = _verdicts(name, [first, second])
    golden_loss, resumed_loss = (v for v in verdicts if v.metric == "lm loss")
    assert golden_loss.passed, golden_loss.message
    assert not resumed_loss.passed and resumed_loss.message.startswith("resumed at 10"), resumed_loss.message


def _as_two_nodes(case: str, nproc_per_node: int, output: pathlib.Path, **environment: str) -> str:
    """The launcher once per node (`--nnodes 2`, static rendezvous at 127.0.0.1), torchrun under each,
    as on a cluster; both must succeed. Node 0's output (it compares with the golden)."""
    port = free_port(count=2)  # the resume run rendezvous at port + 1
    nodes = [subprocess.Popen(
        [sys.executable, "tools/run_functional_case.py", case, "--nnodes", "2", "--node-rank", str(node),
         "--nproc-per-node", str(nproc_per_node), "--master-addr", "127.0.0.1", "--master-port", str(port),
         "--output", str(output)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **environment})
        for node in (0, 1)]
    outputs = [node.communicate(timeout=900) for node in nodes]
    for node, (stdout, stderr) in zip(nodes, outputs):
        assert node.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert "PASSED lm loss" in outputs[0][0] and "FAILED" not in outputs[0][0], outputs[0][0][-3000:]
    return outputs[0][0]


# `make test-slow` (~45 s: six interpreters import megatron-core): make test runs the same case in the harness's
# workers against its golden, and the launcher's command lines in test_functional_cases.py.
@pytest.mark.slow
def test_launcher_runs_a_megatron_lm_loop_case_as_two_nodes_on_machines_without_cuda(tmp_path: pathlib.Path) -> None:
    """A Megatron-LM-loop case at 2 nodes x 1 process, no GPU visible: the loop script takes gloo where
    CUDA is absent (Megatron-LM's default backend, nccl, needs GPUs), the data-parallel group spans
    the node boundary, and the case passes its golden."""
    _as_two_nodes("gpt_megatron_lm_adam_distributed_optimizer_dp2", 1, tmp_path / "output", CUDA_VISIBLE_DEVICES="")


@pytest.mark.slow
def test_launcher_runs_a_tensor_parallel_case_across_two_nodes(tmp_path: pathlib.Path) -> None:
    """A TP=4 case at 2 nodes x 2 processes: the tensor-parallel group spans the node boundary
    (global ranks are node-major)."""
    stdout = _as_two_nodes("gpt_muon_tp4_sharded", 2, tmp_path / "output")
    world = [line for line in stdout.splitlines() if line.startswith("> world")]
    assert world and world[0].startswith("> world 4 = TP 4 (sequence parallel) x DP 1"), world or stdout[-3000:]


def test_slurm_script_is_valid_bash() -> None:
    result = subprocess.run(["bash", "-n", "tools/functional_case.sbatch"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
