"""Muon reaches AdamW's final loss in fewer iterations on the default task (the generated rule
language, the default small GPT), each with a tuned but fixed peak lr.

60 iterations, global batch 16, cosine to a tenth of the peak after 5 warm-up iterations, seed
1234, one process. Sweep behind the lrs (mean loss of the last 10 iterations):
AdamW 3e-3: 1.69, 1e-2: 0.52, 2e-2: 0.60, 3e-2: 1.75; Muon with --muon-match-adamw-rms
1e-2: 0.50, 2e-2: 0.24, 3e-2: 0.28, 5e-2: 0.23. With these lrs Muon reached AdamW's final loss
at iteration 40 (seeds 1-4: 41-47), so the bound of 50 leaves a margin without being loose.

Both runs go through scripts/pretrain_gpt.py's parse_args and train in a worker of the shared
distributed harness (imports paid once per session, not once per run).
"""

import os

from megatron_eopt.training import demo

FLAGS = ["--micro-batch-size", "16", "--global-batch-size", "16", "--train-iters", "60", "--lr-warmup-iters", "5",
         "--lr-decay-style", "cosine", "--seed", "1234", "--log-interval", "1"]
ADAMW = ["--optimizer", "adam", "--lr", "1e-2", "--min-lr", "1e-3"]
MUON = ["--optimizer", "muon", "--muon-match-adamw-rms", "--lr", "2e-2", "--min-lr", "2e-3"]
MUON_REACHES_BY = 50


def _losses(rank: int, world_size: int, argv: list[str]) -> list[float]:
    import torch

    from megatron_eopt.training.arguments.parser import parse_args
    from megatron_eopt.training.loop import train as train_loop
    from megatron_eopt.training.model.gpt import initialize_model_parallel

    os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank))
    args, settings, layout = parse_args(argv)
    initialize_model_parallel(layout.tp, args.seed)
    return [record["loss"] for record in train_loop.train(args, settings, layout, torch.device("cpu"))]


def test_muon_reaches_adamw_final_loss_in_fewer_iterations(run_distributed) -> None:
    (adamw,) = run_distributed(_losses, 1, args=(FLAGS + ADAMW,))
    (muon,) = run_distributed(_losses, 1, args=(FLAGS + MUON,))
    target = demo.final_loss(adamw)
    reached = demo.iterations_to_reach(muon, target)
    assert reached is not None and reached <= MUON_REACHES_BY, (
        f"Muon reached AdamW's final loss {target:.3f} at iteration {reached} (bound {MUON_REACHES_BY}); "
        f"final losses AdamW {target:.3f}, Muon {demo.final_loss(muon):.3f}")
