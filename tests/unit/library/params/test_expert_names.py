"""Routed experts' global names (params/expert_names.py) and the refusal of a layout without them.

The reference is megatron-core's own renaming for its fsdp_dtensor checkpoints,
`handle_experts_in_state_dict` (it offsets each local index by EP rank x local experts), applied
to the same names; ours reads the MoE layer's `local_expert_indices` instead.
"""

import pytest
import torch

from megatron_eopt.checkpointable.child import ChildParam
from megatron_eopt.megatron_core_formats.fsdp_dtensor import stored_names
from megatron_eopt.params.expert_names import expert_global_names

NUM_EXPERTS, EP, EP_RANK = 8, 2, 1


class _MoELayer(torch.nn.Module):
    """What megatron-core's MoELayer records: the global index of each local expert."""

    def __init__(self, first: int, local: int) -> None:
        super().__init__()
        self.local_expert_indices = list(range(first, first + local))
        self.router = torch.nn.Linear(4, NUM_EXPERTS, bias=False)
        self.experts = torch.nn.Module()
        self.experts.local_experts = torch.nn.ModuleList(torch.nn.Linear(4, 4, bias=False) for _ in range(local))


def _model() -> torch.nn.Module:
    local = NUM_EXPERTS // EP
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(torch.nn.Module() for _ in range(2))
    for layer in model.layers:
        layer.mlp = _MoELayer(EP_RANK * local, local)
    return model


def test_local_experts_get_megatron_cores_global_index(monkeypatch) -> None:
    from megatron.core import parallel_state
    from megatron.core.transformer.fsdp_dtensor_checkpoint import handle_experts_in_state_dict

    model = _model()
    fqns = [name for name, _ in model.named_parameters()]
    ours = expert_global_names([model], [name for name in fqns if ".experts." in name])  # the experts' mesh's
    monkeypatch.setattr(parallel_state, "get_expert_model_parallel_world_size", lambda: EP)
    monkeypatch.setattr(parallel_state, "get_expert_model_parallel_rank", lambda: EP_RANK)
    theirs = handle_experts_in_state_dict({name: name for name in fqns}, NUM_EXPERTS)
    expected = {local: name for name, local in theirs.items() if ".experts." in local}
    assert ours == expected and len(ours) == 8, (ours, expected)
    assert ours["layers.0.mlp.experts.local_experts.3.weight"] == "layers.0.mlp.experts.local_experts.7.weight"


def test_grouped_experts_on_their_own_mesh_are_refused_in_one_line() -> None:
    grouped = "decoder.layers.0.mlp.experts.linear_fc1.weight0"
    assert expert_global_names([torch.nn.Module()], [grouped]) == {grouped: None}
    params = [ChildParam("decoder.layers.0.mlp.router.weight", None, None, {}, "decoder.layers.0.mlp.router.weight"),
              ChildParam(grouped, None, None, {}, "")]
    with pytest.raises(ValueError) as error:
        stored_names("adam/expert", params)
    message = str(error.value)
    assert "\n" not in message and grouped in message and "TEGroupedMLP" in message, message
    assert "--moe-grouped-gemm" in message and "save_checkpoint" in message, message
