"""The training loop: the step (forward/backward, gradients finalised, optimizer step) and the iterations."""

import argparse
import dataclasses
import math
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megatron_eopt import get_megatron_optimizer
from arguments import (
    matmul_precision_line,
    optimizer_config_from_args,
)
from arguments.optimizer_args import GIVEN_FLAGS_ATTR
from arguments.validate import other_optimizers_flags_line
from megatron_eopt.integrations.megatron_bridge import get_scheduler
from megatron_eopt.checkpointing import CheckpointSaveError, new_save_group, save_checkpoint, start_save_checkpoint
from megatron_eopt.training.arguments.moe import (
    describe_moe,
    logged_moe_losses,
    moe_layer_pattern,
    moe_note_lines,
)
from megatron_eopt.training.arguments.no_effect import no_effect_lines
from megatron_eopt.training.arguments.training import document_lines, scheduler_config
from megatron_eopt.training.data.batches import BatchSource
from megatron_eopt.training.data.datasets import (
    document_inputs,
)
from megatron_eopt.training.errors import exit_with_error
from megatron_eopt.training.logging.performance import (
    Profiler,
    flops_per_iteration,
    performance_lines,
)
from megatron_eopt.training.logging.training_log import (
    Logger,
    Step,
    params_norm,
    tensorboard_option_lines,
)
from megatron_eopt.training.loop.evaluation import Evaluator
from megatron_eopt.training.loop.housekeeping import Housekeeping
from megatron_eopt.training.loop.resume import resume
from megatron_eopt.training.loop.run_control import (
    ExitSignal,
    run_control_lines,
)
from megatron_eopt.training.loop.token_loss import TokenLoss
from megatron_eopt.training.model.gpt import (
    GPTModelSettings,
    build_gpt_model_chunks,
)
from megatron_eopt.training.model.moe import (
    finish_router_step,
    start_step,
    step_moe_losses,
)
from megatron_eopt.training.parallel.fsdp2 import fully_shard_gpt
from megatron_eopt.training.parallel.megatron_fsdp import finish_grad_sync, megatron_fsdp_gpt, zero_grad_buffers
from megatron_eopt.training.parallel.grad_reduction import (
    BUCKET_NUMEL,
    GradReducer,
    finalize_model_grads,
    nan_in_grads,
)
from megatron_eopt.training.parallel.pipeline import Pipeline, SingleStage


def train_step(model, optimizer, micro_batches, forward, grads: GradReducer, dp_group,
               after_forward_backward: Callable[[], None] = lambda: None
               ) -> tuple[float, bool, Optional[float], Optional[float]]:
    """Forward/backward over the micro-batches (`forward`: one stage or a pipeline,
    megatron_eopt/training/parallel/pipeline.py), the gradients finalised (DP average, sums over TP of the
    sequence-parallel ones and over the pipeline of the tied embedding), optimizer step.

    Each micro-batch's loss is divided by the number of micro-batches and scaled by the
    optimizer's loss scale (fp16; 1 otherwise), which the optimizer divides out of the gradients
    again; an overflow makes it skip the step and back the scale off. Returns (global-batch mean
    loss, update successful, grad norm, zeros in the gradients (with --log-num-zeros-in-grad,
    else None)).
    """
    optimizer.zero_grad()
    grads.zero_grads(len(micro_batches))
    start_step(optimizer.get_loss_scale(), len(micro_batches))  # the MoE aux loss's gradient scale
    total = forward.forward_backward(micro_batches, optimizer.scale_loss)
    after_forward_backward()
    chunks = list(model) if isinstance(model, torch.nn.ModuleList) else [model]
    finish_grad_sync(chunks)  # Megatron-FSDP's (nothing without it)
    finalize_model_grads(chunks, grads)
    finish_router_step(chunks)  # MoE expert biases and token counts, as megatron's finalize_model_grads
    dp_size = dist.get_world_size(dp_group)
    loss_sum = total.to(next(model.parameters()).device)
    dist.all_reduce(loss_sum, group=dp_group)
    ok, grad_norm, num_zeros = optimizer.step()
    zero_grad_buffers(chunks)  # Megatron-FSDP's (nothing without it)
    return loss_sum.item() / dp_size, ok, grad_norm, num_zeros


def _moe_losses(args, settings: GPTModelSettings, num_micro_batches: int, device: torch.device) -> dict[str, float]:
    """The step's MoE losses Megatron-LM logs (none for a dense model)."""
    if args.num_experts is None:
        return {}
    num_moe_layers = sum(moe_layer_pattern(args.moe_layer_freq, settings.num_layers))
    return step_moe_losses(logged_moe_losses(args), num_micro_batches, settings.num_layers, num_moe_layers, device)


def train(args, settings, layout, device, housekeeping: Optional[Housekeeping] = None) -> list[dict]:
    """The training loop (inside `housekeeping.training()`, see `main`): build, say what was
    built, resume, iterate (or with --skip-train only evaluate); returns the logged records."""
    housekeeping = housekeeping or Housekeeping(args, device)
    run = build_training(args, settings, layout, device, housekeeping)
    try:
        say_setup(args, settings, device, run, housekeeping)
        start = resume(args, run.chunks, run.optimizer, run.scheduler, run.log)
        if args.skip_train:  # Megatron-LM: evaluate the loaded model on validation and test, no training
            run.evaluator.final(run.model, start)
        else:
            run_iterations(args, settings, layout, device, run, housekeeping, start)
    finally:
        release_save_group(run)
    run.log.close()
    return run.log.records


@dataclasses.dataclass
class Training:
    """What `train` builds before its first iteration."""

    chunks: list[torch.nn.Module]  # this rank's model chunks, one per virtual pipeline stage
    model: torch.nn.Module  # all of this rank's parameters: the one chunk, or a ModuleList of them
    dp_group: Any
    batches: BatchSource
    forward: SingleStage | Pipeline
    optimizer: Any
    scheduler: Any
    grads: GradReducer
    log: Logger
    evaluator: Evaluator
    save_group: Any = None  # --async-save's gloo group for the writing thread (checkpointing.new_save_group)
    pending_save: Any = None  # the --async-save checkpoint being written (checkpointing.PendingSave)


def build_training(args, settings, layout, device, housekeeping: Housekeeping) -> Training:
    """The model (sharded with --use-torch-fsdp2), the data, the forward, the optimizer and its
    scheduler, the gradient reduction, the logger and the evaluator."""
    from megatron.core import parallel_state

    chunks = build_gpt_model_chunks(settings, device)
    model = chunks[0] if len(chunks) == 1 else torch.nn.ModuleList(chunks)
    dp_group = parallel_state.get_data_parallel_group()
    expert_parallel = parallel_state.get_expert_model_parallel_world_size()
    if args.use_torch_fsdp2:
        expert_dp_group = parallel_state.get_expert_data_parallel_group() if expert_parallel > 1 else None
        fully_shard_gpt(model, dp_group, device, bf16_compute=args.bf16, expert_dp_group=expert_dp_group)
    if args.use_megatron_fsdp:
        model = megatron_fsdp_gpt(model, device, fp32_grads=args.accumulate_allreduce_grads_in_fp32,
                                  expert_parallel_size=expert_parallel)
        chunks = [model]
    batches = BatchSource(args, layout, parallel_state.get_data_parallel_rank())
    forward = _forward(args, layout, device, chunks, model, batches, dp_group)
    config = optimizer_config_from_args(args, device)
    if args.use_torch_fsdp2 or args.use_megatron_fsdp:  # --bf16 is the compute dtype there: the parameters
        config = dataclasses.replace(config, bf16=False)  # stepped are fp32 shards (FSDP2's, Megatron-FSDP's mains)
    optimizer = get_megatron_optimizer(config, chunks)
    scheduler = get_scheduler(config, scheduler_config(args), optimizer)
    # The layer-wise optimizer reduces onto owners itself (unless --overlap-grad-reduce); FSDP2
    # reduce-scatters (averages) in backward.
    grads = GradReducer(model, dp_group, args.accumulate_allreduce_grads_in_fp32,
                        reduce_over_dp=not (config.layer_wise_reduce_grads or args.use_torch_fsdp2
                                            or args.use_megatron_fsdp),
                        bucket_numel=args.ddp_bucket_size or BUCKET_NUMEL,
                        expert_dp_group=parallel_state.get_expert_data_parallel_group(),
                        overlap=args.overlap_grad_reduce)
    flops = flops_per_iteration(settings, 1) if args.log_throughput else None
    log = Logger(args, layout.rank, flops_per_sample=flops, world_size=layout.world_size, on_cuda=device.type == "cuda")
    evaluator = Evaluator(args, batches.data.splits, batches.split_batches, forward.eval_loss, dp_group,
                          is_first_rank=layout.rank == 0, print_line=log.print_line,
                          on_result=log.evaluation,
                          around_each=housekeeping.evaluation)
    save_group = new_save_group(chunks) if args.save and args.async_save else None
    return Training(chunks, model, dp_group, batches, forward, optimizer, scheduler, grads, log, evaluator, save_group)


def release_save_group(run: Training) -> None:
    """Destroy --async-save's group, unless a save still uses it (the run is failing: the
    process ends with the thread)."""
    if run.save_group is not None and (run.pending_save is None or run.pending_save.done()):
        dist.destroy_process_group(run.save_group)
        run.save_group = None


def _forward(args, layout, device, chunks, model, batches: BatchSource, dp_group) -> SingleStage | Pipeline:
    """Forward/backward of one stage, or of the pipeline, with the loss over the tokens that count
    (--eod-mask-loss) and the documents' positions and masks (--reset-position-ids/-attention-mask)."""
    token_loss = TokenLoss(batches.data.tokenizer.eod if args.eod_mask_loss else None,
                           per_token=args.calculate_per_token_loss, dp_group=dp_group)
    documents = None
    if args.reset_position_ids or args.reset_attention_mask:
        eod = batches.data.tokenizer.eod
        documents = lambda inputs: document_inputs(inputs, eod, args.reset_position_ids,  # noqa: E731
                                                   args.reset_attention_mask)
    if layout.pp == 1:
        return SingleStage(model, token_loss, documents)
    return Pipeline(chunks, layout.grad_accumulation_steps, (args.micro_batch_size, args.seq_length), device,
                    token_loss)


def say_setup(args, settings, device, run: Training, housekeeping: Housekeeping) -> None:
    """The lines before training: the model, MoE, flags without effect, notes, the precision."""
    log = run.log
    log.say(describe_model(run.model)
            + (", bf16 compute (FSDP2 MixedPrecisionPolicy)" if args.use_torch_fsdp2 and args.bf16 else "")
            + (", bf16 compute weights (Megatron-FSDP)" if args.use_megatron_fsdp and args.bf16 else ""))
    if args.num_experts is not None:
        log.say(describe_moe(args, settings.num_layers))
    other_optimizers = other_optimizers_flags_line(args, run.optimizer.config, getattr(args, GIVEN_FLAGS_ATTR, ()))
    for line in (no_effect_lines(args) + [other_optimizers] * bool(other_optimizers) + moe_note_lines(args)
                 + run_control_lines(args) + document_lines(args)
                 + performance_lines(args, on_cuda=device.type == "cuda")
                 + tensorboard_option_lines(args, on_cuda=device.type == "cuda")
                 + [line for line in (housekeeping.start_line, args.batch_schedule.describe()) if line]):
        log.say(line)
    if args.overlap_grad_reduce and (args.use_torch_fsdp2 or args.use_megatron_fsdp):
        log.say(f"--overlap-grad-reduce: nothing to change, {'FSDP2' if args.use_torch_fsdp2 else 'Megatron-FSDP'} "
                f"reduce-scatters each layer's gradients during backward")
    precision_line = matmul_precision_line(args, device)
    if precision_line:
        log.say(precision_line)


def run_iterations(args, settings, layout, device, run: Training, housekeeping: Housekeeping, start: int) -> None:
    """Iterations start + 1 .. --train-iters, each followed by its evaluation, checkpoint and exit
    decisions; the final evaluation when none stopped the run early."""
    started = time.time()
    profiler = Profiler(args, layout.rank, on_cuda=device.type == "cuda")
    with ExitSignal(args) as exit_signal:  # --exit-signal-handler (megatron_eopt/training/loop/run_control.py)
        for iteration in range(start + 1, args.train_iters + 1):
            profiler.before(iteration)
            train_iteration(args, settings, device, run, housekeeping, iteration)
            profiler.after(iteration)
            run.evaluator.periodic(run.model, iteration)
            stop = exit_signal.received() or exit_reason(args, iteration, started, device)
            save_if_due(args, iteration, bool(stop), run)
            if stop:
                run.log.say(f"exiting after iteration {iteration} ({stop})")
                break
        else:  # as in Megatron-LM, a run stopped early skips the final evaluation
            run.evaluator.final(run.model, args.train_iters)
    finish_pending_save(args, run)  # none left after a save at the end; without --save none started
    profiler.close()


def train_iteration(args, settings, device, run: Training, housekeeping: Housekeeping, iteration: int) -> None:
    """One training step, the scheduler's step after a successful update, and its log line."""
    lr = run.optimizer.param_groups[0]["lr"]
    micro_batches = run.batches.micro_batches(iteration)
    loss, ok, grad_norm, num_zeros = train_step(run.model, run.optimizer, micro_batches, run.forward, run.grads,
                                                run.dp_group, housekeeping.after_forward_backward)
    housekeeping.after_step(iteration)
    if args.check_for_nan_in_loss_and_grad:
        stop_on_nan(iteration, loss, run.model, check_grads=not args.fp16, device=device)
    batch_size = args.batch_schedule.size(iteration)
    if ok:
        run.scheduler.step(batch_size)
    run.log.iteration(Step(
        iteration, loss, lr, ok, grad_norm=None if grad_norm is None else float(grad_norm),
        loss_scale=float(run.optimizer.get_loss_scale()), num_zeros=None if num_zeros is None else float(num_zeros),
        params_norm=logged_params_norm(run.model, run.optimizer) if args.log_params_norm else None,
        max_attention_logit=run.optimizer.max_attention_logit,
        other_losses=_moe_losses(args, settings, len(micro_batches), device), batch_size=batch_size))


def save_if_due(args, iteration: int, stopping: bool, run: Training) -> None:
    """--save's checkpoint after `iteration`: at --save-interval, when stopping, after the last.
    With --async-save an interval's checkpoint is written in the background (the one before it
    waited for first); the last one, and one on stopping, are written before going on."""
    at_interval = bool(args.save_interval) and iteration % args.save_interval == 0
    final = stopping or iteration == args.train_iters
    if not (args.save and (at_interval or final)):
        return
    finish_pending_save(args, run)
    finish_param_sync(run.optimizer)  # save_checkpoint waits itself, but not when given no optimizer
    optimizer, scheduler = (None, None) if args.no_save_optim else (run.optimizer, run.scheduler)
    if args.async_save and not final:
        run.pending_save = start_save_checkpoint(args.save, iteration, run.chunks, optimizer, scheduler,
                                                 save_rng=not args.no_save_rng, background_group=run.save_group)
        return
    try:
        path = save_checkpoint(args.save, iteration, run.chunks, optimizer, scheduler, save_rng=not args.no_save_rng)
    except CheckpointSaveError as error:  # raised on every rank alike; the directory is as it was
        _save_failed(args, run, error, iteration)
        return
    run.log.say(f"saved checkpoint {path}")


def finish_pending_save(args, run: Training) -> None:
    """Wait for the --async-save checkpoint in flight, if any, and say how it ended."""
    pending, run.pending_save = run.pending_save, None
    if pending is None:
        return
    try:
        path = pending.wait()
    except CheckpointSaveError as error:
        _save_failed(args, run, error, pending.iteration)
        return
    run.log.say(f"saved checkpoint {path} (in the background, --async-save)")


def _save_failed(args, run: Training, error: CheckpointSaveError, iteration: int) -> None:
    if not args.continue_on_save_failure:
        exit_with_error(f"{error} Training stops (the save after iteration {iteration} failed; "
                        f"--continue-on-save-failure would go on training).")
    run.log.say(f"warning: {error} Training goes on (--continue-on-save-failure).")


def stop_on_nan(iteration: int, loss: float, model: torch.nn.Module, check_grads: bool, device: torch.device) -> None:
    """Megatron-LM's --check-for-nan-in-loss-and-grad (on by default): a NaN loss or a NaN in a
    gradient stops the run on every rank. The step has skipped such an update already (its
    gradients are not finite), so the parameters are the last good ones. The loss is reduced over
    the ranks; the gradients' verdict is all-reduced (`nan_in_grads`). With fp16 only the loss is
    checked: an overflow is the loss scaler's to skip (with a dynamic loss scale the check is off,
    as in Megatron-LM: megatron_eopt/training/arguments/training.py)."""
    what = "loss" if math.isnan(loss) else ("gradients" if check_grads and nan_in_grads(model, device) else None)
    if what is not None:
        exit_with_error(f"iteration {iteration}: found NaN in the {what} (Megatron-LM's check; "
                        f"--no-check-for-nan-in-loss-and-grad skips such steps instead).")


def exit_reason(args: argparse.Namespace, iteration: int, started: float, device: torch.device) -> Optional[str]:
    """Why training stops after `iteration` (None: it goes on): --exit-interval, or
    --exit-duration-in-mins, decided on every rank at once (the longest clock: a MAX all-reduce,
    as Megatron-LM does)."""
    if args.exit_interval and iteration % args.exit_interval == 0:
        return f"--exit-interval {args.exit_interval}"
    if args.exit_duration_in_mins is None:
        return None
    minutes = torch.tensor((time.time() - started) / 60, dtype=torch.float64, device=device)
    dist.all_reduce(minutes, op=dist.ReduceOp.MAX)
    if minutes.item() < args.exit_duration_in_mins:
        return None
    return f"--exit-duration-in-mins {args.exit_duration_in_mins:g}: {minutes.item():.2f} minutes of training"


def finish_param_sync(optimizer) -> None:
    """Wait for the layer-wise optimizer's parameter broadcasts still in flight (with
    --overlap-param-gather the next forward would): code that reads every parameter first."""
    finish = getattr(optimizer, "finish_param_sync", None)
    if finish is not None:
        finish()


def logged_params_norm(model: torch.nn.Module, optimizer) -> float:
    """--log-params-norm reads every parameter: first wait for the layer-wise optimizer's
    broadcasts still in flight (with --overlap-param-gather the next forward would wait for them)."""
    from megatron.core import parallel_state

    finish_param_sync(optimizer)
    expert_group = (parallel_state.get_expert_tensor_model_pipeline_parallel_group()
                    if parallel_state.get_expert_model_parallel_world_size() > 1 else None)  # experts split over EP
    return params_norm(model, parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_model_parallel_group(),
                       parallel_state.get_expert_tensor_parallel_rank(), expert_group)


def describe_model(model: torch.nn.Module) -> str:
    """Read from the built model (not the flags), so the line shows what --bf16 really made."""
    params = list(model.parameters())
    return f"model: {sum(p.numel() for p in params):,} parameters on rank 0, {params[0].dtype}"
