"""Optimizer runs over pipeline stages and expert-parallel ranks, without a pipeline schedule.

megatron-core's schedules and MoE forward call CUDA, so nothing here runs a forward pass: each
rank builds its stage's model chunks (megatron-core's GPTModel on CPU), sets parameters and
gradients that depend only on each parameter's GLOBAL name (its name at PP=1/EP=1) and the step,
and steps our optimizer. Every layout therefore sees the same global model and gradient, and
after some steps the parameters, gathered by global name, must equal the PP=1/EP=1 run's.

Tied embeddings: at PP=1 the one weight gets the gradients of both uses; at PP>1 megatron's
embedding-group all-reduce leaves that sum on both copies. Both are set here.
"""

import zlib
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.distributed as dist

from megatron_eopt import OptimizerConfig, get_megatron_optimizer
from megatron_eopt.checkpointing.global_names import TIED_EMBEDDING, TIED_OUTPUT, global_parameter_names
from megatron_eopt.training.model.gpt import (
    GPTModelSettings,
    build_gpt_model_chunks,
    destroy_model_parallel,
    initialize_model_parallel,
)
from tests.unit.library.checkpointing.checkpoint_runs import partition
from tests.gpt_training import local_shard

DENSE = GPTModelSettings(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                         ffn_hidden_size=48, swiglu=True, vocab_size=64, seq_length=8,
                         share_embeddings_and_output_weights=True)
MOE = replace(DENSE, num_layers=2, num_moe_experts=4, moe_router_topk=2, share_embeddings_and_output_weights=False)
# clip_grad 0.5 is below the synthetic gradient's norm (~2.5): clipping is active in every step,
# so a norm summed over the wrong ranks changes every parameter.
OPTIMIZERS = {
    "adam": dict(optimizer="adam", lr=3e-3, weight_decay=0.1, clip_grad=0.5),
    "muon": dict(optimizer="muon", lr=3e-3, weight_decay=0.05, clip_grad=0.5, muon_momentum=0.9,
                 muon_fp32_matmul_prec="highest"),
}
SEED = 7


@dataclass(frozen=True)
class Layout:
    optimizer: str = "muon"
    layer_wise: bool = False
    tp: int = 1
    pp: int = 1
    vpp: Optional[int] = None
    ep: int = 1
    settings: GPTModelSettings = DENSE

    def describe(self, world_size: int) -> str:
        dp = world_size // (self.tp * self.pp)
        return (f"{self.optimizer}{' layer-wise' if self.layer_wise else ''} TP{self.tp} PP{self.pp}"
                f"{f' VPP{self.vpp}' if self.vpp else ''} EP{self.ep} DP{dp}"
                f"{' MoE' if self.settings.num_moe_experts else ''}"
                f"{' ' + self.settings.pipeline_model_parallel_layout if self.settings.pipeline_model_parallel_layout else ''}")


def reference(layout: Layout) -> Layout:
    """The same model and optimizer at TP=1, PP=1, EP=1."""
    settings = replace(layout.settings, pipeline_model_parallel_layout=None)
    return Layout(layout.optimizer, layout.layer_wise, settings=settings)


class Run:
    """This rank's model chunks and optimizer in one layout (megatron-core parallel_state set up)."""

    def __init__(self, layout: Layout, single_process: bool = False) -> None:
        from megatron.core import parallel_state

        self.layout = layout
        initialize_model_parallel(layout.tp, seed=SEED, pipeline_model_parallel_size=layout.pp,
                                  virtual_pipeline_model_parallel_size=layout.vpp,
                                  expert_model_parallel_size=layout.ep)
        self.chunks = build_gpt_model_chunks(layout.settings)
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.names = global_parameter_names(self.chunks)
        self.params = self._named_params()
        self._set_initial_values()
        config = OptimizerConfig(**OPTIMIZERS[layout.optimizer],
                                 use_layer_wise_distributed_optimizer=layout.layer_wise)
        # The reference runs whole on every rank: no process group at all.
        groups = _single_process_groups() if single_process else None
        self.optimizer = get_megatron_optimizer(config, self.chunks, pg_collection=groups)

    def close(self) -> None:
        """Tear down parallel_state and let go of the model and optimizer, so that the groups they
        hold go before the next run makes its own (the suite's thread budget)."""
        destroy_model_parallel()
        vars(self).clear()

    def _named_params(self) -> dict[str, torch.nn.Parameter]:
        result = {}
        for index, chunk in enumerate(self.chunks):
            for name, param in chunk.named_parameters():
                result[f"model_chunk{index}.{name}" if len(self.chunks) > 1 else name] = param
        return result

    def _set_initial_values(self) -> None:
        with torch.no_grad():
            for fqn, param in self.params.items():
                param.copy_(self._shard(f"init/{self.names[fqn]}", param, scale=0.05))

    def _shard(self, key: str, param: torch.Tensor, scale: float) -> torch.Tensor:
        """This rank's TP shard of a global tensor drawn from `key` alone."""
        dim, stride = partition(param)
        shape = list(param.shape)
        if dim >= 0:
            shape[dim] *= self.layout.tp
        generator = torch.Generator().manual_seed(zlib.crc32(key.encode()))
        full = torch.randn(shape, generator=generator) * scale
        return local_shard(full, dim, stride, self.tp_rank, self.layout.tp).to(param.dtype)

    def set_gradients(self, step: int) -> None:
        for fqn, param in self.params.items():
            name = self.names[fqn]
            grad = self._shard(f"grad/{step}/{name}", param, scale=0.01)
            if name.endswith(TIED_EMBEDDING) and self.layout.settings.share_embeddings_and_output_weights:
                grad = grad + self._shard(f"grad/{step}/{TIED_OUTPUT}", param, scale=0.01)
            param.grad = grad

    def step(self, step: int) -> tuple[bool, Optional[float]]:
        self.set_gradients(step)
        ok, norm, _ = self.optimizer.step()
        return ok, norm

    def global_params(self) -> tuple[int, dict[str, tuple[torch.Tensor, int, int]]]:
        """(TP rank, {global name: (this rank's shard, partition_dim, stride)})."""
        return self.tp_rank, {self.names[fqn]: (p.detach().clone(), *partition(p)) for fqn, p in self.params.items()}


def _single_process_groups():
    from megatron_eopt import ParallelGroups

    return ParallelGroups.single_process()


def assemble_global(per_rank: list[tuple[int, dict]]) -> dict[str, torch.Tensor]:
    """{global name: global tensor} from every rank's `global_params`; replicas must be bitwise equal."""
    shards: dict[str, dict[int, tuple[torch.Tensor, int, int]]] = {}
    for tp_rank, params in per_rank:
        for name, entry in params.items():
            held = shards.setdefault(name, {}).setdefault(tp_rank, entry)
            if not torch.equal(held[0], entry[0]):
                raise AssertionError(f"replicas of {name} (TP rank {tp_rank}) differ")
    result = {}
    for name, by_tp_rank in shards.items():
        value, dim, stride = by_tp_rank[0]
        if dim < 0:
            result[name] = value
            continue
        blocks = [by_tp_rank[r][0].chunk(stride, dim=dim) for r in sorted(by_tp_rank)]
        result[name] = torch.cat([torch.cat([b[i] for b in blocks], dim=dim) for i in range(stride)], dim=dim)
    return result


def gather_over_world(value):
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered
