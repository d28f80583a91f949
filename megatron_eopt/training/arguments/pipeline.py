"""The pipeline flags (Megatron-LM's names and meanings): stages, model chunks and the layer split.

Torch-free: parallel/layout.py's `job_layout` calls `pipeline_layout` before and after the import.
--pipeline-model-parallel-layout is read here (`layout_stages`, megatron-core's grammar and rules,
which tests/unit/training/parallel/test_pretrain_gpt_pipeline.py checks against megatron-core's
PipelineParallelLayerLayout); megatron-core reads it again when the model is built.
"""

import argparse
import re
from typing import Optional

# megatron-core's layer characters: embedding, loss, transformer (decoder) layer, multi-token prediction.
LAYER_CHARACTERS = "ELtm"


def pipeline_layout(args: argparse.Namespace, ranks_per_tp_rank: int) -> tuple[int, Optional[int]]:
    """(pipeline stages, model chunks per rank or None for one), checked against the layer
    count so that every (virtual) stage gets the layers the flags say, before anything is built."""
    pp = args.pipeline_model_parallel_size
    if pp < 1 or ranks_per_tp_rank % pp:
        raise ValueError(f"--pipeline-model-parallel-size {pp} must be >= 1 and divide the world size / "
                         f"--tensor-model-parallel-size ({ranks_per_tp_rank}).")
    split_flags = [flag for flag, given in (
        ("--num-layers-per-virtual-pipeline-stage", args.num_layers_per_virtual_pipeline_stage is not None),
        ("--num-virtual-stages-per-pipeline-rank", args.num_virtual_stages_per_pipeline_rank is not None),
        ("--decoder-first-pipeline-num-layers", args.decoder_first_pipeline_num_layers is not None),
        ("--decoder-last-pipeline-num-layers", args.decoder_last_pipeline_num_layers is not None),
        ("--account-for-embedding-in-pipeline-split", args.account_for_embedding_in_pipeline_split),
        ("--account-for-loss-in-pipeline-split", args.account_for_loss_in_pipeline_split),
        ("--pipeline-model-parallel-layout", args.pipeline_model_parallel_layout is not None)) if given]
    if pp == 1:
        if split_flags:
            raise ValueError(f"{split_flags[0]} needs --pipeline-model-parallel-size > 1.")
        return 1, None
    if args.pipeline_model_parallel_layout is not None:
        return pp, _layout_string_chunks(args, pp, split_flags)
    chunks = _virtual_stages(args, pp)
    _check_layer_split(args, pp, chunks)
    return pp, None if chunks == 1 else chunks


def _layout_string_chunks(args: argparse.Namespace, pp: int, split_flags: list[str]) -> Optional[int]:
    others = [flag for flag in split_flags if flag != "--pipeline-model-parallel-layout"]
    if others:
        raise ValueError(f"--pipeline-model-parallel-layout sets the whole split; it excludes {', '.join(others)}.")
    try:
        stages = layout_stages(args.pipeline_model_parallel_layout)
        check_layout(stages, pp, args.num_layers)
    except ValueError as error:
        raise ValueError(f"--pipeline-model-parallel-layout {args.pipeline_model_parallel_layout!r} does not fit "
                         f"--pipeline-model-parallel-size {pp} and --num-layers {args.num_layers}: {error}") from None
    chunks = len(stages) // pp
    return None if chunks == 1 else chunks


def layout_stages(layout: str) -> list[str]:
    """The layer characters of each stage, in stage order (stage i is on pipeline rank i % pp),
    as megatron-core reads the string: commas dropped, then `(...)*n` and `x*n` repeated n times,
    stages split at '|'."""
    text = layout.replace(",", "")
    text = re.sub(r"\(([^)]+)\)\*(\d+)", lambda match: match[1] * int(match[2]), text)
    text = re.sub(r"(.)\*(\d+)", lambda match: match[1] * int(match[2]), text)
    stages = text.split("|")
    for stage in stages:
        unknown = sorted(set(stage) - set(LAYER_CHARACTERS))
        if unknown:
            raise ValueError(f"unknown layer character {unknown[0]!r} in stage {stage!r} (known: E embedding, "
                             f"L loss, t transformer layer, m multi-token prediction)")
    return stages


def check_layout(stages: list[str], pp: int, num_layers: int) -> None:
    """megatron-core's rules (validate_layer_layout, without multi-token prediction): a whole
    number of stages per pipeline rank; the embedding first and the loss last, once each; one
    't' per layer."""
    if len(stages) % pp:
        raise ValueError(f"its {len(stages)} stages do not divide over {pp} pipeline ranks")
    layers = "".join(stages)
    if layers[:1] != "E" or layers.count("E") != 1:
        raise ValueError("the embedding (E) must come first, once")
    if layers[-1:] != "L" or layers.count("L") != 1:
        raise ValueError("the loss (L) must come last, once")
    if layers.count("t") != num_layers:
        raise ValueError(f"it has {layers.count('t')} transformer layers (t), not {num_layers}")
    if "m" in layers:
        raise ValueError("multi-token prediction layers (m) are not offered by this trainer")


def _virtual_stages(args: argparse.Namespace, pp: int) -> int:
    per_chunk, chunks = args.num_layers_per_virtual_pipeline_stage, args.num_virtual_stages_per_pipeline_rank
    if per_chunk is not None and chunks is not None:
        raise ValueError("--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank "
                         "both set the model chunks per rank; give one.")
    if chunks is not None:
        if chunks < 1:
            raise ValueError(f"--num-virtual-stages-per-pipeline-rank must be >= 1; got {chunks}.")
        return chunks
    if per_chunk is None:
        return 1
    per_rank = args.num_layers // pp
    if per_chunk < 1 or args.num_layers % pp or per_rank % per_chunk:
        raise ValueError(f"--num-layers-per-virtual-pipeline-stage {per_chunk} must be >= 1 and divide the "
                         f"layers per pipeline rank (--num-layers {args.num_layers} / "
                         f"--pipeline-model-parallel-size {pp}).")
    return per_rank // per_chunk


def _check_layer_split(args: argparse.Namespace, pp: int, chunks: int) -> None:
    """Megatron's rules: the first/last stage counts are taken out and the rest split evenly;
    or the embedding and loss count as one layer each; or an even split. Every model chunk gets
    the same number of layers on a rank."""
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    layers = args.num_layers
    if first is not None or last is not None:
        if args.account_for_embedding_in_pipeline_split or args.account_for_loss_in_pipeline_split:
            raise ValueError("--decoder-first/last-pipeline-num-layers exclude "
                             "--account-for-embedding/loss-in-pipeline-split.")
        given = {flag: n for flag, n in (("--decoder-first-pipeline-num-layers", first),
                                         ("--decoder-last-pipeline-num-layers", last)) if n is not None}
        for flag, n in given.items():
            if n < 0 or n % chunks:
                raise ValueError(f"{flag} {n} must be >= 0 and divisible by the {chunks} model chunks per rank.")
        rest, middle_ranks = layers - sum(given.values()), pp - len(given)
        if rest < 0 or (middle_ranks == 0 and rest) or (middle_ranks and rest % (middle_ranks * chunks)):
            raise ValueError(f"--num-layers {layers} minus {' and '.join(given)} ({rest}) must split evenly over "
                             f"the other {middle_ranks} pipeline ranks x {chunks} model chunks.")
        return
    counted = layers + args.account_for_embedding_in_pipeline_split + args.account_for_loss_in_pipeline_split
    if counted % (pp * chunks):
        accounted = [flag for flag, on in (("the embedding", args.account_for_embedding_in_pipeline_split),
                                           ("the loss", args.account_for_loss_in_pipeline_split)) if on]
        what = f"--num-layers {layers}" + "".join(f" + 1 for {a}" for a in accounted)
        raise ValueError(f"{what} must be divisible by --pipeline-model-parallel-size {pp} x {chunks} model "
                         f"chunks per rank (or give --decoder-first/last-pipeline-num-layers).")
