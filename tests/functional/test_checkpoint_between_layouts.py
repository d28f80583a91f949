"""A `pretrain_gpt.py` checkpoint loads in every layout, bitwise (CPU, gloo, harness workers).

A checkpoint stores each parameter and its optimizer state under the parameter's name in the bare
model (checkpointing/global_names.py), whatever wraps the model: Megatron-FSDP's wrapper adds
`module.` to every name, torch FSDP2 shards in place, one process and DDP keep the bare model.
Muon in fp32 trains 2 iterations in one layout and saves; each other layout loads that and, in
place of training, saves what it loaded (tests/pretrain_gpt_in_process.run_pretrain_gpt_resaving).
The reference is the checkpoint that was saved: every model tensor and every optimizer state
tensor of the re-saved one equal to it, bitwise; with `--no-load-optim` the model's.
"""

import pathlib

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.functional.test_pretrain_gpt import MODEL_FLAGS
from tests.pretrain_gpt_in_process import run_pretrain_gpt_many, run_pretrain_gpt_resaving

SAVED_AT = 2
FLAGS = MODEL_FLAGS + ["--optimizer", "muon", "--muon-fp32-matmul-prec", "highest", "--train-iters", str(SAVED_AT),
                                "--lr-warmup-iters", "1"]
LAYOUTS = {  # name: (flags, ranks)
    "one process": ([], 1),
    "DDP": ([], 2),
    "FSDP2": (["--use-torch-fsdp2"], 2),
    "Megatron-FSDP": (["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"], 2),
    "Megatron-FSDP at 1": (["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"], 1),
}
# (saved in, loaded in, with the optimizer): Megatron-FSDP's into every other layout, FSDP2's into it.
MOVES = [("Megatron-FSDP", "one process", True), ("Megatron-FSDP", "DDP", True), ("Megatron-FSDP", "FSDP2", True),
         ("Megatron-FSDP", "Megatron-FSDP at 1", True), ("FSDP2", "Megatron-FSDP", True),
         ("Megatron-FSDP", "one process", False)]
SLOW_MOVES = [(saved, loaded, True) for saved in ("one process", "DDP", "FSDP2", "Megatron-FSDP")
              for loaded in LAYOUTS if saved != loaded and (saved, loaded, True) not in MOVES]


def _entries(directory: pathlib.Path, tmp_path: pathlib.Path, optimizer: bool) -> dict[str, torch.Tensor]:
    """The model's tensors (and the optimizer's state) of the checkpoint at SAVED_AT."""
    out = tmp_path / f"{directory.name}.pt"
    dcp_to_torch_save(str(directory / f"iter_{SAVED_AT:07d}"), str(out))
    kinds = ("model/", "state/") if optimizer else ("model/",)
    return {key: value for key, value in torch.load(out, weights_only=False).items() if key.startswith(kinds)}


def _run(run_distributed, ranks: int, call, jobs: list) -> None:
    if jobs:
        for result in run_distributed(call, ranks, args=(jobs,), timeout=600)[0]:
            assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]


def _check_moves(run_distributed, tmp_path: pathlib.Path, moves: list[tuple[str, str, bool]]) -> None:
    saves = sorted({saved for saved, _, _ in moves})
    for ranks in (1, 2):  # every save first: a --load of a directory without a checkpoint starts afresh
        _run(run_distributed, ranks, run_pretrain_gpt_many,
             [FLAGS + LAYOUTS[name][0] + ["--save", str(tmp_path / _dir(name))] for name in saves
              if LAYOUTS[name][1] == ranks])
    for ranks in (1, 2):
        _run(run_distributed, ranks, run_pretrain_gpt_resaving,
             [(FLAGS + LAYOUTS[loaded][0] + ["--load", str(tmp_path / _dir(saved))]
               + ([] if optimizer else ["--no-load-optim"]), str(tmp_path / _dir(saved, loaded, optimizer)))
              for saved, loaded, optimizer in moves if LAYOUTS[loaded][1] == ranks])
    for saved, loaded, optimizer in moves:
        loaded_at = tmp_path / _dir(saved, loaded, optimizer) / f"iter_{SAVED_AT:07d}"
        assert loaded_at.is_dir(), (saved, loaded)  # it loaded the checkpoint of SAVED_AT
        expected = _entries(tmp_path / _dir(saved), tmp_path, optimizer)
        got = _entries(tmp_path / _dir(saved, loaded, optimizer), tmp_path, optimizer)
        where = f"{saved} -> {loaded}{'' if optimizer else ' (--no-load-optim)'}"
        assert sum(key.startswith("state/") for key in expected) > 10 or not optimizer, where  # optimizer state in it
        assert sorted(got) == sorted(expected), (where, sorted(set(got) ^ set(expected))[:5])
        for key, value in expected.items():
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), (where, key)


def _dir(*parts) -> str:
    return "_".join(str(part).replace(" ", "_") for part in parts)


def test_a_megatron_fsdp_checkpoint_loads_in_every_layout_bitwise(run_distributed, tmp_path) -> None:
    _check_moves(run_distributed, tmp_path, MOVES)


@pytest.mark.slow
def test_every_layout_loads_every_other_bitwise(run_distributed, tmp_path) -> None:
    _check_moves(run_distributed, tmp_path, SLOW_MOVES)
