"""Where each optimizer works: the facts behind the README's support table.

Tensor parallelism needs an elementwise optimizer (routing 'all') or one that takes a `tp_group`
(whole-matrix math over TP shards); fp16 needs loss scaling, which only adam/sgd have; the
layer-wise distributed optimizer and bf16 (fp32 main copies) work for every optimizer; FSDP2
needs an elementwise optimizer or one that takes `fsdp_shards` (Muon, AdaptiveMuon, and
MOP/PolarGrad/Scion through `with_tensor_parallelism`). `OptimizerSpec.support` applies these
rules; the factory and `arguments.validate_args` refuse from the same facts.
"""

from dataclasses import dataclass

from megatron_eopt.config.optimizer_names import FP16_NEEDS_LOSS_SCALING


@dataclass(frozen=True)
class Support:
    """Which parallel layouts and precisions an optimizer works with (one row of the README table)."""

    tensor_parallel: bool  # tensor_model_parallel_size > 1
    layer_wise: bool  # use_layer_wise_distributed_optimizer (and use_distributed_optimizer)
    fsdp2: bool  # torch FSDP2 (1-D mesh, Shard(0)): elementwise, or takes `fsdp_shards`
    bf16: bool  # bf16 parameters, fp32 main copies
    fp16: bool  # fp16 parameters with loss scaling

    def why_not(self, feature: str) -> str:
        """Why `feature` (a field name) is unsupported, for error messages."""
        return _WHY_UNSUPPORTED[feature]


# (field, README column heading)
SUPPORT_COLUMNS = (
    ("tensor_parallel", "TP > 1"),
    ("layer_wise", "layer-wise distributed"),
    ("fsdp2", "FSDP2"),
    ("bf16", "bf16"),
    ("fp16", "fp16"),
)
_WHY_UNSUPPORTED = {
    "tensor_parallel": "it works on whole matrices and cannot see the other tensor-parallel shards, so its "
                       "update would depend on the TP degree",
    "layer_wise": "it cannot run on whole-parameter owners",
    "fsdp2": "it works on whole matrices and does not take FSDP2 row shards (`fsdp_shards`) yet",
    "bf16": "it has no bf16 support",
    "fp16": FP16_NEEDS_LOSS_SCALING,
}
