"""The stall of --async-save: iteration time while a checkpoint is written in the background,
divided by the normal iteration time (target <= 1.2), next to the synchronous save's time.

One process, CPU. An iteration is a forward/backward through GPT-shaped fp32 weights (each 2-D
weight applied to a batch of activations) and an Adam step (get_megatron_optimizer). A save is
megatron_eopt.checkpointing's: `start_save_checkpoint` copies the state to the CPU (the blocking
part, reported) and a thread writes, checksums, renames and moves `latest`; the iterations that
run until it is committed are the "in flight" ones. Prints numbers; asserts nothing.

    python benchmarks/async_save.py [--hidden 512 --layers 4] [--saves 3] [--threads N] [--json PATH]
"""

import argparse
import os
import statistics
import tempfile
import time

import torch

from _gpt import GptShape, GptWeights, add_shape_arguments, shape_from
from _timing import write_json

from megatron_eopt import OptimizerConfig, get_megatron_optimizer
from megatron_eopt.checkpointing import save_checkpoint, start_save_checkpoint


def iteration(model: torch.nn.Module, optimizer, batch: torch.Tensor) -> float:
    """Seconds of one forward/backward over every 2-D weight and one optimizer step."""
    start = time.perf_counter()
    optimizer.zero_grad()
    loss = sum((batch[:, :w.shape[1]] @ w.t()).square().mean() for w in model.parameters() if w.dim() == 2)
    loss.backward()
    optimizer.step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_arguments(parser, GptShape(hidden=512, layers=4))
    parser.add_argument("--tokens", type=int, default=1024, help="rows of the activation batch per iteration")
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--normal", type=int, default=8, help="iterations timed without a save")
    parser.add_argument("--threads", type=int, help="torch intra-op threads for training (default: torch's)")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shape = shape_from(args)
    model = GptWeights(shape)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-4), model, config_overrides={})
    batch = torch.randn(args.tokens, max(p.shape[1] for p in model.parameters() if p.dim() == 2))
    for _ in range(2):
        iteration(model, optimizer, batch)  # warm-up: optimizer state exists from here on
    record = {"shape": shape.describe(), "normal_s": [], "in_flight_s": [], "snapshot_s": [], "async_total_s": [],
              "sync_save_s": []}
    with tempfile.TemporaryDirectory() as directory:
        step = 0
        for save in range(args.saves):
            record["normal_s"] += [iteration(model, optimizer, batch) for _ in range(args.normal)]
            step += 1
            start = time.perf_counter()
            pending = start_save_checkpoint(directory, step, model, optimizer)
            record["snapshot_s"].append(time.perf_counter() - start)
            while not pending.done():
                record["in_flight_s"].append(iteration(model, optimizer, batch))
            pending.wait()
            record["async_total_s"].append(time.perf_counter() - start)
            step += 1
            start = time.perf_counter()
            save_checkpoint(directory, step, model, optimizer)
            record["sync_save_s"].append(time.perf_counter() - start)
    median = {key: statistics.median(value) for key, value in record.items() if isinstance(value, list) and value}
    record["stall_ratio"] = median["in_flight_s"] / median["normal_s"]
    record["medians_s"] = median
    print(f"model: {shape.describe()}, {sum(p.numel() for p in model.parameters()):,} parameters (fp32, Adam); "
          f"{torch.get_num_threads()} torch threads, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.0f}")
    print(f"normal iteration           {median['normal_s'] * 1e3:9.1f} ms  ({len(record['normal_s'])} iterations)")
    print(f"iteration, save in flight  {median['in_flight_s'] * 1e3:9.1f} ms  ({len(record['in_flight_s'])} iterations)")
    print(f"stall ratio (in flight / normal): {record['stall_ratio']:.2f}  (target <= 1.2)")
    print(f"async save: blocking copy {median['snapshot_s'] * 1e3:.1f} ms, committed after "
          f"{median['async_total_s'] * 1e3:.1f} ms; synchronous save {median['sync_save_s'] * 1e3:.1f} ms")
    write_json(args.json, record)


if __name__ == "__main__":
    main()
