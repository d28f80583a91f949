"""Megatron-LM's own `pretrain()` for a GPT model, with megatron_eopt's optimizer.

scripts/pretrain_gpt_megatron_lm.py runs it exactly like Megatron-LM's pretrain_gpt.py; every
Megatron-LM flag works, plus ours (`--muon-tp-mode sharded`, `--muon-match-adamw-rms`, ...).

Data: `--mock-data` (megatron-core's MockGPTDataset) or `--data-path [W] PREFIX ...` (Megatron
indexed datasets), built by megatron-core's BlendedMegatronDatasetBuilder. The model is
Megatron-LM's GPTModelConfig built from the flags (`gpt_config_from_args`). Without CUDA the
loop runs on CPU through megatron_eopt/runtime/megatron_lm_cpu.py, on gloo by default (with
`--transformer-impl local` and no fused kernels; docs/megatron-lm.md).
"""

import pathlib
import sys
from functools import partial, wraps
from typing import Any, Callable, Optional

import torch

from megatron_eopt.runtime.rank_exit import exit_pointing_to_help, exit_with_error

PROG = "pretrain_gpt_megatron_lm.py"


def forward_step(data_iterator: Any, model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
    """One micro-batch through the model; the loss function Megatron-LM's schedule calls."""
    batch = _next_batch(data_iterator, next(model.parameters()).device)
    output = model(
        batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"]
    )
    return output, partial(loss_func, batch["loss_mask"])


def loss_func(loss_mask: torch.Tensor, per_token_loss: torch.Tensor) -> tuple:
    """(summed loss, token count, {'lm loss': [sum, count]}): Megatron-LM divides by the count
    over all micro-batches and data-parallel ranks, and logs 'lm loss' as sum / count."""
    mask = loss_mask.reshape(-1).float()
    loss = torch.sum(per_token_loss.reshape(-1).float() * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.cat([loss.detach().view(1), num_tokens.detach().float().view(1)])
    return loss, num_tokens, {"lm loss": report}


def _next_batch(data_iterator: Any, device: torch.device) -> dict:
    """Every rank reads its own batch: each builds the same deterministic dataset (see
    `datasets_provider.is_distributed`), so no broadcast over the TP group is needed."""
    if data_iterator is None:
        raise RuntimeError("this rank has no data iterator; was the dataset built on every rank?")
    return {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in next(data_iterator).items()}


def datasets_provider(num_samples: Optional[list], vp_stage: Optional[int] = None) -> tuple:
    """(train, valid, test) GPT datasets: MockGPTDataset with --mock-data, else indexed data."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset
    from megatron.training import get_args

    args = get_args()
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    sizes = num_samples if num_samples is not None else _split_sample_counts(args)
    builder = BlendedMegatronDatasetBuilder(dataset_type, sizes, lambda: True, _dataset_config(args))
    return builder.build()


datasets_provider.is_distributed = True  # Megatron-LM: build on every rank, not only TP rank 0


def _split_sample_counts(args: Any) -> list[int]:
    """Samples each split needs for the run the flags describe (train, valid, test)."""
    evaluations = args.train_iters // args.eval_interval + 1 if args.eval_interval else 1
    return [
        args.train_iters * args.global_batch_size,
        evaluations * args.eval_iters * args.global_batch_size,
        args.eval_iters * args.global_batch_size,
    ]


def _dataset_config(args: Any) -> Any:
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.training import get_tokenizer
    from megatron.training.utils import get_blend_and_blend_per_split

    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        path_to_cache=args.data_cache_path,
        tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
    )


def use_prebuilt_dataset_helpers() -> None:
    """Megatron-LM's initialisation runs `make` in megatron/core/datasets to build the C++ dataset
    helpers, as in a source checkout; the megatron-core wheel ships them built and without the
    Makefile, so that `make` fails and Megatron-LM exits. Skip the build when the built module
    is there (a source checkout without it still builds)."""
    import importlib.util

    import megatron.core.datasets.utils as dataset_utils

    if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is not None:
        dataset_utils.compile_helpers = lambda: None


def add_script_args(parser: Any) -> Any:
    """Our optimizer flags, plus this script's switch for comparing with megatron-core's own; without
    CUDA, `--distributed-backend` defaults to gloo."""
    from megatron_eopt.integrations import megatron_lm

    megatron_lm.add_megatron_eopt_args(parser)
    if not torch.cuda.is_available():  # Megatron-LM's default, nccl, needs GPUs; our trainer's default there too
        parser.set_defaults(distributed_backend="gloo")
    parser.error = lambda message: exit_pointing_to_help(message, PROG)  # not usage per rank
    parser.add_argument(
        "--megatron-core-optimizer", action="store_true",
        help="build megatron-core's own optimizer instead of megatron_eopt's (for comparisons: "
        "same model, data and loop; flags only megatron_eopt knows are then refused by megatron-core)",
    )
    return parser


def _refusals_in_one_line(run: Callable[[], None]) -> Callable[[], None]:
    """`run` whose refusals end it as our trainer's do: one line on rank 0, status 2 on every rank,
    no traceback (runtime/rank_exit.py). Refusals are our ValueErrors, the assertions of
    Megatron-LM's flag checks (its megatron/training/arguments.py), and megatron-core's check that a
    loaded checkpoint's lr schedule is the command line's (`schedule_mismatch`); other errors stay
    tracebacks."""

    @wraps(run)
    def refusing() -> None:
        try:
            run()
        except ValueError as error:
            exit_with_error(str(error), PROG)
        except AssertionError as error:
            exit_with_error(_refusal_line(error), PROG)

    return refusing


def _refusal_line(error: AssertionError) -> str:
    """The line of an assertion that checks the command line; re-raises any other."""
    last = error.__traceback__
    while last.tb_next is not None:
        last = last.tb_next
    where = pathlib.Path(last.tb_frame.f_code.co_filename).parts[-3:]
    if where == ("megatron", "training", "arguments.py"):
        return f"{error or 'a check failed'} (Megatron-LM's arguments.py line {last.tb_lineno})"
    if where == ("megatron", "core", "optimizer_param_scheduler.py") and last.tb_frame.f_code.co_name == "_check_and_set":
        local = last.tb_frame.f_locals  # the assertion's own values: what was compared, and its name
        return schedule_mismatch(local["name"], local["sd_value"], local["cls_value"], _fixed_global_batch_size())
    raise error


def _fixed_global_batch_size() -> Optional[int]:
    """The run's --global-batch-size, None when it ramps up (iterations then hold different sample counts)."""
    from megatron.training import global_vars

    args = global_vars._GLOBAL_ARGS  # get_args() asserts when unset
    if args is None or getattr(args, "rampup_batch_size", None):
        return None
    return getattr(args, "global_batch_size", None)


# megatron-core's names of the lr schedule's settings (OptimizerParamScheduler.load_state_dict) -> the
# flags that set them; the iteration counts it holds in samples (iterations x --global-batch-size).
SCHEDULE_FLAGS = {
    "learning rate": "--lr",
    "minimum learning rate": "--min-lr",
    "warmup iterations": "--lr-warmup-iters (samples: x --global-batch-size), --lr-warmup-samples or --lr-warmup-fraction",
    "total number of iterations": "--lr-decay-iters (default: --train-iters; samples: x --global-batch-size) "
                                  "or --lr-decay-samples",
    "learning rate decay style": "--lr-decay-style",
    "start weight decay": "--start-weight-decay (default: --weight-decay)",
    "end weight decay": "--end-weight-decay (default: --weight-decay)",
    "total number of weight decay iterations": "--train-iters (samples: x --global-batch-size) or --train-samples",
    "weight decay incr style": "--weight-decay-incr-style",
}


# Those of SCHEDULE_FLAGS' settings megatron-core counts in samples, whatever their names say.
COUNTED_IN_SAMPLES = ("warmup iterations", "total number of iterations", "total number of weight decay iterations")


def schedule_mismatch(name: str, checkpoint_value: Any, command_line_value: Any,
                      global_batch_size: Optional[int] = None) -> str:
    """The line for a loaded lr schedule that differs from the command line's: megatron-core asserts
    they are equal unless one of its two flags says which to keep. A count megatron-core holds in
    samples is given in samples and, with a fixed `global_batch_size`, in iterations."""
    flags = SCHEDULE_FLAGS.get(name, "the lr-schedule flags")
    if name in COUNTED_IN_SAMPLES:
        checkpoint_value, command_line_value = (_samples_and_iterations(value, global_batch_size)
                                                for value in (checkpoint_value, command_line_value))
    return (f"--load: the checkpoint's lr schedule has {name} {checkpoint_value}, this command line gives "
            f"{command_line_value} (set by {flags}); give the checkpoint's value, or "
            f"--override-opt_param-scheduler to use this command line's schedule, or "
            f"--use-checkpoint-opt_param-scheduler to keep the checkpoint's.")


def _samples_and_iterations(samples: Any, global_batch_size: Optional[int]) -> str:
    """'16 samples (4 iterations x --global-batch-size 4)'; the samples alone where they make no whole iterations."""
    count = int(samples) if float(samples).is_integer() else samples
    if global_batch_size and isinstance(count, int) and count % global_batch_size == 0:
        return f"{count} samples ({count // global_batch_size} iterations x --global-batch-size {global_batch_size})"
    return f"{count} samples"


@_refusals_in_one_line
def main() -> None:
    from megatron_eopt.runtime import megatron_core_torch_adam, megatron_lm_cpu, megatron_lm_saves

    megatron_lm_cpu.install()  # without CUDA: the loop on CPU and gloo (does nothing with CUDA)
    megatron_core_torch_adam.install()  # with CUDA but no TE or Apex: megatron-core's Adam is torch's
    megatron_lm_saves.install()  # its async and non-persistent saves without psutil, on CPU, and when a writer dies
    from megatron.core.enums import ModelType
    from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.training import pretrain

    from megatron_eopt.integrations import megatron_lm

    ours = "--megatron-core-optimizer" not in sys.argv[1:]
    if ours:
        megatron_lm.install()  # before validate_args, which install() lets take Megatron-FSDP with ours
    # megatron-core's optimizer gets the same model (MLA on the local attention) and restarts (install() does both)
    replacements = [] if ours else megatron_lm.local_attention_for_mla() + megatron_lm.store_per_restart()
    with megatron_lm_cpu.replaced(replacements):
        args = parse_and_validate_args(extra_args_provider=add_script_args)
        use_prebuilt_dataset_helpers()
        config = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
        pretrain(config, datasets_provider, ModelType.encoder_or_decoder, forward_step)


if __name__ == "__main__":
    main()
