"""`make bench`: every benchmark in turn, then one table of the headline ratios against their targets.

Each benchmark prints its own table and writes benchmarks/results/<name>.json (git-ignored:
the numbers belong to the machine; docs/performance.md records one run); this adds
benchmarks/results/summary.json. Sizes are chosen so the whole run takes a few minutes on
2 CPU cores; every script takes --hidden/--layers for larger runs.
"""

import json
import os
import subprocess
import sys
import time
from typing import Optional

import torch

from megatron_eopt.runtime.hardware import cpu_model, native_bf16_matmul

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
TORCHRUN = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone"]
PYTHON = [sys.executable]
MAIN = ["--hidden", "1024", "--layers", "2"]  # the fp32 comparisons: a hidden-1024 GPT's matrix shapes
SMALL = ["--hidden", "256", "--layers", "2"]  # the defaults note: bf16 is ~1-3 GFLOP/s on CPUs without bf16 instructions

BENCHMARKS = {
    "step_defaults": PYTHON + ["optimizer_step.py", *SMALL, "--repeats", "3"],
    "step_fp32": PYTHON + ["optimizer_step.py", *MAIN, "--repeats", "7",
                           "--rows", "eopt_muon_class,mcore_muon_fp32,eopt_muon_highest,torch_adamw"],
    "step_medium": PYTHON + ["optimizer_step.py", *MAIN, "--repeats", "3", "--rows", "eopt_muon_medium,mcore_muon"],
    "newton_schulz": PYTHON + ["newton_schulz_efficiency.py", *MAIN, "--repeats", "3"],
    "adam_overhead": PYTHON + ["step_overhead.py", *MAIN],
    "layer_wise": TORCHRUN + ["--nproc-per-node", "2", "layer_wise_vs_replicated.py"],
    "tp_modes": TORCHRUN + ["--nproc-per-node", "2", "tp_modes.py"],
    "tp_modes_4": TORCHRUN + ["--nproc-per-node", "4", "tp_modes.py"],
    "memory": TORCHRUN + ["--nproc-per-node", "4", "memory.py"],
    "precision_memory": TORCHRUN + ["--nproc-per-node", "4", "precision_memory.py"],
    "moe_experts": PYTHON + ["moe_experts.py", "--repeats", "3"],
    "fsdp2_2": TORCHRUN + ["--nproc-per-node", "2", "fsdp2_step.py", "--hidden", "256", "--layers", "4"],
    "fsdp2_4": TORCHRUN + ["--nproc-per-node", "4", "fsdp2_step.py", "--hidden", "256", "--layers", "4"],
    "fsdp2_polargrad_2": TORCHRUN + ["--nproc-per-node", "2", "fsdp2_whole_matrix_step.py", "--optimizer",
                                     "polargrad", "--hidden", "256", "--layers", "2"],
    "megatron_fsdp_2": TORCHRUN + ["--nproc-per-node", "2", "megatron_fsdp_step.py", "--hidden", "256", "--layers", "4"],
    "grad_reduce_overlap": TORCHRUN + ["--nproc-per-node", "2", "grad_reduce_overlap.py"],
    "gram_newton_schulz": PYTHON + ["gram_newton_schulz_step.py", *MAIN, "--repeats", "3"],
    "per_head_qkv": PYTHON + ["per_head_qkv.py", *MAIN, "--repeats", "5"],
    "fused_layouts": PYTHON + ["fused_layouts.py", "--hidden", "1024", "--repeats", "3"],
    "async_save": PYTHON + ["async_save.py", "--tokens", "256", "--threads", "1"],
}
GPU_BENCHMARKS = {  # bf16 (fp32_matmul_prec 'medium', the library defaults on GPUs)
    "gpu_step": PYTHON + ["optimizer_step.py", "--device", "cuda", "--hidden", "4096", "--layers", "4",
                          "--repeats", "10", "--warmup", "3", "--rows", "eopt_muon,mcore_muon,torch_muon,torch_adamw"],
    "gpu_newton_schulz": PYTHON + ["newton_schulz_efficiency.py", "--device", "cuda", "--precision", "medium",
                                   "--hidden", "4096", "--layers", "4", "--reference-size", "8192",
                                   "--repeats", "10", "--warmup", "3"],
    "gpu_moe_experts": PYTHON + ["moe_experts.py", "--device", "cuda", "--precision", "medium",
                                 "--repeats", "10", "--warmup", "3"],
}


def run(name: str, command: list[str]) -> Optional[dict]:
    path = os.path.join(RESULTS, f"{name}.json")
    if os.path.exists(path):
        os.remove(path)  # never report a previous run's numbers
    print(f"\n== {name}: {' '.join(os.path.basename(c) if c.startswith('/') else c for c in command)}", flush=True)
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    start = time.perf_counter()
    subprocess.run(command + ["--json", path], cwd=HERE, env=env, check=True)
    print(f"   ({time.perf_counter() - start:.0f} s)", flush=True)
    with open(path) as f:
        return json.load(f)


def gpu_skip_reason() -> Optional[str]:
    if torch.cuda.is_available():
        return None
    return (f"torch.cuda.is_available() is False (torch {torch.__version__}, "
            f"CUDA build {torch.version.cuda or 'none'}, {torch.cuda.device_count()} devices)")


# (label, result, path into its JSON, target, 'max' or 'min'). Step comparisons are at equal
# precision: each library's defaults can differ in precision (megatron-core's 'medium' is bf16),
# so that comparison is only a note (INFO), never a target.
TARGETS = [
    ("Muon step, fp32 ('highest') both: our factory step / megatron-core", "step_fp32",
     ("ratios", "highest: eopt_muon_highest / mcore_muon_fp32"), 0.9, "max"),
    ("Muon step, bf16 NS ('medium') both: our factory step / megatron-core", "step_medium",
     ("ratios", "medium: eopt_muon_medium / mcore_muon"), 0.9, "max"),
    ("Muon step, fp32 both, same blocks: our class / megatron-core", "step_fp32",
     ("ratios", "fp32: eopt_muon_class / mcore_muon_fp32"), 1.0, "max"),
    ("Newton-Schulz GFLOP/s / large fp32 matmul GFLOP/s", "newton_schulz", ("rows", "total", "ratio"), 0.85, "min"),
    ("Layer-wise DP=2 / replicated DP=2 step", "layer_wise", ("step_ratio",), 0.6, "max"),
    ("Sharded TP=2 / duplicated TP=2 step", "tp_modes", ("ratio_to_duplicated", "sharded"), 0.6, "max"),
    ("Layer-wise DP=4 / replicated state per rank", "memory",
     ("rows", "layer-wise muon DP=4", "ratio_to_replicated_muon"), 0.3, "max"),
    # 4 bytes per parameter; the 0.001 is the optimizer's fixed scalar tensors (tens of bytes in
    # all, e.g. 68 at 11M parameters), which no parameter count turns into a per-parameter cost.
    ("Muon matrices, bf16 + remainders + bf16 momentum: optimizer bytes/param beyond the model", "precision_memory",
     ("rows", "muon replicated precision-aware", "muon_matrix_bytes_per_param"), 4.001, "max"),
    ("MoE, 64 experts 256x704 SwiGLU: batched / one Newton-Schulz call per matrix", "moe_experts",
     ("ratios", "batched / per_matrix"), 0.5, "max"),
    ("FSDP2 Muon step / redundant (full_tensor + NS on every rank), FSDP=2", "fsdp2_2", ("step_ratio",), 0.6, "max"),
    ("FSDP2 Muon step / redundant (full_tensor + NS on every rank), FSDP=4", "fsdp2_4", ("step_ratio",), 0.6, "max"),
    ("FSDP2 state per rank at FSDP=4 / unsharded", "fsdp2_4", ("state_ratio",), 0.3, "max"),
    ("--async-save: iteration with a save in flight / normal iteration", "async_save", ("stall_ratio",), 1.2, "max"),
    ("Muon step, FFN-heavy 4:1, bf16 both: Gram Newton-Schulz / megatron-core", "gram_newton_schulz",
     ("rows", "ffn_heavy medium", "gram_over_mcore"), 0.7, "max"),
]
INFO = [
    ("Note (not a target): each library's defaults, ours / megatron-core", "step_defaults",
     ("ratios", "defaults: eopt_muon / mcore_muon")),
    ("Muon step, defaults: ours / torch.optim.Muon", "step_defaults", ("ratios", "eopt_muon / torch_muon")),
    ("Muon step, fp32: our factory step / torch.optim.AdamW", "step_fp32",
     ("ratios", "highest: eopt_muon_highest / torch_adamw")),
    ("Adam step: ours / torch AdamW + clip", "adam_overhead", ("ratio",)),
    ("Distributed TP=2 / duplicated TP=2 step", "tp_modes", ("ratio_to_duplicated", "distributed")),
    ("TP=2 step: auto / duplicated", "tp_modes", ("ratio_to_duplicated", "auto")),
    ("TP=2 step: auto / the fastest fixed mode", "tp_modes", ("auto_over_fastest_fixed",)),
    ("TP=4 step: sharded / duplicated", "tp_modes_4", ("ratio_to_duplicated", "sharded")),
    ("TP=4 step: distributed / duplicated", "tp_modes_4", ("ratio_to_duplicated", "distributed")),
    ("TP=4 step: auto / duplicated", "tp_modes_4", ("ratio_to_duplicated", "auto")),
    ("TP=4 step: auto / the fastest fixed mode", "tp_modes_4", ("auto_over_fastest_fixed",)),
    ("Layer-wise DP=2 / replicated state per rank", "memory",
     ("rows", "layer-wise muon DP=2", "ratio_to_replicated_muon")),
    ("Muon, whole model (adam norms): precision-aware bytes/param beyond the model", "precision_memory",
     ("rows", "muon replicated precision-aware", "bytes_per_param")),
    ("Adam: precision-aware / fp32-state optimizer bytes per parameter", "precision_memory",
     ("ratios", "adam replicated")),
    ("Muon layer-wise DP=4, precision-aware: optimizer bytes/param on the largest rank", "precision_memory",
     ("rows", "muon layer-wise precision-aware", "bytes_per_param")),
    ("Muon FSDP2 over 4, bf16 momentum: optimizer bytes/param on the largest rank", "precision_memory",
     ("rows", "muon fsdp2 precision-aware", "bytes_per_param")),
    ("MoE experts: batched / megatron-core TensorParallelMuon step (fc1 whole there)", "moe_experts",
     ("ratios", "batched / mcore_muon")),
    ("FSDP2 FSDP=4 bytes exchanged / two shard volumes per matrix", "fsdp2_4", ("exchanged_over_bound",)),
    ("FSDP2 polargrad step, one owner per matrix / gather everywhere, FSDP=2", "fsdp2_polargrad_2", ("step_ratio",)),
    ("Megatron-FSDP DP=2 Muon step / unsharded", "megatron_fsdp_2", ("ratio_to_unsharded",)),
    ("Megatron-FSDP DP=2 Muon step / FSDP2 DP=2", "megatron_fsdp_2", ("ratio_to_fsdp2",)),
    ("Megatron-FSDP DP=2 optimizer state per rank / unsharded", "megatron_fsdp_2", ("state_ratio",)),
    ("DP=2 iteration, --overlap-grad-reduce / all-reduce after backward", "grad_reduce_overlap", ("overlap_ratio",)),
    ("Muon step, FFN-heavy 4:1, fp32 both: Gram Newton-Schulz / megatron-core", "gram_newton_schulz",
     ("rows", "ffn_heavy highest", "gram_over_mcore")),
    ("Muon step, square, bf16: with the Gram flag / standard (square blocks stay standard)", "gram_newton_schulz",
     ("rows", "square medium", "gram_over_standard")),
    ("linear_qkv Muon step, fp32: per head / per q, k, v (muon_split_qkv_per_head)", "per_head_qkv",
     ("step_ratio",)),
    ("linear_qkv Newton-Schulz FLOPs: per head / per q, k, v", "per_head_qkv", ("flop_ratio",)),
    ("Fused MLA/Mamba/GDN weights, Newton-Schulz FLOPs: per component / whole", "fused_layouts", ("flop_ratio",)),
    ("MLA linear_kv_up_proj Muon step, fp32: per head key/value / whole", "fused_layouts", ("mla_kv_up_step_ratio",)),
    ("Mamba in_proj Muon step, fp32: [z, x, B, C, dt] / whole", "fused_layouts", ("mamba_step_ratio",)),
]


def lookup(results: dict, name: str, path: tuple) -> float:
    value = results[name]
    for key in path:
        value = value[key]
    return value


def summarize(results: dict, seconds: float, skip: Optional[str]) -> dict:
    cpu = cpu_model()
    native = native_bf16_matmul(torch.device("cpu"))
    print(f"\n== summary: {cpu}, {os.cpu_count()} CPUs, torch {torch.__version__}, {seconds:.0f} s, "
          f"bf16 matrix products {'native' if native else 'emulated'} on this CPU")
    print(f"  {'measurement':72} {'value':>7} {'target':>8}  met")
    rows = []
    for label, name, path, target, kind in TARGETS:
        value = lookup(results, name, path)
        met = value <= target if kind == "max" else value >= target
        rows.append({"measurement": label, "value": value, "target": f"{'<=' if kind == 'max' else '>='} {target}",
                     "met": met})
        print(f"  {label:72} {value:7.3f} {rows[-1]['target']:>8}  {'yes' if met else 'NO'}")
    for label, name, path in INFO:
        rows.append({"measurement": label, "value": lookup(results, name, path)})
        print(f"  {label:72} {rows[-1]['value']:7.3f}")
    print(f"  GPU section: {'skipped, ' + skip if skip else 'ran (gpu_step.json, gpu_newton_schulz.json, gpu_moe_experts.json)'}")
    return {"cpu": cpu, "cpus": os.cpu_count(), "native_bf16_matmul": native, "torch": torch.__version__,
            "seconds": seconds, "rows": rows,
            "gpu_skipped": skip, "results": results}


def main() -> None:
    os.makedirs(RESULTS, exist_ok=True)
    start = time.perf_counter()
    results = {name: run(name, command) for name, command in BENCHMARKS.items()}
    skip = gpu_skip_reason()
    if skip:
        print(f"\n== GPU section skipped: {skip}")
    else:
        results.update({name: run(name, command) for name, command in GPU_BENCHMARKS.items()})
    summary = summarize(results, time.perf_counter() - start, skip)
    with open(os.path.join(RESULTS, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
