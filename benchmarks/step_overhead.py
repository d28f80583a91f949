"""Optimizer step time of get_megatron_optimizer('adam') against plain torch AdamW + clip_grad_norm_.

Both step the same GPT-shaped fp32 weights (hidden 1024, 8 layers, GQA, SwiGLU by default)
with the same gradients; the ratio is the cost of megatron-core's contract (inf/NaN check,
global norm, clipping, wrappers). Median of several steps after warm-up, one process, CPU.
Prints numbers; asserts nothing.
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_eopt import OptimizerConfig, get_megatron_optimizer  # noqa: E402


def gpt_weight_shapes(hidden: int, layers: int, heads: int, groups: int, ffn: int) -> dict[str, tuple]:
    kv = hidden // heads
    shapes = {}
    for i in range(layers):
        prefix = f"decoder.layers.{i}."
        shapes[prefix + "self_attention.linear_qkv.weight"] = (hidden + 2 * groups * kv, hidden)
        shapes[prefix + "self_attention.linear_proj.weight"] = (hidden, hidden)
        shapes[prefix + "mlp.linear_fc1.weight"] = (2 * ffn, hidden)
        shapes[prefix + "mlp.linear_fc2.weight"] = (hidden, ffn)
        shapes[prefix + "input_layernorm.weight"] = (hidden,)
        shapes[prefix + "pre_mlp_layernorm.weight"] = (hidden,)
    return shapes


class Weights(torch.nn.Module):
    def __init__(self, shapes: dict[str, tuple]) -> None:
        super().__init__()
        self.names = list(shapes)
        for index, shape in enumerate(shapes.values()):
            self.register_parameter(f"p{index}", torch.nn.Parameter(torch.randn(shape) * 0.02))


def time_steps(step, model: torch.nn.Module, grads: list[torch.Tensor], warmup: int, repeats: int) -> float:
    times = []
    for i in range(warmup + repeats):
        for p, g in zip(model.parameters(), grads):
            p.grad = g.clone()
        start = time.perf_counter()
        step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    shapes = gpt_weight_shapes(args.hidden, args.layers, heads=16, groups=4, ffn=int(args.hidden * 2.75))
    torch.manual_seed(0)
    ours, plain = Weights(shapes), Weights(shapes)
    plain.load_state_dict(ours.state_dict())
    grads = [torch.randn_like(p) for p in ours.parameters()]
    config = OptimizerConfig(lr=1e-4, weight_decay=0.1, clip_grad=1.0)
    optimizer = get_megatron_optimizer(config, ours, config_overrides={})
    torch_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-4, weight_decay=0.1)

    def torch_step() -> None:
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        torch_optimizer.step()

    t_ours = time_steps(optimizer.step, ours, grads, warmup=2, repeats=args.repeats)
    t_torch = time_steps(torch_step, plain, grads, warmup=2, repeats=args.repeats)
    params = sum(p.numel() for p in ours.parameters())
    print(f"{params / 1e6:.1f}M fp32 parameters, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"megatron_eopt adam step      {t_ours * 1e3:8.1f} ms")
    print(f"torch AdamW + clip_grad_norm_ {t_torch * 1e3:8.1f} ms")
    print(f"ratio (ours / torch)          {t_ours / t_torch:8.3f}")


if __name__ == "__main__":
    main()
