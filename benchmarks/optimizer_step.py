"""Single-process optimizer step time on GPT-shaped weights: our Muon against megatron-core's,
torch.optim.Muon and torch.optim.AdamW.

Rows (all step only the 2-D weights, with the same gradients, lr 1e-3, weight decay 0.1):
- eopt_muon (library defaults), eopt_muon_highest, eopt_muon_medium: our full factory step;
- eopt_muon_class: our TensorParallelMuon with megatron-core's blocks, fp32: what mcore_muon_fp32
  computes, exactly;
- eopt_turbo_muon_highest, eopt_turbo_muon_gram_highest: Turbo-Muon ('aol' x 4), with and without Gram;
- mcore_muon, mcore_muon_fp32: megatron-core's TensorParallelMuon with its factory's kwargs, in
  bf16 ('medium') and fp32 ('highest') Newton-Schulz;
- torch_muon, torch_adamw, torch_adamw_fused: torch's optimizers.
Rows interleave in rounds after warm-up; times are medians, a ratio the median of per-round
ratios. Prints numbers; asserts nothing. docs/performance.md explains the comparisons.

    python benchmarks/optimizer_step.py [--rows eopt_muon,mcore_muon_fp32,...] [--device cuda] [--json PATH]
"""

import argparse
from typing import Callable

import torch


from _gpt import GptShape, GptWeights, add_shape_arguments, matrix_layout, shape_from
from _timing import interleaved_times, medians, paired_ratio, write_json

from megatron_eopt import OptimizerConfig, get_megatron_optimizer
from megatron_eopt.runtime.hardware import native_bf16_matmul
from megatron_eopt.optimizers.muon.tensor_parallel_muon import TensorParallelMuon

LR, WEIGHT_DECAY = 1e-3, 0.1
Step = Callable[[], object]


def eopt_muon(model: GptWeights, **overrides) -> Step:
    config = OptimizerConfig(optimizer="muon", lr=LR, weight_decay=WEIGHT_DECAY, **overrides)
    return get_megatron_optimizer(config, model, config_overrides={}).step


def eopt_muon_class(model: GptWeights, shape: GptShape) -> Step:
    names, params = zip(*model.named_parameters())
    layouts = {n: matrix_layout(n, tuple(p.shape), 1, shape) for n, p in zip(names, params) if "linear_qkv" in n}
    return TensorParallelMuon([{"params": list(params), "param_fqns": list(names)}], lr=LR, momentum=0.95,
                              nesterov=False, weight_decay=WEIGHT_DECAY, fp32_matmul_prec="highest", layouts=layouts).step


def mcore_muon(model: GptWeights, **overrides) -> Step:
    from megatron.core.optimizer import OptimizerConfig as McoreConfig
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon as McoreMuon
    from megatron.core.optimizer.emerging_optimizers import _muon_config_to_kwargs

    for name, p in model.named_parameters():
        p.is_qkv = name.endswith("linear_qkv.weight")  # what its factory's is_qkv_fn reads
    kwargs = _muon_config_to_kwargs(McoreConfig(optimizer="muon", lr=LR, weight_decay=WEIGHT_DECAY), [model], None)
    return McoreMuon(list(model.parameters()), **{**kwargs, **overrides}).step


def torch_muon(model: GptWeights) -> Step:
    return torch.optim.Muon(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY).step


def torch_adamw(model: GptWeights, **options) -> Step:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, **options).step


BUILDERS: dict[str, Callable[[GptWeights, GptShape], Step]] = {
    "eopt_muon": lambda model, shape: eopt_muon(model),
    "eopt_muon_highest": lambda model, shape: eopt_muon(model, muon_fp32_matmul_prec="highest"),
    "eopt_muon_medium": lambda model, shape: eopt_muon(model, muon_fp32_matmul_prec="medium"),
    "eopt_muon_class": eopt_muon_class,
    "eopt_turbo_muon_highest": lambda model, shape: eopt_muon(model, muon_fp32_matmul_prec="highest",
                                                              muon_aol_preconditioner=True),
    "eopt_turbo_muon_gram_highest": lambda model, shape: eopt_muon(model, muon_fp32_matmul_prec="highest",
                                                                   muon_aol_preconditioner=True,
                                                                   muon_gram_newton_schulz=True),
    "mcore_muon": lambda model, shape: mcore_muon(model),
    "mcore_muon_fp32": lambda model, shape: mcore_muon(model, fp32_matmul_prec="highest"),
    "torch_muon": lambda model, shape: torch_muon(model),
    "torch_adamw": lambda model, shape: torch_adamw(model),
    "torch_adamw_fused": lambda model, shape: torch_adamw(model, fused=True),
}
# (numerator, denominator) of the ratios reported when both rows ran.
RATIOS = {
    "defaults: eopt_muon / mcore_muon": ("eopt_muon", "mcore_muon"),
    "fp32: eopt_muon_class / mcore_muon_fp32": ("eopt_muon_class", "mcore_muon_fp32"),
    "highest: eopt_muon_highest / mcore_muon_fp32": ("eopt_muon_highest", "mcore_muon_fp32"),
    "medium: eopt_muon_medium / mcore_muon": ("eopt_muon_medium", "mcore_muon"),
    "Turbo-Muon (AOL, 4 steps): eopt_turbo_muon_highest / mcore_muon_fp32": ("eopt_turbo_muon_highest", "mcore_muon_fp32"),
    "Turbo-Muon + Gram: eopt_turbo_muon_gram_highest / mcore_muon_fp32": ("eopt_turbo_muon_gram_highest",
                                                                         "mcore_muon_fp32"),
    "eopt_muon / torch_muon": ("eopt_muon", "torch_muon"),
    "eopt_muon / torch_adamw": ("eopt_muon", "torch_adamw"),
    "highest: eopt_muon_highest / torch_adamw": ("eopt_muon_highest", "torch_adamw"),
}


def max_difference(a: GptWeights, b: GptWeights) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_arguments(parser, GptShape(hidden=1024, layers=2))
    parser.add_argument("--rows", default=",".join(BUILDERS), help="comma-separated, from: " + ", ".join(BUILDERS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", metavar="PATH", help="also write the numbers here")
    args = parser.parse_args()
    shape, rows, device = shape_from(args), args.rows.split(","), torch.device(args.device)
    models, steps, prepare = build_rows(shape, rows, device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    times = interleaved_times(steps, prepare, args.warmup, args.repeats, before=sync, after=sync)
    report(args, shape, models, times)


def build_rows(shape: GptShape, rows: list[str], device: torch.device) -> tuple[dict, dict, dict]:
    """(models, steps, prepare) per row: equal initial weights; `prepare` sets the same gradients."""
    unknown = [row for row in rows if row not in BUILDERS]
    if unknown:
        raise ValueError(f"unknown rows {unknown}; choose from {', '.join(BUILDERS)}.")
    torch.manual_seed(0)
    models = {row: GptWeights(shape, norms=False).to(device) for row in rows}
    for model in models.values():
        model.load_state_dict(models[rows[0]].state_dict())
    grads = [torch.randn_like(p) for p in models[rows[0]].parameters()]
    steps = {row: BUILDERS[row](models[row], shape) for row in rows}

    def set_grads(model: GptWeights) -> None:
        for p, g in zip(model.parameters(), grads):
            p.grad = g.clone()

    return models, steps, {row: (lambda m=models[row]: set_grads(m)) for row in rows}


def report(args, shape: GptShape, models: dict, times: dict) -> None:
    params = sum(p.numel() for p in next(iter(models.values())).parameters())
    seconds = medians(times)
    ratios = {name: paired_ratio(times, a, b) for name, (a, b) in RATIOS.items() if a in times and b in times}
    native = native_bf16_matmul(torch.device(args.device))
    print(f"{params / 1e6:.1f}M fp32 matrix parameters ({shape.describe()}), 1 process on {args.device}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}, median of {args.repeats} steps, "
          f"bf16 matrix products {'native' if native else 'emulated'}")
    for row, s in seconds.items():
        print(f"  {row:18} {s * 1e3:10.1f} ms")
    for name, ratio in ratios.items():
        print(f"  ratio {name:42} {ratio:.3f}")
    # Sanity: the same hyperparameters and blocks, so the two fp32 classes take the same steps.
    difference = None
    if "eopt_muon_class" in models and "mcore_muon_fp32" in models:
        difference = max_difference(models["eopt_muon_class"], models["mcore_muon_fp32"])
        print(f"  max |weight difference| eopt_muon_class vs mcore_muon_fp32: {difference:.1e}")
    write_json(args.json, {"model": shape.describe(), "device": args.device, "native_bf16_matmul": native,
                           "matrix_parameters": params,
                           "threads": torch.get_num_threads(),
                           "warmup": args.warmup, "repeats": args.repeats,
                           "step_ms": {row: s * 1e3 for row, s in seconds.items()}, "ratios": ratios,
                           "max_weight_difference_class_vs_mcore_fp32": difference})


if __name__ == "__main__":
    main()
