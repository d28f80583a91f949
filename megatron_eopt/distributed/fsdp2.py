"""Models sharded with torch FSDP2 (`fully_shard`) or Megatron-FSDP (`fully_shard_model`, ZeRO-3):
DTensor parameters on a 1-D mesh, Shard(0), shards of any sizes (with Megatron-FSDP and TP, on
its 2-D (dp, tp) mesh, each TP rank's part split by rows); with torch FSDP2 any other placements
too (torchtitan's TP: ops/placed_matrices.py), each rank stepping its local part.

placement/fully_sharded_layout.py reads and checks that layout: the data-parallel group from the
parameters' mesh (with EP, the experts' from theirs), each matrix's row split from the ranks'
shards, the tensor-parallel and expert groups, the partition dims, and each whole-matrix
optimizer's owner ranks by Newton-Schulz cost (ops/row_shards.py runs the exchange). This module
- refuses the settings the sharded path does not implement (`check_fully_sharded_config`);
- wraps the inner optimizers to step each DTensor's local shard (`FullyShardedFP32Optimizer`),
  with the gradient norm and the inf/NaN check summed over the mesh (a replicated part counted
  once), then the (expert) model-parallel group.
docs/fsdp2.md and docs/megatron-fsdp.md describe the behaviour.
"""

from typing import Any, Optional

import torch
from torch.distributed.tensor import DTensor

from megatron_eopt.megatron_core_formats.fsdp_dtensor import (
    FSDP_DTENSOR,
    SHARDING_TYPE_KEY,
    asks_for_fsdp_dtensor,
    dtensor_state_dict,
)
from megatron_eopt.ops.placed_matrices import replicated_mesh_dims
from megatron_eopt.placement.fully_sharded_layout import FullyShardedLayout
from megatron_eopt.placement.megatron_fsdp_model import MEGATRON_FSDP, TORCH_FSDP2, missing_grad
from megatron_eopt.runtime.once import warn_once
from megatron_eopt.runtime.process_groups import group_size
from megatron_eopt.wrappers.fp32 import FP32Optimizer
from megatron_eopt.wrappers.mixed_precision import HALF_DTYPES, MixedPrecisionOptimizer

# megatron-core's language models name their LM head `output_layer` (GPTModel, MambaModel); its
# weight is what megatron-core tags is_embedding_or_output_parameter besides the embedding.
OUTPUT_LAYER_NAMES = ("output_layer.weight", "*.output_layer.weight")


def check_fully_sharded_config(config: Any, engine: str = TORCH_FSDP2) -> None:
    """Refuse settings the sharded path does not implement, before anything is built."""
    refused = [
        ("use_layer_wise_distributed_optimizer", config.use_layer_wise_distributed_optimizer,
         f"{engine} already shards the state; set use_distributed_optimizer=False"),
        ("fp16", config.fp16, f"fp16 loss scaling is not implemented for {engine}; train in bf16 (--bf16)"),
    ]
    for field, value, how in refused:
        if value:
            raise ValueError(f"{field}=True is not supported for a {engine} (DTensor) model: {how}.")
    if config.decoupled_lr is not None and engine == TORCH_FSDP2:
        raise ValueError(
            "decoupled_lr is set, but torch FSDP2 drops megatron-core's is_embedding_or_output_parameter "
            "attribute that the standard override matches on; pass config_overrides with a name key "
            "(e.g. ParamKey(name=('embedding.word_embeddings.weight', 'output_layer.weight'))) and leave "
            "decoupled_lr unset."
        )


class FullyShardedFP32Optimizer(FP32Optimizer):
    """FP32Optimizer over the local shards of fp32 DTensor parameters.

    Its main parameters are plain tensors aliasing each DTensor's local shard (no copy), so the
    inner optimizer steps and keeps state per shard; their gradients are the local shards of the
    DTensor gradients. The aliases are refreshed every step, since FSDP2 may re-create a shard's
    storage (its lazy init re-pads shards after `load_state_dict(assign=True)`).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # A part replicated over a mesh dimension (torchtitan's norms on its tp dimension) counts in
        # the gradient norm on that dimension's first rank only: the norm sums over the whole mesh.
        self._counts_for_norm = [counts and _first_copy(param)
                                 for counts, param in zip(self._counts_for_norm, self.model_params)]

    def _make_main_param(self, param: torch.nn.Parameter) -> torch.nn.Parameter:
        if not isinstance(param, DTensor) or param.dtype != torch.float32:
            raise TypeError(
                f"{type(self).__name__} steps float32 DTensor parameters (torch FSDP2, Megatron-FSDP); got "
                f"{type(param).__name__} of {param.dtype}. For bf16 DTensor parameters set OptimizerConfig.bf16=True "
                f"(Megatron-LM: --bf16): they are then stepped through fp32 main shards."
            )
        with torch.no_grad():
            return torch.nn.Parameter(param.to_local(), requires_grad=False)

    def state_dict(self, is_loading: bool = False) -> dict:
        """torch's convention for sharded state (its own optimizers' under FSDP2), each routed expert on
        a mesh of its own under its global name: state holding this
        rank's rows of its parameter is a DTensor laid out like the parameter, uneven and empty
        shards included, a whole-matrix statistic a replicated one, so torch DCP saves each row once
        and loads at another FSDP size; scalars (the step) are 0-dim tensors. Complete before the
        first step; `is_loading`: new tensors to load into. Collectives over the parameters' mesh
        (megatron_core_formats/fsdp_dtensor.dtensor_state_dict)."""
        self._refuse_tensor_parallel("state_dict()")
        return dtensor_state_dict(self, is_loading)

    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool = False,
                           metadata: Optional[dict] = None) -> dict:
        """megatron-core's fsdp_dtensor layout, which Megatron-LM saves and loads with torch DCP
        (megatron_core_formats/fsdp_dtensor.py); its ShardedTensor formats (torch_dist) are refused."""
        if not asks_for_fsdp_dtensor(metadata):
            raise ValueError(
                f"sharded_state_dict() of a DTensor-sharded model (torch FSDP2, Megatron-FSDP) gives megatron-core's "
                f"fsdp_dtensor layout only: pass metadata={{'{SHARDING_TYPE_KEY}': '{FSDP_DTENSOR}'}} and save it with "
                f"torch.distributed.checkpoint (Megatron-LM's --ckpt-format fsdp_dtensor), or use save_checkpoint."
            )
        self._refuse_tensor_parallel("the fsdp_dtensor layout")
        return super().sharded_state_dict(model_sharded_state_dict, is_loading, metadata)

    def _refuse_tensor_parallel(self, what: str) -> None:
        """DTensor state is keyed by parameter name, which the TP ranks of TP x torch FSDP2 share (each
        TP rank's part is a DTensor of its own). Megatron-FSDP puts the TP parts on one 2-D (dp, tp)
        mesh, whose state the layout places (fsdp_dtensor.row_sharded)."""
        if group_size(self.tp_group) > 1 and self.engine != MEGATRON_FSDP:
            raise ValueError(
                f"{what} of TP x torch FSDP2 is not supported: its DTensor state is keyed by parameter name, "
                f"which the TP ranks share; use megatron_eopt.checkpointing.save_checkpoint."
            )

    def _prepare_main_grads(self) -> None:
        with torch.no_grad():
            for param, main, record in zip(self.model_params, self.main_params, self.records):
                main.data = param.to_local()
                main.grad = self._shard_grad(param, record.fqn)

    def _shard_grad(self, param: DTensor, fqn: str) -> Optional[torch.Tensor]:
        """This rank's rows of `param`'s gradient in fp32 (None: the parameter is not stepped).
        Megatron-FSDP puts it in `decoupled_grad` for a precision-aware optimizer (Megatron-LM's
        --use-precision-aware-optimizer), in its gradient buffer's dtype (bf16 by default there)."""
        grad = param.grad if param.grad is not None else getattr(param, "decoupled_grad", None)
        local = self._missing_grad(fqn, param.to_local()) if grad is None else _local_grad(fqn, grad, param)
        return None if local is None else local.float()

    # The parameters on the placed path (ops/placed_matrices.py); their state is placed like them.
    placed_fqns: frozenset = frozenset()

    # Megatron-FSDP gives an empty shard no gradient (megatron_fsdp_model.missing_grad); FSDP2 gives
    # every rank a gradient or none, and a parameter without one is not stepped.
    empty_shards_lack_grads = False
    engine = TORCH_FSDP2

    def _missing_grad(self, fqn: str, shard: torch.Tensor) -> Optional[torch.Tensor]:
        return missing_grad(fqn, shard) if self.empty_shards_lack_grads else None


class FullyShardedMixedPrecisionOptimizer(FullyShardedFP32Optimizer, MixedPrecisionOptimizer):
    """The local shards of bf16 (or fp16) DTensor parameters stepped through fp32 main shards, as
    megatron-core's Float16OptimizerWithFloat16Params steps the bf16 DTensors that Megatron-LM's
    `--use-torch-fsdp2 --bf16` hands it (fp32 copies of each rank's rows, rounded back after the
    step); fp32 DTensor parameters (Megatron-FSDP's main weights) are stepped in place. The fp32
    main weights are held as the precision-aware settings say (wrappers/main_param_storage.py), over
    each parameter's local shard.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._local_weights: dict[int, torch.nn.Parameter] = {}  # id(DTensor parameter) -> its local shard
        super().__init__(*args, **kwargs)
        if not self._half_pairs() and not self.storage.holds_fp32:
            warn_once("sharded fp32 main weights", f"{type(self).__name__}: store_param_remainders / "
                      f"main_params_dtype have no effect here: every DTensor parameter is fp32 (Megatron-FSDP's "
                      f"main weights, or FSDP2 shards computed in bf16 through its MixedPrecisionPolicy), so "
                      f"the parameters are the fp32 main weights.", stacklevel=3)

    def _make_main_param(self, param: torch.nn.Parameter) -> torch.nn.Parameter:
        if isinstance(param, DTensor) and param.dtype in HALF_DTYPES:
            with torch.no_grad():
                return torch.nn.Parameter(param.to_local().float(), requires_grad=False)
        return super()._make_main_param(param)

    def _weights(self, model: torch.nn.Parameter) -> torch.Tensor:
        # One tensor per parameter, as the storages key their remainders by it, pointed at the local
        # shard anew each time: FSDP2 may re-create a shard's storage (see the class above).
        weights = self._local_weights.get(id(model))
        if weights is None:
            weights = self._local_weights[id(model)] = torch.nn.Parameter(model.to_local(), requires_grad=False)
        else:
            weights.data = model.to_local()
        return weights

    def _prepare_main_grads(self) -> None:
        with torch.no_grad():
            for param, main, record in zip(self.model_params, self.main_params, self.records):
                if param.dtype not in HALF_DTYPES:
                    main.data = param.to_local()
                main.grad = self._shard_grad(param, record.fqn)
                if param.dtype in HALF_DTYPES:
                    param.grad = None  # the fp32 copy replaces it; free the 16-bit one


class MegatronFSDPFP32Optimizer(FullyShardedFP32Optimizer):
    """FullyShardedFP32Optimizer for Megatron-FSDP, which gives an empty shard no gradient."""

    empty_shards_lack_grads = True
    engine = MEGATRON_FSDP


class MegatronFSDPMixedPrecisionOptimizer(FullyShardedMixedPrecisionOptimizer):
    """FullyShardedMixedPrecisionOptimizer for Megatron-FSDP, which gives an empty shard no gradient."""

    empty_shards_lack_grads = True
    engine = MEGATRON_FSDP


def _first_copy(param: DTensor) -> bool:
    """Whether this rank holds the first copy of its part: rank 0 of every mesh dimension that
    replicates it."""
    return all(param.device_mesh.get_local_rank(dim) == 0 for dim in replicated_mesh_dims(tuple(param.placements)))


def _local_grad(fqn: str, grad: torch.Tensor, param: DTensor) -> torch.Tensor:
    if not isinstance(grad, DTensor) or tuple(grad.placements) != tuple(param.placements):
        placement = tuple(grad.placements) if isinstance(grad, DTensor) else "a plain tensor"
        raise ValueError(
            f"parameter {fqn!r}: its gradient is {placement}; a sharded parameter's gradient must be a "
            f"DTensor placed like the parameter, {tuple(param.placements)} (FSDP2's and Megatron-FSDP's "
            f"reduce-scatter give one)."
        )
    return grad.to_local()


def fully_sharded_optimizer_class(layout: FullyShardedLayout, mixed_precision: bool) -> type:
    """The wrapper that steps each child's local shards: with `mixed_precision` (OptimizerConfig.bf16)
    16-bit DTensor parameters through fp32 main shards, fp32 ones (the main weights) in place."""
    if layout.engine == MEGATRON_FSDP:
        return MegatronFSDPMixedPrecisionOptimizer if mixed_precision else MegatronFSDPFP32Optimizer
    return FullyShardedMixedPrecisionOptimizer if mixed_precision else FullyShardedFP32Optimizer
