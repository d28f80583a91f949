"""The Muon planner against counted real steps (CPU, gloo, 4 ranks, one launch for 13 layouts).

On each rank of each layout below the trainer's GPTModel is built and one step of the library's
Muon is taken. Counted there: the parameters (names, shapes, TP split, expert flag) against the
planner's inventory; inside every `orthogonalize_updates` call, the matrices, the matmul FLOPs
(torch's FlopCounterMode over the real products) and every collective (bytes by the convention
below, written here, not taken from the cost model); the optimizer state held. The planner's
numbers for that rank must equal them exactly. Bytes a rank sends: all-gather (p - 1) x its
buffer; all-to-all what goes to other ranks; all-reduce 2 (p - 1) / p x the buffer (a ring).
"""

import contextlib
import dataclasses

import pytest
import torch
import torch.distributed as dist

from megatron_eopt.training.model.settings import GPTModelSettings

DENSE = GPTModelSettings(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=256,
                         swiglu=True, vocab_size=128, position_embedding_type="rope", normalization="RMSNorm")
MOE = dataclasses.replace(DENSE, num_moe_experts=4, moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=64,
                          moe_layer_freq=(0, 1), sequence_parallel=True)
MLA = dataclasses.replace(DENSE, multi_latent_attention=True, num_query_groups=None, q_lora_rank=16, kv_lora_rank=16,
                          qk_head_dim=8, qk_pos_emb_head_dim=8, v_head_dim=8, qk_layernorm=True)
# (name, settings, (tp, pp, ep), distribution, muon_tp_mode, Gram Newton-Schulz, more config); 4 ranks each.
# distribution: True the layer-wise optimizer, False replicated over DP, "fsdp" torch FSDP2.
AUTO = {"muon_tp_hardware_profile": "h100"}
CASES = [
    ("tp2-duplicated", DENSE, (2, 1, 1), True, "duplicated", False, {}),
    ("tp2-distributed", DENSE, (2, 1, 1), True, "distributed", False, {}),
    ("tp2-sharded", DENSE, (2, 1, 1), True, "sharded", False, {}),
    ("tp2-distributed-gram", DENSE, (2, 1, 1), True, "distributed", True, {}),
    ("tp2-auto-gram", DENSE, (2, 1, 1), True, "auto", True, AUTO),
    ("tp2-sharded-replicated-dp", DENSE, (2, 1, 1), False, "sharded", False, {}),
    ("pp2-dp2", DENSE, (1, 2, 1), True, "duplicated", False, {}),
    ("ep2-dp4-moe", MOE, (1, 1, 2), True, "duplicated", False, {}),
    ("tp2-ep2-moe-sharded", MOE, (2, 1, 2), True, "sharded", True, {}),
    ("tp2-ep2-moe-auto-experts-distributed", MOE, (2, 1, 2), True, "auto", False,
     {**AUTO, "muon_expert_tp_mode": "distributed"}),
    ("tp2-mla-duplicated-gram", MLA, (2, 1, 1), True, "duplicated", True, {}),
    ("fsdp-dp4-duplicated-gram", DENSE, (1, 1, 1), "fsdp", "duplicated", True, {}),
    ("tp2-fsdp-dp2-distributed", DENSE, (2, 1, 1), "fsdp", "distributed", False, {}),
]


def _sent_bytes(op: str, args: tuple, kwargs: dict) -> float:
    group = kwargs.get("group")
    size = dist.get_world_size(group)
    if op == "all_gather":
        return (size - 1) * args[1].numel() * args[1].element_size()
    if op == "all_reduce":
        return 2 * (size - 1) / size * args[0].numel() * args[0].element_size()
    if op == "all_to_all_single":
        splits, element = args[3], args[1].element_size()
        return sum(n for r, n in enumerate(splits) if r != dist.get_rank(group)) * element
    raise AssertionError(f"uncounted collective {op} inside orthogonalize_updates")


@contextlib.contextmanager
def counting_collectives(counted: dict):
    names = ("all_gather", "all_reduce", "all_to_all_single", "broadcast", "reduce", "all_gather_into_tensor",
             "reduce_scatter_tensor")
    originals = {name: getattr(dist, name) for name in names}

    def wrap(name):
        def counting(*args, **kwargs):
            counted["bytes"] += _sent_bytes(name, args, kwargs)
            counted["calls"] += 1
            return originals[name](*args, **kwargs)
        return counting

    try:
        for name in names:
            setattr(dist, name, wrap(name))
        yield
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def counted_step(optimizer) -> dict:
    """One step, counting matrices, FLOPs and collectives inside every orthogonalize_updates call
    (FSDP2: every orthogonalize_row_shards call, the row exchange included)."""
    from torch.utils.flop_counter import FlopCounterMode

    import megatron_eopt.optimizers.muon.shards as sharded_matrices

    counted = {"flops": 0, "bytes": 0.0, "calls": 0, "matrices": []}
    originals = (sharded_matrices.orthogonalize_updates, sharded_matrices.orthogonalize_row_shards)

    def count(run, names):
        counted["matrices"] += names
        with FlopCounterMode(display=False) as flops, counting_collectives(counted):
            result = run()
        counted["flops"] += flops.get_total_flops()
        return result

    def counting(updates, layouts, tp_mode, tp_group, settings):
        return count(lambda: originals[0](updates, layouts, tp_mode, tp_group, settings), [lay.name for lay in layouts])

    def counting_rows(updates, shards, group, settings, tp_mode, tp_group):
        mine = [s.layout.name for s in shards if s.owner == dist.get_rank(group)]
        return count(lambda: originals[1](updates, shards, group, settings, tp_mode, tp_group), mine)

    sharded_matrices.orthogonalize_updates, sharded_matrices.orthogonalize_row_shards = counting, counting_rows
    try:
        optimizer.step()
    finally:
        sharded_matrices.orthogonalize_updates, sharded_matrices.orthogonalize_row_shards = originals
    return counted


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor  # DTensor: this rank's shard


def _state_bytes(optimizer) -> int:
    """Optimizer state tensors and fp32 main copies this rank holds, over the chained optimizers
    (a main parameter on a model parameter's own storage, as FSDP2's are, is no copy)."""
    total = 0
    for child in optimizer.chained_optimizers:
        tensors = [_local(t) for state in child.state.values() for t in state.values() if torch.is_tensor(t)]
        storages = {_local(p).untyped_storage().data_ptr() for p in child.model_params}
        tensors += [m for m in map(_local, child.main_params) if m.untyped_storage().data_ptr() not in storages]
        total += sum(t.numel() * t.element_size() for t in tensors)
    return total


def _model_and_grads(settings, distribution):
    """This rank's model chunks with a gradient on every parameter (FSDP2: sharded, by a backward)."""
    from megatron.core import parallel_state as ps

    from megatron_eopt.training.model.gpt import build_gpt_model_chunks, gpt_loss
    from megatron_eopt.training.parallel.fsdp2 import fully_shard_gpt

    chunks = build_gpt_model_chunks(settings)
    real = [(n, tuple(p.shape), int(getattr(p, "partition_dim", -1)) if getattr(p, "tensor_model_parallel", False)
             else -1, not getattr(p, "allreduce", True)) for n, p in chunks[0].named_parameters()]
    if distribution == "fsdp":
        fully_shard_gpt(chunks[0], ps.get_data_parallel_group(), torch.device("cpu"))
        tokens = torch.randint(0, settings.vocab_size, (2, settings.seq_length + 1),
                               generator=torch.Generator().manual_seed(ps.get_data_parallel_rank()))
        gpt_loss(chunks[0], tokens).backward()
    else:
        generator = torch.Generator().manual_seed(dist.get_rank())
        for param in chunks[0].parameters():
            param.grad = torch.randn(param.shape, generator=generator)
    return chunks, real


def _one_case(case: tuple) -> dict:
    from megatron.core import parallel_state as ps

    from megatron_eopt import OptimizerConfig, get_megatron_optimizer
    from megatron_eopt.ops.muon_cost import hardware_profile
    from megatron_eopt.training.model.gpt import destroy_model_parallel, initialize_model_parallel
    from megatron_eopt.training.planning.inventory import stage_parameters
    from megatron_eopt.training.planning.plan import PlanInputs, PlanLayout, plan_rank

    name, settings, (tp, pp, ep), distribution, mode, gram, more = case
    initialize_model_parallel(tensor_model_parallel_size=tp, seed=1, pipeline_model_parallel_size=pp,
                              expert_model_parallel_size=ep)
    try:
        chunks, real = _model_and_grads(settings, distribution)
        config = OptimizerConfig(optimizer="muon", lr=0.01, use_distributed_optimizer=distribution is True,
                                 muon_tp_mode=mode, muon_gram_newton_schulz=gram, **more)
        optimizer = get_megatron_optimizer(config, chunks)
        counted = counted_step(optimizer)
        counted["state"] = _state_bytes(optimizer)
        layout = PlanLayout(tp=tp, pp=pp, dp=dist.get_world_size() // (tp * pp), ep=ep, layer_wise=distribution is True,
                            fsdp=distribution == "fsdp")
        coordinates = (ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank(),
                       ps.get_tensor_model_parallel_rank())
        planned = plan_rank(PlanInputs(settings, layout, config, hardware_profile("h100"), 1e15,
                                       make_vocab_size_divisible_by=1), dist.get_rank())
        inventory = [(p.name, p.shape, p.partition_dim, p.expert)
                     for p in stage_parameters(settings, tp, pp, coordinates[0], ep, ps.get_expert_model_parallel_rank())]
        return {"real": real, "inventory": inventory, "counted": counted, "coordinates": coordinates,
                "planned_coordinates": layout.coordinates(dist.get_rank()),
                "planned": {"matrices": list(planned.matrices), "flops": planned.step[0], "bytes": planned.step[1],
                            "calls": planned.step[2], "state": planned.state_bytes,
                            "standard_flops": planned.flops[mode], "gram_flops": planned.gram_flops[mode]}}
    finally:
        destroy_model_parallel()


def _body(rank: int, world_size: int) -> dict:
    return {case[0]: _one_case(case) for case in CASES}


@pytest.fixture(scope="module")
def results(run_distributed) -> list[dict]:
    return run_distributed(_body, world_size=4, timeout=600)


@pytest.mark.parametrize("case", [case[0] for case in CASES])
def test_planner_equals_counted_step(results: list[dict], case: str) -> None:
    for rank, by_case in enumerate(results):
        got = by_case[case]
        assert got["inventory"] == got["real"], (rank, case)
        assert got["planned_coordinates"] == got["coordinates"], (rank, case)
        counted, planned = got["counted"], got["planned"]
        assert planned["matrices"] == counted["matrices"], (rank, case)
        assert counted["flops"] > 0 or not counted["matrices"], (rank, case)
        for key in ("flops", "bytes", "calls", "state"):
            assert planned[key] == counted[key], (rank, case, key, planned[key], counted[key])
    if case.startswith("tp2"):  # the TP modes move something on some rank (a check that counts)
        assert any(by_case[case]["counted"]["bytes"] > 0 for by_case in results), case
    if "gram" in case:  # and Gram Newton-Schulz takes its path somewhere
        assert any(r[case]["planned"]["gram_flops"] < r[case]["planned"]["standard_flops"] for r in results), case


def _doc_runs() -> list[tuple[list[str], str]]:
    """(arguments, output) of each ```text block of docs/planner.md that starts with the tool."""
    import pathlib
    import re
    import shlex

    text = (pathlib.Path(__file__).resolve().parents[3] / "docs" / "planner.md").read_text()
    runs = []
    for block in re.findall(r"^```text\n(.*?)^```", text, re.S | re.M):
        lines = block.splitlines()
        if not lines[0].startswith("$ python tools/plan_muon.py"):
            continue
        command = []
        while True:
            line = lines.pop(0)
            command.append(line.rstrip("\\").strip())
            if not line.endswith("\\"):
                break
        runs.append((shlex.split(" ".join(command))[3:], "\n".join(lines)))
    return runs


def _plan_text(argv: list[str]) -> str:
    from megatron_eopt.training.planning.cli import build_planner_parser, run

    parser = build_planner_parser()
    return run(parser, parser.parse_args(argv))


def test_docs_tables_are_the_tools_output() -> None:
    runs = _doc_runs()
    assert len(runs) == 3
    for argv, output in runs:
        assert _plan_text(argv) == output, " ".join(argv)


@pytest.mark.parametrize("argv, message", [
    (["--model", "llama3-8b", "--hidden-size", "1024"], "--model llama3-8b describes the whole model; --hidden-size"),
    (["--model", "llama3-8b", "--mfu", "0"], "--mfu must be in (0, 1]"),
    (["--model", "llama3-8b", "--pipeline-model-parallel-size", "4", "--num-layers-per-virtual-pipeline-stage", "2"],
     "drop --num-layers-per-virtual-pipeline-stage"),
    (["--model", "deepseek-v3", "--pipeline-model-parallel-size", "4"], "61 layers do not split over 4 pipeline stages"),
    (["--model", "qwen3-30b-a3b", "--data-parallel-size", "4", "--expert-model-parallel-size", "8"],
     "ep 8 must divide dp 4"),
    (["--model", "llama3-8b", "--optimizer", "adamw"], "invalid choice"),
    (["--model", "llama3-8b", "--optimizer", "soap"], "plans Muon-family optimizers"),
    (["--model", "llama3-8b", "--optimizer", "adam"], "plans Muon-family optimizers"),
    (["--model", "llama3-8b", "--hardware", "tpu"], "hardware profile must be one of"),
])
def test_bad_input_is_one_line(argv: list[str], message: str, capsys) -> None:
    from megatron_eopt.training.planning.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_info.value.code == 2 and message in error, error


def test_flags_describe_the_same_model_as_the_preset() -> None:
    """Llama-3 8B as Megatron-LM flags plans exactly as the preset does."""
    layout = ["--tensor-model-parallel-size", "2", "--data-parallel-size", "2", "--use-distributed-optimizer",
              "--global-batch-size", "8", "--json"]
    flags = ["--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336", "--num-attention-heads", "32",
             "--group-query-attention", "--num-query-groups", "8", "--swiglu", "--normalization", "RMSNorm",
             "--position-embedding-type", "rope", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
             "--vocab-size", "128256", "--seq-length", "8192", "--max-position-embeddings", "8192"]
    assert _plan_text(flags + layout) == _plan_text(["--model", "llama3-8b"] + layout)
