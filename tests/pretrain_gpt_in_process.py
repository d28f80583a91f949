"""Run scripts/pretrain_gpt.py's `main` inside the distributed harness's worker processes.

A torchrun launch pays ~20 s of imports per process; the harness's workers have paid it once
for the whole session. `main` uses the process group it finds, so a test can run many
command lines (layouts, optimizers, resumes) in one world:

    records = run_distributed(run_pretrain_gpt, 4, args=(argv,))

Each rank returns its logged records (one dict per logged iteration, the same on every rank).
"""

from typing import Any

from scripts import pretrain_gpt


def run_pretrain_gpt(rank: int, world_size: int, argv: list[str]) -> list[dict[str, Any]]:
    return pretrain_gpt.main(list(argv))
