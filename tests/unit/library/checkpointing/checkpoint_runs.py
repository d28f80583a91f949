"""Training runs that save and load checkpoints, for the checkpoint tests (run on gloo workers).

A `Layout` says how a run is parallelised; `GPTRun` builds megatron-core's GPTModel, our
optimizer and megatron-core's lr scheduler in it. `train_step` uses real gradients (each DP rank
its slice of the global batch); `synthetic_step` sets the same global gradient in every layout
(each rank its TP shard of it, bf16-representable), so that the steps of two layouts, or of a
bf16 and an fp32 model, can be compared to fp32 round-off. A `fsdp2` layout shards the model
with torch FSDP2 as scripts/pretrain_gpt.py --use-torch-fsdp2 does (FSDP2 averages gradients in
backward; a synthetic gradient is set as the DTensor of the global one).
"""

import zlib
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor

from megatron_eopt import OptimizerConfig, get_megatron_optimizer
from megatron_eopt.integrations.megatron_bridge import SchedulerConfig, get_scheduler
from megatron_eopt.training.model.gpt import (
    GPTModelSettings,
    build_gpt_model,
    destroy_model_parallel,
    initialize_model_parallel,
)
from megatron_eopt.training.parallel.fsdp2 import fully_shard_gpt
from tests.unit.library.distributed.test_layer_wise_gpt import SETTINGS  # the same tiny GPT
from tests.gpt_training import local_shard, token_batch, train_steps

GLOBAL_BATCH = 8
SEED = 5
# Muon runs in fp32 (muon_fp32_matmul_prec='highest'): layouts are compared at fp32 round-off.
OPTIMIZERS = {
    "adam": dict(optimizer="adam", lr=3e-3, min_lr=3e-4, weight_decay=0.1, clip_grad=1.0),
    "muon": dict(optimizer="muon", lr=3e-3, min_lr=3e-4, weight_decay=0.05, clip_grad=1.0, muon_momentum=0.9,
                 muon_fp32_matmul_prec="highest"),
    "normuon": dict(optimizer="adaptive_muon", adaptive_muon_moment2_method="normuon", lr=3e-3, min_lr=3e-4,
                    weight_decay=0.05, clip_grad=1.0, muon_fp32_matmul_prec="highest"),
    "polargrad": dict(optimizer="polargrad", lr=3e-3, min_lr=3e-4, weight_decay=0.05, clip_grad=1.0),
    "soap": dict(optimizer="soap", lr=3e-3, min_lr=3e-4, weight_decay=0.05, clip_grad=1.0),
}


@dataclass(frozen=True)
class Layout:
    optimizer: str = "muon"
    tp: int = 1
    layer_wise: bool = False
    bf16: bool = False
    fsdp2: bool = False
    # The precision-aware optimizer with bf16 moments (and, with bf16, remainders: docs/memory.md).
    bf16_state: bool = False

    def describe(self, world_size: int) -> str:
        return (f"{self.optimizer} TP{self.tp} DP{world_size // self.tp}{' layer-wise' if self.layer_wise else ''}"
                f"{' bf16' if self.bf16 else ''}{' FSDP2' if self.fsdp2 else ''}"
                f"{' bf16-state' if self.bf16_state else ''}")

    def precision_fields(self) -> dict:
        if not self.bf16_state:
            return {}
        return dict(use_precision_aware_optimizer=True, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)


class GPTRun:
    """Model, optimizer and scheduler of one layout (megatron-core parallel_state set up)."""

    def __init__(self, layout: Layout, **config_changes) -> None:
        from megatron.core import parallel_state

        self.layout = layout
        initialize_model_parallel(layout.tp, seed=SEED)
        settings = GPTModelSettings(**{**asdict(SETTINGS), "bf16": layout.bf16}) if layout.bf16 else SETTINGS
        self.model = build_gpt_model(settings)
        # Read before fully_shard, which drops megatron-core's attributes.
        self.partitions = {name: partition(p) for name, p in self.model.named_parameters()}
        if layout.fsdp2:
            fully_shard_gpt(self.model, parallel_state.get_data_parallel_group(), torch.device("cpu"))
        config = OptimizerConfig(**{**OPTIMIZERS[layout.optimizer], **layout.precision_fields(), **config_changes},
                                 bf16=layout.bf16,
                                 use_layer_wise_distributed_optimizer=layout.layer_wise)
        self.optimizer = get_megatron_optimizer(config, [self.model])
        self.scheduler = get_scheduler(config, SchedulerConfig(lr_warmup_iters=2, train_iters=40,
                                                               global_batch_size=GLOBAL_BATCH), self.optimizer)
        self.dp_group = parallel_state.get_data_parallel_group()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()

    def close(self) -> None:
        """Tear down parallel_state and let go of the model and optimizer, so that the groups they
        hold go before the next run makes its own (the suite's thread budget)."""
        destroy_model_parallel()
        vars(self).clear()

    def train_step(self, step: int) -> float:
        dp_rank, dp_size = dist.get_rank(self.dp_group), dist.get_world_size(self.dp_group)
        # What DDP does (layer_wise_reduce_grads is off by default, for every layout); FSDP2
        # reduce-scattered (averaged) the gradients in backward.
        average = self.dp_group if dp_size > 1 and not self.layout.fsdp2 else None
        run = train_steps(self.model, self.optimizer, global_batch(step).chunk(dp_size)[dp_rank], range(step, step + 1),
                          average_grads_over=average, take_step=self._take_step)
        return run.losses[0]

    def synthetic_step(self, step: int) -> None:
        for name, param in self.model.named_parameters():
            full_shape = list(param.shape)  # a DTensor's: this TP rank's shard
            dim, stride = self.partitions[name]
            if dim >= 0:
                full_shape[dim] *= self.layout.tp
            generator = torch.Generator().manual_seed(zlib.crc32(f"{name}/{step}".encode()))
            full = (torch.randn(full_shape, generator=generator) * 0.01).to(torch.bfloat16).float()
            shard = local_shard(full, dim, stride, self.tp_rank, self.layout.tp).to(param.dtype)
            if self.layout.fsdp2:  # src_data_rank=None: each rank its rows of its own (identical) copy
                param.grad = distribute_tensor(shard, param.device_mesh, [Shard(0)], src_data_rank=None)
                continue
            param.grad = shard
        self._take_step(self.optimizer)

    def _take_step(self, optimizer) -> float:
        ok, grad_norm, _ = optimizer.step()
        if not ok:
            raise RuntimeError("the optimizer skipped a step")
        self.scheduler.step(GLOBAL_BATCH)
        return grad_norm

    def master_params(self) -> dict[str, tuple[torch.Tensor, int, int]]:
        """name -> (fp32 value: the main copy when there is one, partition_dim, stride)."""
        # fp32_main_params: the main weight however it is held (an fp32 copy, or bf16 + remainder)
        main_of = {id(m): main for child in self.optimizer.chained_optimizers
                   for m, main in zip(child.model_params, child.fp32_main_params())}
        if self.layout.fsdp2:  # the main parameters alias the shards: gather this TP rank's shards
            return {name: (p.detach().full_tensor(), *self.partitions[name]) for name, p in self.model.named_parameters()}
        return {name: (main_of.get(id(p), p).detach().float().clone(), *partition(p))
                for name, p in self.model.named_parameters()}


def partition(param: torch.Tensor) -> tuple[int, int]:
    if not getattr(param, "tensor_model_parallel", False):
        return -1, 1
    return int(param.partition_dim), int(getattr(param, "partition_stride", 1))


def global_batch(step: int) -> torch.Tensor:
    return token_batch(SETTINGS, batch=GLOBAL_BATCH, seed=1000 + step)


def assemble(shards_by_tp_rank: list[dict]) -> dict[str, torch.Tensor]:
    """Global tensors from the `master_params` of TP ranks 0..n-1 (megatron's shard layout)."""
    result = {}
    for name, (value, dim, stride) in shards_by_tp_rank[0].items():
        if dim < 0:
            result[name] = value
            continue
        blocks = [shard[name][0].chunk(stride, dim=dim) for shard in shards_by_tp_rank]
        result[name] = torch.cat([torch.cat([b[i] for b in blocks], dim=dim) for i in range(stride)], dim=dim)
    return result
