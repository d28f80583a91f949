"""get_megatron_optimizer on models wrapped by Megatron-FSDP (`fully_shard_model`, ZeRO-3), on gloo
through megatron_eopt.runtime.megatron_fsdp_cpu.

Reference: our unsharded get_megatron_optimizer (tested elsewhere against torch and megatron-core)
on an unsharded copy of the same megatron-core GPT, in each rank's process. Each rank runs its own
micro-batch through the Megatron-FSDP model, whose reduce-scatter averages the gradients; the
reference's gradient is the mean of all ranks' micro-batch gradients, as Megatron-FSDP reduces it.
fp32 matmuls at 'highest' and muon_fp32_matmul_prec='highest'; clip_grad=0.5 is active (the norms are
about 1). After 3 steps every parameter equals the reference within 2e-3 of one step's lr (fp32
round-off: the gradients and their norm are summed in another order, and Adam at lr 0.02 carries
it furthest; measured up to 5.3e-4 lr, adaptive_muon's scalar Adam on the embedding) and each
step's gradient norm within 1e-5 relative (each element counted once). Megatron-FSDP's shards are uneven and follow its buckets:
the test checks that the run covers a matrix whole on one rank, an empty shard, and linear_qkv cut
inside a query group.
"""

import pytest
import torch

from megatron_eopt import OptimizerConfig, get_megatron_optimizer
from megatron_eopt.training.model.gpt import (
    GPTModelSettings,
    build_gpt_model,
    destroy_model_parallel,
    gpt_loss,
    initialize_model_parallel,
)
from tests.refusals import error_of

SETTINGS = GPTModelSettings(num_layers=2, hidden_size=32, num_attention_heads=8, num_query_groups=4,
                            ffn_hidden_size=48, swiglu=True, vocab_size=64, seq_length=16)
QUERY_GROUP_ROWS = (8 // 4 + 2) * (32 // 8)  # (q heads per group + k + v) * kv_channels
TOLERANCE = 2e-3  # of one step's lr (module docstring)
STEPS = 3
OPTIMIZERS = ("muon", "adam", "adaptive_muon")


def config_for(optimizer: str) -> OptimizerConfig:
    return OptimizerConfig(optimizer=optimizer, lr=1e-3 if optimizer == "adam" else 0.02, min_lr=0.0,
                           weight_decay=0.05, clip_grad=0.5, muon_momentum=0.9,
                           muon_fp32_matmul_prec="highest", adaptive_muon_moment2_method="normuon")


def build_gpt() -> torch.nn.Module:
    initialize_model_parallel(1, seed=11)
    try:
        return build_gpt_model(SETTINGS)
    finally:
        destroy_model_parallel()


def megatron_fsdp_gpt() -> torch.nn.Module:
    """The GPT wrapped by Megatron-FSDP as the trainer wraps it: ZeRO-3 over all ranks, each
    TransformerLayer a unit, on CPU through runtime/megatron_fsdp_cpu.py."""
    from megatron_eopt.training.parallel import megatron_fsdp

    return megatron_fsdp.megatron_fsdp_gpt(build_gpt(), torch.device("cpu"))


def micro_batch(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, SETTINGS.vocab_size, (2, SETTINGS.seq_length + 1),
                         generator=torch.Generator().manual_seed(100 * step + rank))


def gathered(param: torch.Tensor) -> torch.Tensor:
    """The whole tensor from every rank's shard (test-side only: the optimizer never gathers), by
    Megatron-FSDP's own uneven all_gather, padded on gloo by the patch."""
    from megatron_fsdp.uneven_dtensor import uneven_dtensor_to_full_tensor

    return uneven_dtensor_to_full_tensor(param).detach()


def train_both(optimizer_name: str, rank: int, world_size: int) -> dict:
    from megatron_eopt.runtime.process_groups import ParallelGroups

    torch.set_float32_matmul_precision("highest")
    config = config_for(optimizer_name)
    reference, sharded = build_gpt(), megatron_fsdp_gpt()
    reference_opt = get_megatron_optimizer(config, [reference], pg_collection=ParallelGroups.single_process())
    sharded_opt = get_megatron_optimizer(config, [sharded])
    results = []
    for step in range(STEPS):
        gpt_loss(sharded, micro_batch(step, rank)).backward()
        sharded.finish_grad_sync()  # Megatron-FSDP's protocol: attaches the .grad shards
        got = sharded_opt.step()
        sharded.install_optimized_model_weights()
        sharded.zero_grad_buffer()
        reference.zero_grad()
        for source in range(world_size):
            gpt_loss(reference, micro_batch(step, source)).backward()
        for p in reference.parameters():
            p.grad /= world_size
        results.append((reference_opt.step(), got))
    full = dict(reference.named_parameters())
    errors = {n: (gathered(p) - full[n.removeprefix("module.")]).abs().max().item() for n, p in sharded.named_parameters()}
    steps = {int(s["step"]) for child in sharded_opt.chained_optimizers for s in child.state.values() if "step" in s}
    return {"errors": errors, "results": results, "steps": steps,
            "local_rows": {n: p.to_local().shape[0] for n, p in sharded.named_parameters()}}


def _gpt_body(rank: int, world_size: int) -> dict:
    runs = {optimizer: train_both(optimizer, rank, world_size) for optimizer in OPTIMIZERS}
    return {"runs": runs, "refusals": refusals() if world_size == 2 else {},
            "dropped_model_freed": _dropped_model_is_freed(rank)}


def _dropped_model_is_freed(rank: int) -> bool:
    """A Megatron-FSDP model that took a step, once dropped, is collected, and with it its groups:
    its gradient hooks, which autograd keeps on its own parameters, hold it weakly."""
    import gc
    import weakref

    from megatron_eopt.placement.megatron_fsdp_model import megatron_fsdp_wrappers

    model = megatron_fsdp_gpt()
    optimizer = get_megatron_optimizer(config_for("adam"), [model])
    _take_steps(model, optimizer, 0, 1, rank)
    wrapper = weakref.ref(megatron_fsdp_wrappers([model])[0])
    del model, optimizer
    gc.collect()
    return wrapper() is None


def refusals() -> dict[str, tuple[str, str]]:
    """What is refused, each with a clear error on every rank."""
    from megatron_fsdp import fully_shard_model

    from megatron_eopt.placement.megatron_fsdp_model import hold_gradient_hooks_weakly
    from megatron_eopt.runtime.process_groups import ParallelGroups

    model = megatron_fsdp_gpt()
    optimizer = get_megatron_optimizer(config_for("muon"), [model])
    messages = {"no finish_grad_sync": error_of(optimizer.step)}  # no backward: no gradient anywhere
    for strategy in ("optim", "no_shard"):  # the latter keeps plain parameters
        other = fully_shard_model(torch.nn.Sequential(torch.nn.Linear(8, 6)), zero_dp_strategy=strategy,
                                  device=torch.device("cpu"))
        hold_gradient_hooks_weakly(other)  # as the trainer does: else the model and its groups stay for good
        messages[strategy] = error_of(lambda: get_megatron_optimizer(config_for("muon"), [other]))
    world = ParallelGroups.from_groups(tp=torch.distributed.group.WORLD, mp=torch.distributed.group.WORLD)
    messages["tp"] = error_of(lambda: get_megatron_optimizer(config_for("muon"), [model], pg_collection=world))
    return messages


def check_run(run: dict, label) -> None:
    tolerance = TOLERANCE * config_for(label[-1]).lr
    bad = {name: e for name, e in run["errors"].items() if not e <= tolerance}
    assert not bad, (label, bad)
    for expected, got in run["results"]:
        assert expected[0] and got[0] and expected[1] > 0.5, (label, expected, got)  # clipping active
        assert abs(expected[1] - got[1]) <= 1e-5 * expected[1], (label, expected, got)


# Uneven row shards at 3 ranks: `make test-slow`; `make test` loads Megatron-FSDP checkpoints at DP=3
# (test_fsdp_dtensor.py, and below at another DP size).
@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_gpt_megatron_fsdp_equals_one_process(run_distributed, world_size: int) -> None:
    replies = run_distributed(_gpt_body, world_size=world_size, timeout=600)
    for reply in replies if world_size == 2 else ():
        kind, text = reply["refusals"]["no finish_grad_sync"]
        assert kind == "ValueError" and "finish_grad_sync()" in text, reply["refusals"]
        for strategy in ("optim", "no_shard"):
            kind, text = reply["refusals"][strategy]
            assert kind == "ValueError" and f"{strategy!r}" in text and "'optim_grads_params'" in text, reply["refusals"]
        kind, text = reply["refusals"]["tp"]  # a TP group the TP=1 model was not built over: refused
        assert kind == "ValueError" and "the tensor-parallel group given has ranks" in text, reply["refusals"]
    assert all(reply["dropped_model_freed"] for reply in replies)
    per_rank = [r["runs"] for r in replies]
    for rank, runs in enumerate(per_rank):
        for optimizer, run in runs.items():
            check_run(run, (world_size, rank, optimizer))
        assert runs["adam"]["steps"] <= {STEPS}, runs["adam"]["steps"]  # no zero-gradient initial step
    rows = {name: tuple(r["muon"]["local_rows"][name] for r in per_rank) for name in per_rank[0]["muon"]["local_rows"]}
    matrices = {n: split for n, split in rows.items() if n.endswith("weight") and "norm" not in n}
    # The shards this test covers (Megatron-FSDP's bucket split; a change in it must not go unnoticed).
    assert any(sorted(split)[-1] == sum(split) for split in matrices.values()), rows  # whole on one rank
    assert any(0 in split for split in matrices.values()), rows  # an empty shard
    qkv = rows["module.decoder.layers.0.self_attention.linear_qkv.weight"]
    assert any(r % QUERY_GROUP_ROWS for r in qkv), qkv  # cut inside a query group


# --- Checkpoints: save_checkpoint / load_checkpoint take the Megatron-FSDP model and optimizer as they are ---

RESUME_STEPS = 2


def _take_steps(model, optimizer, first: int, count: int, rank: int) -> None:
    for step in range(first, first + count):
        gpt_loss(model, micro_batch(step, rank)).backward()
        model.finish_grad_sync()
        optimizer.step()
        model.install_optimized_model_weights()
        model.zero_grad_buffer()


def _full_state(model, optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and every optimizer state tensor, whole (test-side gathers of the shards)."""
    import torch.distributed as dist

    full = {f"model/{n.removeprefix('module.')}": gathered(p) for n, p in model.named_parameters()}
    for child in optimizer.chained_optimizers:
        for main, fqn in ((m, child.fqn_of_main[id(m)]) for m in child.main_params):
            for key, value in child.state.get(main, {}).items():
                if torch.is_tensor(value) and value.dim() > 0:
                    shards = [None] * dist.get_world_size()
                    dist.all_gather_object(shards, value.detach())
                    full[f"state/{fqn.removeprefix('module.')}/{key}"] = torch.cat(shards)
    return full


def _resume_body(rank: int, world_size: int, directory: str) -> dict:
    """DP=2: save after 2 steps; 2 more steps straight, and 2 more after loading into a fresh model
    and optimizer: compared bitwise. Rank 0 writes the saved model and state for the DP=3 load."""
    from megatron_eopt.checkpointing import load_checkpoint, save_checkpoint

    torch.set_float32_matmul_precision("highest")
    differences = {}
    for name in ("muon", "adam"):
        model = megatron_fsdp_gpt()
        optimizer = get_megatron_optimizer(config_for(name), [model])
        _take_steps(model, optimizer, 0, RESUME_STEPS, rank)
        save_checkpoint(f"{directory}/{name}", RESUME_STEPS, [model], optimizer)
        saved = _full_state(model, optimizer)
        if rank == 0:
            torch.save(saved, f"{directory}/{name}.pt")
        _take_steps(model, optimizer, RESUME_STEPS, RESUME_STEPS, rank)
        straight = _full_state(model, optimizer)
        model = megatron_fsdp_gpt()
        optimizer = get_megatron_optimizer(config_for(name), [model])
        load_checkpoint(f"{directory}/{name}", [model], optimizer)
        _take_steps(model, optimizer, RESUME_STEPS, RESUME_STEPS, rank)
        resumed = _full_state(model, optimizer)
        assert straight.keys() == resumed.keys() and any(k.startswith("state/") for k in straight)
        differences[name] = [k for k in straight if not torch.equal(straight[k], resumed[k])]
    return differences


def _reshard_body(rank: int, world_size: int, directory: str) -> dict:
    """The DP=2 checkpoints loaded at DP=3 (other shards) give the saved model and state exactly."""
    from megatron_eopt.checkpointing import load_checkpoint

    differences = {}
    for name in ("muon", "adam"):
        model = megatron_fsdp_gpt()
        optimizer = get_megatron_optimizer(config_for(name), [model])
        load_checkpoint(f"{directory}/{name}", [model], optimizer)
        loaded, saved = _full_state(model, optimizer), torch.load(f"{directory}/{name}.pt")
        assert loaded.keys() == saved.keys(), sorted(set(loaded) ^ set(saved))
        differences[name] = [k for k in saved if not torch.equal(saved[k], loaded[k])]
    return differences


def test_megatron_fsdp_checkpoint_resumes_exactly_and_loads_at_another_dp_size(run_distributed, tmp_path) -> None:
    for differences in run_distributed(_resume_body, world_size=2, args=(str(tmp_path),), timeout=600):
        assert differences == {"muon": [], "adam": []}, differences
    for differences in run_distributed(_reshard_body, world_size=3, args=(str(tmp_path),), timeout=600):
        assert differences == {"muon": [], "adam": []}, differences


# --- The trainer: scripts/pretrain_gpt.py --use-megatron-fsdp (Megatron-LM's default strategy, optim_grads_params) ---

def _pretrain_argv(iterations: int) -> list[str]:
    from tests.unit.library.distributed.test_fsdp2 import PRETRAIN_ARGV

    argv = list(PRETRAIN_ARGV)
    argv[argv.index("--train-iters") + 1] = str(iterations)
    return argv


MEGATRON_FSDP_FLAGS = ["--use-megatron-fsdp"]  # no strategy: Megatron-LM's default, optim_grads_params
# --clip-grad 0: the gradient norm is summed in another order on the shards (1 ulp apart), and a
# clipping factor from it moves every update by that ulp, which the bf16 rounding of the compute
# weights turns into loss differences of 4e-5 (measured) instead of fp32 round-off.
BF16 = ["--bf16", "--clip-grad", "0"]
# QK-clip at a threshold the tiny GPT's logits pass from iteration 3 on (measured 0.05 -> 0.14).
QK_CLIP = ["--qk-clip", "--qk-clip-threshold", "0.08", "--log-max-attention-logit"]


def _pretrain_body(rank: int, world_size: int, directory: str) -> dict:
    """DP=2 with Megatron-FSDP: 6 iterations straight, and 3 + save + load + 3 (each command line
    builds its process groups and Megatron-FSDP anew); a refused strategy (optim_grads)."""
    from tests.pretrain_gpt_in_process import run_pretrain_gpt, run_pretrain_gpt_reporting

    argv = _pretrain_argv(6) + MEGATRON_FSDP_FLAGS + BF16 + QK_CLIP
    runs = {"straight": run_pretrain_gpt(rank, world_size, argv),
            "first": run_pretrain_gpt(rank, world_size, argv + ["--save", directory, "--exit-interval", "3"]),
            "resumed": run_pretrain_gpt(rank, world_size, argv + ["--load", directory])}
    refused = run_pretrain_gpt_reporting(rank, world_size, _pretrain_argv(1) + MEGATRON_FSDP_FLAGS + [
        "--data-parallel-sharding-strategy", "optim_grads"])
    return {"runs": runs, "refused": (refused.returncode, refused.stderr + refused.stdout)}


def _one_process_body(rank: int, world_size: int) -> dict:
    """The reference on one rank: --bf16 (bf16 parameters, fp32 main copies, gradients accumulated
    in fp32)."""
    from tests.pretrain_gpt_in_process import run_pretrain_gpt

    return {"bf16": run_pretrain_gpt(rank, world_size, _pretrain_argv(6) + BF16 + QK_CLIP)}


def test_pretrain_gpt_megatron_fsdp_equals_one_process_and_resumes_exactly(run_distributed, tmp_path) -> None:
    """The same seed, data and global batch (8: 2 micro-batches per rank at DP=2, 4 in one process),
    --bf16 (bf16 compute weights, fp32 main weights and gradient accumulation; no gradient clipping,
    BF16 says why), QK-clip clipping from iteration 3, muon at 'highest':
    Megatron-FSDP's losses equal one process's to 1e-5 relative (the fp32 gradients are summed in
    another order; Megatron-FSDP splits linear_qkv inside a query group and leaves rank 1 an empty
    shard of linear_proj); the resumed run's equal the straight run's bitwise."""
    reference = run_distributed(_one_process_body, 1, timeout=600)[0]["bf16"]
    expected = [r["loss"] for r in reference]
    assert len(expected) == 6 and expected[-1] < expected[0], expected
    assert max(r["max_attention_logit"] for r in reference) > 0.08, reference  # QK-clip clips
    results = run_distributed(_pretrain_body, 2, args=(str(tmp_path),), timeout=600)
    code, text = results[0]["refused"]  # rank 0 prints the one line; every rank exits with status 2
    assert code == 2 and "given optim_grads;" in text and "Traceback" not in text, text
    for result in results:
        losses = {name: {r["iteration"]: r["loss"] for r in records} for name, records in result["runs"].items()}
        straight = [losses["straight"][i] for i in range(1, 7)]
        print("Megatron-FSDP DP=2 vs one process: max relative loss difference",
              max(abs(g - e) / abs(e) for g, e in zip(straight, expected)))
        assert straight == pytest.approx(expected, rel=1e-5)
        assert sorted(losses["first"]) == [1, 2, 3] and sorted(losses["resumed"]) == [4, 5, 6], losses
        assert {**losses["first"], **losses["resumed"]} == losses["straight"]  # bitwise
        assert result["refused"][0] == 2, result["refused"]


# --- Megatron-LM's own path: validate_args with --use-megatron-fsdp and an emerging optimizer ---

def _parse_megatron_lm(argv: str, rank: int, world_size: int):
    """test_megatron_lm_args.parse_megatron_lm without CUDA_DEVICE_MAX_CONNECTIONS=1, which Megatron-LM
    refuses with FSDP (it is set there for TP > 1)."""
    import os
    from unittest import mock

    from tests.unit.library.integrations.test_megatron_lm_args import parse_megatron_lm

    with mock.patch.dict(os.environ):
        with mock.patch.object(os.environ, "update", lambda **values: os.environ.__setitem__("RANK", values["RANK"])
                               or os.environ.__setitem__("WORLD_SIZE", values["WORLD_SIZE"])):
            return parse_megatron_lm(argv, rank, world_size)


def megatron_lm_alone(argv: str, rank: int, world_size: int) -> str:
    """'accepted', or Megatron-LM's own refusal (an AssertionError in its validate_args), of `argv`
    parsed without megatron_lm.install()."""
    try:
        _parse_megatron_lm(argv, rank, world_size)
        return "accepted"
    except AssertionError as error:
        return str(error)


def _megatron_lm_body(rank: int, world_size: int) -> dict:
    """Megatron-LM's parse_args + validate_args (as its pretrain_gpt.py runs them) without and with
    megatron_lm.install(); with it, the optimizer Megatron-LM's setup would build, on a Megatron-FSDP GPT."""
    from unittest import mock

    from megatron_eopt.integrations import megatron_lm
    from tests.unit.library.integrations.test_megatron_lm_args import MODEL_FLAGS, build_through_megatron_lm

    argv = (f"{MODEL_FLAGS} --optimizer muon --lr 0.02 --use-megatron-fsdp --data-parallel-sharding-strategy "
            f"optim_grads_params --ckpt-format fsdp_dtensor")
    result = {"without": megatron_lm_alone(argv, rank, world_size)}
    printed = []  # the optimizer Megatron-LM's argument dump shows: validate_args runs it as adam inside
    with megatron_lm.installed(), mock.patch("megatron.training.arguments._print_args",
                                             lambda title, args: printed.append(args.optimizer)):
        args = _parse_megatron_lm(argv, rank, world_size)
        result["args"] = (args.optimizer, args.use_layer_wise_distributed_optimizer, args.use_distributed_optimizer)
        result["printed"] = printed
        try:
            optimizer = build_through_megatron_lm(args, megatron_fsdp_gpt())
            result["config"] = (optimizer.config.use_distributed_optimizer,
                                optimizer.config.use_layer_wise_distributed_optimizer)
            result["children"] = sorted(type(c).__name__ for c in optimizer.chained_optimizers)
        finally:
            from megatron.training import global_vars

            global_vars.set_args(None)
    return result


def test_megatron_lm_validate_args_accepts_emerging_optimizers_on_megatron_fsdp(run_distributed) -> None:
    for result in run_distributed(_megatron_lm_body, 2, timeout=600):
        assert "Megatron-FSDP" in result["without"], result  # refused without install()
        assert result["args"] == ("muon", False, True), result  # Megatron-LM's own flag for its FSDP stays
        assert result["printed"] == ["muon"], result  # the dump shows what runs
        assert result["config"] == (False, False), result  # ours steps the DTensor shards itself
        assert result["children"] == ["MegatronFSDPFP32Optimizer"] * 2, result  # muon and adam children
