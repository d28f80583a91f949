"""pretrain_gpt.py's parser and `parse_args`: every flag parsed and checked before any process group exists.

The parser is built from the flag tables (`flags/`), which import neither torch nor megatron-core,
so `--help` and argparse's errors come at once, and so do the checks of the flags against each
other (arguments/checks.py). `parse_args` then imports torch and megatron-core (saying so on
rank 0) and checks the flags against the installed optimizers and the device.
"""

import argparse
import sys
from typing import TYPE_CHECKING, Optional

from arguments.optimizer_args import add_optimizer_args, resolve_optimizer_flags
from megatron_eopt.training.arguments.flags import checkpoint, data, logging, model, moe, parallel, training
from megatron_eopt.training.arguments.flags.table import Flag, add_flags
from megatron_eopt.training.arguments.no_effect import NO_EFFECT_ROWS, NO_EFFECT_TITLE, REFUSED_ROWS, REFUSED_TITLE
from megatron_eopt.runtime.rank_exit import exit_pointing_to_help
from megatron_eopt.training.errors import PROG, RankZeroArgumentParser, is_rank_zero

if TYPE_CHECKING:
    from megatron_eopt.training.model.gpt import GPTModelSettings
    from megatron_eopt.training.parallel.layout import Layout

# (group title, rows), in the order --help shows them.
TABLES: tuple[tuple[str, tuple[Flag, ...]], ...] = (
    (model.MODEL_TITLE, model.MODEL),
    (parallel.PARALLEL_TITLE, parallel.PARALLEL),
    (parallel.PIPELINE_TITLE, parallel.PIPELINE),
    (training.TRAINING_TITLE, training.TRAINING),
    (training.BATCH_SCHEDULE_TITLE, training.BATCH_SCHEDULE),
    (checkpoint.CHECKPOINT_TITLE, checkpoint.CHECKPOINT),
    (logging.LOGGING_TITLE, logging.LOGGING),
    (checkpoint.RUN_CONTROL_TITLE, checkpoint.RUN_CONTROL),
    (data.DATA_TITLE, data.DATA),
    (data.TOKENIZER_TITLE, data.TOKENIZER),
    (data.VALIDATION_TITLE, data.VALIDATION),
    (moe.MOE_TITLE, moe.MOE),
    (model.MLA_TITLE, model.MLA),
    (training.MEMORY_TITLE, training.MEMORY),
    (logging.PERFORMANCE_TITLE, logging.PERFORMANCE),
    (NO_EFFECT_TITLE, NO_EFFECT_ROWS),
    (REFUSED_TITLE, REFUSED_ROWS),
)


def build_parser() -> argparse.ArgumentParser:
    parser = RankZeroArgumentParser(
        prog=PROG, description="Pretrain a megatron-core GPTModel with megatron_eopt's optimizer: Megatron-LM's flags.")
    for title, rows in TABLES:
        add_flags(parser, title, rows)
    # Deferred: the optimizer's defaults and installed choices are read after the heavy imports.
    return add_optimizer_args(parser, deferred=True)


def parse_args(argv: Optional[list[str]] = None) -> tuple[argparse.Namespace, "GPTModelSettings", "Layout"]:
    """Parse the flags and check them against each other (errors exit at once, one line), then
    import torch and megatron-core and check them against the installed packages and the device.

    Returns a new namespace with every default resolved, the model settings and the layout."""
    from megatron_eopt.training.arguments.checks import check_flags, check_flags_before_import  # torch-free

    parsed = build_parser().parse_args(argv)
    check_flags_before_import(parsed)
    if "megatron.core" not in sys.modules and is_rank_zero():
        print("> importing torch and megatron-core ...", flush=True)
    try:  # the installed optimizers (torch, not yet megatron-core): a misspelt name fails sooner
        resolve_optimizer_flags(parsed)
    except ValueError as error:
        exit_pointing_to_help(str(error), PROG)
    return check_flags(parsed)  # imports torch and megatron-core
