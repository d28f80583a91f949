"""`make demo`: train a small megatron-core GPTModel on CPU with get_megatron_optimizer.

A single process (gloo, world size 1) learns a generated language: each sequence follows
x[t+1] = (a * x[t] + b) mod vocab for a rule (a, b) drawn from a small set, so the loss falls
from ln(vocab) towards the entropy of the first tokens. The lr follows megatron-core's
OptimizerParamScheduler. Until scripts/pretrain_gpt.py exists, this is the main job.
"""

import argparse
import importlib.util
import math
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_eopt import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from scripts.data import rule_batch  # noqa: E402
from scripts.gpt_model import (  # noqa: E402
    GPTModelSettings,
    build_gpt_model,
    destroy_model_parallel,
    gpt_loss,
    initialize_model_parallel,
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizer", default="adam", help="adam or sgd")
    parser.add_argument("--train-iters", type=int, default=80)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--bf16", action="store_true", help="bf16 model with fp32 main params")
    parser.add_argument("--log-interval", type=int, default=10)
    return parser.parse_args()


def describe_environment() -> str:
    optional = {name: importlib.util.find_spec(name) is not None for name in ("transformer_engine", "apex")}
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    extras = ", ".join(f"{name} {'found' if found else 'absent'}" for name, found in optional.items())
    return f"torch {torch.__version__} on {device}; {extras}"


def main() -> None:
    args = parse_args()
    print(f"> {describe_environment()}")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    initialize_model_parallel(tensor_model_parallel_size=1, seed=1234)
    settings = GPTModelSettings(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                                ffn_hidden_size=128, vocab_size=64, seq_length=32, bf16=args.bf16)
    model = build_gpt_model(settings)
    config = OptimizerConfig(optimizer=args.optimizer, lr=args.lr, min_lr=args.lr / 10,
                             weight_decay=0.01, clip_grad=1.0, bf16=args.bf16)
    optimizer = get_megatron_optimizer(config, [model])
    scheduler = _scheduler(optimizer, args)
    print(f"> {sum(p.numel() for p in model.parameters()):,} parameters in "
          f"{len(optimizer.param_groups)} param groups: "
          + ", ".join(f"{g['group_key']} ({len(g['params'])})" for g in optimizer.param_groups))

    generator = torch.Generator().manual_seed(0)
    start, first_loss, loss = time.perf_counter(), None, None
    for iteration in range(1, args.train_iters + 1):
        optimizer.zero_grad()
        loss = gpt_loss(model, rule_batch(16, settings.seq_length + 1, settings.vocab_size, generator))
        loss.backward()
        ok, grad_norm, _ = optimizer.step()
        if ok:
            scheduler.step(1)
        first_loss = loss.item() if first_loss is None else first_loss
        if iteration % args.log_interval == 0 or iteration == 1:
            elapsed_ms = (time.perf_counter() - start) * 1000 / iteration
            print(f" iteration {iteration:4d}/{args.train_iters} | lr {optimizer.param_groups[0]['lr']:.3e} | "
                  f"loss {loss.item():.4f} | grad norm {grad_norm:.3f} | "
                  f"skipped {0 if ok else 1} | {elapsed_ms:.1f} ms/iter")
    print(f"> loss {first_loss:.3f} -> {loss.item():.3f} (ln vocab = {math.log(settings.vocab_size):.3f})")
    destroy_model_parallel()
    dist.destroy_process_group()


def _scheduler(optimizer, args: argparse.Namespace):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.lr / 10, lr_warmup_steps=5,
        lr_decay_steps=args.train_iters, lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
        wd_incr_steps=args.train_iters, wd_incr_style="constant",
    )


if __name__ == "__main__":
    main()
