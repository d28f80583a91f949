"""The layer-wise distributed optimizer on megatron-core's GPTModel (CPU, gloo).

Data parallelism must not change the math: DP=2 and DP=4 layer-wise Muon take the same 10
steps as non-distributed Muon on the same global batch (each DP rank takes its slice; the
reference's loss is the mean of the per-slice mean losses), whether the optimizer averages the
gradients onto their owners (`layer_wise_reduce_grads=True`) or they arrive already averaged
(the DDP case: here the test all-reduces them). Every DP replica must be BITWISE equal after
every step (non-owners only ever receive the owner's values).

Tolerances (fp32, clipping active in every step):
- parameters 1e-6 absolute after 10 steps (measured <= 3.4e-7). The gradients are summed in
  another order (autograd in the reference, gloo's reduce/all-reduce here) and the squared
  norm over owners in another order than over one list, so clip coefficients and gradients
  differ in the last bit; Newton-Schulz amplifies the small singular directions of such
  round-off, which is why the lr is a realistic 0.003 (with lr 0.02 the model memorises the
  batch within 10 steps and the same round-off grows to ~7e-6).
- gradient norms 1e-6 relative (measured <= 2.3e-7). Muon and Adam are nearly invariant to the
  gradient's scale, so a norm check is what catches gradients summed instead of averaged.
TP=2 x DP=2 equals TP=1 x DP=1 shard by shard to 1e-5 (measured <= 2e-6; the matmuls are split
differently over TP, so their round-off differs, as in test_gpt_muon.py).
"""

import hashlib

import pytest
import torch
import torch.distributed as dist

from megatron_eopt import OptimizerConfig, ParallelGroups, get_megatron_optimizer
from megatron_eopt.training.model.gpt import GPTModelSettings, build_gpt_model
from tests.gpt_training import local_shard, model_parallel, snapshot, token_batch, train_steps

SETTINGS = GPTModelSettings(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=48, swiglu=True, vocab_size=64, seq_length=8)
# lr 0.003 is a realistic Muon lr with the spectral scale (update RMS ~ lr); clip_grad 0.5 is
# below every gradient norm of the run, so clipping is active in every step.
MUON = dict(optimizer="muon", lr=0.003, min_lr=0.0, weight_decay=0.05, clip_grad=0.5, muon_momentum=0.9,
            muon_fp32_matmul_prec="highest")  # fp32: layouts compared at fp32 round-off
GLOBAL_BATCH = 8
STEPS = 10
SEED = 11


def global_batch(step: int) -> torch.Tensor:
    """The same global batch every step, so that a falling loss shows the model trains."""
    return token_batch(SETTINGS, batch=GLOBAL_BATCH, seed=100)


def dp_slice(step: int, dp_rank: int, dp_size: int) -> torch.Tensor:
    return global_batch(step).chunk(dp_size)[dp_rank]


def checksum(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        digest.update(name.encode())
        digest.update(param.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def train_reference(slices: int, per_head: bool = False) -> dict:
    """Non-distributed Muon (TP=1, no DP): loss = mean of the `slices` per-slice mean losses."""
    with model_parallel(1, seed=SEED):
        model = build_gpt_model(SETTINGS)
        optimizer = get_megatron_optimizer(OptimizerConfig(**MUON, muon_split_qkv_per_head=per_head), [model],
                                           pg_collection=ParallelGroups.single_process())
        run = train_steps(model, optimizer, lambda step: [dp_slice(step, r, slices) for r in range(slices)], STEPS)
        state_bytes = [sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t))
                       for child in optimizer.chained_optimizers for state in child.state.values()]
        return {"losses": run.losses, "norms": run.grad_norms, "params": snapshot(model), "state_bytes": state_bytes}


def train_layer_wise(tp: int, dp_group, reduce_grads: bool, per_head: bool = False,
                     tp_mode: str = "duplicated") -> dict:
    """Layer-wise Muon; dp_group None: parallel_state's groups (DP = world / tp)."""
    from megatron.core import parallel_state as ps

    with model_parallel(tp, seed=SEED):
        model = build_gpt_model(SETTINGS)
        if dp_group is None:
            pg_collection, dp = None, ps.get_data_parallel_group()
        else:  # explicit groups, as a trainer with its own DP layout passes them
            pg_collection, dp = ParallelGroups.from_groups(tp=None, mp=None, dp_cp=dp_group), dp_group
        config = OptimizerConfig(**MUON, use_layer_wise_distributed_optimizer=True,
                                 layer_wise_reduce_grads=reduce_grads, muon_split_qkv_per_head=per_head,
                                 muon_tp_mode=tp_mode, muon_tp_hardware_profile="h100" if tp_mode == "auto" else None)
        optimizer = get_megatron_optimizer(config, [model], pg_collection=pg_collection)
        dp_rank, dp_size = dist.get_rank(dp), dist.get_world_size(dp)
        checksums = []
        run = train_steps(model, optimizer, lambda step: dp_slice(step, dp_rank, dp_size), STEPS,
                          average_grads_over=None if reduce_grads else dp,  # else: what DDP does
                          after_step=lambda step: checksums.append(checksum(model)))
        return {"losses": run.losses, "norms": run.grad_norms, "checksums": checksums, "params": snapshot(model),
                "state_bytes": optimizer.optimizer_state_bytes(),
                "tp_rank": ps.get_tensor_model_parallel_rank(), "dp_ranks": dist.get_process_group_ranks(dp)}


def _data_parallel_body(rank: int, world_size: int) -> dict:
    assert world_size == 4
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    dp2 = pairs[rank // 2]
    result = {}
    for dp_size, dp_group in ((2, dp2), (4, None)):
        reference = train_reference(slices=dp_size)
        for reduce_grads in (True, False):
            run = train_layer_wise(1, dp_group, reduce_grads)
            errors = {name: (value - reference["params"][name][0]).abs().max().item()
                      for name, (value, _, _) in run["params"].items()}
            result[(dp_size, reduce_grads)] = {
                "errors": errors, "checksums": run["checksums"], "dp_ranks": run["dp_ranks"],
                "losses": list(zip(reference["losses"], run["losses"])),
                "norms": list(zip(reference["norms"], run["norms"])),
                "state_bytes": run["state_bytes"], "reference_state_bytes": reference["state_bytes"],
            }
    return result


def test_layer_wise_muon_dp2_dp4_equals_dp1(run_distributed) -> None:
    results = run_distributed(_data_parallel_body, world_size=4, timeout=300)
    for (dp_size, reduce_grads), first in results[0].items():
        case = (dp_size, "reduce_grads" if reduce_grads else "pre-averaged")
        for rank, per_rank in enumerate(results):
            run = per_rank[(dp_size, reduce_grads)]
            bad = {name: e for name, e in run["errors"].items() if e > 1e-6}
            assert not bad, (case, rank, bad)
            # Every replica in the DP group is bitwise the same after every step.
            replicas = [results[r][(dp_size, reduce_grads)]["checksums"] for r in run["dp_ranks"]]
            assert all(c == replicas[0] for c in replicas), (case, rank)
            # The norm is summed over the owners: each parameter once, of the averaged gradient.
            for reference, norm in run["norms"]:
                assert abs(norm - reference) < 1e-6 * reference, (case, run["norms"])
            assert min(reference for reference, _ in run["norms"]) > MUON["clip_grad"]  # clipping active
            # Owner-only state: the DP group's state adds up to the non-distributed optimizer's,
            # and no rank holds more than its share plus the largest parameter's state.
            total, largest = sum(run["reference_state_bytes"]), max(run["reference_state_bytes"])
            assert sum(results[r][(dp_size, reduce_grads)]["state_bytes"] for r in run["dp_ranks"]) == total
            assert run["state_bytes"] <= total / dp_size + largest, (case, rank, run["state_bytes"], total, largest)
            ref_losses = [a for a, _ in run["losses"]]
            assert ref_losses[-1] < ref_losses[0] - 0.5, (case, ref_losses)  # it trains
        assert len(first["dp_ranks"]) == dp_size


def _tensor_and_data_parallel_body(rank: int, world_size: int, per_head: bool) -> dict:
    reference = train_reference(slices=2, per_head=per_head)
    result = {}
    # 'auto' (profile 'h100'): each owner's matrices in the mode chosen for the whole model.
    for reduce_grads, tp_mode in ((True, "duplicated"), (False, "duplicated"), (False, "auto")):
        run = train_layer_wise(2, None, reduce_grads, per_head, tp_mode)  # parallel_state: TP=2, DP=2
        errors = {}
        for name, (shard, dim, stride) in run["params"].items():
            expected = local_shard(reference["params"][name][0], dim, stride, run["tp_rank"], 2)
            errors[name] = (shard - expected).abs().max().item()
        result[(reduce_grads, tp_mode)] = {"errors": errors, "checksums": run["checksums"],
                                           "dp_ranks": run["dp_ranks"],
                                           "norms": list(zip(reference["norms"], run["norms"]))}
    return result


@pytest.mark.parametrize("per_head", [False, True], ids=["qkv", "per_head"])
def test_layer_wise_muon_tp2_dp2_equals_tp1_dp1(run_distributed, per_head: bool) -> None:
    """Also per head (muon_split_qkv_per_head): 4 heads in 2 query groups, one group per TP rank."""
    results = run_distributed(_tensor_and_data_parallel_body, world_size=4, args=(per_head,), timeout=300)
    for case in ((True, "duplicated"), (False, "duplicated"), (False, "auto")):
        for rank, per_rank in enumerate(results):
            result = per_rank[case]
            bad = {name: e for name, e in result["errors"].items() if e > 1e-5}
            assert not bad, (case, rank, bad)
            for reference, norm in result["norms"]:
                assert abs(norm - reference) < 1e-6 * reference, (case, result["norms"])
            assert len(result["dp_ranks"]) == 2 and rank in result["dp_ranks"]
            assert all(results[r][case]["checksums"] == result["checksums"] for r in result["dp_ranks"])
