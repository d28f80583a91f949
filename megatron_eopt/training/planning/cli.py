"""tools/plan_muon.py's command line: the trainer's flag tables (Megatron-LM's model, parallelism
and optimizer flags) plus a few of the planner's own (--model, --data-parallel-size, --hardware,
--mfu, --json). docs/planner.md describes it."""

import argparse
import dataclasses
from typing import Optional

from arguments import optimizer_config_from_args, validate_args
from arguments.optimizer_args import add_optimizer_args, resolve_optimizer_flags
from megatron_eopt.training.arguments.device import Device
from megatron_eopt.training.arguments.flags import model as model_flags
from megatron_eopt.training.arguments.flags import moe as moe_flags
from megatron_eopt.training.arguments.flags.table import replaced
from megatron_eopt.training.arguments.model import model_defaults, model_settings
from megatron_eopt.training.arguments.moe import moe_settings, resolve_moe_flags
from megatron_eopt.training.arguments.flags.table import add_flags
from megatron_eopt.training.arguments.parser import TABLES
from megatron_eopt.training.model.settings import GPTModelSettings
from megatron_eopt.training.planning.presets import PRESETS

# Flags of the model tables that a preset still takes: the tokens and the layout, not the matrices.
PRESET_FLAGS = ("seq_length", "expert_model_parallel_size", "expert_tensor_parallel_size")


def build_planner_parser() -> argparse.ArgumentParser:
    """The trainer's flag tables and the optimizer's flags, then the planner's own."""
    parser = argparse.ArgumentParser(prog="plan_muon.py",
                                     description="Per-rank cost of Muon's step for a model and a layout.")
    for title, rows in TABLES:
        add_flags(parser, title, rows)
    add_optimizer_args(parser, deferred=True)
    group = parser.add_argument_group("planner")
    group.add_argument("--model", choices=sorted(PRESETS), help="a named model (else the model flags describe it)")
    group.add_argument("--data-parallel-size", type=int, default=1, help="DP: world = TP x PP x DP")
    group.add_argument("--hardware", default="h100", help="hardware profile of the cost model (ops/muon_cost.py)")
    group.add_argument("--peak-tflops", type=float, help="dense bf16 peak per GPU for the iteration time "
                       "(default: the hardware profile's datasheet peak, e.g. h100 989)")
    group.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilization of an iteration (0-1]")
    group.add_argument("--json", action="store_true", help="every rank as JSON instead of the table")
    group.add_argument("--all-ranks", action="store_true", help="every group of ranks in the table")
    return parser


def _given_model_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    rows = model_flags.MODEL + model_flags.MLA + moe_flags.MOE
    return [row.option for row in rows if row.name not in PRESET_FLAGS
            and getattr(args, row.name, None) != parser.get_default(row.name)]


def model_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> GPTModelSettings:
    """The preset (with --seq-length if given), or the model the trainer's model flags describe."""
    tp = args.tensor_model_parallel_size
    if args.model is not None:
        given = _given_model_flags(parser, args)
        if given:
            raise ValueError(f"--model {args.model} describes the whole model; {', '.join(given)} would change it. "
                             f"Give either --model or the model flags.")
        changes = {"seq_length": args.seq_length} if args.seq_length != parser.get_default("seq_length") else {}
        return dataclasses.replace(PRESETS[args.model], **changes,
                                   num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
                                   num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers)
    args = replaced(args, **model_defaults(args, tp, say=False))
    settings = model_settings(args, tp, Device(None, None, None, None))
    return dataclasses.replace(settings, **moe_settings(replaced(args, **resolve_moe_flags(args))))


def optimizer_config(args: argparse.Namespace):
    """OptimizerConfig from the optimizer flags: --optimizer muon and Newton-Schulz in bf16
    ('medium') unless given."""
    if args.optimizer is None:
        args = replaced(args, optimizer="muon")
    args = resolve_optimizer_flags(args)
    if args.muon_fp32_matmul_prec is None:
        args = replaced(args, muon_fp32_matmul_prec="medium")
    args = validate_args(args, args.tensor_model_parallel_size, wraps_fully_shard=True)
    return optimizer_config_from_args(args)


def main(argv: Optional[list[str]] = None) -> None:
    parser = build_planner_parser()
    args = parser.parse_args(argv)
    try:
        text = run(parser, args)
    except ValueError as error:
        parser.error(str(error))  # one line, status 2, under this tool's name
    print(text)


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    from megatron_eopt.ops.muon_cost import hardware_profile
    from megatron_eopt.training.planning.plan import PlanInputs, PlanLayout, plan_ranks
    from megatron_eopt.training.planning.report import as_json, render_table

    if args.num_layers_per_virtual_pipeline_stage is not None:
        raise ValueError("the planner plans one model chunk per pipeline rank; drop "
                         "--num-layers-per-virtual-pipeline-stage.")
    if not 0 < args.mfu <= 1:
        raise ValueError(f"--mfu must be in (0, 1]; got {args.mfu}.")
    settings = model_from_args(parser, args)
    config = optimizer_config(args)
    layout = PlanLayout(tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
                        dp=args.data_parallel_size, ep=args.expert_model_parallel_size, fsdp=args.use_torch_fsdp2,
                        layer_wise=config.use_layer_wise_distributed_optimizer)
    profile = hardware_profile(args.hardware)  # an unknown name lists the known ones
    peak = args.peak_tflops * 1e12 if args.peak_tflops else profile.peak_bf16_flops
    if peak is None:
        raise ValueError(f"hardware {args.hardware!r} has no peak FLOP/s here; give --peak-tflops.")
    tokens = (args.global_batch_size or 0) * settings.seq_length
    inputs = PlanInputs(settings, layout, config, profile, peak, args.mfu, tokens,
                        args.make_vocab_size_divisible_by)
    plans = plan_ranks(inputs)
    return as_json(inputs, plans) if args.json else render_table(inputs, plans, 0 if args.all_ranks else 12)
