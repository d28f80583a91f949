"""Megatron-LM's own training loop (`megatron.training`, shipped in the megatron-core 0.19.x wheel)
on CPU and gloo: its CUDA-only calls replaced at run time, never by editing the installed package,
and only where CUDA is absent.

`install()` enters a torch function mode that puts every tensor asked of a CUDA device on the CPU
and names CPU tensors by their CUDA type, stands in for the `torch.cuda` calls the loop makes, and
rebinds the few megatron-core names listed in REPLACED_CALLS. `uninstall()` undoes all of it, and
`with installed():` does both. With CUDA available `install()` does nothing. Only megatron-core
0.19.x is supported: another version is refused in one line, since the names replaced here are
that release's.

The loop then runs as on GPUs with `--distributed-backend gloo --transformer-impl local
--no-gradient-accumulation-fusion --no-persist-layer-norm` (no Transformer Engine, Apex or fused
CUDA kernels on a CPU).
"""

import contextlib
import functools
import importlib.metadata
import threading
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.overrides import TorchFunctionMode

from megatron_eopt.runtime import megatron_core_torch_adam, megatron_fsdp_cpu
from megatron_eopt.runtime.cpu_stand_ins import NoEvent, NoStream, Passthrough, all_gather_padded, replace_names

SUPPORTED_MEGATRON_CORE = "0.19"  # the release series whose names REPLACED_CALLS replaces

REPLACED_CALLS = {
    "device='cuda' / 'cuda:N' / N, tensor.cuda(), tensor.to('cuda'), pin_memory":
        "the CPU (a torch function mode, _CudaOnCpu): the loop, DDP buffers and optimizers ask for "
        "their tensors on the current CUDA device",
    "tensor.type()": "the CUDA type name of a CPU tensor ('torch.cuda.FloatTensor'): clip_grads and "
                     "megatron-core's Float16 and Distributed optimizers check parameters by that name",
    "torch.cuda.device_count()": "1: with 0, initialize_megatron never sets up the model-parallel "
                                 "groups nor the RNG tracker",
    "torch.cuda.current_device(), set_device()": "device 0, nothing to set",
    "torch.cuda streams, events, synchronize(), empty_cache(), memory counters":
        "do nothing or count 0 (CPU work runs in program order)",
    "torch.cuda RNG (get/set_rng_state, manual_seed) and tensor_parallel.random's "
    "_get_cuda_rng_state/_set_cuda_rng_state": "a CPU generator of their own, which dropout draws from "
        "(the function mode): the RNG tracker's states stay apart from the CPU generator's, both are "
        "checkpointed and restored, and a resumed run draws the same dropout masks",
    "initialize_megatron(allow_no_cuda=False)": "allow_no_cuda=True: it asserts CUDA otherwise",
    "get_device_arch_version() in validate_args": "10: there is no GPU to ask; validate_args asks only for "
        "GPU stream settings (before 10 it demands CUDA_DEVICE_MAX_CONNECTIONS=1 with TP or CP > 1; from "
        "10 on it marks data-parallel groups for high-priority NCCL streams, as it does for FSDP2 anyway)",
    "set_jit_fusion_options()": "skipped: on torch >= 2.2 it only warms up the fused kernels, with "
        "torch.rand on 'cuda', which here would draw from the CPU generator that --use-cpu-initialization "
        "then draws the weights from (and compile them with a C++ compiler, seconds per process)",
    "DistributedOptimizer.load_state_dict and state_dict with torch's Adam": "no_grad load; step given "
        "apart and one step tensor per parameter; step 0 before the first step or load; with "
        "Megatron-FSDP no state kept for empty local shards (megatron_core_torch_adam.py, on a GPU without TE or Apex too)",
    "DistributedOptimizer.sharded_param_state_fsdp_dtensor with torch's Adam and Megatron-FSDP":
        "Adam's moments for the parameters whose local shard is empty too, as TE's FusedAdam has "
        "them, in the state handed to the fsdp_dtensor save and load: every rank hands over the same "
        "tensors, whose collectives otherwise hang (megatron_core_torch_adam.py)",
    "HybridDeviceOptimizer._get_sub_optimizer_param_groups (--optimizer-cpu-offload with megatron-core's "
    "DistributedOptimizer)": "the host stands in for the device: megatron-core offloads only parameters with "
        "`is_cuda`, so on CPU it took none and its step then looked every host-group parameter up in its map of "
        "host copies (KeyError). Here its fraction rule takes the same parameters and each gets a host copy of "
        "its own, so its copies, host step and copy back run as on a GPU (_hybrid_offload_on_the_host)",
    "FileSystemWriterAsync.preload_tensors (torch_dist saves)": "a copy of each tensor: on a GPU it copies "
        "them to the host, a snapshot an async writer writes while training goes on; on CPU `.to('cpu')` "
        "is the tensor itself, whose memory the persistent checkpoint worker shares, so the next steps "
        "changed what it was still writing (a resume from it then differed)",
    "dist.all_gather(unequal sizes) in the layer-wise optimizer": "gloo gathers equal sizes only: "
        "padded to the largest, cut back",
    "DeviceMesh.from_group(group, 'cuda') in torch FSDP2's wrapper": "a CPU mesh: FSDP2 puts its shards "
        "on the mesh's device",
    "Megatron-FSDP's CUDA-only calls in megatron-core's copy of it (--use-megatron-fsdp)": "those of "
        "megatron_fsdp_cpu.REPLACED_CALLS",
    "torch.device('cuda:N') in megatron-core's Megatron-FSDP adapter": "the CPU: the device it hands "
        "Megatron-FSDP, whose own current device is the CPU here (megatron_fsdp_cpu); CUDA's device 0 "
        "there made Megatron-FSDP warn on every rank that the two differ",
}
_lock = threading.Lock()
_undo: list[Callable[[], None]] = []  # set while installed: each undoes one replacement
_mode: Optional[TorchFunctionMode] = None


def check_megatron_core_version(version: Optional[str] = None) -> str:
    """The installed megatron-core version, or ValueError when it is not a supported one."""
    version = version or importlib.metadata.version("megatron-core")
    if version.split("+")[0].split(".")[:2] != SUPPORTED_MEGATRON_CORE.split("."):
        raise ValueError(
            f"megatron_eopt's CPU patch for Megatron-LM's loop supports megatron-core "
            f"{SUPPORTED_MEGATRON_CORE}.x; found {version}. Run on CUDA or install megatron-core "
            f"{SUPPORTED_MEGATRON_CORE}.x."
        )
    return version


# ---------------------------------------------------------------- devices


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)  # a bare index names a GPU


def _cuda_type_name(name: str) -> str:
    return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name


# What draws from the CUDA generator on GPUs while the model trains (Megatron-LM's dropout, in and
# out of the RNG tracker's forks). Weight initialisation with --use-cpu-initialization draws from the
# CPU generator, as on GPUs.
_DROPOUTS = (torch.nn.functional.dropout, torch.dropout, torch.nn.functional.dropout1d,
             torch.nn.functional.dropout2d, torch.nn.functional.dropout3d)


class _CudaOnCpu(TorchFunctionMode):
    """Every CUDA device asked for is the CPU; `tensor.type()` gives the CUDA name; dropout draws
    from the "CUDA" generator, so that, as on GPUs, what draws from the CPU generator (a DataLoader's
    seed when its iterator starts, after a resume too) does not move the dropout masks."""

    def __init__(self, rng: "_CudaGenerator") -> None:
        super().__init__()
        self.rng = rng

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _DROPOUTS:
            with self.rng.drawn_from():
                return func(*args, **kwargs)
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func in (torch.Tensor.cuda, torch.Tensor.pin_memory):
            return args[0]
        if func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda(a) else a for a in args)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return _cuda_type_name(func(*args))
        return func(*args, **kwargs)


# ---------------------------------------------------------------- torch.cuda


class _CudaGenerator:
    """The "CUDA" generator: a CPU generator apart from torch's default one, so that checkpointing
    both (torch_rng_state, cuda_rng_state) and restoring them in turn keeps both."""

    def __init__(self) -> None:
        self.generator = torch.Generator()

    def get_rng_state(self, device: Any = "cuda") -> torch.Tensor:
        return self.generator.get_state()

    def set_rng_state(self, new_state: torch.Tensor, device: Any = "cuda", graph_safe: bool = False) -> None:
        self.generator.set_state(new_state.clone())

    def manual_seed(self, seed: int) -> None:
        self.generator.manual_seed(int(seed))

    @contextlib.contextmanager
    def drawn_from(self) -> Iterator[None]:
        """Inside, torch's CPU generator draws this generator's numbers (a CPU kernel takes no
        other generator); after, each generator is where its own draws left it."""
        cpu_state = torch.get_rng_state()
        torch.set_rng_state(self.generator.get_state())
        try:
            yield
        finally:
            self.generator.set_state(torch.get_rng_state())
            torch.set_rng_state(cpu_state)


def _returning(value: Any) -> Callable[..., Any]:
    """A new function returning `value`: one per name, as torch._dynamo's rule map of torch.cuda's
    functions refuses one function under two names."""
    return lambda *args, **kwargs: value


# The torch.cuda.memory_stats() keys Megatron-LM's --log-memory-to-tensorboard reads: no CUDA memory
# is allocated on CPU (a CPU golden leaves the mem-* metrics out).
CUDA_MEMORY_STATS = ("reserved_bytes.all.current", "allocated_bytes.all.current", "allocated_bytes.all.peak",
                     "allocation.all.current")


def _cuda_stand_ins(rng: _CudaGenerator) -> dict[str, Any]:
    """The `torch.cuda` attributes the loop calls, none needing a GPU."""
    nothing = ("set_device", "set_stream", "synchronize", "empty_cache", "reset_peak_memory_stats")
    zero = ("current_device", "memory_allocated", "max_memory_allocated", "memory_reserved",
            "max_memory_reserved")
    return dict(
        {name: _returning(None) for name in nothing}, **{name: _returning(0) for name in zero},
        device_count=_returning(1), memory_stats=_returning(dict.fromkeys(CUDA_MEMORY_STATS, 0)),
        Stream=NoStream, current_stream=NoStream, default_stream=NoStream, Event=NoEvent,
        stream=lambda stream=None: contextlib.nullcontext(),
        get_rng_state=rng.get_rng_state, set_rng_state=rng.set_rng_state,
        manual_seed=rng.manual_seed, manual_seed_all=rng.manual_seed,
    )


# ---------------------------------------------------------------- megatron-core names


def _replacements(rng: _CudaGenerator) -> list[tuple[Any, str, Any]]:
    """(owner, name, replacement) for every name install() rebinds."""
    import megatron.core.distributed.fsdp.mcore_fsdp_adapter as megatron_fsdp_adapter
    import megatron.core.distributed.torch_fully_sharded_data_parallel as torch_fsdp2
    import megatron.core.optimizer.layer_wise_optimizer as layer_wise
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
    import megatron.core.tensor_parallel.random as tp_random
    import megatron.training.arguments as arguments
    import megatron.training.initialize as initialize
    import megatron.training.training as training
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    replaced = [(torch.cuda, name, value) for name, value in _cuda_stand_ins(rng).items()]
    replaced += [(torch.cuda.random, name, getattr(rng, name)) for name in ("get_rng_state", "set_rng_state")]
    replaced += [
        (tp_random, "_get_cuda_rng_state", lambda device="cuda", clone=False, graph_safe=False: rng.get_rng_state()),
        (tp_random, "_set_cuda_rng_state", rng.set_rng_state),
        (training, "initialize_megatron", functools.partial(initialize.initialize_megatron, allow_no_cuda=True)),
        (training, "set_jit_fusion_options", _returning(None)),
        (arguments, "get_device_arch_version", _returning(10)),
        (layer_wise, "torch", Passthrough(torch, distributed=Passthrough(dist, all_gather=all_gather_padded))),
        (torch_fsdp2, "DeviceMesh", Passthrough(DeviceMesh, from_group=_cpu_mesh_from_group)),
        (megatron_fsdp_adapter, "torch", Passthrough(torch, device=megatron_fsdp_cpu.cpu_device)),
        (HybridDeviceOptimizer, "_get_sub_optimizer_param_groups", _hybrid_offload_on_the_host),
        (FileSystemWriterAsync, "preload_tensors", staticmethod(preload_copies)),
    ]
    replaced += megatron_fsdp_cpu.replacements(megatron_fsdp_cpu.IN_MEGATRON_CORE)
    return replaced + megatron_core_torch_adam.replacements(DistributedOptimizer)


def _hybrid_offload_on_the_host(self: Any, offload_fraction: float) -> tuple:
    """megatron-core's split of a HybridDeviceOptimizer's parameters, with every parameter counted as
    on the device (REPLACED_CALLS). Its rule: in param-group order, a parameter is offloaded while
    the elements offloaded so far are fewer than `offload_fraction` of all; an offloaded one steps on
    a host copy of its own (fp32 when `param_update_in_fp32`), the others on an fp32 copy or in place.
    Returns megatron-core's five values: host groups, device groups, parameter -> host copy, host copy
    -> parameter, parameter -> fp32 copy."""
    params = [p for group in self.param_groups for p in group["params"]]
    threshold, offloaded = sum(p.numel() for p in params) * offload_fraction, 0
    host_groups, device_groups, host_copy_of, param_of_host_copy, fp32_of = [], [], {}, {}, {}
    for group in self.param_groups:
        host_group, device_group = {**group, "params": []}, {**group, "params": []}
        for param in group["params"]:
            to_host, inner = offloaded < threshold, param
            if to_host:
                inner = param.detach().clone()
                offloaded += param.numel()
            if self.param_update_in_fp32 and inner.dtype != torch.float32:
                inner = fp32_of[param] = inner.detach().clone().float()
            if to_host:
                host_copy_of[param], param_of_host_copy[inner] = inner, param
            (host_group if to_host else device_group)["params"].append(inner)
        host_groups += [host_group] if host_group["params"] else []
        device_groups += [device_group] if device_group["params"] else []
    return host_groups, device_groups, host_copy_of, param_of_host_copy, fp32_of


def preload_copies(write_buckets: list, non_blocking: bool = True) -> list:
    """megatron-core's staging of a torch_dist save's tensors to the host, each as a copy
    (REPLACED_CALLS): its buckets, (file name, storage key, (bytes, [(item, tensor)]))."""
    return [(file_name, key, (bytes_data, [(item, tensor.detach().clone()) for item, tensor in tensors]))
            for file_name, key, (bytes_data, tensors) in write_buckets]


def _cpu_mesh_from_group(group: Any, device_type: str, *args: Any, **kwargs: Any) -> DeviceMesh:
    return DeviceMesh.from_group(group, "cpu" if device_type.startswith("cuda") else device_type, *args, **kwargs)


# ---------------------------------------------------------------- install


@contextlib.contextmanager
def replaced(replacements: list[tuple[Any, str, Any]]) -> Iterator[None]:
    """Some of these replacements alone, inside the block (tests use megatron-core's
    DistributedOptimizer on CPU with megatron_core_torch_adam's replacements)."""
    undo = replace_names(replacements)
    try:
        yield
    finally:
        while undo:
            undo.pop()()


def install() -> bool:
    """Replace Megatron-LM's CUDA-only calls (REPLACED_CALLS) when CUDA is absent; idempotent.

    Returns whether the patch is active. Call it before `pretrain()`, on the thread that runs it
    (torch function modes are per thread).
    """
    global _mode
    if torch.cuda.is_available():
        return False
    with _lock:
        if _mode is not None:
            return True
        check_megatron_core_version()
        rng = _CudaGenerator()
        _undo.extend(replace_names(_replacements(rng)))
        _mode = _CudaOnCpu(rng)
        _mode.__enter__()
    return True


def uninstall() -> None:
    """Undo install() (no-op when not installed); call it on the thread that installed."""
    global _mode
    with _lock:
        if _mode is None:
            return
        _mode.__exit__(None, None, None)
        _mode = None
        while _undo:
            _undo.pop()()


def is_installed() -> bool:
    return _mode is not None


@contextlib.contextmanager
def installed() -> Iterator[bool]:
    """`with installed(): pretrain(...)`: the patch inside (when CUDA is absent), undone after."""
    was_installed = is_installed()
    active = install()
    try:
        yield active
    finally:
        if active and not was_installed:
            uninstall()
