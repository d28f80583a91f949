"""GPT-shaped weights for the benchmarks, built from the GPT config instead of the whole model.

The 2-D weights (and layer norms) of a megatron-core GPTModel decoder with grouped-query
attention and SwiGLU, under megatron-core's parameter names, plus the `.config` fields the
optimizers read (query groups for the QKV split, gated_linear_unit for the fc1 split).
"""

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from megatron_eopt.ops.splits import MatrixLayout


@dataclass(frozen=True)
class GptShape:
    hidden: int = 1024
    layers: int = 8
    heads: int = 16
    groups: int = 4  # query groups (GQA)

    @property
    def ffn(self) -> int:
        return int(self.hidden * 2.75)

    @property
    def kv_channels(self) -> int:
        return self.hidden // self.heads

    def model_config(self) -> SimpleNamespace:
        return SimpleNamespace(hidden_size=self.hidden, ffn_hidden_size=self.ffn, num_attention_heads=self.heads,
                               num_query_groups=self.groups, kv_channels=self.kv_channels, gated_linear_unit=True)

    def describe(self) -> str:
        return (f"hidden {self.hidden}, {self.layers} layers, {self.heads} heads in {self.groups} query groups, "
                f"SwiGLU ffn {self.ffn}")


def gpt_weight_shapes(shape: GptShape, norms: bool = True) -> dict[str, tuple]:
    hidden, kv = shape.hidden, shape.kv_channels
    shapes = {}
    for i in range(shape.layers):
        prefix = f"decoder.layers.{i}."
        shapes[prefix + "self_attention.linear_qkv.weight"] = (hidden + 2 * shape.groups * kv, hidden)
        shapes[prefix + "self_attention.linear_proj.weight"] = (hidden, hidden)
        shapes[prefix + "mlp.linear_fc1.weight"] = (2 * shape.ffn, hidden)
        shapes[prefix + "mlp.linear_fc2.weight"] = (hidden, shape.ffn)
        if norms:
            shapes[prefix + "input_layernorm.weight"] = (hidden,)
            shapes[prefix + "pre_mlp_layernorm.weight"] = (hidden,)
    return shapes


class GptWeights(torch.nn.Module):
    """Parameters under their megatron-core names (nested modules), N(0, 0.02), and `.config`."""

    def __init__(self, shape: GptShape, norms: bool = True) -> None:
        super().__init__()
        self.config = shape.model_config()
        for name, size in gpt_weight_shapes(shape, norms).items():
            *path, leaf = name.split(".")
            module = self
            for part in path:
                if not hasattr(module, part):
                    module.add_module(part, torch.nn.Module())
                module = getattr(module, part)
            module.register_parameter(leaf, torch.nn.Parameter(torch.randn(size) * 0.02))


def matrix_layout(name: str, local_shape: tuple[int, int], tp: int, shape: GptShape) -> MatrixLayout:
    """How TensorParallelMuon splits a (TP-sharded) GPT weight: q/k/v per query group, fc1 gate/up."""
    if name.endswith("linear_qkv.weight"):
        q_rows = shape.heads // shape.groups * shape.kv_channels
        blocks = (q_rows, shape.kv_channels, shape.kv_channels)
        return MatrixLayout(name, local_shape, 0, tp, shape.groups // tp, blocks)
    if name.endswith("linear_fc1.weight"):
        return MatrixLayout(name, local_shape, 0, tp, 1, (local_shape[0] // 2, local_shape[0] // 2))
    return MatrixLayout(name, local_shape, 1, tp)


def add_shape_arguments(parser, default: GptShape) -> None:
    parser.add_argument("--hidden", type=int, default=default.hidden)
    parser.add_argument("--layers", type=int, default=default.layers)
    parser.add_argument("--heads", type=int, default=default.heads)
    parser.add_argument("--groups", type=int, default=default.groups, help="query groups (GQA)")


def shape_from(args) -> GptShape:
    return GptShape(args.hidden, args.layers, args.heads, args.groups)
