"""Which optimizer steps each parameter (ParamRouting), the group keys and `param_fqns` that
record it, and the matrix layouts a Muon-family optimizer gets.

Expected routes are written out per parameter, not computed with the library's rule.
"""

import pytest
import torch

from megatron_eopt import OptimizerConfig, ParamKey, get_megatron_optimizer
from megatron_eopt.params.groups import ParamRouting, build_param_groups, matrix_layout, matrix_layouts
from megatron_eopt.params.overrides import get_standard_config_overrides


class _Model(torch.nn.Module):
    """Every kind of parameter the Muon rule distinguishes."""

    def __init__(self):
        super().__init__()
        self.token_table = torch.nn.Embedding(10, 4)  # a lookup table nobody tagged
        self.output = torch.nn.Linear(4, 10, bias=False)
        self.output.weight.is_embedding_or_output_parameter = True
        self.hidden = torch.nn.Linear(4, 4)  # weight: matrix; bias: 1-D
        self.norm = torch.nn.LayerNorm(4)
        self.router = torch.nn.Linear(4, 2, bias=False)
        self.router.weight.use_muon = False
        self.conv = torch.nn.Conv1d(2, 2, 3, bias=False)  # 3-D
        self.experts = torch.nn.Linear(4, 4, bias=False)
        self.experts.weight.allreduce = False


HIDDEN_MATRICES_ROUTE = {
    "token_table.weight": "adam", "output.weight": "adam", "hidden.weight": "muon", "hidden.bias": "adam",
    "norm.weight": "adam", "norm.bias": "adam", "router.weight": "adam", "conv.weight": "adam", "experts.weight": "muon",
}


def _routes(routing, config=None, overrides=None):
    config = config or OptimizerConfig(optimizer=routing.optimizer, lr=0.1)
    overrides = get_standard_config_overrides(config) if overrides is None else overrides
    groups, records = build_param_groups([_Model()], config, overrides, routing=routing)
    return groups, {r.fqn: r.optimizer_name for r in records}


def test_hidden_matrices_routing():
    _, routes = _routes(ParamRouting("muon", "hidden_matrices", "adam"))
    assert routes == HIDDEN_MATRICES_ROUTE


def test_lookup_tables_are_recognised_by_module_type():
    class MyTable(torch.nn.Embedding):
        pass

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = MyTable(5, 3)  # subclass of an embedding
            # 4 rows, not the table's 5: a linear layer with the vocabulary's rows is an output head (params/heads.py)
            self.weights = torch.nn.Linear(3, 4, bias=False)
            self.custom = torch.nn.Module()
            self.custom.rows = torch.nn.Parameter(torch.zeros(5, 3))

    class Lookup(torch.nn.Module):
        pass

    config = OptimizerConfig(optimizer="muon", lr=0.1)
    for types, expected in (
        ((torch.nn.Embedding,), {"table.weight": "adam", "weights.weight": "muon", "custom.rows": "muon"}),
        ((torch.nn.Embedding, torch.nn.Linear), {"table.weight": "adam", "weights.weight": "adam", "custom.rows": "muon"}),
    ):
        routing = ParamRouting("muon", "hidden_matrices", "adam", types)
        _, records = build_param_groups([Holder()], config, {}, routing=routing)
        assert {r.fqn: r.optimizer_name for r in records} == expected


def test_matrices_and_all_routing():
    _, routes = _routes(ParamRouting("oblique_adam", "matrices", "lion"))
    assert routes == {
        fqn: ("oblique_adam" if fqn in ("token_table.weight", "output.weight", "hidden.weight", "experts.weight") else "lion")
        for fqn in HIDDEN_MATRICES_ROUTE
    }
    _, routes = _routes(ParamRouting("lion", "all"))
    assert set(routes.values()) == {"lion"}


def test_group_keys_name_the_optimizer_and_groups_list_fqns():
    groups, _ = _routes(ParamRouting("muon", "hidden_matrices", "adam"))
    keys = [g["group_key"] for g in groups]
    assert keys == [
        "muon/dense/default",
        "adam/dense/default",
        "adam/dense/ParamKey(name=*.bias,predicate=param_len_1)",
        "muon/expert/default",
    ]
    for group in groups:
        assert group["optimizer"] == group["group_key"].split("/")[0]
        assert len(group["param_fqns"]) == len(group["params"])
    by_key = {g["group_key"]: g["param_fqns"] for g in groups}
    assert by_key["muon/dense/default"] == ["hidden.weight"]
    assert by_key["adam/dense/default"] == ["token_table.weight", "output.weight", "router.weight", "conv.weight"]
    assert by_key["muon/expert/default"] == ["experts.weight"]


def test_multiple_chunks_prefix_fqns_and_keep_routing():
    config = OptimizerConfig(optimizer="muon", lr=0.1)
    routing = ParamRouting("muon", "hidden_matrices", "adam")
    groups, records = build_param_groups([_Model(), _Model()], config, {}, routing=routing)
    muon = [r.fqn for r in records if r.optimizer_name == "muon"]
    assert muon == ["model_chunk0.hidden.weight", "model_chunk0.experts.weight",
                    "model_chunk1.hidden.weight", "model_chunk1.experts.weight"]
    assert {r.fqn: r.chunk_index for r in records}["model_chunk1.hidden.weight"] == 1


def test_factory_children_and_their_groups():
    model = _Model()
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="muon", lr=0.1, muon_scalar_optimizer="lion"), model)
    children = {c.name: c for c in optimizer.chained_optimizers}
    assert list(children) == ["muon/dense", "lion/dense", "muon/expert"]
    assert {type(c.optimizer).__name__ for c in children.values()} == {"TensorParallelMuon", "Lion"}
    # torch's view of the groups carries param_fqns unchanged; the chain concatenates children.
    assert [g["group_key"] for g in optimizer.param_groups] == [
        g["group_key"] for c in children.values() for g in c.optimizer.param_groups]
    assert children["muon/expert"].optimizer.param_groups[0]["param_fqns"] == ["experts.weight"]


def test_param_fqns_are_metadata_in_state_dicts():
    torch.manual_seed(0)
    model = _Model()
    config = OptimizerConfig(optimizer="muon", lr=0.1)
    optimizer = get_megatron_optimizer(config, model)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    state = optimizer.state_dict()  # torch's layout: the groups name their parameters
    muon_group = state["param_groups"][0]
    assert muon_group["param_names"] == ["hidden.weight"]
    assert set(state["state"][muon_group["params"][0]]) == {"momentum_buffer"}
    # Our own child layout keeps param_fqns as metadata: a checkpoint without them (or with stale
    # ones) loads; the live groups keep theirs.
    for child in optimizer.chained_optimizers:
        saved = child.state_dict()
        for group in saved["param_groups"].values():
            group["param_fqns"] = ["stale"]
        child.load_state_dict(saved)
    fresh = get_megatron_optimizer(config, model)
    fresh.load_state_dict(state)
    for group in optimizer.param_groups + fresh.param_groups:
        assert len(group["param_fqns"]) == len(group["params"]) and "stale" not in group["param_fqns"]
    fresh.step()


# ------------------------------------------------------------------------------------------------
# Matrix layouts
# ------------------------------------------------------------------------------------------------


class _Config:
    num_attention_heads, num_query_groups, kv_channels, hidden_size = 4, 2, 2, 8
    attention_output_gate, gated_linear_unit = False, True


def _records(module, optimizer="muon"):
    config = OptimizerConfig(optimizer=optimizer, lr=0.1)
    routing = ParamRouting("muon", "hidden_matrices", "adam")
    return {r.fqn: r for r in build_param_groups([module], config, {}, routing=routing)[1]}


def test_layout_of_a_non_matrix_names_the_parameter():
    records = _records(torch.nn.Linear(3, 2))
    with pytest.raises(ValueError, match=r"parameter 'bias' has shape \(2,\), but optimizer 'adam' orthogonalizes 2-D matrices only"):
        matrix_layout(records["bias"], None, 1, True)


def test_qkv_layout_needs_the_model_config():
    module = torch.nn.Module()
    module.linear_qkv = torch.nn.Linear(8, 16, bias=False)  # 2 groups x (4 q + 2 k + 2 v) rows
    records = _records(module)
    with pytest.raises(ValueError, match=r"parameter 'linear_qkv\.weight' is a fused QKV weight.*muon_split_qkv=False"):
        matrix_layouts(records.values(), [module], 1, split_qkv=True)
    assert matrix_layouts(records.values(), [module], 1, split_qkv=False)["linear_qkv.weight"].row_blocks == ()
    module.config = _Config()
    layout = matrix_layouts(records.values(), [module], 1, split_qkv=True)["linear_qkv.weight"]
    assert (layout.num_row_groups, layout.row_blocks) == (2, (4, 2, 2))


def test_tensor_parallel_qkv_shard_layout():
    module = torch.nn.Module()
    module.config = _Config()
    module.linear_qkv = torch.nn.Linear(8, 8, bias=False)  # TP rank's shard: 1 of 2 query groups
    module.linear_qkv.weight.tensor_model_parallel, module.linear_qkv.weight.partition_dim = True, 0
    module.linear_fc1 = torch.nn.Linear(8, 6, bias=False)
    module.linear_fc1.weight.tensor_model_parallel, module.linear_fc1.weight.partition_dim = True, 0
    layouts = matrix_layouts(_records(module).values(), [module], 2, split_qkv=True)
    qkv, fc1 = layouts["linear_qkv.weight"], layouts["linear_fc1.weight"]
    assert (qkv.num_row_groups, qkv.row_blocks, qkv.tp_size, qkv.partition_dim) == (1, (4, 2, 2), 2, 0)
    assert qkv.global_block_shapes() == [(8, 8), (4, 8), (4, 8)]
    assert (fc1.row_blocks, fc1.global_block_shapes()) == ((3, 3), [(6, 8), (6, 8)])


def test_gated_fc1_with_odd_rows_names_the_parameter():
    module = torch.nn.Module()
    module.config = _Config()
    module.linear_fc1 = torch.nn.Linear(8, 7, bias=False)
    with pytest.raises(ValueError, match=r"parameter 'linear_fc1\.weight': 7 rows"):
        matrix_layouts(_records(module).values(), [module], 1, split_qkv=True)


def test_use_muon_false_and_overrides_for_the_scalar_part():
    model = _Model()
    key = ParamKey(attr="use_muon")  # use_muon=False is falsy: matches nothing
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="muon", lr=0.1), model,
                                       config_overrides={ParamKey(name="router.*"): {"max_lr": 0.3}, key: {}})
    routed = {g["group_key"]: g["param_fqns"] for g in optimizer.param_groups}
    assert routed["adam/dense/ParamKey(name=router.*)"] == ["router.weight"]
    assert [g["lr"] for g in optimizer.param_groups if g["group_key"] == "adam/dense/ParamKey(name=router.*)"] == [0.3]
