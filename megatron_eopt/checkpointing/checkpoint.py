"""save_checkpoint / load_checkpoint: model, optimizer and scheduler in one sharded checkpoint.

Built on torch.distributed.checkpoint: each rank writes the pieces it holds (its TP shard, its
FSDP2 rows, the state of the parameters it owns), nothing is gathered. Tensors are stored in
their global shape under their names in the PP=1/EP=1 model (global_names.py), so a checkpoint
loads at another TP, DP, pipeline or expert-parallel size, with or without the layer-wise
optimizer, in bf16 or fp32. Every rank loads the whole part of the model it holds.

Directories are committed atomically, by one run at a time (storage.py); the lr schedule is
checked before anything changes (schedule.py); RNG states are kept per rank (rng.py). Call both
functions on every rank of the job. Collectives run over the job's own ranks (`tp_dp_cp`, or
`job` with pipelines; an FSDP2 model's mesh group), so jobs sharing one WORLD checkpoint
independently. docs/checkpoints.md describes the behaviour.
"""

import json
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from megatron_eopt.checkpointing import storage
from megatron_eopt.checkpointing.global_names import stored_child_name
from megatron_eopt.checkpointing.layout import MeshCache, local_tensor
from megatron_eopt.checkpointable.optimizer_change import (allows_optimizer_change, optimizer_changes,
                                                          settle_optimizer_changes)
from megatron_eopt.checkpointing.rng import restore_rng, rng_entries, rng_keys_to_load
from megatron_eopt.checkpointing.schedule import LR_BOUNDS_KEY, SCHEDULER_KEY, plan_scheduler_load, scheduler_entries
from megatron_eopt.checkpointing.state import (
    CheckpointIndex,
    LoadPlan,
    check_structure,
    checkpoint_group,
    global_group_structure,
    has_main_copy,
    loaded_optimizer_state,
    pipeline_size,
    model_params,
    optimizer_children,
    optimizer_of_each_parameter,
    plan_model,
    plan_optimizer_state,
    save_entries,
    stored_model_names,
    stored_names_by_fqn,
)
from megatron_eopt.checkpointing.storage import CheckpointError, CheckpointSaveError  # noqa: F401 (re-exported)
from megatron_eopt.placement.fully_sharded_layout import fully_sharded_layout
from megatron_eopt.placement.megatron_fsdp_model import refresh_compute_weights
from megatron_eopt.runtime.process_groups import ProcessGroup, group_rank, group_size, resolve_parallel_groups
from megatron_eopt.ops.collectives import group_timeout


@dataclass(frozen=True)
class LoadedCheckpoint:
    path: str
    iteration: int
    extra: dict  # what the trainer passed to save_checkpoint (consumed samples, ...)
    # What the caller should tell the user: a fallback for a missing `latest`, RNG not restored.
    messages: tuple[str, ...] = field(default=())


def save_checkpoint(
    checkpoint_dir: str,
    iteration: int,
    model_chunks: list[torch.nn.Module],
    optimizer: Any = None,
    scheduler: Any = None,
    extra: Optional[dict] = None,
    pg_collection: Any = None,
    before_commit: Optional[Callable[[str], None]] = None,
    save_rng: bool = True,
) -> str:
    """Write `checkpoint_dir/iter_<iteration>` and point `latest` at it; returns its path.

    `extra`: JSON-serialisable trainer state. `before_commit(path)` runs on every rank when all
    files are written, just before the directory is renamed into place (tests pause there).
    Without `optimizer` (and `scheduler`) only the model is saved (Megatron-LM's --no-save-optim);
    `save_rng=False` leaves the RNG states out (--no-save-rng). An OS error on any rank (a full
    disk, an unwritable directory) raises CheckpointSaveError on every rank, with the directory
    as it was before the save.
    """
    entries, manifest, group = _prepare_save(iteration, model_chunks, optimizer, scheduler, extra, pg_collection,
                                             save_rng, snapshot=False)
    return _write(checkpoint_dir, iteration, entries, manifest, group, before_commit)


def start_save_checkpoint(
    checkpoint_dir: str,
    iteration: int,
    model_chunks: list[torch.nn.Module],
    optimizer: Any = None,
    scheduler: Any = None,
    extra: Optional[dict] = None,
    pg_collection: Any = None,
    save_rng: bool = True,
    background_group: Optional[ProcessGroup] = None,
) -> "PendingSave":
    """`save_checkpoint` in the background (Megatron-LM's --async-save): copies the state to the
    CPU now, then writes, verifies, renames and moves `latest` in a thread, with the same
    guarantees; training may change the model meanwhile. `wait()` on the result returns the path
    or raises the save's error. Call it on every rank; one save per directory in flight at a time.

    The thread's collectives must not interleave with training's, so a checkpoint of more than
    one rank needs `background_group`: a gloo group of the checkpoint's ranks that nothing else
    uses, made once by `new_save_group` and passed to every call (None for a rank alone)."""
    key = os.path.realpath(checkpoint_dir)
    if key in _IN_FLIGHT:
        raise ValueError(f"a save into {checkpoint_dir} is still in flight (iteration {_IN_FLIGHT[key].iteration}); "
                         f"wait() for it before starting another.")
    entries, manifest, group = _prepare_save(iteration, model_chunks, optimizer, scheduler, extra, pg_collection,
                                             save_rng, snapshot=True)
    _check_background_group(background_group, group)
    pending = PendingSave(iteration, lambda: _write(checkpoint_dir, iteration, entries, manifest, background_group, None))
    _IN_FLIGHT[key] = pending
    pending.start(on_done=lambda: _IN_FLIGHT.pop(key, None))
    return pending


def new_save_group(model_chunks: list[torch.nn.Module], pg_collection: Any = None) -> Optional[ProcessGroup]:
    """A gloo group of the ranks that write `model_chunks`' checkpoint, for `start_save_checkpoint`'s
    background thread (same timeout as the checkpoint group); None when one rank writes it alone.

    torch.distributed.new_group: every rank of the default group calls it, at the same point,
    like any other group. Made once per run and destroyed by the caller when no save is in
    flight. (A group made with use_local_synchronization would be named after its ranks alone;
    made again on the same store, its rendezvous would read the previous one's addresses.)"""
    group = checkpoint_group(_parallel_groups(_as_chunks(model_chunks), pg_collection))
    if group is None:
        return None
    return torch.distributed.new_group(torch.distributed.get_process_group_ranks(group), backend="gloo",
                                       timeout=group_timeout(group))


def _check_background_group(background: Optional[ProcessGroup], group: Optional[ProcessGroup]) -> None:
    if group is None:
        return
    if background is None:
        raise ValueError(f"start_save_checkpoint: this checkpoint is written by {group_size(group)} ranks, "
                         f"so it needs background_group=, a gloo group of those ranks for the writing thread "
                         f"alone: make it once with new_save_group(model_chunks) on every rank and pass it to "
                         f"every call.")
    ranks, expected = (torch.distributed.get_process_group_ranks(g) for g in (background, group))
    if ranks != expected:
        raise ValueError(f"start_save_checkpoint: background_group has the ranks {ranks}, but the checkpoint is "
                         f"written by the ranks {expected}; make it with new_save_group(model_chunks).")
    if background is group:
        raise ValueError("start_save_checkpoint: background_group is the checkpoint group itself; the writing "
                         "thread needs a group of its own (new_save_group(model_chunks)).")


class PendingSave:
    """A checkpoint being written by a background thread (`start_save_checkpoint`)."""

    def __init__(self, iteration: int, write: Callable[[], str]) -> None:
        self.iteration = iteration
        self._path: Optional[str] = None
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, args=(write,), name=f"save-iter-{iteration}", daemon=True)
        self._on_done: Callable[[], Any] = lambda: None

    def start(self, on_done: Callable[[], Any]) -> None:
        """Start writing; `on_done()` runs in the thread when the save has ended, either way."""
        self._on_done = on_done
        self._thread.start()

    def _run(self, write: Callable[[], str]) -> None:
        try:
            # Lowest CPU priority for this thread only (Linux: a thread is a task), so training keeps its cores.
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICENESS)
        except (OSError, AttributeError):
            pass  # not Linux, or not allowed: the save runs at the process's priority
        try:
            self._path = write()
        except BaseException as error:  # re-raised by wait(), in the caller's thread
            self._error = error
        finally:
            self._on_done()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> str:
        """Block until the save is committed; its path, or the save's error (CheckpointSaveError...)."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._path


BACKGROUND_NICENESS = 19
# realpath of a directory -> its asynchronous save while it runs. A save leaves when it ends: a failed
# one's error holds the frames of its write, and with them the model and its groups.
_IN_FLIGHT: dict[str, PendingSave] = {}


def _prepare_save(iteration, model_chunks, optimizer, scheduler, extra, pg_collection, save_rng: bool,
                  snapshot: bool) -> tuple[dict, dict, Optional[ProcessGroup]]:
    """(entries, manifest, checkpoint group): what this rank writes, checked; copies with `snapshot`."""
    _check_iteration(iteration)
    extra = _check_extra(extra)
    _finish_param_sync(optimizer)
    chunks = _as_chunks(model_chunks)
    groups = _parallel_groups(chunks, pg_collection)
    params = model_params(chunks, groups)
    group = checkpoint_group(groups)
    children = optimizer_children(optimizer)
    entries = save_entries(params, children, MeshCache(), snapshot=snapshot)
    if scheduler is not None:
        entries.update(scheduler_entries(scheduler, children))
    if save_rng:
        entries.update(rng_entries(group_rank(group), group_size(group)))
    structure = global_group_structure(children, group, stored_names_by_fqn(params)) if children else None
    manifest = {
        "format": storage.FORMAT_VERSION,
        "iteration": iteration,
        "extra": extra,
        "world_size": group_size(group),
        "tensor_parallel_size": _tp_size(groups),
        "pipeline_parallel_size": pipeline_size(groups),
        "expert_parallel_size": _ep_size(groups, params),
        "optimizers": structure,
        "has_scheduler": scheduler is not None,
    }
    return entries, manifest, group


def _write(checkpoint_dir: str, iteration: int, entries: dict, manifest: dict, group: Optional[ProcessGroup],
           before_commit: Optional[Callable[[str], None]]) -> str:
    """Stage, write, checksum, rename, verify and point `latest` (storage.py); a failed step puts
    the directory back and raises CheckpointSaveError on every rank."""
    path, lock = storage.begin_save(checkpoint_dir, iteration, group)
    try:
        write = lambda: dcp.save(entries, storage_writer=FileSystemWriter(path), **_dcp_group(group))  # noqa: E731
        storage.agree(write, group, "saving", saving=True)
        storage.write_manifest(path, manifest, group)
        if before_commit is not None:
            before_commit(path)
        return storage.commit(checkpoint_dir, iteration, group)
    except storage.SaveFailed as failure:
        raise storage.abandon_save(checkpoint_dir, iteration, failure, group) from None
    finally:
        storage.end_save(lock)


def load_checkpoint(
    checkpoint_dir: str,
    model_chunks: list[torch.nn.Module],
    optimizer: Any = None,
    scheduler: Any = None,
    iteration: Optional[int] = None,
    load_optimizer: bool = True,
    load_rng: bool = True,
    pg_collection: Any = None,
) -> LoadedCheckpoint:
    """Load the latest (or the given iteration's) checkpoint into the model and optimizer.

    With `load_optimizer=False` only the model parameters are loaded (fp32 main copies
    included), e.g. to change optimizers; the scheduler is then left as it is too (Megatron-LM's
    --no-load-optim: its schedule starts again from step 0). The scheduler's lr schedule must
    match the checkpoint's unless the scheduler was built with `override_opt_param_scheduler` or
    `use_checkpoint_opt_param_scheduler` (schedule.py). Without a `latest` marker the newest
    checkpoint that verifies is loaded. RNG states are restored at the saved world and TP size
    only (rng.py). Every check runs before anything is changed: on any error nothing was loaded.
    `messages` of the result say what the caller should tell the user.
    """
    _finish_param_sync(optimizer)  # a broadcast still in flight would overwrite what is loaded
    chunks = _as_chunks(model_chunks)
    groups = _parallel_groups(chunks, pg_collection)
    params = model_params(chunks, groups)
    group = checkpoint_group(groups)
    path, manifest, note = storage.open_checkpoint(checkpoint_dir, iteration, group)
    messages = [note] if note else []
    children = optimizer_children(optimizer) if load_optimizer else []
    saved_children = _saved_children(manifest, children, optimizer, group, params, path)
    model_names = stored_model_names(params, group)

    # Every rank plans and checks, then all learn of any rank's error before anything collective
    # or irreversible happens, so a problem on one rank neither hangs nor half-loads the others.
    plan, masters, states = storage.agree(lambda: _plan_load(path, params, model_names, children, saved_children), group)
    read_scheduler = load_optimizer and scheduler is not None
    rng_keys, rng_note = _rng_to_load(plan, manifest, _layout(groups, params), group) if load_rng else ([], None)
    messages += [rng_note] if rng_note else []
    storage.agree(lambda: _plan_extras(plan, path, read_scheduler, rng_keys), group)
    _read(plan, path, group)

    def checked_states() -> tuple[list[dict], Optional[Callable[[], None]]]:
        # a child the checkpoint lacks (its parameters' optimizer changed): the live hyperparameters
        loaded = [loaded_optimizer_state(child, get_state(), plan.targets.get(f"groups/{stored_child_name(child.name)}", "{}"),
                                         plan.targets.get(f"grad_scaler/{stored_child_name(child.name)}", "null"), masters)
                  for child, get_state in zip(children, states)]
        for child, state in zip(children, loaded):
            child.check_state_dict(state)
        load_scheduler = plan_scheduler_load(
            scheduler, plan.targets[SCHEDULER_KEY], plan.targets.get(LR_BOUNDS_KEY), children, path
        ) if read_scheduler else None
        return loaded, load_scheduler

    child_states, load_scheduler = storage.agree(checked_states, group)
    _apply(params, masters, children, child_states, optimizer_children(optimizer))
    refresh_compute_weights(chunks)  # Megatron-FSDP computes with copies of the loaded shards
    if load_scheduler is not None:
        load_scheduler()
    if rng_keys:
        restore_rng({key: plan.targets[key] for key in rng_keys})
    return LoadedCheckpoint(path, int(manifest["iteration"]), manifest.get("extra") or {}, tuple(messages))


def _saved_children(manifest: dict, children: list, optimizer: Any, group: Optional[ProcessGroup],
                    params: list, path: str) -> Optional[dict[str, str]]:
    """{stored name: the child its state is read from}, or None when every parameter's is its own
    child's. A parameter whose optimizer changed since the save (checkpointable/optimizer_change.py) is refused
    (CheckpointError) without the opt-in, else left out: its state starts fresh; one saved under a
    child of another name but the same torch class (an AdamW run's 'dense', a Muon run's
    'adam/dense') is read from there. Without either, the checkpoint's optimizers and param groups
    must be this run's (check_structure)."""
    if not children:
        return None
    live_structure = global_group_structure(children, group, stored_names_by_fqn(params))
    saved_structure = manifest.get("optimizers")
    saved, live = optimizer_of_each_parameter(saved_structure), optimizer_of_each_parameter(live_structure)
    changes = optimizer_changes(saved, live)
    if saved_structure is None or all(saved.get(name) == owner for name, owner in live.items()):
        check_structure(saved_structure, live_structure, path)
        return None
    fresh = settle_optimizer_changes(changes, allows_optimizer_change(optimizer), path, CheckpointError)
    return {name: saved[name].child for name in live if name not in fresh}


def _plan_load(path: str, params: list, model_names: set[str], children: list,
               saved_children: Optional[dict[str, str]]) -> tuple:
    """Buffers for the model's (master) values and each child's state; shapes checked."""
    plan = LoadPlan(CheckpointIndex(FileSystemReader(path).read_metadata(), path), MeshCache())
    masters = plan_model(plan, params, model_names)
    states = [plan_optimizer_state(plan, child, params, saved_children) for child in children]
    for name in {stored_child_name(child.name) for child in children}:
        if f"groups/{name}" in plan.index.objects:  # else a child the checkpoint lacks
            plan.plain(f"groups/{name}", torch.device("cpu"))
            plan.plain(f"grad_scaler/{name}", torch.device("cpu"))
    return plan, masters, states


def _plan_extras(plan: LoadPlan, path: str, read_scheduler: bool, rng_keys: list[str]) -> None:
    if read_scheduler and SCHEDULER_KEY not in plan.index.objects:
        raise CheckpointError(f"{path} holds no lr scheduler state; pass scheduler=None to load without it.")
    if read_scheduler:
        plan.plain(SCHEDULER_KEY, torch.device("cpu"))
        if LR_BOUNDS_KEY in plan.index.objects:  # absent in checkpoints written before it existed
            plan.plain(LR_BOUNDS_KEY, torch.device("cpu"))
    for key in rng_keys:
        plan.plain(key, torch.device("cpu"))


def _rng_to_load(
    plan: LoadPlan, manifest: dict, layout: tuple[int, int, int], group: Optional[ProcessGroup]
) -> tuple[list[str], Optional[str]]:
    """This rank's RNG keys, when the checkpoint was saved at this job size and TP/PP/EP layout (rng.py)."""
    tp, pp, ep = layout
    # Checkpoints written before PP/EP were recorded had neither (size 1).
    saved = (manifest.get("world_size"), manifest.get("tensor_parallel_size", tp),
             manifest.get("pipeline_parallel_size", 1), manifest.get("expert_parallel_size", 1))
    here = (group_size(group), tp, pp, ep)
    if saved != here:
        with_pp_ep = (saved[2:], here[2:]) != ((1, 1), (1, 1))
        return [], (f"RNG states not restored: saved at {_describe_layout(saved, with_pp_ep)}, this run has "
                    f"{_describe_layout(here, with_pp_ep)}; the RNGs keep this run's seeding")
    keys = rng_keys_to_load(plan.index.tensors, group_rank(group), group_size(group))
    if not keys:
        return [], "RNG states not restored: the checkpoint holds none (saved without them); the RNGs keep this run's seeding"
    return keys, None


def _describe_layout(layout: tuple, with_pp_ep: bool) -> str:
    world, tp, pp, ep = layout
    return f"world size {world} with TP {tp}" + (f", PP {pp}, EP {ep}" if with_pp_ep else "")


def _read(plan: LoadPlan, path: str, group: Optional[ProcessGroup]) -> None:
    try:
        dcp.load(plan.targets, storage_reader=FileSystemReader(path), **_dcp_group(group))
    except CheckpointException as error:
        raise CheckpointError(f"reading {path} failed: {error}") from None


def _dcp_group(group: Optional[ProcessGroup]) -> dict[str, Any]:
    """dcp.save's and dcp.load's process_group and no_dist for a checkpoint `group` (None: this
    rank alone). dcp warns on every no_dist call ("torch.distributed is disabled ... assuming the
    intent is to save in a single process"), so where torch.distributed runs this process alone,
    its default group, which holds no other process, coordinates the rank instead."""
    if group is not None:
        return {"process_group": group, "no_dist": False}
    alone = torch.distributed.is_available() and torch.distributed.is_initialized() and \
        torch.distributed.get_world_size() == 1
    return {"process_group": None, "no_dist": not alone}


def _apply(params, masters, children, child_states, all_children) -> None:
    with torch.no_grad():
        for p in params:
            local_tensor(p.param).copy_(masters[id(p.param)])  # in place: FSDP2 keeps its shard storage
    for child, state in zip(children, child_states):
        child.load_state_dict(state)
    if not children:  # model only: fp32 main copies follow the loaded values at full precision
        for child in all_children:
            child.set_main_params({id(param.model): masters[id(param.model)] for param in child.checkpoint_params()
                                   if has_main_copy(param.model, param.main)})


def _finish_param_sync(optimizer: Any) -> None:
    """The layer-wise optimizer with overlap_param_gather may still be broadcasting parameters."""
    finish = getattr(optimizer, "finish_param_sync", None)
    if finish is not None:
        finish()


def _tp_size(groups: Any) -> int:
    return group_size(groups.require("tp", "a checkpoint (which records its tensor-parallel size)"))


def _ep_size(groups: Any, params: list) -> int:
    """Expert-parallel size: expert tp x ep x pp over expert tp x pp (1 without expert parameters).
    A sharded model's experts on a mesh of their own lost `allreduce=False` to the engine; its
    groups then hold the expert roles (placement/fully_sharded_layout.py)."""
    sharded_experts = "expt_dp" in groups.provided and any(isinstance(p.param, DTensor) for p in params)
    if all(getattr(p.param, "allreduce", True) for p in params) and not sharded_experts:
        return 1
    why = "a checkpoint (which records its expert-parallel size)"
    return group_size(groups.require("expt_mp", why)) // (
        group_size(groups.require("expt_tp", why)) * pipeline_size(groups))


def _layout(groups: Any, params: list) -> tuple[int, int, int]:
    return _tp_size(groups), pipeline_size(groups), _ep_size(groups, params)


def _parallel_groups(chunks: list[torch.nn.Module], pg_collection: Any) -> Any:
    """A torch FSDP2 model's groups come from its parameters' mesh, as for its optimizer (factory.py)."""
    fsdp = fully_sharded_layout(chunks, pg_collection)
    return resolve_parallel_groups(pg_collection) if fsdp is None else fsdp.parallel_groups()


def _as_chunks(model_chunks: Any) -> list[torch.nn.Module]:
    chunks = [model_chunks] if isinstance(model_chunks, torch.nn.Module) else list(model_chunks)
    if not chunks or not all(isinstance(c, torch.nn.Module) for c in chunks):
        raise TypeError("model_chunks must be a torch.nn.Module or a non-empty list of them.")
    return chunks


def _check_iteration(iteration: Any) -> None:
    if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
        raise ValueError(f"iteration must be an int >= 0; got {iteration!r}.")


def _check_extra(extra: Optional[dict]) -> dict:
    extra = {} if extra is None else extra
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as error:
        raise TypeError(f"extra must be JSON-serialisable (numbers, strings, lists, dicts): {error}") from None
    return extra
