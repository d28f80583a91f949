"""`make gpu-check`: every check that needs a CUDA GPU, in one command.

1. the GPU-tier tests (`pytest -m gpu tests`);
2. Newton-Schulz TFLOP/s in bf16 and fp32 on a GPT's blocks against a dense matmul beside it;
3. our Muon step / torch.optim.AdamW(fused=True) on a GPT's 2-D weights;
4. a scripts/pretrain_gpt.py iteration (bf16, one GPU), layer-wise Muon / Adam;
5. Megatron-LM's `pretrain()`, megatron-core's optimizer and ours: losses, time, a halfway resume;
6. the trainer's CUDA-only paths against its CPU substitutes: losses within 1e-3 relative;
7. pretrain_gpt --use-megatron-fsdp on CUDA (Megatron-FSDP as shipped) against CPU (patched);
8. the DeepSeek-style recipe on Megatron-FSDP: Muon's iteration against Adam's, and its resume;
9. `--optimizer-cpu-offload`: the optimizer's device bytes per parameter and step time, Adam and Muon.
Writes gpu_check.json and .md to --out (default benchmarks/results/); without CUDA (or --dry-run)
it builds what each check would run and records each skipped with the reason (docs/gpu.md):
    python benchmarks/gpu_check.py [--out DIR] [--dry-run] [--hidden 4096] [--layers 2] [--checks ...]
"""

import argparse
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional

import newton_schulz_efficiency as ns_bench
import optimizer_offload as offload_bench
import optimizer_step as step_bench
import torch
from _gpt import GptShape
from _timing import interleaved_times, medians, paired_ratio

from megatron_eopt.runtime.hardware import cpu_model, native_bf16_matmul

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

STEP_ROWS = ("eopt_muon", "torch_adamw_fused")
PRETRAIN_RUNS = {  # name -> the optimizer flags of pretrain_gpt.py
    "muon_layer_wise": ["--optimizer", "muon", "--use-distributed-optimizer"],
    "adamw": ["--optimizer", "adam"],
}


def cuda_skip_reason(dry_run: bool) -> Optional[str]:
    if not torch.cuda.is_available():
        return (f"no CUDA: torch.cuda.is_available() is False (torch {torch.__version__}, "
                f"CUDA build {torch.version.cuda or 'none'}, {torch.cuda.device_count()} devices)")
    if dry_run:
        return "--dry-run"
    return None


def skipped(check: str, reason: str, **built) -> dict:
    return {"check": check, "status": "skipped", "reason": reason, **built}


# ------------------------------------------------------------------------------------------------
# 1. GPU-tier tests
# ------------------------------------------------------------------------------------------------


def gpu_tests(skip: Optional[str]) -> dict:
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "tests", "-q", "-p", "no:cacheprovider"]
    shown = "python -m pytest -m gpu tests -q"
    if skip:
        return skipped("GPU-tier tests", skip, command=shown)
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    summary = lines[-1] if lines else result.stderr.strip()[-500:]
    return {"check": "GPU-tier tests", "status": "ran" if result.returncode == 0 else "failed",
            "command": shown, "returncode": result.returncode, "summary": summary,
            "output_tail": (result.stdout + result.stderr)[-4000:] if result.returncode else None}


# ------------------------------------------------------------------------------------------------
# 2. Newton-Schulz flop rate against the dense matmul rate
# ------------------------------------------------------------------------------------------------


def newton_schulz(args, shape: GptShape, precision: str, skip: Optional[str]) -> dict:
    dtype = "bf16" if precision == "medium" else "fp32"
    check = f"Newton-Schulz {dtype} ('{precision}') / dense {dtype} matmul"
    blocks = ns_bench.block_shapes(shape)
    gflop = sum(c * ns_bench.newton_schulz_flops(*s, 5) for s, c in blocks.items()) / 1e9
    built = {"blocks": {f"{s[0]}x{s[1]}": c for s, c in blocks.items()}, "gflop_per_step": gflop,
             "reference_size": args.reference_size}
    if skip:
        return skipped(check, skip, **built)
    device = torch.device("cuda")
    options = argparse.Namespace(precision=precision, reference_size=args.reference_size,
                                 warmup=args.warmup, repeats=args.repeats)
    summary = ns_bench.summarize(ns_bench.measure(options, shape, device), shape, args.reference_size)
    total = summary["rows"]["total"]
    return {"check": check, "status": "ran", **built,
            "newton_schulz_tflops": total["gflops"] / 1e3, "matmul_tflops": summary["reference_gflops"] / 1e3,
            "ratio": total["ratio"], "per_shape": summary["rows"]}


# ------------------------------------------------------------------------------------------------
# 3. Optimizer step: our Muon / fused AdamW
# ------------------------------------------------------------------------------------------------


def optimizer_steps(args, shape: GptShape, skip: Optional[str]) -> dict:
    check = f"Muon step (ours, defaults) / torch AdamW(fused=True) step, GPT hidden {shape.hidden}, {shape.layers} layers"
    device = torch.device("cpu" if skip else "cuda")
    models, steps, prepare = step_bench.build_rows(shape, list(STEP_ROWS), device)
    params = sum(p.numel() for p in next(iter(models.values())).parameters())
    built = {"matrix_parameters": params, "built_on": device.type}
    if skip:
        return skipped(check, skip, **built)
    sync = lambda: torch.cuda.synchronize(device)  # noqa: E731
    times = interleaved_times(steps, prepare, args.warmup, args.repeats, before=sync, after=sync)
    return {"check": check, "status": "ran", **built,
            "step_ms": {row: s * 1e3 for row, s in medians(times).items()},
            "ratio": paired_ratio(times, *STEP_ROWS)}


# ------------------------------------------------------------------------------------------------
# 4. A whole pretrain_gpt iteration
# ------------------------------------------------------------------------------------------------


def pretrain_flags(args, optimizer_flags: list[str], global_batch: int, metrics: str) -> list[str]:
    return ["--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
            "--num-attention-heads", str(args.heads), "--group-query-attention", "--num-query-groups", str(args.groups), "--swiglu",
            "--seq-length", str(args.seq_length), "--micro-batch-size", str(args.micro_batch_size),
            "--global-batch-size", str(global_batch),
            "--train-iters", str(args.pretrain_warmup + args.repeats), "--log-interval", "1",
            "--bf16", "--lr", "3e-4", "--metrics-jsonl", metrics, *optimizer_flags]


def pretrain_iterations(args, skip: Optional[str], directory: str) -> dict:
    """Muon's extra work per iteration is fixed (Newton-Schulz on every matrix) while the model's
    grows with the tokens, so the ratio is measured at each --pretrain-global-batch-sizes."""
    check = f"pretrain_gpt iteration, Muon layer-wise / AdamW (world size 1, hidden {args.hidden}, {args.layers} layers)"
    flags = {f"{name}@{batch}": pretrain_flags(args, opt, batch, os.path.join(directory, f"{name}_{batch}.jsonl"))
             for batch in args.pretrain_global_batch_sizes for name, opt in PRETRAIN_RUNS.items()}
    te = importlib.util.find_spec("transformer_engine") is not None
    built = {"flags": {name: " ".join(f) for name, f in flags.items()}, "transformer_engine": te,
             "tokens_per_iteration": {b: b * args.seq_length for b in args.pretrain_global_batch_sizes}}
    if skip:
        from megatron_eopt.training.arguments.parser import parse_args  # checks every flag as a run would, builds nothing

        for argv in flags.values():
            parse_args(argv)
        return skipped(check, skip, **built)
    iteration_ms = {}
    for name, argv in flags.items():
        command = [sys.executable, os.path.join(ROOT, "scripts", "pretrain_gpt.py"), *argv]
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        if result.returncode != 0:
            return {"check": check, "status": "failed", **built, "failed_run": name,
                    "output_tail": (result.stdout + result.stderr)[-4000:]}
        iteration_ms[name] = median_iteration_ms(argv[argv.index("--metrics-jsonl") + 1], args.pretrain_warmup)
    ratio = {b: iteration_ms[f"muon_layer_wise@{b}"] / iteration_ms[f"adamw@{b}"] for b in args.pretrain_global_batch_sizes}
    return {"check": check, "status": "ran", **built, "iteration_ms": iteration_ms, "ratio": ratio}


def median_iteration_ms(metrics: str, warmup: int) -> float:
    with open(metrics) as f:
        records = [json.loads(line) for line in f if line.strip()]
    times = [r["elapsed_ms"] for r in records if r["iteration"] > warmup]
    if not times:
        raise ValueError(f"{metrics}: no iteration after the {warmup} warm-up ones was logged.")
    return statistics.median(times)


# ------------------------------------------------------------------------------------------------
# 6. The trainer on CUDA against the trainer on CPU
# ------------------------------------------------------------------------------------------------

SMALL_RUN = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
             "--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", "10", "--lr", "1e-2",
             "--log-interval", "1", "--eval-iters", "0", "--optimizer", "muon", "--use-distributed-optimizer",
             "--muon-fp32-matmul-prec", "highest"]
MOE = ["--num-experts", "4", "--disable-bias-linear", "--moe-aux-loss-coeff", "0.01"]
CUDA_VS_CPU_RUNS = {  # name -> (flags on CUDA, flags of the CPU run it must equal)
    "dense": ([], []),
    "rope": (["--position-embedding-type", "rope"], ["--position-embedding-type", "rope"]),
    "moe allgather": (MOE, MOE),
    "moe alltoall": (MOE + ["--moe-token-dispatcher-type", "alltoall"], MOE),  # alltoall needs CUDA
}
CUDA_VS_CPU_TOLERANCE = 1e-3


def run_losses(argv: list[str], metrics: str, cuda: bool) -> tuple[Optional[list[float]], str]:
    env = dict(os.environ) if cuda else {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, os.path.join(ROOT, "scripts", "pretrain_gpt.py"), *argv, "--metrics-jsonl", metrics]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        return None, (result.stdout + result.stderr)[-4000:]
    with open(metrics) as f:
        return [json.loads(line)["loss"] for line in f if line.strip()], ""


def cuda_matches_cpu(args, skip: Optional[str], directory: str) -> dict:
    check = "pretrain_gpt on CUDA (megatron-core's router, dispatchers, RoPE) = on CPU (substitutions), 10 it."
    built = {"flags": {name: " ".join(SMALL_RUN + cuda) for name, (cuda, _) in CUDA_VS_CPU_RUNS.items()}}
    if skip:
        from megatron_eopt.training.arguments.parser import parse_args

        for _, cpu in CUDA_VS_CPU_RUNS.values():  # the CUDA-only flags are refused here, rightly
            parse_args(SMALL_RUN + cpu)
        return skipped(check, skip, **built)
    differences, failures = {}, []
    for name, (cuda_flags, cpu_flags) in CUDA_VS_CPU_RUNS.items():
        losses = {}
        for device, flags in (("cuda", cuda_flags), ("cpu", cpu_flags)):
            losses[device], output = run_losses(SMALL_RUN + flags, os.path.join(directory, f"{name}_{device}.jsonl"),
                                                cuda=device == "cuda")
            if losses[device] is None:
                return {"check": check, "status": "failed", **built, "failed_run": f"{name} on {device}",
                        "output_tail": output}
        differences[name] = max(abs(a / b - 1) for a, b in zip(losses["cuda"], losses["cpu"]))
        if len(losses["cuda"]) != len(losses["cpu"]) or differences[name] > CUDA_VS_CPU_TOLERANCE:
            failures.append(f"{name}: loss rel. diff {differences[name]:.1e} > {CUDA_VS_CPU_TOLERANCE}")
    summary = "; ".join(f"{name}: {d:.1e}" for name, d in differences.items())
    return {"check": check, "status": "failed" if failures else "ran", **built, "failures": failures,
            "loss_relative_difference_by_run": differences, "summary": f"loss rel. diff {summary}"}


MEGATRON_FSDP_RUN = [flag for flag in SMALL_RUN if flag != "--use-distributed-optimizer"] + [
    "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]


def megatron_fsdp_cuda_matches_cpu(args, skip: Optional[str], directory: str) -> dict:
    """Megatron-FSDP's own CUDA calls (streams, buffers on the GPU) against the run on CPU through
    megatron_eopt.runtime.megatron_fsdp_cpu: muon, 10 iterations, one rank."""
    check = "pretrain_gpt --use-megatron-fsdp on CUDA = on CPU (megatron_fsdp_cpu patch), muon, 10 it."
    built = {"flags": " ".join(MEGATRON_FSDP_RUN)}
    if skip:
        from megatron_eopt.training.arguments.parser import parse_args

        parse_args(MEGATRON_FSDP_RUN)
        return skipped(check, skip, **built)
    losses = {}
    for device in ("cuda", "cpu"):
        losses[device], output = run_losses(MEGATRON_FSDP_RUN, os.path.join(directory, f"megatron_fsdp_{device}.jsonl"),
                                            cuda=device == "cuda")
        if losses[device] is None:
            return {"check": check, "status": "failed", **built, "failed_run": device, "output_tail": output}
    difference = max(abs(a / b - 1) for a, b in zip(losses["cuda"], losses["cpu"]))
    failed = len(losses["cuda"]) != len(losses["cpu"]) or difference > CUDA_VS_CPU_TOLERANCE
    return {"check": check, "status": "failed" if failed else "ran", **built, "losses": losses,
            "summary": f"loss rel. diff {difference:.1e} (bound {CUDA_VS_CPU_TOLERANCE})"}


# ------------------------------------------------------------------------------------------------
# 5. Megatron-LM's pretrain() with megatron-core's optimizer and with ours
# ------------------------------------------------------------------------------------------------

MEGATRON_LM_SCRIPT = os.path.join(ROOT, "scripts", "pretrain_gpt_megatron_lm.py")
MEGATRON_LM_OPTIMIZERS = {"adam": ["--optimizer", "adam", "--lr", "3e-4"],
                          "muon": ["--optimizer", "muon", "--lr", "3e-3"]}
# Relative loss tolerance, ours against megatron-core's, per optimizer (issue 17): the same Adam
# up to kernel order; Muon's bf16 Newton-Schulz differs in how blocks are batched.
MEGATRON_LM_TOLERANCE = {"adam": 1e-3, "muon": 1e-2}
MEGATRON_LM_LINE = re.compile(r"iteration +(\d+)/ *\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+) \|"
                              r".*?lm loss: ([-+\d.Ee]+) \|")


def megatron_lm_flags(args) -> list[str]:
    """A GPT Megatron-LM builds without Transformer Engine or apex (local layers, unfused kernels).

    RoPE, not a learned position table: megatron-core gives Muon every 2-D parameter not tagged
    `is_embedding_or_output_parameter`, and megatron-core's GPT tags the word embeddings but not
    the learned position table, whereas we give that table to the scalar optimizer (a lookup
    table, like the word embeddings). With a learned table the two optimizers differ by design.
    """
    return ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16",
            "--position-embedding-type", "rope",
            "--seq-length", "1024", "--max-position-embeddings", "1024", "--micro-batch-size", "4",
            "--global-batch-size", "16", "--train-iters", str(args.megatron_lm_iters), "--lr-warmup-iters", "5",
            "--bf16", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "8192",
            "--seed", "1234", "--log-interval", "1", "--eval-interval", str(10 * args.megatron_lm_iters),
            "--eval-iters", "1", "--transformer-impl", "local", "--no-gradient-accumulation-fusion",
            "--no-masked-softmax-fusion", "--no-rope-fusion", "--no-persist-layer-norm"]


def megatron_lm_log(text: str) -> dict[int, tuple[float, float]]:
    """{iteration: (elapsed ms, lm loss)} from Megatron-LM's iteration lines."""
    return {int(m[1]): (float(m[2]), float(m[3])) for m in MEGATRON_LM_LINE.finditer(text)}


def run_megatron_lm(argv: list[str]) -> tuple[Optional[dict], str]:
    command = ["torchrun", "--nproc-per-node", "1", "--master-port", str(free_port()), MEGATRON_LM_SCRIPT, *argv]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    output = result.stdout + result.stderr
    return (megatron_lm_log(output) if result.returncode == 0 else None), output


def parse_megatron_lm_flags(runs) -> None:
    """Each run's flags through Megatron-LM's own parser plus the script's (no CUDA needed)."""
    from megatron.training.arguments import add_megatron_arguments

    from megatron_eopt.integrations.megatron_lm_gpt import add_script_args

    parser = add_script_args(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
    for argv in runs:
        parser.parse_args(argv)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def max_relative_difference(a: dict, b: dict) -> float:
    """Largest |a - b| / |b| of the losses over a's iterations (b has them all)."""
    return max(abs(a[i][1] - b[i][1]) / abs(b[i][1]) for i in a)


def megatron_lm_runs(args, skip: Optional[str], directory: str) -> dict:
    check = f"Megatron-LM pretrain(), ours / megatron-core's optimizer ({args.megatron_lm_iters} iterations, bf16)"
    base = megatron_lm_flags(args)
    runs = {f"{name}_{side}": base + flags + ([] if side == "ours" else ["--megatron-core-optimizer"])
            for name, flags in MEGATRON_LM_OPTIMIZERS.items() for side in ("ours", "core")}
    half = args.megatron_lm_iters // 2
    for name, flags in MEGATRON_LM_OPTIMIZERS.items():  # ours saves half-way; a new run resumes there
        checkpoint = os.path.join(directory, f"megatron_lm_{name}")
        runs[f"{name}_ours"] += ["--save", checkpoint, "--save-interval", str(half)]
        runs[f"{name}_resumed"] = base + flags + ["--load", checkpoint, "--ckpt-step", str(half)]
    built = {"flags": {name: " ".join(argv) for name, argv in runs.items()}, "tolerance": MEGATRON_LM_TOLERANCE}
    if skip:
        parse_megatron_lm_flags(runs.values())
        return skipped(check, skip, **built)
    logs, failed = run_logged(args, check, runs, "megatron_lm", built, args.megatron_lm_iters)
    return failed or {"check": check, **built, **compare_megatron_lm(logs, half)}


def run_logged(args, check: str, runs: dict, prefix: str, built: dict, iterations: int) -> tuple[dict, Optional[dict]]:
    """Each run of Megatron-LM's loop, its output in --out as PREFIX_NAME.log: (logs, None), or the failed
    row at the first run that fails or logs fewer than `iterations` (a resumed run logs fewer)."""
    logs = {}
    for name, argv in runs.items():
        logs[name], output = run_megatron_lm(argv)
        with open(os.path.join(args.out, f"{prefix}_{name}.log"), "w") as f:
            f.write(output)
        if not logs[name] or (not name.endswith("_resumed") and len(logs[name]) < iterations):
            return logs, {"check": check, "status": "failed", **built, "failed_run": name, "output_tail": output[-6000:]}
    return logs, None


# Issue 73 item 6: the DeepSeek-style functional case (gpt_megatron_lm_deepseek_muon_megatron_fsdp_ep2)
# at a size for one GPU (EP=1), on Megatron-FSDP as shipped. megatron-core's Adam cannot take --qk-clip
# without Transformer Engine, so both Adam runs leave it out.
DEEPSEEK = ["--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
            "--multi-latent-attention", "--q-lora-rank", "384", "--kv-lora-rank", "256", "--qk-head-dim", "64",
            "--qk-pos-emb-head-dim", "32", "--v-head-dim", "64", "--qk-layernorm", "--num-experts", "8",
            "--moe-router-topk", "2", "--moe-ffn-hidden-size", "512", "--moe-shared-expert-intermediate-size", "1024",
            "--moe-token-dispatcher-type", "alltoall", "--no-bias-swiglu-fusion", "--use-megatron-fsdp",
            "--data-parallel-sharding-strategy", "optim_grads_params", "--ckpt-format", "fsdp_dtensor"]
DEEPSEEK_RUNS = {"muon_ours": MEGATRON_LM_OPTIMIZERS["muon"] + ["--qk-clip", "--log-max-attention-logit"],
                 "adam_ours": MEGATRON_LM_OPTIMIZERS["adam"],
                 "adam_core": MEGATRON_LM_OPTIMIZERS["adam"] + ["--megatron-core-optimizer"]}


def deepseek_runs(args, skip: Optional[str], directory: str) -> dict:
    check = f"DeepSeek-style recipe on Megatron-FSDP, one GPU ({args.deepseek_iters} iterations, bf16)"
    base = [*megatron_lm_flags(args), *DEEPSEEK]
    base[base.index("--train-iters") + 1] = str(args.deepseek_iters)
    half, checkpoint = args.deepseek_iters // 2, os.path.join(directory, "deepseek")
    runs = {name: base + flags for name, flags in DEEPSEEK_RUNS.items()}
    runs["muon_ours"] += ["--save", checkpoint, "--save-interval", str(half)]
    runs["muon_resumed"] = base + DEEPSEEK_RUNS["muon_ours"] + ["--load", checkpoint, "--ckpt-step", str(half)]
    built = {"flags": {name: " ".join(argv) for name, argv in runs.items()}}
    if skip:
        parse_megatron_lm_flags(runs.values())
        return skipped(check, skip, **built)
    logs, failed = run_logged(args, check, runs, "deepseek", built, args.deepseek_iters)
    if failed:
        return failed
    ms = {name: statistics.median(t for i, (t, _) in log.items() if i > 5) for name, log in logs.items()
          if name != "muon_resumed"}
    resumed = logs["muon_resumed"]
    expected = as_logged_after_restart(logs["muon_ours"], half)
    difference = max_relative_difference(resumed, expected) if sorted(resumed) == sorted(
        i for i in expected if i > half) else float("inf")
    failures = [] if difference <= LOG_PRECISION else [f"resumed losses differ by {difference:.2e} relative"]
    summary = (f"iteration {ms['muon_ours']:.1f} ms (Muon, ours) / {ms['adam_ours']:.1f} (Adam, ours) / "
               f"{ms['adam_core']:.1f} (Adam, megatron-core's): Muon / Adam = {ms['muon_ours'] / ms['adam_ours']:.2f} "
               f"and {ms['muon_ours'] / ms['adam_core']:.2f}; resumed at {half}: loss rel. diff {difference:.1e}")
    return {"check": check, "status": "failed" if failures else "ran", "failures": failures, "summary": summary,
            "iteration_ms": ms, "resume_relative_difference": difference, **built}


# Megatron-LM logs losses with 7 significant digits ('{:.6E}'): equal runs agree to this.
LOG_PRECISION = 2e-6


def compare_megatron_lm(logs: dict, half: int) -> dict:
    """Loss differences per optimizer, iteration-time ratios (median after 5 iterations), resume."""
    result = {"losses": {name: [loss for _, (_, loss) in sorted(log.items())] for name, log in logs.items()},
              "loss_relative_difference": {}, "iteration_ms": {}, "ratio": {}, "resume_relative_difference": {}}
    failures = []
    for name, tolerance in MEGATRON_LM_TOLERANCE.items():
        ours, core = logs[f"{name}_ours"], logs[f"{name}_core"]
        difference = max_relative_difference(ours, core)
        result["loss_relative_difference"][name] = difference
        if not difference <= tolerance:
            failures.append(f"{name}: losses differ by {difference:.2e} relative (> {tolerance:g})")
        ms = {side: statistics.median(t for i, (t, _) in logs[f"{name}_{side}"].items() if i > 5)
              for side in ("ours", "core")}
        result["iteration_ms"][name] = ms
        result["ratio"][name] = ms["ours"] / ms["core"]
        resumed = logs[f"{name}_resumed"]
        if sorted(resumed) != [i for i in sorted(ours) if i > half]:
            failures.append(f"{name}: the resumed run logged iterations {sorted(resumed)}, not {half + 1}..{max(ours)}")
            continue
        difference = max_relative_difference(resumed, as_logged_after_restart(ours, half))
        result["resume_relative_difference"][name] = difference
        if not difference <= LOG_PRECISION:
            failures.append(f"{name}: resumed losses differ by {difference:.2e} relative (> {LOG_PRECISION:g})")
    return {"status": "failed" if failures else "ran", "failures": failures, **result}


def as_logged_after_restart(log: dict, start: int) -> dict:
    """What a run started after iteration `start` logs for the same iterations: Megatron-LM logs
    a run's first iteration without resetting its averages, so the second one's `lm loss` is the
    mean of the first two (training_log's `should_reset`)."""
    logged = dict(log)
    first, second = start + 1, start + 2
    if second in log:
        logged[second] = (log[second][0], (log[first][1] + log[second][1]) / 2)
    return logged


# ------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------


def value_of(row: dict) -> str:
    if row["status"] == "skipped":
        return f"skipped: {row['reason']}"
    if row["status"] == "failed":
        return "FAILED: " + "; ".join(row.get("failures") or [row.get("failed_run", "see the JSON")])
    if "summary" in row:
        return row["summary"]
    if "step_time_ratio" in row:
        without, offloaded = row["without"], row["with"]
        return (f"{without['bytes_per_param']:.3f} -> {offloaded['bytes_per_param']:.3f} bytes/param between steps, "
                f"step peak {without['step_peak_bytes_per_param']:.3f} -> {offloaded['step_peak_bytes_per_param']:.3f}, "
                f"{without['step_ms']:.1f} -> {offloaded['step_ms']:.1f} ms (x{row['ratio']:.2f}), "
                f"max weight difference {row['max_weight_difference']:.1e}")
    if "newton_schulz_tflops" in row:
        return (f"{row['newton_schulz_tflops']:.1f} / {row['matmul_tflops']:.1f} TFLOP/s = {row['ratio']:.3f}")
    if "step_ms" in row:
        a, b = (row["step_ms"][r] for r in STEP_ROWS)
        return f"{a:.2f} ms / {b:.2f} ms, paired median ratio {row['ratio']:.2f}"
    if "loss_relative_difference" in row:
        return "; ".join(f"{name}: loss rel. diff {row['loss_relative_difference'][name]:.1e}, "
                         f"{ms['ours']:.1f} / {ms['core']:.1f} ms = {row['ratio'][name]:.2f}"
                         for name, ms in row["iteration_ms"].items()) + \
            "; resumed at half-way, loss rel. diff: " + ", ".join(
                f"{name} {d:.1e}" for name, d in row["resume_relative_difference"].items())
    return "; ".join(f"global batch {b} ({row['tokens_per_iteration'][b]} tokens): "
                     f"{row['iteration_ms'][f'muon_layer_wise@{b}']:.1f} ms / {row['iteration_ms'][f'adamw@{b}']:.1f} ms = {r:.2f}"
                     for b, r in row["ratio"].items())


# ------------------------------------------------------------------------------------------------
# 9. Optimizer state on the host (optimizer_cpu_offload)
# ------------------------------------------------------------------------------------------------


def offload_rows(args, skip: Optional[str]) -> list[dict]:
    """Per optimizer: device bytes per parameter and step time without and with offload (fraction 1)."""
    rows = []
    for name in offload_bench.ROWS:
        check = f"{name}: optimizer device bytes/param and step time, without / with --optimizer-cpu-offload"
        built = {"hidden": args.hidden, "layers": args.layers}
        if skip:
            rows.append(skipped(check, skip, **built))
            continue
        row = offload_bench.compare(name, args.hidden, args.layers, torch.device("cuda"), args.repeats)
        rows.append({"check": check, "status": "ran", **built, **row,
                     "ratio": row["step_time_ratio"]})
    return rows


def markdown(record: dict) -> str:
    lines = [f"# gpu-check ({'dry run' if record['dry_run'] else 'CUDA'})", "",
             f"Device: {record['device']}; torch {record['torch']}; bf16 matrix products "
             f"{'native' if record['native_bf16_matmul'] else 'not native'}; Transformer Engine "
             f"{'installed' if record['transformer_engine'] else 'not installed'}.", ""]
    if record["skip_reason"]:
        lines += [f"Skipped: {record['skip_reason']}.", ""]
    lines += ["| check | result |", "|---|---|"]
    lines += [f"| {row['check']} | {value_of(row)} |" for row in record["checks"]]
    return "\n".join(lines) + "\n"


CHECKS = {  # name -> the rows it adds
    "tests": lambda args, shape, skip, directory: [gpu_tests(skip)],
    "newton_schulz": lambda args, shape, skip, directory: [newton_schulz(args, shape, "medium", skip),
                                                           newton_schulz(args, shape, "highest", skip)],
    "step": lambda args, shape, skip, directory: [optimizer_steps(args, shape, skip)],
    "pretrain": lambda args, shape, skip, directory: [pretrain_iterations(args, skip, directory)],
    "megatron_lm": lambda args, shape, skip, directory: [megatron_lm_runs(args, skip, directory)],
    "cuda_vs_cpu": lambda args, shape, skip, directory: [cuda_matches_cpu(args, skip, directory)],
    "megatron_fsdp": lambda args, shape, skip, directory: [megatron_fsdp_cuda_matches_cpu(args, skip, directory)],
    "deepseek": lambda args, shape, skip, directory: [deepseek_runs(args, skip, directory)],
    "offload": lambda args, shape, skip, directory: offload_rows(args, skip),
}


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(HERE, "results"), help="folder for gpu_check.json and .md")
    parser.add_argument("--dry-run", action="store_true", help="build everything, time nothing (also without CUDA)")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--groups", type=int, default=8, help="query groups (GQA)")
    parser.add_argument("--reference-size", type=int, default=4096, help="the dense matmul is N x N times N x N")
    parser.add_argument("--seq-length", type=int, default=1024, help="pretrain_gpt")
    parser.add_argument("--micro-batch-size", type=int, default=4, help="pretrain_gpt")
    parser.add_argument("--pretrain-warmup", type=int, default=3, help="pretrain_gpt iterations left out")
    parser.add_argument("--pretrain-global-batch-sizes", type=int, nargs="+", default=[4, 64],
                        help="pretrain_gpt global batch sizes (gradient accumulation over --micro-batch-size)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--megatron-lm-iters", type=int, default=50, help="Megatron-LM pretrain() iterations")
    parser.add_argument("--deepseek-iters", type=int, default=20, help="the DeepSeek-style recipe's iterations")
    parser.add_argument("--checks", nargs="+", choices=list(CHECKS), default=list(CHECKS),
                        help="run only these checks (default: all)")
    args = parser.parse_args(argv)
    if min(args.megatron_lm_iters, args.deepseek_iters) < 10:
        parser.error(f"--megatron-lm-iters and --deepseek-iters must be >= 10 (timed after 5, saved half-way); "
                     f"got {args.megatron_lm_iters} and {args.deepseek_iters}.")
    for name in ("hidden", "layers", "heads", "groups", "reference_size", "repeats", "megatron_lm_iters"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}.")
    shape = GptShape(args.hidden, args.layers, args.heads, args.groups)
    os.makedirs(args.out, exist_ok=True)  # the Megatron-LM runs write their logs there first
    skip = cuda_skip_reason(args.dry_run)
    device = torch.cuda.get_device_name() if skip is None else f"cpu ({cpu_model()})"
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as directory:
        checks = [row for name in args.checks for row in CHECKS[name](args, shape, skip, directory)]
    record = {"dry_run": skip is not None, "skip_reason": skip, "device": device, "torch": torch.__version__,
              "native_bf16_matmul": native_bf16_matmul(torch.device("cpu" if skip else "cuda")),
              "transformer_engine": importlib.util.find_spec("transformer_engine") is not None,
              "model": shape.describe(), "seconds": time.perf_counter() - start, "checks": checks}
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        json.dump(record, f, indent=2)
    table = markdown(record)
    with open(os.path.join(args.out, "gpu_check.md"), "w") as f:
        f.write(table)
    print(table, end="")
    print(f"wrote {os.path.join(args.out, 'gpu_check.json')} and gpu_check.md")
    if any(row["status"] == "failed" for row in checks):
        sys.exit(1)
    return record


if __name__ == "__main__":
    main()
