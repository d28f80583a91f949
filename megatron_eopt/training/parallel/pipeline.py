"""Forward and backward over a step's micro-batches: one stage, or a pipeline of GPT stages.

`SingleStage` runs the micro-batches one after another through the whole model. `Pipeline` runs
them through this rank's stages with `torch.distributed.pipelining`'s schedules (1F1B, GPipe with
fewer micro-batches than stages, interleaved 1F1B with several chunks per rank), on CPU and CUDA
alike: megatron-core's own schedules allocate on CUDA.

Each model chunk is wrapped in a `GPTStage`: the first takes token ids, the others the previous
stage's hidden states, and the last computes megatron's `compute_language_model_loss` from its
logits. token_loss.py turns each micro-batch's token losses into its share of the step's loss.
Both classes return the sum of this rank's shares on every rank (the last stage broadcasts it);
`eval_loss` gives an evaluation micro-batch's summed loss and token count.
"""

from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from megatron_eopt.training.arguments.pipeline import pipeline_layout  # noqa: F401 (re-exported)
from megatron_eopt.training.loop.token_loss import TokenLoss
from megatron_eopt.training.model.gpt import gpt_token_losses

ScaleLoss = Callable[[torch.Tensor], torch.Tensor]


class SingleStage:
    """The whole model on this rank: micro-batches one after another (gradients accumulate)."""

    def __init__(self, model: torch.nn.Module, token_loss: Optional[TokenLoss] = None,
                 document_inputs: Optional[Callable] = None) -> None:
        """`document_inputs`: --reset-position-ids / --reset-attention-mask (gpt_token_losses)."""
        self.model, self.token_loss, self.document_inputs = model, token_loss or TokenLoss(), document_inputs

    def forward_backward(self, micro_batches: list[torch.Tensor], scale_loss: ScaleLoss) -> torch.Tensor:
        self.token_loss.start_step(micro_batches)
        total = torch.zeros((), dtype=torch.float32)
        for tokens in micro_batches:
            loss = self.token_loss.share(*gpt_token_losses(self.model, tokens, self.document_inputs))
            scale_loss(loss).backward()
            total += loss.detach().float().cpu()
        return total

    def eval_loss(self, model: torch.nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, int]:
        return self.token_loss.eval_sum_and_count(*gpt_token_losses(model, tokens, self.document_inputs))


class GPTStage(torch.nn.Module):
    """One pipeline stage of a GPT: token ids (first stage) or hidden states in; hidden states
    ([s, b, h]) or, on the last stage, logits ([b, s, vocab / TP]) out."""

    def __init__(self, chunk: torch.nn.Module) -> None:
        super().__init__()
        self.chunk = chunk

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.chunk.pre_process:
            position_ids = torch.arange(inputs.size(1), device=inputs.device).expand_as(inputs)
            return self.chunk(input_ids=inputs, position_ids=position_ids, attention_mask=None)
        self.chunk.set_input_tensor(inputs)
        return self.chunk(input_ids=None, position_ids=None, attention_mask=None)


class Pipeline:
    """This rank's stages of a pipeline over megatron's pipeline-parallel group.

    `chunks`: this rank's model chunks in virtual-stage order (megatron_eopt/training/model/gpt.py's
    `build_gpt_model_chunks`). `micro_batches_per_step`: the gradient-accumulation steps.
    `micro_batch_shape`: (micro-batch size, sequence length) of the model inputs.
    """

    def __init__(self, chunks: list[torch.nn.Module], micro_batches_per_step: int,
                 micro_batch_shape: tuple[int, int], device: torch.device,
                 token_loss: Optional[TokenLoss] = None) -> None:
        from megatron.core import parallel_state

        self.chunks, self.token_loss = chunks, token_loss or TokenLoss()
        self.micro_batch_shape = micro_batch_shape
        self.device = device
        self.group = parallel_state.get_pipeline_model_parallel_group()
        self.stages_per_rank = len(chunks)
        self.num_stages = dist.get_world_size(self.group) * self.stages_per_rank
        self.last_rank = dist.get_world_size(self.group) - 1
        self.is_last_rank = dist.get_rank(self.group) == self.last_rank
        self._losses: list[torch.Tensor] = []
        self._scale_loss: ScaleLoss = lambda loss: loss
        self._micro_batches = micro_batches_per_step
        # One training schedule per micro-batch count (a growing global batch needs several,
        # megatron_eopt/training/data/batch_schedule.py), built when first needed.
        self._train_schedules = {micro_batches_per_step: self._schedule(micro_batches_per_step, self._train_loss)}
        # Evaluation runs one micro-batch at a time (megatron_eopt/training/loop/evaluation.py); its own stages keep
        # the training schedule's buffers (sized for its micro-batch count) apart.
        self.eval_schedule = self._schedule(1, self._eval_loss)

    def _schedule(self, micro_batches: int, loss_fn: Callable):
        pp_rank = dist.get_rank(self.group)
        pp_size = dist.get_world_size(self.group)
        stages = [PipelineStage(GPTStage(chunk), index * pp_size + pp_rank, self.num_stages, self.device,
                                *self._stage_shapes(chunk), group=self.group)
                  for index, chunk in enumerate(self.chunks)]
        # scale_grads=False: the loss function divides by the micro-batch count itself, before
        # the fp16 loss scale, as the one-stage path does.
        if self.stages_per_rank > 1:
            return ScheduleInterleaved1F1B(stages, micro_batches, loss_fn=loss_fn, scale_grads=False)
        schedule = Schedule1F1B if micro_batches >= pp_size else ScheduleGPipe  # 1F1B needs >= stages
        return schedule(stages[0], micro_batches, loss_fn=loss_fn, scale_grads=False)

    def _stage_shapes(self, chunk: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """Meta tensors of a stage's input and output. Given, they spare the schedule its shape
        inference, which would run every stage's forward once more on uninitialised tensors
        (and so feed them to QK-clip's logit maxima and the MoE statistics)."""
        from megatron.core import parallel_state

        batch, seq = self.micro_batch_shape
        dtype = chunk.config.params_dtype
        tp = parallel_state.get_tensor_model_parallel_world_size()
        # Between stages the hidden states are this rank's part of the sequence under sequence
        # parallelism (megatron_eopt/training/parallel/sequence_parallel.py).
        hidden_seq = seq // tp if chunk.config.sequence_parallel else seq
        hidden = torch.empty(hidden_seq, batch, chunk.config.hidden_size, dtype=dtype, device="meta", requires_grad=True)
        if chunk.pre_process:
            inputs = torch.empty(batch, seq, dtype=torch.long, device="meta")
        else:
            inputs = hidden
        if chunk.post_process:
            vocab = chunk.vocab_size // tp
            return inputs, torch.empty(batch, seq, vocab, dtype=dtype, device="meta", requires_grad=True)
        return inputs, hidden

    def _token_losses(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # megatron's own loss on [s, b, vocab / TP] logits: the per-token values gpt_token_losses gets.
        return self.chunks[-1].compute_language_model_loss(labels, logits.transpose(0, 1).contiguous()).float()

    def _train_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = self.token_loss.share(self._token_losses(logits, labels), labels)
        self._losses.append(loss.detach())
        return self._scale_loss(loss)

    def _eval_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        total, count = self.token_loss.eval_sum_and_count(self._token_losses(logits, labels), labels)
        self._losses.append(torch.stack([total, torch.tensor(float(count), dtype=torch.float64, device=total.device)]))
        return total

    def forward_backward(self, micro_batches: list[torch.Tensor], scale_loss: ScaleLoss) -> torch.Tensor:
        self.token_loss.start_step(micro_batches)
        tokens = torch.cat(micro_batches).to(self.device, torch.long)
        self._scale_loss = scale_loss
        self._micro_batches = len(micro_batches)
        if self._micro_batches not in self._train_schedules:
            self._train_schedules[self._micro_batches] = self._schedule(self._micro_batches, self._train_loss)
        self._run(self._train_schedules[self._micro_batches].step, tokens)
        return self._broadcast_loss(torch.zeros((), dtype=torch.float32, device=self.device)).cpu()

    def eval_loss(self, model: torch.nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, int]:
        """A micro-batch's (summed counted loss, count), forward only (the caller sets eval
        mode and no_grad)."""
        self._run(self.eval_schedule.eval, tokens.to(self.device, torch.long))
        total, count = self._broadcast_loss(torch.zeros(2, dtype=torch.float64, device=self.device))
        return total, int(count.item())

    def _run(self, schedule_step: Callable, tokens: torch.Tensor) -> None:
        # Every rank passes both; the schedule gives the inputs to the first stage and the
        # labels to the last.
        inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        self._losses = []
        schedule_step(inputs, target=labels)

    def _broadcast_loss(self, total: torch.Tensor) -> torch.Tensor:
        """The last stage's summed micro-batch losses (into `total`, zeros of their shape), on
        every rank of the pipeline."""
        if self.is_last_rank:
            total = torch.stack(self._losses).sum(0)
        dist.broadcast(total, group=self.group, group_src=self.last_rank)
        return total
