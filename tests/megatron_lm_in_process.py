"""Run Megatron-LM's own `pretrain()` (scripts/pretrain_gpt_megatron_lm.py's `main`) inside the
distributed harness's worker processes, on CPU (megatron_eopt/runtime/megatron_lm_cpu.py).

A torchrun launch pays ~20 s of imports per process; the harness's workers have paid them once.
Megatron-LM keeps its run in module globals (args, timers, microbatch calculator, rerun state
machine, model-parallel groups) and sets them once per process; `run_megatron_lm` tears them down
after each run, so one world runs many command lines:

    records = run_distributed(run_megatron_lm, 2, args=(argv,))

Each rank returns a `Run`: one record per iteration, read from what the loop hands its logger
(`training_log`: the iteration, 'lm loss' averaged over micro-batches and data-parallel ranks,
the gradient norm, the learning rate, the largest attention logit), the package whose optimizer the loop stepped, and the exit
status (Megatron-LM ends an `--exit-interval` run with sys.exit). Nothing is read from files our
code wrote.
"""

import contextlib
import copy
import dataclasses
import gc
import os
import sys
from typing import Any, Iterator, Optional

from tests import distributed_harness


@dataclasses.dataclass
class Run:
    records: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    optimizer_package: Optional[str] = None  # 'megatron_eopt' or 'megatron' (megatron-core's own)
    exit_status: int = 0
    # After the loop's last iteration (none when it exited by sys.exit): this rank's parameters by
    # name, and its optimizer's state (ours: state_dict(); megatron-core's: its torch optimizers'
    # state, as _torch_states reads it); DTensors as this rank's shards.
    parameters: Optional[dict[str, Any]] = None
    optimizer_state: Optional[dict[str, Any]] = None
    # Ours: how many parameters each child keeps on the host (optimizer_cpu_offload), by child name.
    host_resident: dict[str, int] = dataclasses.field(default_factory=dict)
    # What the run logged at WARNING or above (Megatron-LM and Megatron-FSDP warn through logging).
    warnings: list[str] = dataclasses.field(default_factory=list)

    def losses(self) -> dict[int, float]:
        return {r["iteration"]: r["lm loss"] for r in self.records}


@contextlib.contextmanager
def _recording(run: Run, keep_state: bool = True) -> Iterator[None]:
    """Records what Megatron-LM's `train` is given and what it hands `training_log`; with
    `keep_state`, the parameters and optimizer state it ends with."""
    import megatron.training.training as training

    from megatron_eopt.placement.megatron_fsdp_model import hold_gradient_hooks_weakly

    original, original_train = training.training_log, training.train
    records = run.records

    def train(forward_step_func, model, optimizer, *args, **kwargs):
        run.optimizer_package = type(optimizer).__module__.split(".")[0]
        run.host_resident = {child.name: len(child.host_state.indices) for child in _children(optimizer)
                             if getattr(child, "host_state", None) is not None}
        for chunk in model:  # a process runs one loop in Megatron-LM; here the next run follows
            hold_gradient_hooks_weakly(chunk)
        try:
            result = original_train(forward_step_func, model, optimizer, *args, **kwargs)
        finally:  # also when it ends with sys.exit (--exit-interval)
            for chunk in model:
                _drop_kept_graphs(chunk)
        if not keep_state:
            return result
        run.parameters = {f"{i}.{name}": _local(p.detach()).clone() for i, chunk in enumerate(model)
                          for name, p in chunk.named_parameters()}
        ours = run.optimizer_package == "megatron_eopt"
        run.optimizer_state = _local(copy.deepcopy(optimizer.state_dict() if ours else _torch_states(optimizer)))
        return result

    def training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, report_memory_flag,
                     skipped_iter, grad_norm, *args, **kwargs):
        loss = loss_dict.get("lm loss")
        records.append({
            "iteration": iteration,
            "lm loss": float(loss) if loss is not None else None,
            "grad norm": None if grad_norm is None else float(grad_norm),
            "learning rate": learning_rate,
            "skipped": int(skipped_iter),
            # training_log(..., params_norm, num_zeros_in_grad, max_attention_logit, ...)
            "max attention logit": args[2] if len(args) > 2 else kwargs.get("max_attention_logit"),
            "loss scale": float(loss_scale),
        })
        return original(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, report_memory_flag,
                        skipped_iter, grad_norm, *args, **kwargs)

    training.training_log, training.train = training_log, train
    try:
        yield
    finally:
        training.training_log, training.train = original, original_train


@contextlib.contextmanager
def _logged_warnings(into: list[str]) -> Iterator[None]:
    """Collects the messages logged at WARNING or above inside the block, as they are also printed."""
    import logging

    class Collecting(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            into.append(record.getMessage())

    handler, root = Collecting(logging.WARNING), logging.getLogger()
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)


def _children(optimizer: Any) -> list[Any]:
    """The children of our chain (the layer-wise optimizer is one)."""
    return list(getattr(optimizer, "chained_optimizers", None) or [])


def _torch_states(optimizer: Any) -> list[list[dict]]:
    """megatron-core's optimizer's state, which its `state_dict()` leaves out with the distributed
    optimizer: each child's torch optimizer's state, per parameter in group order."""
    torch_optimizers = [getattr(child, "optimizer", child) for child in getattr(optimizer, "chained_optimizers",
                                                                                [optimizer])]
    return [[dict(torch_optimizer.state.get(p, {})) for group in torch_optimizer.param_groups for p in group["params"]]
            for torch_optimizer in torch_optimizers]


def _drop_kept_graphs(chunk: Any) -> None:
    """Detach tensors a module (or a helper it keeps) holds from its last forward: MoE's token
    dispatcher keeps the routing probabilities. Their autograd graph reaches the parameters'
    gradient accumulators, whose DDP hooks hold the model: a cycle through C++ that garbage
    collection cannot free, so the model and its process groups would outlive the run in these
    reused workers."""
    import torch

    for module in chunk.modules():
        helpers = [v for v in vars(module).values() if hasattr(v, "__dict__") and not isinstance(v, torch.nn.Module)]
        for holder in (module, *helpers):  # the dispatcher is a plain object the layer keeps
            for name, value in list(vars(holder).items()):
                if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                    setattr(holder, name, value.detach())


def _local(value: Any) -> Any:
    """`value` with each DTensor (FSDP2, Megatron-FSDP) as this rank's shard: what comes back to the
    test process is compared there, without the ranks' groups."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(value, dict):
        return {key: _local(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_local(item) for item in value)
    return value


@contextlib.contextmanager
def _command_line(argv: list[str]) -> Iterator[None]:
    saved = sys.argv
    sys.argv = ["pretrain_gpt_megatron_lm.py", *argv]
    try:
        yield
    finally:
        sys.argv = saved


def _reset_class_state() -> None:
    """State megatron-core keeps on a class, as a new process has it, before each run: the MoE
    aux-loss scale. Another test in this worker may have left a 0-dim one there (our trainer's),
    into which Megatron-LM's initialization then copies its 1-element tensor."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.main_loss_backward_scale = None


def forget_megatron_lm_run() -> None:
    """Megatron-LM's per-process state, reset as for a new process (torch.distributed stays)."""
    from megatron.core import num_microbatches_calculator, rerun_state_machine, tensor_parallel
    from megatron.core.transformer.moe import moe_logging
    from megatron.training import global_vars

    from megatron_eopt.integrations import megatron_lm
    from megatron_eopt.runtime import megatron_lm_cpu
    from megatron_eopt.training.model.model_parallel import destroy_model_parallel

    megatron_lm.uninstall()
    writer = global_vars.get_tensorboard_writer()
    if writer is not None:  # a process's exit flushes it; here the next run follows in this process
        writer.close()
    global_vars.destroy_global_vars()
    num_microbatches_calculator.destroy_num_microbatches_calculator()
    rerun_state_machine.destroy_rerun_state_machine()
    moe_logging.destroy_moe_metrics_tracker()  # its entries keep the groups they reduce over
    tensor_parallel.get_cuda_rng_tracker().reset()
    gc.collect()  # the model and optimizer sit in cycles with the groups they were built on
    destroy_model_parallel()
    # DTensor's sharding caches compare meshes without their groups: the next run's FSDP2 outputs
    # would carry this run's mesh, whose groups are gone ("Could not resolve the process group").
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    _clear_sharding_prop_cache()
    megatron_lm_cpu.uninstall()


def read_field_docstrings_once() -> None:
    """Megatron-LM builds its parser's help texts from the sources of its config dataclasses
    (`ArgumentGroupFactory._get_field_docstrings`: inspect.getsource and ast.parse of each class) at
    every parse, about 0.3 s a parse, and a run parses two or three times. A class's texts depend on
    its source only, so this process reads each class's once. Help texts only: a parse's result is
    the same."""
    from megatron.training import argument_utils

    factory = argument_utils.ArgumentGroupFactory
    if getattr(factory._get_field_docstrings, "read_once", False):
        return
    read, texts = factory._get_field_docstrings, {}

    def field_docstrings(self, src_cfg_class: type) -> dict[str, str]:
        if src_cfg_class not in texts:
            texts[src_cfg_class] = read(self, src_cfg_class)
        return dict(texts[src_cfg_class])

    field_docstrings.read_once = True
    factory._get_field_docstrings = field_docstrings


def _with_index_cache(argv: list[str]) -> list[str]:
    """`--mock-data` runs read their sample indices from a cache this session's workers share:
    megatron-core otherwise builds them at every run (a shuffle of its 100,000 mock documents'
    samples, about 0.75 s a run for the three splits). Indices are a function of what the cache's
    file names hash (megatron-core's `unique_description`), so a cached run equals a built one."""
    folder = distributed_harness.shared_dir()
    if "--mock-data" not in argv or "--data-cache-path" in argv or folder is None:
        return argv
    return [*argv, "--data-cache-path", os.path.join(folder, "mock-data-indices")]


def run_megatron_lm(rank: int, world_size: int, argv: list[str]) -> Run:
    """`pretrain_gpt_megatron_lm.py argv` in this worker: what its loop computed."""
    from megatron_eopt.integrations import megatron_lm_gpt

    argv = _with_index_cache(argv)
    run = Run()
    read_field_docstrings_once()
    _reset_class_state()
    try:
        with _command_line(argv), _recording(run), _logged_warnings(run.warnings):
            megatron_lm_gpt.main()
    except SystemExit as exit_:  # --exit-interval: Megatron-LM's loop saves, then exits with 0
        if exit_.code not in (0, None):
            raise RuntimeError(f"pretrain_gpt_megatron_lm.py {' '.join(argv)} exited with {exit_.code}") from exit_
        run.exit_status = 0
    finally:
        forget_megatron_lm_run()
    return run


def run_megatron_lm_many(rank: int, world_size: int, argvs: list[list[str]]) -> list[Run]:
    """Several runs in one call (one round trip to the workers): the records of each."""
    return [run_megatron_lm(rank, world_size, argv) for argv in argvs]


def run_megatron_lm_refused(rank: int, world_size: int, argvs: list[list[str]]) -> list[tuple[int, str, str]]:
    """Command lines the loop refuses: each one's exit status and this rank's stderr and stdout."""
    return [(ended.status, ended.stderr, ended.stdout) for ended in run_megatron_lm_ended(rank, world_size, argvs)]


@dataclasses.dataclass
class Ended:
    """How a command line ended on this rank: its exit status, stderr and stdout, and the iterations
    Megatron-LM's loop ran before (those it handed its logger), for refusals that must come first."""
    status: int
    stderr: str
    stdout: str
    iterations: list[int]


def run_megatron_lm_ended(rank: int, world_size: int, argvs: list[list[str]]) -> list[Ended]:
    """Each command line to its end, refused or not. The other ranks' wait for rank 0's line
    (rank_exit.OTHER_RANKS_WAIT_S) is for torchrun; here there is none."""
    import io

    from megatron_eopt.integrations import megatron_lm_gpt
    from megatron_eopt.runtime import rank_exit

    read_field_docstrings_once()
    results, before = [], rank_exit.OTHER_RANKS_WAIT_S
    rank_exit.OTHER_RANKS_WAIT_S = 0.0
    try:
        for argv in argvs:
            stderr, stdout, run = io.StringIO(), io.StringIO(), Run()
            _reset_class_state()
            try:
                with (_command_line(_with_index_cache(argv)), _recording(run, keep_state=False), contextlib.redirect_stderr(stderr),
                      contextlib.redirect_stdout(stdout)):
                    megatron_lm_gpt.main()
                status = 0
            except SystemExit as exit_:
                status = exit_.code
            finally:
                forget_megatron_lm_run()
            results.append(Ended(status, stderr.getvalue(), stdout.getvalue(), [r["iteration"] for r in run.records]))
    finally:
        rank_exit.OTHER_RANKS_WAIT_S = before
    return results
