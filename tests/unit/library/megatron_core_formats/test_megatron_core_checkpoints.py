"""Checkpoints both ways with megatron-core 0.19.2's own optimizers (issue 46).

The reference is megatron-core's code: its `get_megatron_optimizer` builds FP32Optimizer (Adam)
and the chain FP32Optimizer(TensorParallelMuon) + FP32Optimizer(AdamW) on CPU once its loss-scale
tensor is made off CUDA (`cuda_tensors_on_cpu`), and with bf16 parameters the same kinds wrapped in
Float16OptimizerWithFloat16Params once its type check sees CUDA names (`cuda_named_types`). Its
step is each child's `prepare_grads` and `step_with_ready_grads` (gradients to the fp32 main copies,
the torch optimizer's step, the main copies back to bf16): its wrappers' `step` computes the norm
on CUDA, and nothing is clipped (clip_grad=0), so ours skips nothing either. Both libraries use the standard overrides: two param groups (wd_mult 0 for
biases and 1-D), which megatron-core starts at the same weight decay and ours at its own, so the
steps before a save differ; after a load both run with the checkpoint's hyperparameters.

Each case: library S trains N steps and saves; library L loads into a fresh model and optimizer
and takes M steps; that must equal S continuing itself for M steps without the save, bitwise
(fp32 Adam and Muon step bitwise alike: tests/unit/library/test_megatron_core_parity.py; in bf16
both step the same fp32 main copies and round them to bf16 alike).
Saved through `sharded_state_dict(model_sd, is_loading, metadata)` with megatron-core's
`dist_checkpointing` (its torch_dist format, written on CPU as test_dist_checkpointing.py explains;
loaded by `dist_checkpointing.load` itself), with and without `chained_optim_avoid_prefix`, and
through the plain format (`--ckpt-format torch`: `torch.save`/`torch.load` of what megatron-core's
`state_dict()` returned, or for ours `megatron_core_state_dict(optimizer)`).
"""

import io

import pytest
import torch

from megatron_eopt.checkpointing import checkpoint_optimizer_layout, megatron_core_state_dict
from tests.gpt_training import model_parallel, step_loss, token_batch
from tests.unit.library.megatron_core_formats.test_dist_checkpointing import _megatron_save
from tests.megatron_core_on_cpu import cuda_named_types, cuda_tensors_on_cpu, megatron_core_ddp_on_cpu

SAVED_STEPS, MORE_STEPS = 2, 2
SETTINGS = dict(num_layers=2, hidden_size=32, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=48,
                vocab_size=64, seq_length=16, position_embedding_type="none", swiglu=False)
FIELDS = {
    "adam": dict(optimizer="adam", lr=0.01, min_lr=0.0, weight_decay=0.05, clip_grad=0.0),
    "muon": dict(optimizer="muon", lr=0.02, min_lr=0.0, weight_decay=0.05, clip_grad=0.0, muon_momentum=0.9,
                 muon_fp32_matmul_prec="highest", muon_tp_mode="duplicated"),
}
# (name, metadata Megatron-LM would pass): Megatron-LM's own (avoid the prefix) and the default.
# ours before megatron-core's layout: a checkpoint in it loads when the metadata names it.
METADATA = {"avoid_prefix": {"chained_optim_avoid_prefix": True, "singleton_local_shards": False},
            "prefix": None, "eopt_v1": {"eopt_optimizer_layout": "megatron_eopt_v1"}}


class Run:
    """A GPTModel and one library's optimizer (`library`: 'core' or 'ours')."""

    def __init__(self, library: str, optimizer: str, seed: int, bf16: bool = False) -> None:
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig as CoreConfig
        from megatron.core.optimizer import get_megatron_optimizer as core_get_megatron_optimizer

        from megatron_eopt import OptimizerConfig, get_megatron_optimizer
        from megatron_eopt.training.model.gpt import GPTModelSettings, build_gpt_model

        self.library, self.settings = library, GPTModelSettings(**SETTINGS, bf16=bf16)
        fields = dict(FIELDS[optimizer], bf16=bf16)
        torch.manual_seed(seed)
        self.model = build_gpt_model(self.settings)
        if library == "ours":
            self.optimizer = get_megatron_optimizer(OptimizerConfig(**fields), [self.model])
        else:
            self.model.ddp_config = DistributedDataParallelConfig()  # read by megatron-core's factory
            # bf16: Float16OptimizerWithFloat16Params, which checks parameter types by CUDA name.
            with cuda_tensors_on_cpu(), cuda_named_types():
                self.optimizer = core_get_megatron_optimizer(CoreConfig(**fields), [self.model])

    def train(self, steps: range) -> None:
        for step in steps:
            self.optimizer.zero_grad()
            step_loss(self.model, token_batch(self.settings, batch=4, seed=100 + step)).backward()
            if self.library == "ours":
                assert self.optimizer.step()[0]
            else:
                for child in self.optimizer.chained_optimizers:  # bf16: gradients to the fp32 main copies and back
                    child.prepare_grads()
                    child.step_with_ready_grads()

    def sharded(self, metadata, is_loading: bool = False, keep_metadata: bool = False) -> dict:
        """`keep_metadata`: hand over `metadata` itself (Megatron-LM saves what the optimizer left in it)."""
        model = self.model.sharded_state_dict()
        metadata = dict(metadata) if metadata is not None and not keep_metadata else metadata
        return {"model": model, "optimizer": self.optimizer.sharded_state_dict(model, is_loading=is_loading,
                                                                                metadata=metadata)}

    def params(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in self.model.named_parameters()}


def _differences(expected: dict, actual: dict) -> list[str]:
    return [name for name in expected if not torch.equal(expected[name], actual[name])]


def _continued(saver: str, loader: str, optimizer: str, how: str, metadata, precision: str, directory: str) -> dict:
    """`saver` trains and saves, `loader` loads and continues; both against `saver` continuing."""
    from megatron.core import dist_checkpointing

    bf16 = precision == "bf16"
    saved = Run(saver, optimizer, seed=1, bf16=bf16)
    saved.train(range(SAVED_STEPS))
    if how == "sharded":
        written = dict(metadata or {})
        _megatron_save(saved.sharded(written, keep_metadata=True), directory)
    else:
        buffer = io.BytesIO()
        optimizer_state = saved.optimizer.state_dict() if saver == "core" else megatron_core_state_dict(saved.optimizer)
        torch.save({"model": saved.model.state_dict(), "optimizer": optimizer_state}, buffer)
    saved.train(range(SAVED_STEPS, SAVED_STEPS + MORE_STEPS))

    loaded = Run(loader, optimizer, seed=2, bf16=bf16)
    fresh_differs = bool(_differences(saved.params(), loaded.params()))
    if how == "sharded":
        state = dist_checkpointing.load(loaded.sharded(metadata, is_loading=True), directory)
    else:
        buffer.seek(0)
        state = torch.load(buffer, weights_only=False)
    loaded.model.load_state_dict(state["model"])
    loaded.optimizer.load_state_dict(state["optimizer"])
    loaded.train(range(SAVED_STEPS, SAVED_STEPS + MORE_STEPS))
    result = {"fresh_differs": fresh_differs, "differences": _differences(saved.params(), loaded.params())}
    core = saved if saver == "core" else loaded
    result["core_kinds"] = {type(child).__name__ for child in core.optimizer.chained_optimizers}
    if how == "sharded":
        result.update(written=written, keys=_optimizer_keys(directory), layout=checkpoint_optimizer_layout(directory))
    return result


def _optimizer_keys(directory: str) -> list[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return sorted(k for k in FileSystemReader(directory).read_metadata().state_dict_metadata if "optimizer." in k)


# bf16: megatron-core's Float16OptimizerWithFloat16Params, its fp32 main copies saved as fp32_param.
CASES = [(saver, loader, optimizer, how, metadata, "fp32")
         for saver, loader in (("core", "ours"), ("ours", "core"))
         for optimizer in ("adam", "muon")
         for how, metadata in (("sharded", "avoid_prefix"), ("sharded", "prefix"), ("plain", None))
         ] + [("ours", "ours", "muon", "sharded", "eopt_v1", "fp32")] + [
         (saver, loader, optimizer, how, "avoid_prefix" if how == "sharded" else None, "bf16")
         for saver, loader in (("core", "ours"), ("ours", "core"))
         for optimizer in ("adam", "muon") for how in ("sharded", "plain")]


def _both_ways_body(rank: int, world_size: int, directory: str) -> dict:
    import os

    results = {}
    with model_parallel(1, seed=3):
        for index, (saver, loader, optimizer, how, metadata, precision) in enumerate(CASES):
            case_directory = os.path.join(directory, str(index))
            os.makedirs(case_directory)
            results[(saver, loader, optimizer, how, metadata, precision)] = _continued(
                saver, loader, optimizer, how, METADATA.get(metadata), precision, case_directory)
        refusals = _refusals()
    return results, refusals


def _refusals() -> dict[str, tuple[str, bool]]:
    """Loading what does not fit: (the error, whether the live optimizer is untouched)."""
    core = {name: Run("core", name, seed=1) for name in ("adam", "muon")}
    for run in core.values():
        run.train(range(1))
    swapped = core["adam"].optimizer.state_dict()  # megatron-core's Adam state, two parameters' swapped
    swapped["state"][0], swapped["state"][1] = swapped["state"][1], swapped["state"][0]
    cases = {"muon_into_adam": ("adam", core["muon"].optimizer.state_dict()),
             "adam_into_muon": ("muon", core["adam"].optimizer.state_dict()),
             "another_parameter_order": ("adam", swapped)}
    refusals = {}
    for case, (name, state_dict) in cases.items():
        ours = Run("ours", name, seed=2)
        ours.train(range(1))
        before = io.BytesIO()
        torch.save(ours.optimizer.state_dict(), before)
        try:
            ours.optimizer.load_state_dict(state_dict)
            message = "loaded"
        except ValueError as error:
            message = str(error)
        after = io.BytesIO()
        torch.save(ours.optimizer.state_dict(), after)
        refusals[case] = (message, before.getvalue() == after.getvalue())
    return refusals


def test_checkpoints_move_both_ways_and_continue_bitwise(run_distributed, tmp_path) -> None:
    ((results, refusals),) = run_distributed(_both_ways_body, world_size=1, args=(str(tmp_path),), timeout=600)
    assert set(results) == set(CASES)
    for case, result in results.items():
        assert result["fresh_differs"], case
        assert not result["differences"], (case, result["differences"][:5])
        saver, _, optimizer, how, metadata, precision = case
        kind = "Float16OptimizerWithFloat16Params" if precision == "bf16" else "FP32Optimizer"
        assert result["core_kinds"] == {kind}, (case, result["core_kinds"])
        if how != "sharded":
            continue
        keys = result["keys"]
        if metadata == "eopt_v1":  # the keys today's main writes (issue 46 lists them)
            assert result["layout"] == "megatron_eopt_v1", case
            assert any(k.startswith("optimizer.muon.dense.state.momentum_buffer.") for k in keys), keys[:5]
            assert any(k.startswith("optimizer.adam.dense.state.exp_avg.") for k in keys), keys[:5]
            continue
        assert result["layout"] == "megatron_core", case
        names = {"adam": {"exp_avg", "exp_avg_sq"}, "muon": {"momentum_buffer", "exp_avg", "exp_avg_sq"}}[optimizer]
        if precision == "bf16":  # the fp32 main copies, as megatron-core's Float16 optimizer keys them
            names = names | {"fp32_param"}
            assert any(k.startswith("optimizer.state.fp32_param.") for k in keys), (case, keys[:5])
        prefixed = optimizer == "muon" and metadata == "prefix"  # one child: no prefix (megatron-core's rule)
        for key in keys:
            bare = key.split(".", 1)[1] if prefixed else key
            assert key.startswith("chained_") == prefixed, (case, key)
            assert bare.startswith("optimizer.state.") and bare.split(".")[2] in names, (case, key)
        if saver == "ours" and metadata == "avoid_prefix":  # the metadata we leave says what we wrote
            assert result["written"]["eopt_optimizer_layout"] == "megatron_core", result["written"]

    expected = {"muon_into_adam": "holds 2 optimizer(s) (megatron-core's format) but this chain has 1",
                "adam_into_muon": "holds 1 optimizer(s) (megatron-core's format) but this chain has 2",
                "another_parameter_order": "has shape (32, 32), but parameter 'embedding.word_embeddings.weight'"}
    for case, (message, untouched) in refusals.items():
        assert expected[case] in message and "\n" not in message, (case, message)
        assert untouched, case


# ------------------------------------------------------------------------------------------------
# Another TP size on the way (2 ranks: TP=2, or TP=1 x DP=2 with the same data on both)
# ------------------------------------------------------------------------------------------------

RESHARD_CASES = [(saver, saved_tp, optimizer) for saver, saved_tp in (("core", 2), ("ours", 1))
                 for optimizer in ("adam", "muon")]


def _reshard_body(rank: int, world_size: int, directory: str) -> dict:
    """`saver` saves at TP `saved_tp`; megatron-core and ours each load it at the other TP and
    continue: ours must continue as megatron-core does. Returns the names that differ per case."""
    import os

    from megatron.core import dist_checkpointing

    results = {}
    metadata = METADATA["avoid_prefix"]
    for index, (saver, saved_tp, optimizer) in enumerate(RESHARD_CASES):
        case_directory = os.path.join(directory, str(index))
        if rank == 0:
            os.makedirs(case_directory)
        torch.distributed.barrier()
        with model_parallel(saved_tp, seed=3):
            saved = Run(saver, optimizer, seed=1)
            saved.train(range(SAVED_STEPS))
            _megatron_save(saved.sharded(dict(metadata)), case_directory)
        continued = {}
        with model_parallel(3 - saved_tp, seed=3):
            for loader in ("core", "ours"):
                loaded = Run(loader, optimizer, seed=2)
                fresh = loaded.params()
                state = dist_checkpointing.load(loaded.sharded(metadata, is_loading=True), case_directory)
                loaded.model.load_state_dict(state["model"])
                loaded.optimizer.load_state_dict(state["optimizer"])
                if loader == "ours":  # the load changed every parameter and filled the state
                    unchanged = set(fresh) - set(_differences(fresh, loaded.params()))
                    empty = [k for k, v in _state_tensors(loaded.optimizer).items() if not v.any()]
                loaded.train(range(SAVED_STEPS, SAVED_STEPS + MORE_STEPS))
                continued[loader] = loaded.params()
        errors = {name: (continued["ours"][name] - value).abs().max().item() for name, value in continued["core"].items()}
        results[(saver, saved_tp, optimizer)] = (errors, sorted(unchanged), empty)
    return results


def _state_tensors(optimizer) -> dict[str, torch.Tensor]:
    return {f"{fqn}/{name}": value for child in optimizer.chained_optimizers for p in child.checkpoint_params()
            for fqn in [p.fqn] for name, value in p.state.items() if torch.is_tensor(value) and value.dim() > 0}


def test_megatron_core_checkpoint_at_another_tp_size_continues_as_megatron_core(run_distributed, tmp_path) -> None:
    for rank, results in enumerate(run_distributed(_reshard_body, world_size=2, args=(str(tmp_path),), timeout=600)):
        for case, (errors, unchanged, empty) in results.items():
            assert errors and not any(errors.values()), (rank, case, {n: e for n, e in errors.items() if e})
            assert not unchanged and not empty, (rank, case, unchanged, empty)


# ------------------------------------------------------------------------------------------------
# megatron-core's DistributedOptimizer (`--use-distributed-optimizer`), its fully_reshardable format
# ------------------------------------------------------------------------------------------------


DISTRIBUTED_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True,
                        "distrib_optim_fully_reshardable_mem_efficient": True, "singleton_local_shards": False}


def _distributed_body(rank: int, world_size: int, directory: str) -> dict:
    """megatron-core's DDP + DistributedOptimizer (Adam) trains and saves fully_reshardable; ours
    loads and continues, against megatron-core continuing; and a deprecated format's refusal."""
    from megatron.core import dist_checkpointing
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig as CoreConfig
    from megatron.core.optimizer import get_megatron_optimizer as core_get_megatron_optimizer

    from megatron_eopt.training.model.gpt import GPTModelSettings, build_gpt_model

    settings = GPTModelSettings(**SETTINGS)
    with model_parallel(1, seed=3), megatron_core_ddp_on_cpu():
        torch.manual_seed(1)
        model = build_gpt_model(settings)
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
            use_distributed_optimizer=True, grad_reduce_in_fp32=True), model)
        with cuda_named_types():
            core = core_get_megatron_optimizer(CoreConfig(**FIELDS["adam"], use_distributed_optimizer=True), [ddp])

        def train(steps: range) -> None:
            for step in steps:
                ddp.zero_grad_buffer()
                core.zero_grad()
                step_loss(ddp, token_batch(settings, batch=4, seed=100 + step)).backward()
                ddp.finish_grad_sync()
                for child in core.chained_optimizers:  # megatron-core's step less its CUDA-only norm
                    assert not child.prepare_grads() and child.step_with_ready_grads()

        train(range(SAVED_STEPS))
        model_sd = model.sharded_state_dict()
        _megatron_save({"model": model_sd, "optimizer": core.sharded_state_dict(
            model_sd, metadata=dict(DISTRIBUTED_METADATA))}, directory)
        train(range(SAVED_STEPS, SAVED_STEPS + MORE_STEPS))
        expected = {name: p.detach().clone() for name, p in model.named_parameters()}

        ours = Run("ours", "adam", seed=2)
        state = dist_checkpointing.load(ours.sharded(DISTRIBUTED_METADATA, is_loading=True), directory)
        ours.model.load_state_dict(state["model"])
        ours.optimizer.load_state_dict(state["optimizer"])
        ours.train(range(SAVED_STEPS, SAVED_STEPS + MORE_STEPS))
        keys = _optimizer_keys(directory)
        try:
            ours.sharded({**DISTRIBUTED_METADATA, "distrib_optim_sharding_type": "fully_sharded_bucket_space"},
                         is_loading=True)
            refusal = "accepted"
        except ValueError as error:
            refusal = str(error)
    return {"differences": _differences(expected, ours.params()), "keys": keys, "refusal": refusal}


def test_megatron_core_distributed_optimizer_checkpoint_continues_in_ours(run_distributed, tmp_path) -> None:
    (result,) = run_distributed(_distributed_body, world_size=1, args=(str(tmp_path),), timeout=600)
    assert any(k.startswith("optimizer.state.param.") for k in result["keys"]), result["keys"][:5]
    assert not result["differences"], result["differences"][:5]
    assert "'fully_sharded_bucket_space' format, which megatron_eopt cannot read" in result["refusal"], result["refusal"]
