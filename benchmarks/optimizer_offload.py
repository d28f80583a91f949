"""`optimizer_cpu_offload` on one device: optimizer memory per parameter and step time, with and without.

A GPT's 2-D weights (per layer: qkv, proj, fc1, fc2 at `--hidden`, bf16), the precision-aware
optimizer (bf16 moments, parameter remainders), Adam or Muon, with the offload fraction 0 and 1.
Per row: the device bytes the optimizer holds between steps (state and main weights: tensors
reachable from it on the device, the model's own left out) per parameter, the step's peak
device memory above the model's weights and gradients, the median step time, and the largest
difference of the weights from the run without offload after the same steps (0 on CPU). Prints
numbers, asserts none; `make gpu-check` and tests/unit/library/offload/test_host_resident_gpu.py run it.

    python benchmarks/optimizer_offload.py [--hidden 2048] [--layers 4] [--device cuda] [--steps 5]
"""

import argparse
import statistics
import time

import torch

from megatron_eopt import OptimizerConfig, get_megatron_optimizer

ROWS = ("adam", "muon")


def gpt_weights(hidden: int, layers: int, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    shapes = [(3 * hidden, hidden), (hidden, hidden), (4 * hidden, hidden), (hidden, 4 * hidden)]
    model = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(s, device=device) * 0.02)
                                   for _ in range(layers) for s in shapes)
    return model.to(torch.bfloat16)


def device_bytes(optimizer, model: torch.nn.Module) -> int:
    """Bytes on the device the optimizer holds (state, main weights, remainders), model's own left out."""
    model_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, total = set(), 0
    for child in optimizer.chained_optimizers:
        for tensor in child._owned_tensors():
            storage = tensor.untyped_storage()
            if tensor.device.type == "cpu" or storage.data_ptr() in model_storages | seen:
                continue
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def measure(name: str, hidden: int, layers: int, device: torch.device, offload: bool, steps: int) -> dict:
    model = gpt_weights(hidden, layers, device)
    config = OptimizerConfig(optimizer=name, lr=1e-3, bf16=True, use_precision_aware_optimizer=True,
                             exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16,
                             optimizer_cpu_offload=offload, optimizer_offload_fraction=1.0,
                             overlap_cpu_optimizer_d2h_h2d=True, clip_grad=0.0)
    optimizer = get_megatron_optimizer(config, [model], config_overrides={})
    generator = torch.Generator(device=device).manual_seed(1)
    numel = sum(p.numel() for p in model.parameters())
    times, peak = [], 0
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=generator, device=device).to(p.dtype)
        sync(device)
        before = memory(device)
        reset_peak(device)
        start = time.perf_counter()
        optimizer.step()
        sync(device)
        times.append(time.perf_counter() - start)
        peak = max(peak, peak_memory(device) - before)
        optimizer.zero_grad()
    return {"optimizer": name, "offload": offload, "bytes_per_param": device_bytes(optimizer, model) / numel,
            "step_peak_bytes_per_param": peak / numel, "step_ms": statistics.median(times[1:] or times) * 1e3,
            "weights": [p.detach().float().cpu() for p in model.parameters()]}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def compare(name: str, hidden: int, layers: int, device: torch.device, steps: int) -> dict:
    """Both runs of one optimizer, and how far the offloaded weights are from the others."""
    plain, offloaded = (measure(name, hidden, layers, device, offload, steps) for offload in (False, True))
    difference = max((a - b).abs().max().item() for a, b in zip(plain.pop("weights"), offloaded.pop("weights")))
    return {"optimizer": name, "without": plain, "with": offloaded, "max_weight_difference": difference,
            "step_time_ratio": offloaded["step_ms"] / plain["step_ms"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    for name in ROWS:
        row = compare(name, args.hidden, args.layers, torch.device(args.device), args.steps)
        print(f"{name}: device bytes/param {row['without']['bytes_per_param']:.3f} -> {row['with']['bytes_per_param']:.3f}, "
              f"step peak bytes/param {row['without']['step_peak_bytes_per_param']:.3f} -> "
              f"{row['with']['step_peak_bytes_per_param']:.3f}, step {row['without']['step_ms']:.2f} ms -> "
              f"{row['with']['step_ms']:.2f} ms (x{row['step_time_ratio']:.2f}), "
              f"max weight difference {row['max_weight_difference']:.3g}")


if __name__ == "__main__":
    main()
