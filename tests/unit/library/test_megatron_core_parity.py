"""Our Muon against megatron-core's own, through each library's `get_megatron_optimizer`.

Same megatron-core GPTModel (GQA, fp32, Newton-Schulz in fp32 'highest'), same batch, no
per-parameter overrides (`config_overrides={}`: megatron-core's None means none, ours the
standard ones), on CPU: megatron-core 0.19's factory is the independent reference.
Where both treat every parameter alike, 3 steps end bitwise equal (checked to 1e-6). Two
deliberate differences, each shown to be the only parameter that differs after one step:
- a learned position table: megatron-core gives Muon every 2-D parameter its GPTModel does not
  tag `is_embedding_or_output_parameter`, and the position table is untagged; we give lookup
  tables to the scalar optimizer, as the word embeddings;
- a gated (SwiGLU) `linear_fc1`: we orthogonalize gate and up separately (two matrices that
  multiply elementwise), megatron-core the stacked [gate; up] matrix.
Found by `make gpu-check`'s Megatron-LM runs (docs/gpu.md), which therefore use RoPE.
"""

import pytest
import torch

from megatron_eopt import OptimizerConfig, get_megatron_optimizer
from megatron_eopt.training.model.gpt import GPTModelSettings, build_gpt_model
from tests.gpt_training import model_parallel, params, token_batch, train_steps
from tests.megatron_core_on_cpu import cuda_tensors_on_cpu

SETTINGS = dict(num_layers=2, hidden_size=32, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=48,
                vocab_size=64, seq_length=16)
# name -> (GPTModelSettings fields, the parameters that differ by design); a case with such
# parameters takes one step (after that every gradient differs through the forward pass).
CASES = {
    "same_routing": (dict(position_embedding_type="none", swiglu=False), set()),
    "learned_position_table": (dict(position_embedding_type="learned_absolute", swiglu=False),
                               {"embedding.position_embeddings.weight"}),
    "swiglu": (dict(position_embedding_type="none", swiglu=True),
               {f"decoder.layers.{i}.mlp.linear_fc1.weight" for i in range(2)}),
}
FIELDS = dict(optimizer="muon", lr=0.02, min_lr=0.0, weight_decay=0.05, clip_grad=0.0, muon_momentum=0.9,
              muon_fp32_matmul_prec="highest", muon_tp_mode="duplicated")


def train(library: str, model_fields: dict, steps: int) -> dict:
    from megatron.core.optimizer import OptimizerConfig as CoreConfig
    from megatron.core.optimizer import get_megatron_optimizer as core_get_megatron_optimizer

    with model_parallel(1, seed=3):
        model = build_gpt_model(GPTModelSettings(**SETTINGS, **model_fields))
        if library == "ours":
            optimizer = get_megatron_optimizer(OptimizerConfig(**FIELDS), [model], config_overrides={})
        else:
            with cuda_tensors_on_cpu():
                optimizer = core_get_megatron_optimizer(CoreConfig(**FIELDS), [model], config_overrides={})
        tokens = token_batch(GPTModelSettings(**SETTINGS), batch=4, seed=5)
        run = train_steps(model, optimizer, tokens, steps, take_step=lambda optimizer: step(library, optimizer))
        return {"losses": run.losses, "params": params(model)}


def step(library: str, optimizer) -> None:
    """Ours: the whole step. megatron-core's: each chained torch optimizer's own step, since its
    wrappers' step computes the gradient norm on CUDA (nothing is clipped: clip_grad=0)."""
    if library == "core":
        for child in optimizer.chained_optimizers:
            child.optimizer.step()
    else:
        assert optimizer.step()[0]


def _body(rank: int, world_size: int, case: str) -> dict:
    model_fields, different = CASES[case]
    steps = 1 if different else 3
    ours, core = train("ours", model_fields, steps), train("core", model_fields, steps)
    errors = {n: (p - core["params"][n]).abs().max().item() for n, p in ours["params"].items()}
    return {"errors": errors, "losses": (ours["losses"], core["losses"])}


@pytest.mark.parametrize("case", list(CASES))
def test_muon_equals_megatron_core_muon(run_distributed, case: str) -> None:
    (result,) = run_distributed(_body, world_size=1, args=(case,), timeout=600)
    different = {n for n, e in result["errors"].items() if e > 1e-6}
    assert different == CASES[case][1], {n: result["errors"][n] for n in different}
    if not different:
        assert result["losses"][0] == result["losses"][1]
