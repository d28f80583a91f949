"""megatron_eopt.runtime.megatron_lm_cpu: Megatron-LM's CUDA-only calls replaced while installed, and
only without CUDA, for megatron-core 0.19.x only. Megatron-LM's loop on CPU with it (against
megatron-core's optimizer, exact resume) is tests/functional/test_megatron_lm_loop.py.
"""

import pytest
import torch

from megatron_eopt.runtime import megatron_core_torch_adam, megatron_lm_cpu


@pytest.mark.parametrize("version", ["0.18.2", "0.20.0", "1.19.0", "0.1.9"])
def test_other_megatron_core_versions_are_refused_in_one_line(version: str) -> None:
    with pytest.raises(ValueError) as refused:
        megatron_lm_cpu.check_megatron_core_version(version)
    message = str(refused.value)
    assert "\n" not in message and version in message and "0.19.x" in message, message


@pytest.mark.parametrize("version", ["0.19.0", "0.19.2", "0.19.2+551afdd", "0.19.3rc1"])
def test_megatron_core_0_19_is_accepted(version: str) -> None:
    assert megatron_lm_cpu.check_megatron_core_version(version) == version


def test_inactive_when_cuda_is_available(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    device_count = torch.cuda.device_count
    assert megatron_lm_cpu.install() is False and not megatron_lm_cpu.is_installed()
    assert torch.cuda.device_count is device_count
    assert torch.zeros(1, device="cpu").type() == "torch.FloatTensor"


def test_cuda_is_the_cpu_while_installed_and_restored_after() -> None:
    import megatron.core.tensor_parallel.random as tp_random
    import megatron.training.training as training

    before = (torch.cuda.device_count, torch.cuda.get_rng_state, tp_random._set_cuda_rng_state,
              training.initialize_megatron)
    torch.manual_seed(0)
    with megatron_lm_cpu.installed() as active:
        assert active and megatron_lm_cpu.install() is True  # idempotent
        assert torch.cuda.device_count() == 1 and torch.cuda.current_device() == 0
        for tensor in (torch.zeros(2, device="cuda"), torch.ones(2, device=0), torch.ones(2).cuda(),
                       torch.ones(2).to("cuda:0"), torch.empty(2, pin_memory=True).pin_memory()):
            assert tensor.device == torch.device("cpu")
        assert torch.zeros(1).type() == "torch.cuda.FloatTensor"  # names as megatron-core checks them
        assert torch.zeros(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
        with torch.cuda.stream(torch.cuda.Stream()):
            torch.cuda.current_stream().wait_event(torch.cuda.Event())
        # The "CUDA" generator is a CPU generator apart from torch's default one.
        cpu_state = torch.get_rng_state()
        torch.cuda.manual_seed(1234)
        cuda_state = torch.cuda.get_rng_state()
        tp_random._set_cuda_rng_state(cuda_state)
        assert torch.equal(torch.get_rng_state(), cpu_state) and not torch.equal(cuda_state, cpu_state)
        # Dropout draws from it, as on GPUs: the CPU generator stays where it was.
        masks = [torch.nn.functional.dropout(torch.ones(64), 0.5) for _ in range(2)]
        assert torch.equal(torch.get_rng_state(), cpu_state) and not torch.equal(*masks)
        torch.cuda.set_rng_state(cuda_state)
        assert torch.equal(torch.nn.functional.dropout(torch.ones(64), 0.5), masks[0])
        assert training.initialize_megatron.keywords == {"allow_no_cuda": True}
    assert not megatron_lm_cpu.is_installed()
    assert (torch.cuda.device_count, torch.cuda.get_rng_state, tp_random._set_cuda_rng_state,
            training.initialize_megatron) == before
    assert torch.zeros(1).type() == "torch.FloatTensor"


def _fsdp_optimizer(rank: int, mesh):
    """megatron-core's DistributedOptimizer as Megatron-FSDP hands it torch's Adam on CPU: two
    parameters sharded by rows, `held_by_one` wholly on rank 1 (rank 0's shard is empty, and its
    gradient None, as Megatron-FSDP's `update_main_grads` gives it), `split` 4 rows on each rank."""
    from types import SimpleNamespace

    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from torch.distributed.tensor import DTensor, Shard

    def sharded(local: torch.Tensor) -> torch.nn.Parameter:
        return torch.nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                                     shape=(8, 4), stride=(4, 1)))

    generator = torch.Generator().manual_seed(rank)
    params = {"held_by_one": sharded(torch.randn(8 * rank, 4, generator=generator)),
              "split": sharded(torch.randn(4, 4, generator=generator))}
    optimizer = DistributedOptimizer.__new__(DistributedOptimizer)
    optimizer.optimizer = torch.optim.AdamW(list(params.values()), lr=1e-2)
    optimizer.ddp_config = SimpleNamespace(use_megatron_fsdp=True)
    optimizer.param_to_name = {param: name for name, param in params.items()}
    return optimizer, params


def _fsdp_dtensor_state_of_each_rank(rank: int, world_size: int, directory: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        preprocess_state_dict_for_uneven_dtensor,
    )
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from torch.distributed.device_mesh import init_device_mesh

    assert not megatron_lm_cpu.is_installed(), "this worker has the patch installed: no run without the fix"
    mesh = init_device_mesh("cpu", (world_size,))
    optimizer, params = _fsdp_optimizer(rank, mesh)
    for _ in range(2):
        for param in params.values():
            param.grad = torch.ones_like(param) if param.to_local().numel() else None
        optimizer.optimizer.step()
    without_fix = sorted(DistributedOptimizer.sharded_param_state_fsdp_dtensor(optimizer)["state"])
    fix = megatron_core_torch_adam.replacements(DistributedOptimizer)
    with megatron_lm_cpu.replaced(fix):
        saved = optimizer.sharded_param_state_fsdp_dtensor()
        handed_over = {name: state["exp_avg"].to_local().shape for name, state in saved["state"].items()}
        keys = {name: sorted(state) for name, state in saved["state"].items()}
        every_rank = [None] * world_size
        torch.distributed.all_gather_object(every_rank, sorted(keys))
        if any(names != sorted(keys) for names in every_rank):  # the save's collectives would hang
            raise AssertionError(f"the ranks hand the save different parameters: {every_rank}")
        # Megatron-LM's fsdp_dtensor save and load: collectives for each DTensor, then torch's DCP.
        dcp.save(preprocess_state_dict_for_uneven_dtensor({"optimizer": saved}), checkpoint_id=directory)
        resumed, _ = _fsdp_optimizer(rank, mesh)
        loading = resumed.sharded_param_state_fsdp_dtensor(is_loading=True)
        dcp.load(preprocess_state_dict_for_uneven_dtensor({"optimizer": loading}), checkpoint_id=directory)
        resumed.load_state_dict(loading)
    return {"without fix": without_fix, "keys": keys, "handed over": handed_over,
            "saved": _local_states(optimizer), "resumed": _local_states(resumed)}


def _local_states(optimizer) -> dict:
    return {optimizer.param_to_name[param]: {key: value.to_local() if hasattr(value, "to_local") else value
                                             for key, value in optimizer.optimizer.state[param].items()}
            for param in optimizer.optimizer.param_groups[0]["params"] if param in optimizer.optimizer.state}


def test_a_torch_dist_save_stages_copies_as_on_a_gpu() -> None:
    """megatron-core's staging of a save's tensors (FileSystemWriterAsync.preload_tensors) copies
    them while installed: an async writer writes the snapshot, not the tensor the next steps change."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    weight = torch.arange(4.0)
    with megatron_lm_cpu.installed():
        [(name, key, (data, [(item, staged)]))] = FileSystemWriterAsync.preload_tensors(
            [("f.distcp", "key", (["b"], [("item", weight)]))], True)
    weight.add_(1)  # the next step, in place
    assert (name, key, data, item) == ("f.distcp", "key", ["b"], "item")
    assert torch.equal(staged, torch.arange(4.0))


def test_fsdp_dtensor_state_has_every_parameter_on_every_rank(run_distributed, tmp_path) -> None:
    """megatron-core's DistributedOptimizer with Megatron-FSDP and torch's Adam: a parameter whose
    shard is empty on a rank had no state there, and the fsdp_dtensor save's per-DTensor
    collectives hung on 2 ranks. With the fix every rank hands over the same parameters, the save
    and load complete, and the resumed state is the saved one, the step of the rank that stepped;
    the empty shard's state is in the checkpoint only, not in torch's Adam, before or after."""
    ranks = run_distributed(_fsdp_dtensor_state_of_each_rank, 2, args=(str(tmp_path),), timeout=120)
    assert [rank["without fix"] for rank in ranks] == [["split"], ["held_by_one", "split"]]  # the defect
    for rank, result in enumerate(ranks):
        assert result["keys"] == {"held_by_one": ["exp_avg", "exp_avg_sq"] + (["step"] if rank else []),
                                  "split": ["exp_avg", "exp_avg_sq", "step"]}, rank
        saved, resumed = result["saved"], result["resumed"]
        assert result["handed over"] == {"held_by_one": (8, 4) if rank else (0, 4), "split": (4, 4)}, rank
        holding = ("split", "held_by_one") if rank else ("split",)
        assert saved.keys() == resumed.keys() == set(holding), rank  # torch's Adam's own state, as it was
        for name in holding:
            assert resumed[name].keys() == {"exp_avg", "exp_avg_sq", "step"}, (rank, name)
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(resumed[name][key], saved[name][key]), (rank, name, key)
            assert resumed[name]["step"].item() == 2.0, (rank, name)
    # An independent reference: torch's AdamW, on rank 1's rows of `held_by_one` alone, twice.
    generator = torch.Generator().manual_seed(1)
    rows = torch.nn.Parameter(torch.randn(8, 4, generator=generator))
    reference = torch.optim.AdamW([rows], lr=1e-2)
    for _ in range(2):
        rows.grad = torch.ones_like(rows)
        reference.step()
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(ranks[1]["resumed"]["held_by_one"][key], reference.state[rows][key]), key


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA install() would patch this test process")
def test_the_torch_adam_fixes_install_on_their_own_only_with_cuda() -> None:
    """Without CUDA megatron_lm_cpu applies them; megatron_core_torch_adam.install() leaves the class alone."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    before = DistributedOptimizer.state_dict
    assert megatron_core_torch_adam.install() is False
    assert DistributedOptimizer.state_dict is before
