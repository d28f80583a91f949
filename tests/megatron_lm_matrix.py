"""The parity matrix: Megatron-LM's loop (scripts/pretrain_gpt_megatron_lm.py, on gloo CPU ranks) with
megatron-core's optimizer (`--megatron-core-optimizer`) and with ours, over a table of cells.

A cell is an engine, a layout, a precision, the checkpoint formats the engine admits, a world size,
the Muon TP modes it admits, its tier, and each side's outcome on CPU (`RUNS`, `refuses(...)`,
`fails(...)`): CELLS below is the one place that says which cells megatron-core runs on CPU. Where
both run, ours must do what megatron-core does:
- the compared optimizer's (Adam, or megatron-core's own Muon) losses, learning rates and gradient
  norms equal megatron-core's bitwise, at Megatron-LM's default --clip-grad 1.0 (`Cell.clip`, else
  `CLIP_OFF`);
- per format, each move continues as the same side's own continuation: megatron-core saves at 3 and
  ours continues it as megatron-core does; ours saves at 3 and megatron-core continues it as ours
  does; ours resumes ours equal to the run not interrupted, every rank's parameters and state bitwise.
  As Megatron-LM's ckpt-resume functional tests run, the run that saves at 3 goes on to 6 and is
  itself the run not interrupted; a load resumes at 3 (`_rewind_what_it_loads`). That saving changes no run is
  checked where a saving run stops instead (the bitwise Adam comparison with megatron-core here;
  the MoE and offload runs of Megatron-LM's loop);
- our Muon, in each TP mode, learns and resumes the same way from each format.
A side that refuses or fails, and a load that fails (`Cell.move_fails`), must still do so with the
recorded message (a record cannot go stale); the other side must still learn and resume exactly.

`parts(cell)` splits a cell into tests, `cell_jobs` gives a part's command lines, `run_jobs` runs many
in one call to the workers (tests/megatron_lm_in_process.py), `check_part` asserts the contract.
`matrix_table()` is the table docs/megatron-lm.md shows; `python -m tests.megatron_lm_matrix` prints it."""

import dataclasses
import pathlib
from typing import Any, Literal, Optional

from megatron_eopt.training.functional.cases import rewind

ROOT = pathlib.Path(__file__).resolve().parents[1]
ITERATIONS, SAVED_AT = 6, 3
MODEL = (
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 256 --num-layers 2 --hidden-size 64 "
    "--num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 --position-embedding-type rope "
    f"--micro-batch-size 2 --global-batch-size 8 --train-iters {ITERATIONS} --lr 1e-3 --log-interval 1 "
    "--eval-iters 0 --eval-interval 1000 --attention-dropout 0 --hidden-dropout 0 --num-workers 0 "
    "--transformer-impl local --use-cpu-initialization --no-gradient-accumulation-fusion "
    "--no-persist-layer-norm --no-rope-fusion --no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion "
    "--distributed-backend gloo"
).split()
MEGATRON_CORE = ["--megatron-core-optimizer"]
# A cell runs at Megatron-LM's default --clip-grad 1.0: ours sums the gradient norm as megatron-core
# does (wrappers/grad_stats.py; the layer-wise optimizer's ranks take megatron-core's parts,
# distributed/layer_wise_norm_order.py; Megatron-FSDP reduces once over every rank, in its one
# optimizer's order), so the clipping factor, and every step after it, is the same to the bit.
# CLIP_OFF never clips (the factor is above 1), and both sides still compute and log the norm: one
# make-test cell runs so, to hold the step without clipping to megatron-core's too.
CLIP_OFF = ("--clip-grad", "1e9")
# megatron-core's OptimizerConfig takes these with its own Adam only (and Transformer Engine); ours
# with every optimizer (install()'s _optimizer_config_replacement).
BF16_MOMENTS = ["--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]
TORCH_FSDP2 = ["--use-torch-fsdp2", "--ckpt-format", "torch_dcp", "--untie-embeddings-and-output-weights", "--bf16"]
# --swiglu: Megatron-LM's fsdp_dtensor checkpointing splits linear_fc1 into halves, state included
# (with install(): integrations/megatron_lm_swiglu.py); the fusion compiles a kernel per process.
MEGATRON_FSDP = ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor", "--untie-embeddings-and-output-weights",
                 "--swiglu", "--no-bias-swiglu-fusion", "--bf16"]

ENGINES = {
    "DDP": [],
    "distributed optimizer": ["--use-distributed-optimizer"],
    "FSDP2": ["--use-torch-fsdp2", "--untie-embeddings-and-output-weights"],
    "Megatron-FSDP": ["--use-megatron-fsdp", "--untie-embeddings-and-output-weights", "--swiglu",
                      "--no-bias-swiglu-fusion"],
}
TP2, SP = ["--tensor-model-parallel-size", "2"], ["--sequence-parallel"]
EXPERTS = ["--num-experts", "4", "--moe-router-topk", "2"]
EP2, EXPERT_TP2 = ["--expert-model-parallel-size", "2"], ["--expert-tensor-parallel-size", "2"]
# Megatron-FSDP's MoE as the command line has it: bias-free experts, tokens all-gathered.
ALLGATHER = ["--moe-token-dispatcher-type", "allgather", "--disable-bias-linear"]
LAYOUTS = {  # name: flags (the world size is the cell's)
    "one rank": [],
    "DP=2": [],
    "DP=2, dropout 0.1": ["--attention-dropout", "0.1", "--hidden-dropout", "0.1"],
    "TP=2": TP2,
    "TP=2, SP": TP2 + SP,
    "TP=2 x DP=2": TP2,
    "PP=2": ["--pipeline-model-parallel-size", "2"],
    "PP=2, VP=2": ["--pipeline-model-parallel-size", "2", "--num-layers", "4",
                   "--num-layers-per-virtual-pipeline-stage", "1"],
    "EP=2": EXPERTS + EP2,
    "EP=2, allgather": EXPERTS + EP2 + ALLGATHER,
    "expert TP=2": EXPERTS + EXPERT_TP2 + ["--disable-bias-linear"],  # megatron-core: biases only at expert TP=1
    "EP=2 x expert TP=2": EXPERTS + EP2 + EXPERT_TP2 + ALLGATHER,
    "TP=2 x EP=2": TP2 + EXPERTS + EP2 + ["--expert-tensor-parallel-size", "1"],
    "TP=2 x EP=2, SP": TP2 + SP + EXPERTS + EP2 + ["--expert-tensor-parallel-size", "1"],
}
# fp16 from a loss scale of 4096: at Megatron-LM's 2**32 (hysteresis 2) every one of 6 iterations overflows
# and is skipped, so nothing would be compared (and a checkpoint at 3 holds no moments, which our
# torch_dist load asks for: docs/megatron-lm.md).
PRECISIONS = {"fp32": [], "bf16": ["--bf16"], "fp16": ["--fp16", "--initial-loss-scale", "4096"]}
FORMATS = {
    "torch": ["--ckpt-format", "torch"],
    "torch_dist": ["--ckpt-format", "torch_dist"],
    "torch_dist fully_reshardable": ["--ckpt-format", "torch_dist", "--dist-ckpt-optim-fully-reshardable"],
    "torch_dcp": ["--ckpt-format", "torch_dcp"],
    "fsdp_dtensor": ["--ckpt-format", "fsdp_dtensor"],
}
COMPARED = {"adam": ["--optimizer", "adam"], "muon": ["--optimizer", "muon"]}
ALL_TP_MODES = ("duplicated", "blockwise", "distributed")


@dataclasses.dataclass(frozen=True)
class Outcome:
    """An optimizer's outcome in a cell on CPU: it runs, or refuses (one `error:` line at start-up,
    status 2), or fails (an exception in the run, a save included); `message` is a part of its line."""
    kind: Literal["runs", "refuses", "fails"]
    message: str = ""


RUNS = Outcome("runs")


def refuses(message: str) -> Outcome:
    return Outcome("refuses", message)


def fails(message: str) -> Outcome:
    return Outcome("fails", message)


@dataclasses.dataclass(frozen=True)
class Cell:
    engine: str
    layout: str
    precision: str
    formats: tuple[str, ...]
    megatron_core: Outcome = RUNS
    ours: Outcome = RUNS  # other than RUNS: a known failure of ours, recorded
    # (format, "in" | "out" | "itself", message): a load that fails with it, recorded: "in", ours loading
    # megatron-core's checkpoint; "out", megatron-core loading ours; "itself", megatron-core loading its own
    # (the moves are then held to its run not interrupted)
    move_fails: tuple[tuple[str, str, str], ...] = ()

    def move_failure(self, name: str, direction: str) -> Optional[str]:
        return next((message for at, way, message in self.move_fails if (at, way) == (name, direction)), None)
    world_size: int = 2
    compared: str = "adam"  # the optimizer run on both sides
    muon_tp_modes: tuple[str, ...] = ("duplicated",)  # our Muon's, each trained and resumed; () none
    muon_flags: tuple[str, ...] = ()  # added to our Muon's runs (bf16 moments)
    extra: tuple[str, ...] = ()  # flags the cell needs beyond its engine, layout and precision
    make_test: tuple[str, ...] = ()  # formats whose compared part runs in `make test`
    make_test_muon: bool = False  # our Muon's first TP mode too, in the first of them
    clip: bool = True  # Megatron-LM's default --clip-grad 1.0; False: CLIP_OFF (see there)

    @property
    def name(self) -> str:
        compared = "" if self.compared == "adam" else f", {self.compared} compared"
        formats = "" if self.ours == RUNS else f", {' '.join(self.formats)}"
        return f"{self.engine}, {self.layout}, {self.precision}{compared}{formats}"

    def flags(self) -> list[str]:
        clip = [] if self.clip else list(CLIP_OFF)
        return ENGINES[self.engine] + LAYOUTS[self.layout] + PRECISIONS[self.precision] + clip + list(self.extra)




# What megatron-core's optimizer (and ours, where it cannot run either) does on CPU, as its runs print it.
SP_ON_CPU = "sequence parallel not supported by torch LayerNorm"  # megatron-core's local norm: no SP
MOE_TP_WITHOUT_SP = "performance may degrade if MoE and tensor parallelism"  # megatron-core's TransformerConfig
# Megatron-LM's torch_dcp load asks optimizer.state_dict(is_loading=True), which megatron-core's chain does
# not take; ours reads megatron-core's torch-style keys (megatron_core_formats/torch_dcp.py).
DCP_CORE_LOAD = "state_dict() got an unexpected keyword argument 'is_loading'"
DCP_MOVES = tuple((("torch_dcp", way, DCP_CORE_LOAD) for way in ("out", "itself")))
CELLS = [
    # ---- make test: every engine, every format, every move once; one 4-rank cell
    Cell("DDP", "DP=2, dropout 0.1", "fp32", ("torch", "torch_dist"), make_test=("torch",)),
    # clip off: make test holds the step without clipping to megatron-core's too (CLIP_OFF)
    Cell("distributed optimizer", "one rank", "bf16", ("torch_dist",), world_size=1, compared="muon",
         muon_tp_modes=(), make_test=("torch_dist",), clip=False),
    Cell("distributed optimizer", "DP=2", "bf16", ("torch_dist", "torch_dist fully_reshardable"),
         compared="muon", muon_tp_modes=(), make_test=("torch_dist",)),
    Cell("FSDP2", "DP=2", "bf16", ("torch_dcp",), muon_flags=tuple(BF16_MOMENTS), make_test=("torch_dcp",),
         make_test_muon=True, move_fails=DCP_MOVES),
    Cell("Megatron-FSDP", "TP=2 x DP=2", "bf16", ("fsdp_dtensor",), world_size=4,
         muon_tp_modes=ALL_TP_MODES, muon_flags=tuple(BF16_MOMENTS), make_test=("fsdp_dtensor",), make_test_muon=True),
    # ---- make test-slow
    Cell("DDP", "DP=2", "bf16", ("torch_dist",)),
    Cell("DDP", "DP=2", "fp16", ("torch_dist",), muon_tp_modes=()),
    Cell("DDP", "TP=2", "fp32", ("torch_dist",), muon_tp_modes=ALL_TP_MODES),
    Cell("DDP", "TP=2", "fp32", ("torch_dist",), compared="muon", muon_tp_modes=()),
    Cell("DDP", "TP=2, SP", "fp32", ("torch_dist",), megatron_core=fails(SP_ON_CPU), ours=fails(SP_ON_CPU),
         muon_tp_modes=()),
    Cell("DDP", "TP=2 x EP=2", "fp32", ("torch_dist",), muon_tp_modes=(),
         megatron_core=refuses(MOE_TP_WITHOUT_SP), ours=refuses(MOE_TP_WITHOUT_SP)),
    Cell("DDP", "TP=2 x EP=2, SP", "fp32", ("torch_dist",), megatron_core=fails(SP_ON_CPU), ours=fails(SP_ON_CPU),
         muon_tp_modes=()),
    Cell("DDP", "PP=2", "fp32", ("torch_dist",)),
    Cell("DDP", "PP=2, VP=2", "fp32", ("torch_dist",)),
    Cell("DDP", "EP=2", "fp32", ("torch_dist",)),
    Cell("DDP", "expert TP=2", "fp32", ("torch_dist",), muon_tp_modes=ALL_TP_MODES),
    Cell("distributed optimizer", "DP=2", "fp16", ("torch_dist",), muon_tp_modes=()),
    # megatron-core's fp32 DistributedOptimizer is not here: it shards `model_param.view(-1)` without
    # detaching it, so autograd keeps its DDP's hooks and process groups alive in the reused workers.
    Cell("distributed optimizer", "DP=2", "fp32", ("torch_dist", "torch_dist fully_reshardable", "torch"),
         compared="muon", muon_tp_modes=(),
         megatron_core=fails("'TensorParallelMuon' object has no attribute 'get_loss_scale'")),
    Cell("distributed optimizer", "DP=2", "bf16", ("torch_dist", "torch_dist fully_reshardable", "torch")),
    Cell("distributed optimizer", "EP=2", "bf16", ("torch_dist",), compared="muon", muon_tp_modes=(),
         make_test=("torch_dist",)),  # the layer-wise experts' norm in megatron-core's chain order
    Cell("distributed optimizer", "TP=2", "bf16", ("torch_dist",), muon_tp_modes=ALL_TP_MODES),
    Cell("distributed optimizer", "PP=2, VP=2", "bf16", ("torch_dist",)),
    Cell("FSDP2", "DP=2", "fp32", ("torch_dcp",), move_fails=DCP_MOVES),
    Cell("FSDP2", "DP=2", "bf16", ("torch_dcp",), compared="muon", muon_tp_modes=(),
         megatron_core=refuses("Emerging optimizer does not support Torch-FSDP2 for now.")),
    Cell("FSDP2", "DP=2", "bf16", ("torch_dist",), muon_tp_modes=(), megatron_core=fails("KeyError: 0"),  # its save
         ours=refuses("--use-torch-fsdp2 with --ckpt-format torch_dist is not supported by megatron_eopt's optimizer")),
    Cell("FSDP2", "DP=2", "fp16", ("torch_dcp",), muon_tp_modes=(),
         megatron_core=refuses("--use-torch-fsdp2 not supported with fp16 yet"),
         ours=refuses("--use-torch-fsdp2 not supported with fp16 yet")),
    Cell("Megatron-FSDP", "DP=2", "bf16", ("fsdp_dtensor",), muon_flags=tuple(BF16_MOMENTS)),
    Cell("Megatron-FSDP", "DP=2", "bf16", ("fsdp_dtensor",), compared="muon", muon_tp_modes=(),
         megatron_core=refuses("Megatron-FSDP does not support the muon optimizer yet.")),
    Cell("Megatron-FSDP", "DP=2", "fp32", ("fsdp_dtensor",), muon_tp_modes=(),
         megatron_core=fails("GPTModel has no attribute")),
    Cell("Megatron-FSDP", "DP=2", "fp16", ("fsdp_dtensor",), muon_tp_modes=(),
         megatron_core=fails("'NoneType' object has no attribute 'data'"),
         ours=refuses("fp16 loss scaling is not implemented for Megatron-FSDP")),
    Cell("Megatron-FSDP", "EP=2, allgather", "bf16", ("fsdp_dtensor",), muon_flags=tuple(BF16_MOMENTS)),
    Cell("Megatron-FSDP", "EP=2 x expert TP=2", "bf16", ("fsdp_dtensor",), world_size=4,
         muon_tp_modes=ALL_TP_MODES, muon_flags=tuple(BF16_MOMENTS)),
]

Part = tuple[str, str]  # ("compared" or "muon <tp mode>", a format)
Job = tuple[Literal["run", "failing", "refused"], list[str]]


def parts(cell: Cell) -> list[tuple[Part, bool]]:
    """The cell's parts, each with whether it runs in `make test`: per format, the compared
    optimizer's and one per Muon TP mode (in make test: the compared part of the formats the cell
    names, and where `make_test_muon`, the first Muon mode in the first of them)."""
    first = cell.make_test[:1] if cell.make_test_muon else ()
    return [(("compared", name), name in cell.make_test) for name in cell.formats] + [
        ((f"muon {mode}", name), index == 0 and name in first)
        for index, mode in enumerate(cell.muon_tp_modes) for name in cell.formats]


def saving_at_3(directory: str) -> list[str]:
    """Save at SAVED_AT to `directory`, and stop there."""
    return saving_at_3_going_on(directory) + ["--exit-interval", str(SAVED_AT)]


def saving_at_3_going_on(directory: str) -> list[str]:
    """Save at SAVED_AT (and at ITERATIONS) to `directory` and train on: the run not interrupted too."""
    return ["--save", directory, "--save-interval", str(SAVED_AT)]


def cell_jobs(cell: Cell, part: Part, directory: str) -> list[Job]:
    """The command lines of one part of a cell, in the order `check_part` reads their runs. A run that
    saves goes on: it is the run not interrupted too (`saving_at_3_going_on`); `run_jobs` rewinds a
    checkpoint to SAVED_AT before a run loads it."""
    what, name = part
    flags = MODEL + cell.flags() + FORMATS[name]
    theirs, ours = f"{directory}/theirs", f"{directory}/ours"
    if what != "compared":
        muon = flags + COMPARED["muon"] + ["--muon-tp-mode", what.split()[1]] + list(cell.muon_flags)
        return [("run", muon + saving_at_3_going_on(ours)), ("run", muon + ["--load", ours])]
    compared = flags + COMPARED[cell.compared]
    sides = {"megatron-core": (cell.megatron_core, MEGATRON_CORE, theirs), "ours": (cell.ours, [], ours)}
    if cell.megatron_core != RUNS or cell.ours != RUNS:  # each side that does not run: its check; the others resume
        jobs: list[Job] = []
        for outcome, side, directory in sides.values():
            if outcome != RUNS:
                kind = "refused" if outcome.kind == "refuses" else "failing"
                jobs.append((kind, compared + side + saving_at_3(f"{directory}_check")))
            else:
                jobs += [("run", compared + side + saving_at_3_going_on(directory)),
                         ("run", compared + side + ["--load", directory])]
        return jobs
    move_in, move_out, itself = ("run" if cell.move_failure(name, way) is None else "failing"
                                 for way in ("in", "out", "itself"))
    return [("run", compared + MEGATRON_CORE + saving_at_3_going_on(theirs)),
            ("run", compared + saving_at_3_going_on(ours)), (move_in, compared + ["--load", theirs]),
            (itself, compared + MEGATRON_CORE + ["--load", theirs]),
            (move_out, compared + MEGATRON_CORE + ["--load", ours]), ("run", compared + ["--load", ours])]


def unique_jobs(jobs: list[Job]) -> tuple[list[Job], list[int]]:
    """`jobs` with each command line once (the parts of a cell share their runs without a checkpoint),
    and for each job its index in them."""
    index: dict[tuple, int] = {}
    for kind, argv in jobs:
        index.setdefault((kind, tuple(argv)), len(index))
    return [(kind, list(argv)) for kind, argv in index], [index[kind, tuple(argv)] for kind, argv in jobs]


def _raised() -> tuple[type, ...]:
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    return Exception, CheckpointException


def run_jobs(rank: int, world_size: int, jobs: list[Job]) -> list[Any]:
    """Each job in this worker: a Run (`Unexpected` if it raised); for a 'failing' job the exception's
    `Type: message` (or its Run when it did not fail); for a 'refused' one (status, stderr, stdout)."""
    from tests.megatron_lm_in_process import run_megatron_lm, run_megatron_lm_refused

    raised, results = _raised(), []
    for kind, argv in jobs:
        _rewind_what_it_loads(rank, argv)
        if kind == "refused":
            results.append(run_megatron_lm_refused(rank, world_size, [argv])[0])
        elif kind == "failing":
            try:
                results.append(run_megatron_lm(rank, world_size, argv))
            except raised as error:  # what the load raises is the record
                results.append(f"{type(error).__name__}: {error}")
        else:
            try:
                results.append(run_megatron_lm(rank, world_size, argv))
            except raised as error:  # the other command lines still run; check_part names it
                results.append(Unexpected(f"pretrain_gpt_megatron_lm.py {' '.join(argv)}: {error!r}"))
    return results


def _rewind_what_it_loads(rank: int, argv: list[str]) -> None:
    """Before a run with `--load D`, what Megatron-LM's functional-test runner does before a ckpt-resume
    run: rank 0 removes D's checkpoints after SAVED_AT and points its tracker there; the others wait."""
    if "--load" not in argv:
        return
    import torch.distributed as dist

    if rank == 0:
        rewind(pathlib.Path(argv[argv.index("--load") + 1]), SAVED_AT)
    dist.barrier()


class Unexpected(str):
    """A run that was to train and raised instead: the command line and the exception."""


# ---------------------------------------------------------------- the contract's assertions

def column(run: Any, key: str, iterations) -> list:
    by_iteration = {record["iteration"]: record[key] for record in run.records}
    return [by_iteration.get(i) for i in iterations]


def assert_equal_tensors(mine, reference, where: str) -> None:
    import torch

    if isinstance(mine, dict):
        assert mine.keys() == reference.keys(), where
        for key in mine:
            assert_equal_tensors(mine[key], reference[key], f"{where}.{key}")
    elif isinstance(mine, (list, tuple)):
        assert len(mine) == len(reference), where
        for i, (a, b) in enumerate(zip(mine, reference)):
            assert_equal_tensors(a, b, f"{where}[{i}]")
    elif torch.is_tensor(mine):
        assert torch.equal(mine, reference), where
    else:
        assert mine == reference, where


def state_dtypes(state) -> set:
    """The dtypes of the tensors anywhere in `state` (nested dicts and lists)."""
    import torch

    if isinstance(state, dict):
        return set().union(*map(state_dtypes, state.values()))
    if isinstance(state, (list, tuple)):
        return set().union(*map(state_dtypes, state))
    return {state.dtype} if torch.is_tensor(state) else set()


def assert_learns(runs: list, where: str) -> None:
    losses = column(runs[-1], "lm loss", range(1, ITERATIONS + 1))  # the last pipeline stage's
    assert None not in losses and losses[-1] < losses[0] - 0.2, (where, losses)  # not two runs that do nothing


def assert_same_math(ours: list, theirs: list, our_package: str = "megatron_eopt", where: str = "") -> None:
    """Bitwise equal losses, learning rates and gradient norms (ours sums the norm in megatron-core's order)."""
    every = range(1, ITERATIONS + 1)
    assert [r.optimizer_package for r in ours + theirs] == [our_package] * len(ours) + ["megatron"] * len(theirs)
    for rank, (mine, reference) in enumerate(zip(ours, theirs)):
        at = f"{where}, rank {rank}"
        for key in ("lm loss", "learning rate", "grad norm"):
            expected = column(reference, key, every)
            assert column(mine, key, every) == expected, (at, key, column(mine, key, every), expected)
    assert_learns(ours, where)


def assert_resumed_exactly(straight: list, saved: list, resumed: list, where: str) -> None:
    """Saved at SAVED_AT (and stopped there, or went on as `straight` itself); resumed, equal to the
    run not interrupted from there on, to the last bit of every rank's parameters and optimizer state."""
    after = range(SAVED_AT + 1, ITERATIONS + 1)
    for rank, (first, mine, reference) in enumerate(zip(saved, resumed, straight)):
        where_rank = f"{where}, rank {rank}"
        assert first.exit_status == 0 and column(first, "iteration", range(1, ITERATIONS + 1)) == (
            list(range(1, ITERATIONS + 1)) if first is reference else [1, 2, 3, None, None, None]), where_rank
        assert [r["iteration"] for r in mine.records] == list(after), where_rank  # it went on from the save
        for key in ("lm loss", "grad norm", "learning rate"):
            assert column(mine, key, after) == column(reference, key, after), f"{where_rank}: {key}"
        assert mine.parameters and mine.optimizer_state, where_rank  # something to compare
        assert_equal_tensors(mine.parameters, reference.parameters, f"{where_rank}: parameters")
        assert_equal_tensors(mine.optimizer_state, reference.optimizer_state, f"{where_rank}: optimizer state")
        assert mine.optimizer_package == reference.optimizer_package, where_rank


def assert_moved(saved: list, moved_in: list, core_resumed: list, ours_saved: list, moved_out: list,
                 our_package: str, where: str) -> None:
    """megatron-core saved at 3 (`saved`, which went on: its run not interrupted); ours continued that
    (`moved_in`) as megatron-core did (`core_resumed`, itself equal to `saved`); ours saved at 3
    (`ours_saved`) and megatron-core continued that (`moved_out`) the same."""
    import pytest

    after = range(SAVED_AT + 1, ITERATIONS + 1)
    for rank in range(len(saved)):
        where_rank = f"{where}, rank {rank}"
        assert saved[rank].optimizer_package == "megatron" and ours_saved[rank].optimizer_package == our_package
        assert [r["iteration"] for r in saved[rank].records] == list(range(1, ITERATIONS + 1)), where_rank
        assert moved_in is None or moved_in[rank].optimizer_package == our_package, where_rank
        for key in ("lm loss", "grad norm", "learning rate"):
            expected = column((core_resumed or saved)[rank], key, after)
            assert None not in expected or (key == "lm loss" and rank < len(saved) - 1), where_rank  # PP: last stage
            ours_expected = pytest.approx(expected, rel=1e-6) if key == "grad norm" else expected
            for moved, way in ((moved_in, "in"), (moved_out, "out")):
                if moved is not None:  # None: a recorded failure (Cell.move_fails)
                    assert column(moved[rank], key, after) == (ours_expected if way == "in" else expected), (
                        f"{where_rank}: {way}, {key}")
            assert expected == column(saved[rank], key, after), f"{where_rank}: megatron-core's resume, {key}"


def our_package(cell: Cell) -> str:
    """Whose optimizer the loop steps with ours installed: Adam on reduce-scattered gradients is
    megatron-core's DistributedOptimizer built from our config (megatron_eopt/distributed/reduce_scattered.py)."""
    plain_distributed = cell.engine == "distributed optimizer" and cell.compared == "adam"
    return "megatron" if plain_distributed else "megatron_eopt"


def check_part(cell: Cell, part: Part, results: list[Any]) -> None:
    """The contract for one part of a cell, on its jobs' results (per job, each rank's)."""
    unexpected = [result for ranks in results for result in ranks if isinstance(result, Unexpected)]
    assert not unexpected, unexpected[0]
    what, name = part
    where = f"{cell.name}, {what}, {name}"
    if what != "compared":
        _check_resumed(results, where, "megatron_eopt")
        if "--exp-avg-dtype" in cell.muon_flags:
            import torch

            assert torch.bfloat16 in state_dtypes(results[0][0].optimizer_state), where  # bf16 moments
        return
    if cell.megatron_core != RUNS or cell.ours != RUNS:
        for who, outcome, package in (("megatron-core", cell.megatron_core, "megatron"),
                                      ("ours", cell.ours, our_package(cell))):
            if outcome != RUNS:
                _check_outcome(outcome, results[0], f"{where}, {who}")
                results = results[1:]
            else:
                _check_resumed(results[:2], f"{where}, {who}", package)
                results = results[2:]
        return
    saved, ours_saved, moved_in, core_resumed, moved_out, ours_resumed = results
    assert_same_math(ours_saved, saved, our_package(cell), where)
    loads = {"in": moved_in, "out": moved_out, "itself": core_resumed}
    for way in loads:
        if cell.move_failure(name, way) is not None:
            _check_outcome(fails(cell.move_failure(name, way)), loads[way], f"{where}, the load {way}")
            loads[way] = None
    assert_moved(saved, loads["in"], loads["itself"], ours_saved, loads["out"], our_package(cell), where)
    assert_resumed_exactly(ours_saved, ours_saved, ours_resumed, where)


def _check_resumed(results: list[Any], where: str, package: str) -> None:
    saved, resumed = results  # the saving run went on: it is the run not interrupted
    assert saved[0].optimizer_package == package, where
    assert_learns(saved, where)
    assert_resumed_exactly(saved, saved, resumed, where)


def _check_outcome(expected: Outcome, per_rank: list[Any], where: str) -> None:
    """A side that does not run still refuses (status 2 on every rank, rank 0's one line) or fails
    (an exception on some rank) with the recorded message."""
    if expected.kind == "refuses":
        statuses = [status for status, _, _ in per_rank]
        assert statuses == [2] * len(per_rank), (where, statuses, per_rank[0][1][-2000:])
        assert expected.message in per_rank[0][1], (where, per_rank[0][1][-2000:])
        return
    messages = [outcome for outcome in per_rank if isinstance(outcome, str)]
    assert messages, f"{where}: no longer fails; record it as running"
    assert any(expected.message in message for message in messages), (where, messages)


# ---------------------------------------------------------------- the table

def outcome_text(cell: Cell) -> str:
    """What the cell checks, in words."""
    if cell.megatron_core == cell.ours == RUNS:
        whose = {"in": "our load of megatron-core's", "out": "megatron-core's load of our",
                 "itself": "megatron-core's load of its"}
        failing = "; ".join(f"{whose[way]} `{name}` fails: `{message}`" for name, way, message in cell.move_fails)
        return f"ours equals megatron-core; {failing or 'moves both ways'}"
    if cell.megatron_core == cell.ours:
        return f"either optimizer {cell.ours.kind}: `{cell.ours.message}`"
    if cell.megatron_core == RUNS:
        return f"megatron-core runs and resumes; ours {cell.ours.kind}: `{cell.ours.message}`"
    if cell.ours == RUNS:
        return f"megatron-core {cell.megatron_core.kind}: `{cell.megatron_core.message}`; ours trains and resumes"
    return (f"megatron-core {cell.megatron_core.kind}: `{cell.megatron_core.message}`; "
            f"ours {cell.ours.kind}: `{cell.ours.message}`")


def matrix_table(cells: Optional[list[Cell]] = None) -> str:
    """The matrix as a markdown table, one row per cell."""
    rows = ["| engine | layout | ranks | precision | clip | compared | formats | our Muon's TP modes | "
            "on CPU | tier |", "|---|---|---|---|---|---|---|---|---|---|"]
    for cell in cells or CELLS:
        formats = ", ".join(f"`{name}`" for name in cell.formats)
        modes = ", ".join(cell.muon_tp_modes) or "–"
        muon = ", Muon" if cell.make_test_muon else ""
        tier = ("make test: " + ", ".join(f"`{name}`" for name in cell.make_test) + muon) if cell.make_test else "slow"
        extra = f" `{' '.join(cell.extra)}`" if cell.extra else ""
        clip = "1.0" if cell.clip else "off"
        rows.append(f"| {cell.engine} | {cell.layout}{extra} | {cell.world_size} | {cell.precision} | {clip} "
                    f"| {cell.compared} "
                    f"| {formats} | {modes} | {outcome_text(cell)} | {tier} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(matrix_table(), end="")
