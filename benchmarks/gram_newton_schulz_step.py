"""Gram Newton-Schulz: Muon step time and FLOPs against our standard iteration and megatron-core.

Two GPT weight sets at hidden h, each `--layers` times: FFN-heavy, fc1 (4h x h) and fc2
(h x 4h) (4:1), and square, q and proj (h x h). Rows per precision ('highest': fp32,
'medium': bf16 products): megatron-core's TensorParallelMuon (its factory's kwargs), our
TensorParallelMuon with the standard iteration, and with `gram_newton_schulz=True`; with
`--package`, at 'medium' also through the gram-newton-schulz package (its kernels on CUDA, its
float16 torch path elsewhere). FLOPs are the matmul FLOPs of Newton-Schulz per step
(ops/gram_newton_schulz.py counts them exactly).

    python benchmarks/gram_newton_schulz_step.py [--hidden 1024] [--layers 2] [--device cuda] [--package] [--json PATH]
"""

import argparse

import torch
from _gpt import GptShape
from _timing import interleaved_times, medians, write_json

from megatron_eopt.ops.gram_newton_schulz import gram_flops, restart_steps, standard_flops
from megatron_eopt.ops.newton_schulz import NewtonSchulzSettings
from megatron_eopt.optimizers.muon.tensor_parallel_muon import TensorParallelMuon

LR, WEIGHT_DECAY, STEPS = 1e-3, 0.1, 5


def weights(kind: str, hidden: int, layers: int, device: torch.device) -> torch.nn.Module:
    shapes = [(4 * hidden, hidden), (hidden, 4 * hidden)] if kind == "ffn_heavy" else [(hidden, hidden)] * 2
    model = torch.nn.Module()
    model.config = GptShape(hidden).model_config()  # megatron-core's kwargs read the qkv split from it
    for i, shape in enumerate(shapes * layers):
        model.register_parameter(f"w{i}", torch.nn.Parameter(torch.randn(shape, device=device) * 0.02))
    return model


def mcore_step(model: torch.nn.Module, precision: str):
    from megatron.core.optimizer import OptimizerConfig as McoreConfig
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon as McoreMuon
    from megatron.core.optimizer.emerging_optimizers import _muon_config_to_kwargs

    for p in model.parameters():
        p.is_qkv = False
    kwargs = _muon_config_to_kwargs(McoreConfig(optimizer="muon", lr=LR, weight_decay=WEIGHT_DECAY), [model], None)
    return McoreMuon(list(model.parameters()), **{**kwargs, "fp32_matmul_prec": precision}).step


def eopt_step(model: torch.nn.Module, precision: str, gram: bool, package: bool = False):
    names, params = zip(*model.named_parameters())
    return TensorParallelMuon([{"params": list(params), "param_fqns": list(names)}], lr=LR, momentum=0.95,
                              nesterov=False, weight_decay=WEIGHT_DECAY, fp32_matmul_prec=precision, gram_newton_schulz=gram,
                              gram_newton_schulz_package=package).step


def flops(model: torch.nn.Module, precision: str, gram: bool) -> int:
    settings, total = NewtonSchulzSettings(gram=gram), 0
    for p in model.parameters():
        m, n = min(p.shape), max(p.shape)
        takes_gram = settings.takes_gram_path(*p.shape, precision)
        total += gram_flops(m, n, STEPS, restart_steps(STEPS)) if takes_gram else standard_flops(m, n, STEPS)
    return total


def measure(kind: str, precision: str, args, device: torch.device) -> dict:
    rows = {"mcore": None, "eopt_standard": False, "eopt_gram": True}
    if args.package and precision == "medium":
        rows["eopt_gram_package"] = True
    torch.manual_seed(0)
    models = {row: weights(kind, args.hidden, args.layers, device) for row in rows}
    for model in models.values():
        model.load_state_dict(models["mcore"].state_dict())
    steps = {row: mcore_step(models[row], precision) if gram is None
             else eopt_step(models[row], precision, gram, row == "eopt_gram_package") for row, gram in rows.items()}
    grads = [torch.randn_like(p) for p in models["mcore"].parameters()]

    def prepare(model: torch.nn.Module):
        return lambda: [setattr(p, "grad", g.clone()) for p, g in zip(model.parameters(), grads)]

    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    times = medians(interleaved_times(steps, {r: prepare(models[r]) for r in rows}, args.warmup, args.repeats,
                                      before=sync, after=sync))
    return {row: {"seconds": times[row], "gflop": flops(models[row], precision, bool(gram)) / 1e9}
            for row, gram in rows.items()} | {"gram_over_mcore": times["eopt_gram"] / times["mcore"],
                                               "gram_over_standard": times["eopt_gram"] / times["eopt_standard"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--precisions", default="highest,medium")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--package", action="store_true", help="add the gram-newton-schulz package row ('medium')")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    device = torch.device(args.device)
    results = {}
    print(f"hidden {args.hidden}, {args.layers} layers, {STEPS} Newton-Schulz steps (quintic), {device}")
    print(f"  {'weights':10} {'precision':9} {'row':17} {'GFLOP':>8} {'ms':>9}  gram/mcore  gram/standard")
    for precision in args.precisions.split(","):
        for kind in ("ffn_heavy", "square"):
            result = results[f"{kind} {precision}"] = measure(kind, precision, args, device)
            for row in [row for row in result if row.startswith(("mcore", "eopt_"))]:
                ratios = (f"  {result['gram_over_mcore']:10.3f}  {result['gram_over_standard']:13.3f}"
                          if row == "eopt_gram" else
                          f"  {result[row]['seconds'] / result['eopt_gram']['seconds']:10.3f} x eopt_gram"
                          if row == "eopt_gram_package" else "")
                print(f"  {kind:10} {precision:9} {row:17} {result[row]['gflop']:8.1f} "
                      f"{1e3 * result[row]['seconds']:9.1f}{ratios}", flush=True)
    if args.json:
        write_json(args.json, {"hidden": args.hidden, "layers": args.layers, "device": str(device), "rows": results})


if __name__ == "__main__":
    main()
