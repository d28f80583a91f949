"""`--optimizer adam --use-distributed-optimizer` through `install()`: model chunks wrapped in
megatron-core's DDP with `ddp_config.use_distributed_optimizer=True`, which reduce-scatters the
gradients into byte shards of its buckets (distributed/reduce_scattered.py).

The reference is megatron-core 0.19.2 itself, on gloo at DP=2 with tests/megatron_core_on_cpu.py's
patches: its own `get_megatron_optimizer` for the same config over its own DDP of the same model.
Each rank trains on its own batches (so the reduce-scatter matters), with gradient clipping on.
- steps: ours (given our standard overrides, our ParamKeys) and megatron-core's give bitwise equal
  parameters after every step: Adam in fp32 and in bf16 with fp32 main copies; a non-distributed
  run (all-reducing DDP) takes the same steps to fp32 round-off (its norm and averages are summed
  in another order), so the shards were stepped with the right gradients;
- memory: each rank keeps optimizer state (moments and fp32 main copies) for half the elements of
  the non-distributed optimizer's; the two ranks' together are exactly its;
- checkpoints: megatron-core's writes (`fully_reshardable`, `dp_reshardable`, and its plain
  `state_dict()` with its parameter-state file, Megatron-LM's `--ckpt-format torch`), ours loads and
  continues bitwise as megatron-core continues itself; and the mirror;
- refusals: Muon (whole matrices), SGD (megatron-core's DistributedOptimizer refuses it), the
  layer-wise and a non-distributed optimizer on such a DDP, and a module that only carries the
  DDP's config, each in one line saying what to do.
"""

import types

import pytest
import torch

from tests.gpt_training import model_parallel, step_loss, token_batch
from tests.megatron_core_on_cpu import (
    cuda_named_types,
    distributed_optimizer_loads_on_cpu,
    megatron_core_ddp_on_cpu,
    megatron_core_steps_on_cpu,
)

SETTINGS = dict(num_layers=2, hidden_size=32, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=48,
                vocab_size=64, seq_length=16, position_embedding_type="none", swiglu=False)
FIELDS = dict(optimizer="adam", lr=0.01, min_lr=0.0, weight_decay=0.05, clip_grad=0.5, adam_beta2=0.95)
BUCKET_SIZE = 3000  # elements: several buckets, parameters cut between the ranks' shards
STEPS = 3


def _ddp_config(use_distributed_optimizer: bool = True):
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(use_distributed_optimizer=use_distributed_optimizer, grad_reduce_in_fp32=True,
                                         overlap_grad_reduce=True, bucket_size=BUCKET_SIZE)


class Run:
    """A GPTModel in megatron-core's DDP and an optimizer built by `factory` ('ours' or 'core')."""

    def __init__(self, factory: str, bf16: bool = False, distributed: bool = True, optimizer: str = "adam",
                 our_overrides: bool = False) -> None:
        """`our_overrides`: ours gets our standard overrides (our ParamKeys) instead of None."""
        from megatron.core.distributed import DistributedDataParallel
        from megatron.core.optimizer import OptimizerConfig as CoreConfig
        from megatron.core.optimizer import get_megatron_optimizer as core_get_megatron_optimizer

        from megatron_eopt import OptimizerConfig, get_megatron_optimizer, get_standard_config_overrides
        from megatron_eopt.training.model.gpt import GPTModelSettings, build_gpt_model

        self.settings = GPTModelSettings(**SETTINGS, bf16=bf16)
        torch.manual_seed(11)
        self.model = build_gpt_model(self.settings)
        self.ddp = DistributedDataParallel(self.model.config, _ddp_config(distributed), self.model)
        fields = dict(FIELDS, optimizer=optimizer, bf16=bf16, use_distributed_optimizer=distributed)
        with cuda_named_types():
            if factory == "core":
                self.optimizer = core_get_megatron_optimizer(CoreConfig(**fields), [self.ddp])
            else:
                config = OptimizerConfig(**fields)
                overrides = get_standard_config_overrides(config) if our_overrides else None
                self.optimizer = get_megatron_optimizer(config, [self.ddp], config_overrides=overrides)
        for group in self.optimizer.param_groups:  # what Megatron-LM's scheduler sets (constant lr)
            group["lr"], group["weight_decay"] = group["max_lr"], FIELDS["weight_decay"] * group["wd_mult"]

    def train(self, steps: range) -> list[float]:
        """Megatron-LM's step: zero the buffers, forward and backward, the DDP's gradient sync, step."""
        import torch.distributed as dist

        norms = []
        for step in steps:
            self.ddp.zero_grad_buffer()
            self.optimizer.zero_grad()
            batch = token_batch(self.settings, batch=4, seed=100 + 10 * step + dist.get_rank())
            step_loss(self.ddp, batch).backward()
            self.ddp.finish_grad_sync()
            with megatron_core_steps_on_cpu():
                successful, grad_norm, _ = self.optimizer.step()
            assert successful
            norms.append(grad_norm)
        return norms

    def params(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().float().clone() for name, p in self.model.named_parameters()}

    def state_numel(self) -> int:
        """Elements the torch optimizer inside keeps on this rank: its moments and the parameters
        it steps (the fp32 main copies, or their shards)."""
        numel = 0
        for child in self.optimizer.chained_optimizers:
            for state in child.optimizer.state.values():
                numel += sum(t.numel() for k, t in state.items() if torch.is_tensor(t) and k != "step")
            numel += sum(p.numel() for g in child.optimizer.param_groups for p in g["params"])
        return numel


def _differences(expected: dict, actual: dict) -> list[str]:
    return [name for name in expected if not torch.equal(expected[name], actual[name])]


def _steps_body(rank: int, world_size: int, optimizer: str, bf16: bool) -> dict:
    with model_parallel(1, seed=3), megatron_core_ddp_on_cpu():
        core = Run("core", bf16, optimizer=optimizer)
        core_norms, core_params = [], []
        for step in range(STEPS):
            core_norms += core.train(range(step, step + 1))
            core_params.append(core.params())
        ours = Run("ours", bf16, optimizer=optimizer, our_overrides=True)
        ours_params = []
        for step in range(STEPS):
            ours.train(range(step, step + 1))
            ours_params.append(ours.params())
        plain = Run("ours", bf16, distributed=False, optimizer=optimizer)
        plain.train(range(STEPS))
        return {
            "class": [type(ours.optimizer).__name__, [type(c).__name__ for c in ours.optimizer.chained_optimizers]],
            "differences": [_differences(c, o) for c, o in zip(core_params, ours_params)],
            "moved": bool(_differences(ours_params[0], ours_params[-1])),
            "buckets": [len(buffer.buckets) for buffer in ours.ddp.buffers],
            "norms": core_norms,
            "from_plain": max((plain.params()[n] - ours_params[-1][n]).abs().max().item() for n in ours_params[-1]),
            "state": ours.state_numel(), "plain_state": plain.state_numel(),
        }


@pytest.mark.parametrize("optimizer,bf16", [("adam", False), ("adam", True)], ids=["adam-fp32", "adam-bf16"])
def test_steps_reduce_scattered_shards_as_megatron_core(run_distributed, optimizer, bf16) -> None:
    results = run_distributed(_steps_body, world_size=2, args=(optimizer, bf16), timeout=600)
    for rank, result in enumerate(results):
        assert result["class"] == ["ChainedOptimizer", ["DistributedOptimizer"]], result["class"]
        assert result["differences"] == [[]] * STEPS, (rank, result["differences"])
        assert result["moved"] and all(n > FIELDS["clip_grad"] for n in result["norms"]), result["norms"]
        assert max(result["buckets"]) > 1, result["buckets"]
        # fp32 round-off of a few steps of lr 0.01; bf16 parameters round to 2**-8 relative.
        assert result["from_plain"] < (1e-2 if bf16 else 1e-5), result["from_plain"]
    states = [r["state"] for r in results]
    assert sum(states) == results[0]["plain_state"] and max(states) <= 0.55 * results[0]["plain_state"], states


# ------------------------------------------------------------------------------------------------
# Checkpoints: one saves, the other loads and continues as the saver continues
# ------------------------------------------------------------------------------------------------

SAVED_STEPS, MORE_STEPS = 2, 2
SHARDED_FORMATS = ("fully_reshardable", "dp_reshardable")


def _sharded(run: Run, sharding_type: str, is_loading: bool = False) -> dict:
    model = run.model.sharded_state_dict()
    metadata = {"distrib_optim_sharding_type": sharding_type, "chained_optim_avoid_prefix": True,
                "singleton_local_shards": False}  # as Megatron-LM passes them
    return {"model": model, "optimizer": run.optimizer.sharded_state_dict(model, is_loading=is_loading,
                                                                          metadata=metadata)}


def _save(run: Run, how: str, directory: str) -> None:
    """torch_dist (`how` a sharding type) or Megatron-LM's --ckpt-format torch (`how` 'torch')."""
    import os

    import torch.distributed as dist

    from tests.unit.library.megatron_core_formats.test_dist_checkpointing import _megatron_save

    if how == "torch":
        torch.save({"model": run.model.state_dict(), "optimizer": run.optimizer.state_dict()},
                   os.path.join(directory, f"rank_{dist.get_rank()}.pt"))
        run.optimizer.save_parameter_state(os.path.join(directory, "distrib_optim.pt"))
        dist.barrier()
    else:
        _megatron_save(_sharded(run, how), directory)


def _load(run: Run, how: str, directory: str) -> None:
    import os

    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    with distributed_optimizer_loads_on_cpu():  # its load with torch's Adam (tests/megatron_core_on_cpu.py)
        if how == "torch":
            saved = torch.load(os.path.join(directory, f"rank_{dist.get_rank()}.pt"), weights_only=False)
            run.model.load_state_dict(saved["model"])
            run.optimizer.load_state_dict(saved["optimizer"])
            with torch.no_grad():  # it copies fp32 main shards into views of the parameters, as its load does
                run.optimizer.load_parameter_state(os.path.join(directory, "distrib_optim.pt"))
        else:
            state = dist_checkpointing.load(_sharded(run, how, is_loading=True), directory)
            run.model.load_state_dict(state["model"])
            run.optimizer.load_state_dict(state["optimizer"])


def _checkpoint_body(rank: int, world_size: int, saver: str, loader: str, how: str, directory: str) -> dict:
    """`saver` trains SAVED_STEPS and saves, then continues; `loader` (trained as many steps on other
    data, so that torch's lazy Adam state and per-parameter step exist as in the saver) loads and
    continues on the saver's data."""
    with model_parallel(1, seed=3), megatron_core_ddp_on_cpu():
        saving = Run(saver)
        saving.train(range(SAVED_STEPS))
        _save(saving, how, directory)
        saving.train(range(SAVED_STEPS, SAVED_STEPS + MORE_STEPS))
        expected = saving.params()
        loading = Run(loader)
        loading.train(range(1000, 1000 + SAVED_STEPS))
        differs_before = bool(_differences(expected, loading.params()))
        _load(loading, how, directory)
        loading.train(range(SAVED_STEPS, SAVED_STEPS + MORE_STEPS))
        return {"differs_before": differs_before, "differences": _differences(expected, loading.params())}


@pytest.mark.parametrize("how", [*SHARDED_FORMATS, "torch"])
@pytest.mark.parametrize("saver,loader", [("core", "ours"), ("ours", "core")])
def test_checkpoints_load_into_the_other_and_continue(run_distributed, tmp_path, saver, loader, how) -> None:
    results = run_distributed(_checkpoint_body, world_size=2, args=(saver, loader, how, str(tmp_path)), timeout=600)
    for rank, result in enumerate(results):
        assert result["differs_before"] and result["differences"] == [], (rank, result["differences"][:5])


# ------------------------------------------------------------------------------------------------
# Refusals, in one line each, before anything is built
# ------------------------------------------------------------------------------------------------


def _carrying_ddp_config(use_distributed_optimizer: bool = True, **attributes) -> torch.nn.Module:
    """A module with megatron-core DDP's `ddp_config` (and `attributes`, e.g. its buffers)."""
    model = torch.nn.Linear(4, 4)
    model.ddp_config = types.SimpleNamespace(use_distributed_optimizer=use_distributed_optimizer,
                                             use_megatron_fsdp=False)
    for name, value in attributes.items():
        setattr(model, name, value)
    return model


DDP_LIKE = dict(buffers=[], bucket_size=None)  # passes the chunk check; every refusal below comes first
REFUSALS = [
    ("muon", dict(optimizer="muon", use_distributed_optimizer=True), DDP_LIKE,
     r"optimizer 'muon' steps whole matrices.*reduce-scatters.*--no-use-layer-wise-param-layout"),
    ("muon-layer-wise", dict(optimizer="muon", use_layer_wise_distributed_optimizer=True), DDP_LIKE,
     r"optimizer 'muon' steps whole matrices.*Build DDP with use_distributed_optimizer=False"),
    ("dist_muon", dict(optimizer="dist_muon"), DDP_LIKE, r"optimizer 'muon' steps whole matrices"),
    ("lion", dict(optimizer="lion", use_distributed_optimizer=True), DDP_LIKE,
     r"optimizer 'lion' steps whole parameters.*for adam only"),
    ("sgd", dict(optimizer="sgd", use_distributed_optimizer=True), DDP_LIKE,
     r"optimizer 'sgd' .*refuses SGD.*Build DDP with use_distributed_optimizer=False"),
    ("adam-layer-wise", dict(optimizer="adam", use_layer_wise_distributed_optimizer=True), DDP_LIKE,
     r"layer-wise distributed optimizer steps whole parameters.*Build DDP with use_distributed_optimizer=False.*"
     r"use_layer_wise_distributed_optimizer=False"),
    ("adam-not-distributed", dict(optimizer="adam"), DDP_LIKE,
     r"bucket shard only.*Set OptimizerConfig\.use_distributed_optimizer=True"),
    ("qk-clip", dict(optimizer="adam", use_distributed_optimizer=True, log_max_attention_logit=True), DDP_LIKE,
     r"log_max_attention_logit=True is not supported by megatron-core's DistributedOptimizer"),
    ("not-ddp", dict(optimizer="adam", use_distributed_optimizer=True), {},
     r"model chunk 0 carries ddp_config\.use_distributed_optimizer=True but is not megatron-core's "
     r"DistributedDataParallel"),
]


@pytest.mark.parametrize("fields,attributes,message", [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_what_cannot_step_reduce_scattered_gradients_is_refused(fields, attributes, message) -> None:
    from megatron_eopt import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(lr=0.01, **fields)
    with pytest.warns(DeprecationWarning) if fields["optimizer"] == "dist_muon" else _nothing():
        with pytest.raises(ValueError, match=message) as raised:
            get_megatron_optimizer(config, _carrying_ddp_config(**attributes))
    assert "\n" not in str(raised.value)


def test_chunks_that_disagree_on_reduce_scattering_are_refused() -> None:
    from megatron_eopt import OptimizerConfig, get_megatron_optimizer

    chunks = [_carrying_ddp_config(**DDP_LIKE), _carrying_ddp_config(False, **DDP_LIKE)]
    with pytest.raises(ValueError, match=r"model chunks \[0\] reduce-scatter .* and the others do not"):
        get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=0.01, use_distributed_optimizer=True), chunks)


def _nothing():
    import contextlib

    return contextlib.nullcontext()


# ------------------------------------------------------------------------------------------------
# Megatron-LM's command line, with its own DDP wrapping (get_model's), after install()
# ------------------------------------------------------------------------------------------------


def _megatron_lm_run(argv: str, rank: int, world_size: int, ours: bool, validated_by_ours: bool = True) -> dict:
    """Megatron-LM's arguments, its DDP as `get_model` wraps it, its optimizer factory (ours when
    `ours`, through install(), which validates the arguments too unless not `validated_by_ours`),
    then its step: the class it builds, and the parameters after each step, or the ValueError it raises."""
    import megatron.training.training as megatron_lm_training
    import torch.distributed as dist
    from megatron.training import global_vars

    from megatron_eopt.integrations import megatron_lm
    from tests.unit.library.integrations.test_megatron_lm_args import fixed_batch, model_from_args, parse_megatron_lm

    with megatron_lm.installed() if ours and validated_by_ours else _nothing():
        args = parse_megatron_lm(argv, rank, world_size)
    global_vars.set_args(args)
    try:
        model = model_from_args(args)
        ddp_config = megatron_lm_training.get_megatron_ddp_config(args)
        (ddp,) = megatron_lm_training.wrap_model_chunks_with_ddp(
            [model], model.config, ddp_config,
            use_layer_wise_distributed_optimizer=args.use_layer_wise_distributed_optimizer,
            use_layer_wise_param_layout=args.use_layer_wise_param_layout)
        config, config_overrides = megatron_lm_training.get_megatron_optimizer_config(args)
        with megatron_lm.installed() if ours else _nothing(), cuda_named_types():
            try:
                optimizer = megatron_lm_training.get_megatron_optimizer(config, [ddp], config_overrides=config_overrides)
            except ValueError as error:
                return {"error": str(error)}
        tokens = fixed_batch(args).chunk(world_size)[dist.get_rank()]
        params = []
        for _ in range(3):
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            step_loss(ddp, tokens).backward()
            ddp.finish_grad_sync()
            with megatron_core_steps_on_cpu():
                assert optimizer.step()[0]
            params.append({n: p.detach().clone() for n, p in model.named_parameters()})
        return {"ddp_reduce_scatters": ddp_config.use_distributed_optimizer, "class": type(optimizer).__name__,
                "children": [type(c).__name__ for c in getattr(optimizer, "chained_optimizers", [])], "params": params}
    finally:
        global_vars.set_args(None)


def _megatron_lm_body(rank: int, world_size: int) -> dict:
    from megatron_eopt.training.model.gpt import destroy_model_parallel, initialize_model_parallel
    from tests.unit.library.integrations.test_megatron_lm_args import ADAM, MODEL_FLAGS, MUON, SEED

    runs = {"adam": (f"{MODEL_FLAGS} {ADAM} --use-distributed-optimizer", True),
            "adam-core": (f"{MODEL_FLAGS} {ADAM} --use-distributed-optimizer", False),
            # megatron-core's DistributedOptimizer writes its parameter-state files itself
            "adam-torch-format": (f"{MODEL_FLAGS} {ADAM} --use-distributed-optimizer --ckpt-format torch", True),
            "muon": (f"{MODEL_FLAGS} {MUON} --use-distributed-optimizer", True),
            # our factory alone, after Megatron-LM's own validate_args (its reduce-scattering layout)
            "muon-validated-by-megatron-lm": (f"{MODEL_FLAGS} {MUON} --use-distributed-optimizer", True)}
    results = {}
    for name, (argv, ours) in runs.items():
        initialize_model_parallel(1, seed=SEED)
        try:
            with megatron_core_ddp_on_cpu():
                results[name] = _megatron_lm_run(argv, rank, world_size, ours,
                                                 validated_by_ours=name != "muon-validated-by-megatron-lm")
        finally:
            destroy_model_parallel()
    return results


def test_megatron_lm_command_lines_with_its_ddp(run_distributed) -> None:
    """`--optimizer adam --use-distributed-optimizer`: megatron-core's DistributedOptimizer, equal
    bitwise after each step to Megatron-LM without install(), with `--ckpt-format torch` too. `--optimizer muon
    --use-distributed-optimizer`: megatron-core 0.19.2's Megatron-LM builds DDP to reduce-scatter
    (its shard-aligned layer-wise layout); install()'s validate_args picks its all-reducing layout
    (--no-use-layer-wise-param-layout), ours builds the layer-wise optimizer, and DP replicas stay
    equal. Our factory after Megatron-LM's own validate_args refuses in one line naming that flag."""
    per_rank = run_distributed(_megatron_lm_body, world_size=2, timeout=600)
    for rank, results in enumerate(per_rank):
        adam, core = results["adam"], results["adam-core"]
        assert adam["ddp_reduce_scatters"] and adam["children"] == ["DistributedOptimizer"], adam.get("children")
        assert all(not _differences(c, o) for c, o in zip(core["params"], adam["params"])), rank
        assert _differences(adam["params"][0], adam["params"][-1])  # it trained
        assert results["adam-torch-format"]["children"] == ["DistributedOptimizer"], results["adam-torch-format"]
        message = results["muon-validated-by-megatron-lm"]["error"]
        assert "--no-use-layer-wise-param-layout" in message and "\n" not in message, message
        whole = results["muon"]
        assert not whole["ddp_reduce_scatters"] and whole["class"] == "LayerWiseDistributedOptimizer", whole
    replicas = [results["muon"]["params"][-1] for results in per_rank]
    assert not _differences(*replicas) and _differences(per_rank[0]["muon"]["params"][0], replicas[0])
