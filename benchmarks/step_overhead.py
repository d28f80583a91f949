"""Optimizer step time of get_megatron_optimizer('adam') against plain torch AdamW + clip_grad_norm_.

Both step the same GPT-shaped fp32 weights (hidden 1024, 8 layers, GQA, SwiGLU by default)
with the same gradients; the ratio is the cost of megatron-core's contract (inf/NaN check,
global norm, clipping, wrappers). Median of several steps after warm-up, the two interleaved,
one process, CPU. Prints numbers; asserts nothing.

    python benchmarks/step_overhead.py [--json PATH]
"""

import argparse

import torch


from _gpt import GptShape, GptWeights, add_shape_arguments, shape_from
from _timing import interleaved_times, medians, write_json

from megatron_eopt import OptimizerConfig, get_megatron_optimizer


def set_grads(model: torch.nn.Module, grads: list[torch.Tensor]) -> None:
    for p, g in zip(model.parameters(), grads):
        p.grad = g.clone()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_arguments(parser, GptShape())
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", metavar="PATH", help="also write the numbers here")
    args = parser.parse_args()
    torch.manual_seed(0)
    ours, plain = GptWeights(shape_from(args)), GptWeights(shape_from(args))
    plain.load_state_dict(ours.state_dict())
    grads = [torch.randn_like(p) for p in ours.parameters()]
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-4, weight_decay=0.1, clip_grad=1.0), ours,
                                       config_overrides={})
    torch_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-4, weight_decay=0.1)

    def torch_step() -> None:
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        torch_optimizer.step()

    seconds = medians(interleaved_times(
        {"megatron_eopt adam": optimizer.step, "torch AdamW + clip": torch_step},
        {"megatron_eopt adam": lambda: set_grads(ours, grads), "torch AdamW + clip": lambda: set_grads(plain, grads)},
        args.warmup, args.repeats,
    ))
    params = sum(p.numel() for p in ours.parameters())
    ratio = seconds["megatron_eopt adam"] / seconds["torch AdamW + clip"]
    print(f"{params / 1e6:.1f}M fp32 parameters, {torch.get_num_threads()} threads, torch {torch.__version__}")
    for name, s in seconds.items():
        print(f"{name:20} {s * 1e3:8.1f} ms")
    print(f"ratio (ours / torch) {ratio:8.3f}")
    write_json(args.json, {"model": shape_from(args).describe(), "parameters": params, "repeats": args.repeats,
                           "step_ms": {n: s * 1e3 for n, s in seconds.items()}, "ratio": ratio})


if __name__ == "__main__":
    main()
