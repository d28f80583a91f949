"""`make gpu-check`: every check that needs a CUDA GPU, in one command, for a machine with one.

1. the GPU-tier tests (`pytest -m gpu tests`: tests/unit/test_gpu.py, test_checkpoint_gpu.py);
2. Newton-Schulz TFLOP/s in bf16 ('medium') and fp32 ('highest') on the blocks of a GPT of
   --hidden, against a dense --reference-size^3 matmul in the same dtype timed beside it
   (newton_schulz_efficiency.py);
3. our Muon step (get_megatron_optimizer defaults) / torch.optim.AdamW(fused=True) step on the
   2-D weights of a GPT of --hidden and --layers (optimizer_step.py);
4. a whole scripts/pretrain_gpt.py iteration (bf16, world size 1; Transformer Engine layers when
   installed), Muon with the layer-wise distributed optimizer / Adam: the median of the
   per-iteration times it logs, after --pretrain-warmup iterations.
Writes gpu_check.json and gpu_check.md to --out (default benchmarks/results/).

Without CUDA (or with --dry-run) nothing is timed: it builds what each check would run (the
models and optimizers of 3, the block shapes of 2, the pretrain_gpt flags of 4 through its own
parser) and records every check as skipped with the reason, so the command and its outputs can
be checked anywhere.

    python benchmarks/gpu_check.py [--out DIR] [--dry-run] [--hidden 4096] [--layers 2]
"""

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)  # this folder
sys.path.insert(0, ROOT)  # the repository

import newton_schulz_efficiency as ns_bench  # noqa: E402
import optimizer_step as step_bench  # noqa: E402
from _gpt import GptShape  # noqa: E402
from _timing import interleaved_times, medians, paired_ratio  # noqa: E402

from megatron_eopt.config import native_bf16_matmul  # noqa: E402

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


def pretrain_flags(args, optimizer_flags: list[str], metrics: str) -> list[str]:
    return ["--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
            "--num-attention-heads", str(args.heads), "--group-query-attention", "--num-query-groups", str(args.groups), "--swiglu",
            "--seq-length", str(args.seq_length), "--micro-batch-size", str(args.micro_batch_size),
            "--train-iters", str(args.pretrain_warmup + args.repeats), "--log-interval", "1",
            "--bf16", "--lr", "3e-4", "--metrics-jsonl", metrics, *optimizer_flags]


def pretrain_iterations(args, skip: Optional[str], directory: str) -> dict:
    check = f"pretrain_gpt iteration, Muon layer-wise / AdamW (world size 1, hidden {args.hidden}, {args.layers} layers)"
    flags = {name: pretrain_flags(args, opt, os.path.join(directory, f"{name}.jsonl"))
             for name, opt in PRETRAIN_RUNS.items()}
    te = importlib.util.find_spec("transformer_engine") is not None
    built = {"flags": {name: " ".join(f) for name, f in flags.items()}, "transformer_engine": te}
    if skip:
        from scripts.pretrain_gpt import parse_args  # checks every flag as a run would, builds nothing

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
    return {"check": check, "status": "ran", **built, "iteration_ms": iteration_ms,
            "ratio": iteration_ms["muon_layer_wise"] / iteration_ms["adamw"]}


def median_iteration_ms(metrics: str, warmup: int) -> float:
    with open(metrics) as f:
        records = [json.loads(line) for line in f if line.strip()]
    times = [r["elapsed_ms"] for r in records if r["iteration"] > warmup]
    if not times:
        raise ValueError(f"{metrics}: no iteration after the {warmup} warm-up ones was logged.")
    return statistics.median(times)


# ------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------


def value_of(row: dict) -> str:
    if row["status"] == "skipped":
        return f"skipped: {row['reason']}"
    if row["status"] == "failed":
        return "FAILED"
    if "summary" in row:
        return row["summary"]
    if "newton_schulz_tflops" in row:
        return (f"{row['newton_schulz_tflops']:.1f} / {row['matmul_tflops']:.1f} TFLOP/s = {row['ratio']:.3f}")
    if "step_ms" in row:
        a, b = (row["step_ms"][r] for r in STEP_ROWS)
        return f"{a:.2f} ms / {b:.2f} ms, paired median ratio {row['ratio']:.2f}"
    a, b = row["iteration_ms"]["muon_layer_wise"], row["iteration_ms"]["adamw"]
    return f"{a:.1f} ms / {b:.1f} ms = {row['ratio']:.2f}"


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                        platform.machine())
    except OSError:
        return platform.machine()


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
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    for name in ("hidden", "layers", "heads", "groups", "reference_size", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}.")
    shape = GptShape(args.hidden, args.layers, args.heads, args.groups)
    skip = cuda_skip_reason(args.dry_run)
    device = torch.cuda.get_device_name() if skip is None else f"cpu ({cpu_name()})"
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as directory:
        checks = [gpu_tests(skip), newton_schulz(args, shape, "medium", skip),
                  newton_schulz(args, shape, "highest", skip), optimizer_steps(args, shape, skip),
                  pretrain_iterations(args, skip, directory)]
    record = {"dry_run": skip is not None, "skip_reason": skip, "device": device, "torch": torch.__version__,
              "native_bf16_matmul": native_bf16_matmul(torch.device("cpu" if skip else "cuda")),
              "transformer_engine": importlib.util.find_spec("transformer_engine") is not None,
              "model": shape.describe(), "seconds": time.perf_counter() - start, "checks": checks}
    os.makedirs(args.out, exist_ok=True)
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
