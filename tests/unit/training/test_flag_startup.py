"""--help and flag errors come before torch and megatron-core are imported, in one line."""

import json
import os
import subprocess
import sys

import pytest

from megatron_eopt.training.arguments.device import cuda_surely_absent

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
                                "'blockwise', 'duplicated', 'distributed', 'sharded', 'auto'); did you mean duplicated?; see "
                                "pretrain_gpt.py --help."),
    (["--normalization", "rmsnorm"], "did you mean RMSNorm?"),
    # The installed optimizers and coefficient sets, known without torch (config/optimizer_names.py).
    (["--optimizer", "muonn", "--lr", "1e-3"], "pretrain_gpt.py: error: argument --optimizer: invalid choice: 'muonn' "
                                               "(choose from 'adam', "),
    (["--optimizer", "muonn"], "'sgd', 'sinkhorn_muon', 'soap', 'spel', 'dist_muon'); did you mean muon?; see "
                               "pretrain_gpt.py --help."),
    (["--muon-coefficient-type", "quintc"], "invalid choice: 'quintc' (choose from 'simple', 'quintic', "),
], ids=["bad-type", "unknown-flag", "bad-choice", "close-choice", "optimizer", "optimizer-close", "coefficients"])
def test_flag_errors_are_one_line_without_torch(argv, message) -> None:
    report, stdout, stderr = _probe(argv)
    assert report == {"code": 2, "heavy": []}
    assert stdout.strip() == "" and len(stderr.strip().splitlines()) == 1, stderr
    assert message in stderr


# Runs every command line in one fresh interpreter (one start-up for them all), each through the
# entry script, and reports per command line its status, its stdout and stderr, and its seconds;
# then which heavy modules any of them imported.
PROBE_MANY = """
import contextlib, io, json, runpy, sys, time
results = []
for argv in json.loads(sys.argv[1]):
    sys.argv = ["pretrain_gpt.py", *argv]
    out, err = io.StringIO(), io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path("scripts/pretrain_gpt.py", run_name="__main__")
            code = 0
        except SystemExit as exit:
            code = exit.code
    results.append({"code": code, "stdout": out.getvalue(), "stderr": err.getvalue(),
                    "seconds": time.perf_counter() - start})
heavy = sorted(name for name in ("torch", "megatron.core", "transformer_engine") if name in sys.modules)
sys.__stdout__.write("\\nPROBE " + json.dumps({"results": results, "heavy": heavy}) + "\\n")
"""

# One error of each concern that depends on flags together or on defaults, not on the machine.
SEMANTIC_ERRORS = {
    "model": (["--lr", "0.1", "--num-query-groups", "2"],
              "--num-query-groups 2 needs --group-query-attention (without it every head has its own key/value "
              "group)."),
    "recompute": (["--lr", "0.1", "--recompute-method", "uniform"],
                  "--recompute-method only applies with --recompute-granularity full."),
    "moe": (["--lr", "0.1", "--num-experts", "4", "--moe-router-topk", "5", "--disable-bias-linear"],
            "--moe-router-topk must be in [1, --num-experts 4]; got 5."),
    "mla": (["--lr", "0.1", "--multi-latent-attention", "--group-query-attention"],
            "--group-query-attention and --multi-latent-attention exclude each other"),
    "parallel": (["--lr", "0.1", "--tensor-model-parallel-size", "3"],
                 "--tensor-model-parallel-size 3 must divide the world size (1)."),
    "lr-required": ([], "--lr is required (the peak learning rate)."),
    "training-length": (["--lr", "0.1", "--train-iters", "10", "--train-samples", "100"],
                        "--train-iters and --train-samples both set the training length; give one."),
    "wsd": (["--lr", "0.1", "--lr-wsd-decay-iters", "5"], "--lr-wsd-decay-iters only applies with --lr-decay-style WSD"),
    "batch-schedule": (["--lr", "0.1", "--rampup-batch-size", "4", "4", "100"],
                       "--rampup-batch-size needs --train-samples"),
    "data": (["--lr", "0.1", "--eod-mask-loss"], "--eod-mask-loss needs --data-path or --mock-data"),
    "eval": (["--lr", "0.1", "--eval-iters", "-1"], "--eval-iters must be >= 0 (0: no evaluation); got -1."),
    "logging": (["--lr", "0.1", "--profile-step-start", "5", "--profile-step-end", "5"],
                "--profile-step-end 5 must be > --profile-step-start 5."),
    "checkpoint": (["--lr", "0.1", "--ckpt-step", "5"], "--ckpt-step needs --load."),
    "run-control": (["--lr", "0.1", "--exit-signal", "SIGINT"], "--exit-signal SIGINT needs --exit-signal-handler."),
    # OptimizerConfig's rules (config/rules.py), in its words, before the trainer's own checks.
    "precision": (["--fp16", "--bf16"], "--fp16 and --bf16 are both True; choose at most one."),
    "optimizer-config": (["--lr", "0.1", "--min-lr", "1"], "--min-lr (1.0) must not exceed --lr (0.1)."),
    # validate_args' refusals that need no installed optimizer (arguments/validate.py's check_before_import).
    "cpu-offload": (["--lr", "0.1", "--optimizer-cpu-offload"],
                    "--optimizer-cpu-offload needs --use-precision-aware-optimizer, as in Megatron-LM"),
    "fp16-emerging": (["--lr", "0.1", "--fp16", "--optimizer", "muon"],
                      "pretrain_gpt.py: error: --fp16 is not supported with --optimizer muon (it has no loss scaling, "
                      "which fp16 needs (bf16 works); optimizers that do: adam, sgd)."),
    # The precision-aware optimizer's rules (config/precision.py), the flags' values named as given.
    "state-dtype": (["--lr", "0.1", "--exp-avg-dtype", "bf16"],
                    "--exp-avg-dtype can only be fp32 without --use-precision-aware-optimizer (as in megatron-core); "
                    "got bf16."),
    "grads-dtype": (["--lr", "0.1", "--bf16", "--main-grads-dtype", "bf16"],
                    "--main-grads-dtype can only be fp32 without --use-precision-aware-optimizer"),
    "main-params-model-dtype": (["--lr", "0.1", "--bf16", "--use-precision-aware-optimizer", "--main-params-dtype",
                                 "fp16"], "pretrain_gpt.py: error: --main-params-dtype must be fp32 or the model's own "
                                          "16-bit dtype, bf16 with --bf16; got fp16."),
    "main-params-remainders": (["--lr", "0.1", "--bf16", "--use-precision-aware-optimizer", "--main-params-dtype",
                                "bf16"], "pretrain_gpt.py: error: --main-params-dtype bf16 with --bf16 needs "
                                         "--no-store-param-remainders: by default the main weights are exact fp32, "
                                         "each the bf16 parameter plus a 16-bit remainder. Allowed: --main-params-dtype "
                                         "fp32, or bf16 with --no-store-param-remainders."),
    # The lr schedule's SchedulerConfig, --step-batch-size-schedule and --pipeline-model-parallel-layout,
    # read without torch and megatron-core.
    "scheduler": (["--lr", "0.1", "--lr-decay-style", "WSD"], "--lr-wsd-decay-iters must be set when"),
    "step-schedule": (["--lr", "0.1", "--step-batch-size-schedule", "0:4 x", "--train-samples", "60"],
                      "--step-batch-size-schedule '0:4 x': Invalid schedule entry \"x\""),
}
if cuda_surely_absent():  # a CPU-only torch build, or no NVIDIA driver: known without torch
    SEMANTIC_ERRORS["device"] = (["--lr", "0.1", "--distributed-backend", "nccl"],
                                 "--distributed-backend nccl needs CUDA, and none is available")


def _probe_many(argvs: list[list[str]], world_size: int = 1) -> dict:
    result = subprocess.run([sys.executable, "-c", PROBE_MANY, json.dumps(argvs)], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, env={**os.environ, "RANK": "0", "WORLD_SIZE": str(world_size)})
    return json.loads(result.stdout.rsplit("PROBE ", 1)[1])


def _assert_one_line_errors(report: dict, errors: dict) -> None:
    assert report["heavy"] == [], report["heavy"]
    for (concern, (_, message)), run in zip(errors.items(), report["results"]):
        lines = run["stderr"].strip().splitlines()
        assert run["code"] == 2 and run["stdout"].strip() == "" and len(lines) == 1, (concern, run)
        assert lines[0].startswith("pretrain_gpt.py: error: ") and message in lines[0], (concern, lines[0])
        assert run["seconds"] < 5, (concern, run["seconds"])


def test_semantic_flag_errors_come_before_torch() -> None:
    """Errors of flags together (or of their defaults) exit 2 with one line before torch,
    megatron-core or Transformer Engine is imported, each in well under the import's time."""
    _assert_one_line_errors(_probe_many([argv for argv, _ in SEMANTIC_ERRORS.values()]), SEMANTIC_ERRORS)


TWO_RANK_ERRORS = {  # at WORLD_SIZE 2 (nothing is started before the flags are checked)
    "layout": (["--lr", "0.1", "--num-layers", "2", "--pipeline-model-parallel-size", "2",
                "--pipeline-model-parallel-layout", "Et*3|L"],
               "--pipeline-model-parallel-layout 'Et*3|L' does not fit --pipeline-model-parallel-size 2 and "
               "--num-layers 2: it has 3 transformer layers (t), not 2"),
    "layout-characters": (["--lr", "0.1", "--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout",
                           "Et|tx|L"], "unknown layer character 'x'"),
    "qk-clip-tp-fsdp2": (["--lr", "0.1", "--use-torch-fsdp2", "--qk-clip", "--tensor-model-parallel-size", "2",
                          "--num-attention-heads", "4"],
                         "pretrain_gpt.py: error: --use-torch-fsdp2 does not support --qk-clip with "
                         "--tensor-model-parallel-size > 1 (fully_shard drops the attributes that say which weights TP "
                         "splits by heads; QK-clip works on FSDP2 at TP=1) yet."),
}


def test_two_rank_flag_errors_come_before_torch() -> None:
    _assert_one_line_errors(_probe_many([argv for argv, _ in TWO_RANK_ERRORS.values()], world_size=2),
                            TWO_RANK_ERRORS)
