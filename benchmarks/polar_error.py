"""Polar error of each Newton-Schulz variant: ||U V^T - NS(X)||_F / ||U V^T||_F against a float64 SVD.

Two sets of matrices:
- the Muon momenta of a real run: the demo's GPT (`make demo`'s model, data and Muon settings),
  trained here in one process, its momentum buffers taken after several iterations;
- heavy-tailed random matrices of the same shapes (Student-t entries, 3 degrees of freedom).

Variants: quintic x 5 (megatron-core's default), Turbo-Muon (AOL preconditioner, quintic x 4),
quintic x 4 alone, the 'aol' coefficients x 4 without the preconditioner (megatron-core's
`muon_coefficient_type='aol'`), polar_express x 5; each standard and Gram, in fp32 ('highest');
and the floor of every AOL-preconditioned iteration (`aol_floor`). Prints a markdown table (median
and worst over each set): docs/newton-schulz.md holds one.

    python benchmarks/polar_error.py [--iterations 20 60 120] [--seed 0]
"""

import argparse
import os
import statistics
import sys

import torch

from megatron_eopt.ops.aol import aol_preconditioned
from megatron_eopt.ops.newton_schulz import NewtonSchulzSettings
from megatron_eopt.ops.newton_schulz_steps import oriented_unit_input, restored_output

# (label, settings): each standard, then Gram (where it pays, as Muon would run it: `takes_gram_path`).
VARIANTS = {
    "quintic x 5": NewtonSchulzSettings(5, "quintic"),
    "Turbo-Muon: AOL, quintic x 4": NewtonSchulzSettings(4, "quintic", aol=True),
    "quintic x 4": NewtonSchulzSettings(4, "quintic"),
    "'aol' x 4 without AOL": NewtonSchulzSettings(4, "aol"),
    "polar_express x 5": NewtonSchulzSettings(5, "polar_express"),
}


def polar_factor(x: torch.Tensor) -> torch.Tensor:
    u, _, vh = torch.linalg.svd(x.double(), full_matrices=False)
    return u @ vh


def polar_error(x: torch.Tensor, y: torch.Tensor) -> float:
    polar = polar_factor(x)
    return ((polar - y.double()).norm() / polar.norm()).item()


def aol_floor(x: torch.Tensor) -> float:
    """The least polar error any Newton-Schulz on the AOL-preconditioned D X can reach, whatever its
    coefficients and steps. Each computes U' p(S') V'^T from D X = U' S' V'^T (p odd); D X has
    another polar factor than X, and the closest matrix U' S V'^T (S diagonal) to X's polar factor
    P has S = diag(U'^T P V'): the error left is sqrt(||P||^2 - sum S^2) / ||P||."""
    polar = polar_factor(x)
    unit, transposed = oriented_unit_input(x.double(), None, 1e-7, None)
    preconditioned, _ = aol_preconditioned(unit, transposed)
    u, _, vh = torch.linalg.svd(restored_output(preconditioned, transposed, torch.float64), full_matrices=False)
    closest = torch.diagonal(u.mT @ polar @ vh.mT)
    return ((polar.norm() ** 2 - (closest**2).sum()).clamp_min(0).sqrt() / polar.norm()).item()


def demo_momenta(iterations: list[int]) -> dict[str, torch.Tensor]:
    """Muon's momentum buffers of the demo's run at `iterations` (one process, its data and flags)."""
    from megatron_eopt.optimizers.muon.tensor_parallel_muon import TensorParallelMuon
    from megatron_eopt.training import demo, pretrain
    from megatron_eopt.training.corpus import prepare_stdlib_corpus

    taken: dict[str, torch.Tensor] = {}
    step, count = TensorParallelMuon.step, [0]

    def recording_step(self, *args, **kwargs):  # the benchmark's own wrapper: the library is unchanged
        result = step(self, *args, **kwargs)
        count[0] += 1
        if count[0] in iterations:
            for group in self.param_groups:
                for name, p in zip(group["param_fqns"], group["params"]):
                    buffer = self.state[p].get("momentum_buffer")
                    if buffer is not None and buffer.dim() == 2:
                        taken[f"{name} @ {count[0]}"] = buffer.detach().float().clone()
        return result

    muon = next(run for run in demo.RUNS if run.key == "muon")
    os.environ.update(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0")  # one process: the trainer's in-process store
    corpus = prepare_stdlib_corpus(verbose=False)
    argv = [*demo.COMMON_FLAGS, *corpus.trainer_flags(), *muon.flags, "--train-iters", str(max(iterations)),
            "--eval-interval", str(max(iterations) + 1), "--eval-iters", "0", "--lr", str(muon.lr),
            "--min-lr", str(muon.lr / 10), "--muon-fp32-matmul-prec", "highest"]
    TensorParallelMuon.step = recording_step
    try:
        pretrain.main(argv)
    finally:
        TensorParallelMuon.step = step
    return taken


def heavy_tailed(shapes: list[torch.Size], seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)  # torch.distributions samples from the global generator
    student = torch.distributions.StudentT(3.0)
    return {f"{tuple(shape)} #{i}": student.sample(shape).float() for i, shape in enumerate(shapes)}


def errors(matrices: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    table: dict[str, list[float]] = {}
    for label, settings in VARIANTS.items():
        for gram in (False, True):
            variant = NewtonSchulzSettings(settings.num_steps, settings.coefficient_type, gram=gram, aol=settings.aol)
            taking = sum(variant.takes_gram_path(*x.shape, "highest") for x in matrices.values())
            name = f"{label}{f', Gram (taken by {taking})' if gram else ''}"
            table[name] = [polar_error(x, variant.orthogonalize(x)) for x in matrices.values()]
    table["AOL's floor: the least any iteration on D X reaches"] = [aol_floor(x) for x in matrices.values()]
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, nargs="+", default=[20, 60, 120])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_float32_matmul_precision("highest")
    momenta = demo_momenta(args.iterations)
    sets = {f"demo GPT momenta ({len(momenta)}: iterations {', '.join(map(str, args.iterations))})": momenta,
            f"Student-t(3) matrices of the same shapes ({len(momenta)})":
                heavy_tailed([m.shape for m in momenta.values()], args.seed)}
    results = {name: errors(matrices) for name, matrices in sets.items()}
    print("shapes:", ", ".join(sorted({"x".join(map(str, m.shape)) for m in momenta.values()})))
    print("| Newton-Schulz | " + " | ".join(f"{name}: median / worst" for name in results) + " |")
    print("|---|" + "---|" * len(results))
    for variant in next(iter(results.values())):
        cells = [f"{statistics.median(r[variant]):.4f} / {max(r[variant]):.4f}" for r in results.values()]
        print(f"| {variant} | " + " | ".join(cells) + " |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
