"""The GPU tier: runs only where CUDA is available, and says why it skips elsewhere.

bf16 on CUDA against an fp32 CPU torch.optim.AdamW reference (the GPU AdamW kernel rounds
differently from the CPU loop, so 1e-6 relative on the fp32 main parameters); our dynamic
loss scaler against megatron-core's (which is CUDA-only); a single-GPU NCCL run of a
megatron-core GPTModel built from its CUDA layer spec; megatron-core's dist_checkpointing save/load of our
sharded_state_dict (its torch_dist strategy calls CUDA).
"""

import pathlib
import subprocess
import sys

import pytest
import torch

from megatron_eopt import DynamicGradScaler, OptimizerConfig, get_megatron_optimizer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; torch.cuda.is_available() is False"),
]
ROOT = pathlib.Path(__file__).resolve().parents[3]


def test_bf16_on_cuda_matches_fp32_cpu_reference() -> None:
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8))
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(p.to(torch.bfloat16).float())  # start from bf16-representable values
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8)).cuda().to(torch.bfloat16)
    model.load_state_dict({k: v.to(torch.bfloat16) for k, v in reference.state_dict().items()})
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-2, bf16=True, clip_grad=0.0), model, config_overrides={})
    torch_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=generator).to(torch.bfloat16) for p in reference.parameters()]
        for p, r, g in zip(model.parameters(), reference.parameters(), grads):
            p.grad, r.grad = g.cuda(), g.float()
        assert optimizer.step()[0]
        torch_optimizer.step()
    for main, ref in zip(optimizer.chained_optimizers[0].main_params, reference.parameters()):
        torch.testing.assert_close(main.detach().cpu(), ref.detach(), rtol=1e-6, atol=1e-7)


def test_dynamic_scaler_matches_megatron_core() -> None:
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler as CoreScaler

    ours = DynamicGradScaler(initial_scale=2.0**12, min_scale=1.0, growth_interval=3, hysteresis=2)
    core = CoreScaler(initial_scale=2.0**12, min_scale=1.0, growth_factor=2.0, backoff_factor=0.5,
                      growth_interval=3, hysteresis=2)
    for found_inf in [True, False, False, False, True, True, True, False, False, False]:
        ours.update(found_inf)
        core.update(found_inf)
        assert ours.scale.item() == core.scale.item()


NCCL_SCRIPT = """
import os, torch, torch.distributed as dist
from megatron_eopt import OptimizerConfig, get_megatron_optimizer
from megatron_eopt.training.model.gpt import GPTModelSettings, build_gpt_model, gpt_loss, initialize_model_parallel
torch.cuda.set_device(0)
dist.init_process_group("nccl", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
initialize_model_parallel(tensor_model_parallel_size=1, seed=0)
settings = GPTModelSettings(bf16=True, position_embedding_type="rope")
model = build_gpt_model(settings, device="cuda")
optimizer = get_megatron_optimizer(OptimizerConfig(lr=3e-3, bf16=True), [model])
tokens = torch.randint(0, settings.vocab_size, (8, settings.seq_length + 1), device="cuda")
losses = []
for _ in range(10):
    optimizer.zero_grad()
    loss = gpt_loss(model, tokens)
    loss.backward()
    assert optimizer.step()[0]
    losses.append(loss.item())
assert losses[-1] < losses[0], losses
print("NCCL-OK", losses[0], losses[-1])
"""


def _run_single_gpu_script(script: str, success_marker: str) -> None:
    """Run `script` (formatted with a free `port`) in a fresh process; it must print the marker."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = subprocess.run([sys.executable, "-c", script.format(port=port)], cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert success_marker in result.stdout


def test_single_gpu_nccl_gpt_run() -> None:
    _run_single_gpu_script(NCCL_SCRIPT, "NCCL-OK")


DIST_CHECKPOINTING_SCRIPT = """
import tempfile, torch, torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron_eopt import OptimizerConfig, get_megatron_optimizer
from megatron_eopt.training.model.gpt import GPTModelSettings, build_gpt_model, gpt_loss, initialize_model_parallel
torch.cuda.set_device(0)
dist.init_process_group("nccl", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
initialize_model_parallel(tensor_model_parallel_size=1, seed=0)
settings = GPTModelSettings(bf16=True, swiglu=True)
config = OptimizerConfig(optimizer="muon", lr=3e-3, bf16=True)
def build():
    model = build_gpt_model(settings, device="cuda")
    return model, get_megatron_optimizer(config, [model])
model, optimizer = build()
tokens = torch.randint(0, settings.vocab_size, (8, settings.seq_length + 1), device="cuda")
for _ in range(3):
    optimizer.zero_grad()
    gpt_loss(model, tokens).backward()
    assert optimizer.step()[0]
directory = tempfile.mkdtemp()
model_sd = model.sharded_state_dict()
dist_checkpointing.save({{"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd)}}, directory)
expected = optimizer.state_dict()
fresh_model, fresh = build()
model_sd = fresh_model.sharded_state_dict()
loaded = dist_checkpointing.load({{"model": model_sd, "optimizer": fresh.sharded_state_dict(model_sd, is_loading=True)}}, directory)
fresh_model.load_state_dict(loaded["model"], strict=False)
fresh.load_state_dict(loaded["optimizer"])
actual = fresh.state_dict()
for name, child in expected["optimizers"].items():
    for fqn, entries in child["state"].items():
        for key, value in entries.items():
            other = actual["optimizers"][name]["state"][fqn][key]
            assert torch.equal(value.cpu(), other.cpu()), (name, fqn, key)
    for fqn, main in child.get("main_params", {{}}).items():
        assert torch.equal(main.cpu(), actual["optimizers"][name]["main_params"][fqn].cpu()), fqn
print("DIST-CHECKPOINTING-OK")
"""


def test_megatron_dist_checkpointing_round_trip() -> None:
    """megatron-core's dist_checkpointing (needs CUDA) saves and loads our sharded_state_dict."""
    _run_single_gpu_script(DIST_CHECKPOINTING_SCRIPT, "DIST-CHECKPOINTING-OK")


BF16_BOTH_WAYS_SCRIPT = """
import os
os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # cuBLAS's deterministic mode needs it before CUDA starts
import tempfile, torch, torch.distributed as dist
torch.use_deterministic_algorithms(True)  # the embedding's backward on CUDA adds with atomics, in any order
import megatron_eopt.ops.newton_schulz as newton_schulz
def each_alone(matrices, scales, settings):  # megatron-core's rounding: cuBLAS rounds a batch otherwise
    return [settings.orthogonalize(matrix).mul_(scale) for matrix, scale in zip(matrices, scales)]
newton_schulz.orthogonalize_batched = each_alone
from megatron.core import dist_checkpointing
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig as CoreConfig
from megatron.core.optimizer import get_megatron_optimizer as core_get_megatron_optimizer
from megatron_eopt import OptimizerConfig, get_megatron_optimizer
from megatron_eopt.training.model.gpt import GPTModelSettings, build_gpt_model, gpt_loss, initialize_model_parallel
torch.cuda.set_device(0)
dist.init_process_group("nccl", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
initialize_model_parallel(tensor_model_parallel_size=1, seed=0)
settings = GPTModelSettings(bf16=True, position_embedding_type="none", swiglu=False)
FIELDS = dict(adam=dict(optimizer="adam"), muon=dict(optimizer="muon", muon_fp32_matmul_prec="highest",
                                                      muon_tp_mode="duplicated"))
def build(library, name, seed):
    torch.manual_seed(seed)
    model = build_gpt_model(settings, device="cuda")
    fields = dict(FIELDS[name], lr=1e-2, min_lr=0.0, weight_decay=0.05, clip_grad=0.0, bf16=True)
    if library == "ours":
        return model, get_megatron_optimizer(OptimizerConfig(**fields), [model])
    model.ddp_config = DistributedDataParallelConfig()
    return model, core_get_megatron_optimizer(CoreConfig(**fields), [model])
def train(model, optimizer, steps):
    for step in steps:
        optimizer.zero_grad()
        tokens = torch.randint(0, settings.vocab_size, (4, settings.seq_length + 1),
                               generator=torch.Generator().manual_seed(step)).cuda()
        gpt_loss(model, tokens).backward()
        assert optimizer.step()[0]
for name in ("adam", "muon"):
    for saver, loader in (("core", "ours"), ("ours", "core")):
        directory = tempfile.mkdtemp()
        model, optimizer = build(saver, name, seed=1)
        train(model, optimizer, range(2))
        model_sd = model.sharded_state_dict()
        metadata = {{"chained_optim_avoid_prefix": True}}
        dist_checkpointing.save({{"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, metadata=metadata)}},
                                directory)
        train(model, optimizer, range(2, 4))
        fresh_model, fresh = build(loader, name, seed=2)
        model_sd = fresh_model.sharded_state_dict()
        loaded = dist_checkpointing.load({{"model": model_sd, "optimizer": fresh.sharded_state_dict(
            model_sd, is_loading=True, metadata={{"chained_optim_avoid_prefix": True}})}}, directory)
        fresh_model.load_state_dict(loaded["model"], strict=False)
        fresh.load_state_dict(loaded["optimizer"])
        train(fresh_model, fresh, range(2, 4))
        expected = dict(model.named_parameters())
        for key, param in fresh_model.named_parameters():  # within 2 bf16 ulps (module docstring of the test)
            torch.testing.assert_close(param.float(), expected[key].float(), rtol=2.0 ** -6, atol=0.0,
                                       msg=lambda m: f"{{name}} {{saver}} -> {{loader}} {{key}}: {{m}}")
print("BF16-BOTH-WAYS-OK")
"""


def test_bf16_checkpoints_move_both_ways_with_megatron_core() -> None:
    """megatron-core's Float16OptimizerWithFloat16Params (CUDA-only) saves with fp32_param keys, ours
    loads and continues as it continues; and the mirror (tests/unit/library/megatron_core_formats/
    test_megatron_core_checkpoints.py does fp32 and bf16 on CPU, bitwise). Within 2 bf16 ulps of the
    parameters, not bitwise: on a GPU megatron-core may step with Transformer Engine's fused Adam.

    Ours orthogonalizes each matrix alone here, as megatron-core does: cuBLAS rounds our batched
    Newton-Schulz (one call per shape) otherwise, and the Adam-stepped embedding amplifies that
    (measured on an H200: 92 of 8,192 elements up to 0.0116 apart when batched; docs/gpu.md)."""
    _run_single_gpu_script(BF16_BOTH_WAYS_SCRIPT, "BF16-BOTH-WAYS-OK")


@pytest.mark.parametrize("optimizer_name", ["adam", "muon"])
def test_step_synchronizes_with_the_host_at_most_twice(optimizer_name: str) -> None:
    """torch's sync debug mode flags every synchronizing CUDA call (read-backs, blocking copies);
    the step's statistics are read back once (tests/unit/library/test_host_syncs.py counts on CPU)."""
    import warnings

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 256)).cuda().to(torch.bfloat16)
    config = OptimizerConfig(optimizer=optimizer_name, lr=1e-3, bf16=True, clip_grad=1.0, log_num_zeros_in_grad=True)
    optimizer = get_megatron_optimizer(config, model, config_overrides={})
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()  # creates the state
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            ok = optimizer.step()[0]
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert ok
    assert len(syncs) <= 2, syncs


MEGATRON_DDP_SCRIPT = """
import contextlib, torch, torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed import finalize_model_grads as megatron_finalize_model_grads
from megatron_eopt import OptimizerConfig, get_megatron_optimizer
from megatron_eopt.training.model.gpt import GPTModelSettings, build_gpt_model, gpt_loss, initialize_model_parallel
from megatron_eopt.training.parallel.grad_reduction import GradReducer, finalize_model_grads
torch.cuda.set_device(0)
dist.init_process_group("nccl", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
initialize_model_parallel(tensor_model_parallel_size=1, seed=0)
settings = GPTModelSettings(bf16=True, swiglu=True)
config = OptimizerConfig(optimizer="muon", lr=3e-3, bf16=True, muon_fp32_matmul_prec="highest")
ours, theirs = build_gpt_model(settings, device="cuda"), build_gpt_model(settings, device="cuda")
for (name, a), b in zip(ours.state_dict().items(), theirs.state_dict().values()):
    if torch.is_tensor(a):
        assert torch.equal(a, b), name
ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=True,
                                           use_distributed_optimizer=False, bucket_size=2000)
ddp = DistributedDataParallel(config=theirs.config, ddp_config=ddp_config, module=theirs)
reducer = GradReducer(ours, dist.group.WORLD, accumulate_in_fp32=True, bucket_numel=2000, overlap=True)
our_optimizer, their_optimizer = get_megatron_optimizer(config, [ours]), get_megatron_optimizer(config, [ddp])
generator = torch.Generator().manual_seed(1)
for step in range(3):
    micro_batches = [torch.randint(0, settings.vocab_size, (2, settings.seq_length + 1), generator=generator).cuda()
                     for _ in range(3)]
    our_optimizer.zero_grad()
    reducer.zero_grads(len(micro_batches))
    for tokens in micro_batches:
        (gpt_loss(ours, tokens) / len(micro_batches)).backward()
    finalize_model_grads([ours], reducer)
    their_optimizer.zero_grad()
    ddp.zero_grad_buffer()
    for index, tokens in enumerate(micro_batches):
        last = index == len(micro_batches) - 1
        with contextlib.nullcontext() if last else ddp.no_sync():
            (gpt_loss(ddp, tokens) / len(micro_batches)).backward()
    megatron_finalize_model_grads([ddp])
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.equal(a.main_grad, b.main_grad), (step, name)
    assert our_optimizer.step()[0] and their_optimizer.step()[0]
for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
    assert torch.equal(a, b), name
print("MEGATRON-DDP-OK")
"""


def test_megatron_ddp_and_finalize_give_our_reducers_gradients() -> None:
    """megatron-core's DistributedDataParallel (fp32 grad buffers, overlap_grad_reduce, no_sync
    for all but the last micro-batch) and its finalize_model_grads against the trainer's
    GradReducer and finalize_model_grads, on one GPU: the same fp32 main_grads, bit for bit, in
    every step, and the same parameters after three steps of our Muon on each."""
    _run_single_gpu_script(MEGATRON_DDP_SCRIPT, "MEGATRON-DDP-OK")
