"""The pipeline flags (Megatron-LM's names and meanings): stages, model chunks and the layer split.

Torch-free: parallel/layout.py's `job_layout` calls `pipeline_layout` before and after the import.
"""

import argparse
from typing import Optional

from megatron_eopt.training.arguments.device import NotYetKnown



def pipeline_layout(args: argparse.Namespace, ranks_per_tp_rank: int, imported: bool = True
                    ) -> tuple[int, Optional[int]]:
    """(pipeline stages, model chunks per rank or None for one), checked against the layer
    count so that every (virtual) stage gets the layers the flags say, before anything is built.
    `imported` False: NotYetKnown where megatron-core must read --pipeline-model-parallel-layout."""
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
        return pp, _layout_string_chunks(args, pp, split_flags, imported)
    chunks = _virtual_stages(args, pp)
    _check_layer_split(args, pp, chunks)
    return pp, None if chunks == 1 else chunks


def _layout_string_chunks(args: argparse.Namespace, pp: int, split_flags: list[str], imported: bool) -> Optional[int]:
    others = [flag for flag in split_flags if flag != "--pipeline-model-parallel-layout"]
    if others:
        raise ValueError(f"--pipeline-model-parallel-layout sets the whole split; it excludes {', '.join(others)}.")
    if not imported:
        raise NotYetKnown
    from megatron.core.transformer.pipeline_parallel_layer_layout import (
        PipelineParallelLayerLayout,
    )

    try:
        layout = PipelineParallelLayerLayout.from_str(args.pipeline_model_parallel_layout, pp)
        layout.validate_layer_layout(num_layers=args.num_layers, mtp_num_layers=None)
    except (AssertionError, ValueError, KeyError) as error:
        raise ValueError(f"--pipeline-model-parallel-layout {args.pipeline_model_parallel_layout!r} does not fit "
                         f"--pipeline-model-parallel-size {pp} and --num-layers {args.num_layers}: "
                         f"{' '.join(str(error).split())}") from None
    chunks = layout.virtual_pipeline_model_parallel_size
    return None if chunks == 1 else chunks


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
