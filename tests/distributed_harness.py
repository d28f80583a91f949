"""Run a function on N CPU ranks (gloo) in worker processes that outlive a single test.

Why it is built this way: importing torch + megatron-core costs ~15-20 s of CPU per process, far
more than most distributed tests. So one "zygote" process pays that import once per session and
forks ready-made workers from it; a world (one worker per rank) is then kept and reused across
calls. After a failure or a timeout the world is killed, and the next call forks a fresh one in
well under a second.

Pytest code uses the session fixture ``run_distributed`` from tests/conftest.py; other code can
call :func:`run_distributed` here and :func:`shutdown_distributed` when done. Linux only (fork).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import ctypes
import faulthandler
import gc
import hmac
import importlib
import importlib.util
import inspect
import itertools
import math
import os
import pickle
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TIMEOUT_S = 300.0
# Once one rank has failed, the others usually finish or fail within moments; a rank that is
# still running after this long is stuck in a collective the failed rank will never join.
FAILURE_GRACE_S = 20.0
# Covers the zygote's one-off import on a busy 2-core machine, and process-group set-up.
STARTUP_TIMEOUT_S = 300.0
SHUTDOWN_TIMEOUT_S = 10.0
SEED = 1234
PRELOAD_MODULES = (
    "torch",
    "torch.distributed",
    "megatron.core.parallel_state",
    "megatron.core.models.gpt",
)
# Imported by nearly every test module: preloading saves seconds per new world on a busy machine.
OPTIONAL_PRELOAD_MODULES = ("pytest",)
_TOKEN_ENV = "_MEGATRON_EOPT_HARNESS_TOKEN"
# A call that leaves threads behind (a live group, a running thread) fails with ThreadLeakError,
# naming the test and what holds them. "0" relaxes that: the world is replaced and the culprit
# printed (to list every culprit of a suite in one run).
STRICT_LEAKS_ENV = "MEGATRON_EOPT_STRICT_LEAKS"
# Seconds the leak check gives threads that sleep to end (default _LEAK_WAIT_S); the harness's own tests
# shorten it, to show a running thread waited for past it without running seconds.
LEAK_GRACE_ENV = "MEGATRON_EOPT_LEAK_GRACE_S"
# No process of the suite holds more threads at any moment (docs/testing.md): a call whose worker
# went over fails with ThreadLeakError.
THREAD_BUDGET = 200
# The thread census waits for events, not for a time: a thread to start and name itself, a thread on its
# way out to be gone. This bound on such a wait is reached only when the event never comes (a broken
# worker), so it is generous: under load (`make test`'s two processes, other jobs) events come late.
_EVENT_WAIT_S = 60.0
# How long the leak check gives threads that sleep, as a live group's do, to end all the same. Threads
# still running (a destroyed group's, joined and exiting) are waited for until they are gone.
_LEAK_WAIT_S = 3.0
_STACK_DUMP_WAIT_S = 0.5
_STACK_SIGNAL = signal.SIGUSR1


class DistributedRunError(RuntimeError):
    """``fn`` raised, or a worker died, on at least one rank.

    ``failures`` maps each failed rank to its traceback text.
    """

    def __init__(self, message: str, failures: dict[int, str]) -> None:
        super().__init__(message)
        self.failures = failures


class DistributedTimeoutError(DistributedRunError, TimeoutError):
    """Some ranks did not finish within the call's timeout (typically a collective deadlock)."""


class ThreadLeakError(DistributedRunError):
    """The call succeeded, but afterwards a worker holds threads a fresh worker does not: it left
    a process group (or a thread) alive. ``failures`` maps each such rank to what it holds."""


class HarnessStartupError(RuntimeError):
    """The zygote or a world's worker processes could not be started."""


# ---------------------------------------------------------------------------------------------
# Messages between processes
# ---------------------------------------------------------------------------------------------


def _send(conn: Connection, message: Any) -> None:
    # Plain pickle rather than Connection.send: torch registers shared-memory reducers with
    # multiprocessing's pickler, and those cannot work between unrelated processes.
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


def _connect(address: tuple[str, int], token: bytes) -> Connection:
    conn = Connection(socket.create_connection(address).detach())
    conn.send_bytes(token)
    return conn


def _scratch_path(scratch_dir: str, world_id: int, rank: int, kind: str) -> str:
    """Per-rank file the worker writes and the test process reads: "stack" or "output"."""
    return os.path.join(scratch_dir, f"world{world_id}-rank{rank}.{kind}")


class _Rendezvous:
    """The test process's listening socket; the zygote and workers dial in with a secret token,
    so nothing else on the machine can feed pickles to the test process."""

    def __init__(self) -> None:
        self.token = secrets.token_bytes(32)
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.address: tuple[str, int] = self._sock.getsockname()[:2]

    def accept(
        self,
        deadline: float,
        check_alive: Callable[[], None],
        wanted: Callable[[Any], bool],
    ) -> tuple[Connection, Any]:
        """Wait for an authenticated connection whose hello message satisfies ``wanted``."""
        while True:
            check_alive()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise HarnessStartupError("timed out waiting for a worker process to connect")
            # Short accept timeouts so a crashed zygote is noticed quickly.
            self._sock.settimeout(min(remaining, 1.0))
            try:
                sock, _ = self._sock.accept()
            except TimeoutError:
                continue
            conn = Connection(sock.detach())
            hello = self._read_hello(conn, deadline)
            if hello is not None and wanted(hello):
                return conn, hello
            conn.close()  # a stranger, or a late worker of a world already given up on

    def _read_hello(self, conn: Connection, deadline: float) -> Any:
        try:
            if not conn.poll(max(deadline - time.monotonic(), 0.1)):
                return None
            if not hmac.compare_digest(conn.recv_bytes(maxlength=64), self.token):
                return None
            if not conn.poll(max(deadline - time.monotonic(), 0.1)):
                return None
            return _recv(conn)
        except (OSError, EOFError, pickle.UnpicklingError):
            return None

    def close(self) -> None:
        self._sock.close()


# ---------------------------------------------------------------------------------------------
# Test-process side
# ---------------------------------------------------------------------------------------------


def _locate_function(fn: Callable[..., Any]) -> tuple[str, str, str | None]:
    """Return (module, qualname, file) by which a worker imports ``fn``: code is never pickled."""
    qualname = getattr(fn, "__qualname__", "")
    if not inspect.isfunction(fn) or "<" in qualname:
        raise TypeError(
            "run_distributed needs a module-level function (workers import it by name), "
            f"got {fn!r}; lambdas, nested functions, partials and bound methods cannot be sent"
        )
    module_name = fn.__module__
    target: Any = sys.modules.get(module_name)
    for part in qualname.split("."):
        target = getattr(target, part, None)
    if target is not fn:
        raise TypeError(
            f"run_distributed needs a module-level function, but {module_name}.{qualname} "
            f"does not name {fn!r}"
        )
    try:
        file: str | None = os.path.abspath(inspect.getfile(fn))
    except TypeError:
        file = None
    return module_name, qualname, file


def _make_task(
    fn: Callable[..., Any], args: Any, kwargs: Mapping[str, Any] | None, leaves_groups: bool = False
) -> dict[str, Any]:
    module_name, qualname, file = _locate_function(fn)
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple or list, got {type(args).__name__}")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TypeError(f"kwargs must be a mapping or None, got {type(kwargs).__name__}")
    try:
        payload = pickle.dumps((tuple(args), dict(kwargs or {})), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise TypeError(f"args and kwargs must be picklable to reach the workers: {exc}") from exc
    return {
        "module": module_name,
        "qualname": qualname,
        "file": file,
        "payload": payload,
        # Mirrored in the worker so test modules and their helpers import as they do here.
        "sys_path": list(sys.path),
        "cwd": os.getcwd(),
        "strict_leaks": os.environ.get(STRICT_LEAKS_ENV) != "0",
        "leak_grace_s": float(os.environ.get(LEAK_GRACE_ENV, _LEAK_WAIT_S)),
        "leaves_groups": leaves_groups,
    }


def _check_world_size(world_size: Any) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be an int, got {type(world_size).__name__}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")


def _check_timeout(timeout: Any) -> None:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds, got {type(timeout).__name__}")
    if not timeout > 0:
        raise ValueError(f"timeout must be positive, got {timeout}")


def _worker_environment(token: bytes) -> dict[str, str]:
    env = dict(os.environ)
    # Up to 4 ranks share 2 CPU cores: intra-op thread pools would only oversubscribe them.
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"  # worker prints interleave sensibly with the test's output
    if os.path.exists("/sys/class/net/lo"):
        # Gloo otherwise binds to whatever the hostname resolves to, which fails in some sandboxes.
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env[_TOKEN_ENV] = token.hex()
    return env


class _Zygote:
    """Handle on the process that imports torch + megatron-core once and forks workers."""

    def __init__(self, rendezvous: _Rendezvous) -> None:
        self.rendezvous = rendezvous
        # Stack dumps, per-call output and the zygote's log; removed by whichever of the two
        # processes ends first.
        self.scratch_dir = tempfile.mkdtemp(prefix="distributed-harness-")
        self._log_path = os.path.join(self.scratch_dir, "zygote.log")
        host, port = rendezvous.address
        with open(self._log_path, "wb") as log:
            self._process = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--zygote", host, str(port),
                 self.scratch_dir],
                cwd=os.getcwd(),
                env=_worker_environment(rendezvous.token),
                # Not the terminal: the zygote may start before pytest captures output, and
                # workers' per-call output is replayed in the calling test instead.
                stdout=log,
                stderr=subprocess.STDOUT,
            # Its own session: Ctrl+C in the test terminal is handled by the test process,
            # which then cleans up; the zygote also exits when that process's socket closes.
                start_new_session=True,
            )
        self._conn: Connection | None = None  # set once the zygote has finished its imports

    def wait_ready(self) -> None:
        """Block until the zygote has imported everything and dialled in."""
        if self._conn is not None:
            return
        try:
            self._conn, _ = self.rendezvous.accept(
                time.monotonic() + STARTUP_TIMEOUT_S,
                self.check_alive,
                wanted=lambda hello: hello[0] == "zygote",
            )
        except BaseException:
            self._process.kill()
            raise

    def alive(self) -> bool:
        return self._process.poll() is None

    def check_alive(self) -> None:
        if not self.alive():
            raise HarnessStartupError(
                f"the worker zygote exited with code {self._process.returncode} (often an "
                f"import error in torch or megatron-core). Its output ends:\n{self.log_tail()}"
            )

    def log_tail(self, chars: int = 6000) -> str:
        """The end of what the zygote and its workers printed outside calls."""
        try:
            return Path(self._log_path).read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def spawn(self, world_id: int, world_size: int) -> list[int]:
        self.wait_ready()
        return self._request(("spawn", world_id, world_size))

    def signal(self, pids: list[int], signum: int) -> None:
        """Signal workers that are still alive; the zygote reaps its children itself, so a pid
        here can never belong to an unrelated process that reused it."""
        if not pids or not self.alive():
            return
        try:
            self._request(("signal", pids, int(signum)))
        except (OSError, EOFError):
            pass  # the zygote just died; its workers die with it

    def check_workers_alive(self, pids: list[int]) -> None:
        self.check_alive()
        exited = self._request(("exited", pids))
        if exited:
            raise HarnessStartupError(
                f"worker process(es) {exited} exited while starting. Output:\n{self.log_tail()}"
            )

    def close(self) -> None:
        try:
            if self._conn is None:
                raise OSError("never connected")  # still importing: nothing to shut down politely
            _send(self._conn, ("exit",))
            self._process.wait(timeout=SHUTDOWN_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired):
            self._process.kill()
            self._process.wait()
        finally:
            if self._conn is not None:
                self._conn.close()
            shutil.rmtree(self.scratch_dir, ignore_errors=True)

    def _request(self, message: tuple[Any, ...]) -> Any:
        if self._conn is None:
            raise HarnessStartupError("the worker zygote is not connected")
        try:
            _send(self._conn, message)
            if not self._conn.poll(SHUTDOWN_TIMEOUT_S):
                raise HarnessStartupError(f"the worker zygote did not answer {message[0]!r}")
            return _recv(self._conn)
        except BaseException:
            # An unfinished exchange leaves the channel out of step; a fresh zygote is cheaper
            # to get right. Its workers die with it.
            self._process.kill()
            raise


@dataclass
class _World:
    world_id: int
    size: int
    pids: list[int]
    conns: list[Connection]

    def close(self) -> None:
        for conn in self.conns:
            conn.close()

    def looks_idle(self) -> bool:
        # An idle worker sends nothing; a readable connection means it died (EOF).
        return not any(conn.poll(0) for conn in self.conns)


class DistributedHarness:
    """Owns the zygote and one reusable world per world size. One call at a time (locked)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rendezvous: _Rendezvous | None = None
        self._zygote: _Zygote | None = None
        self._worlds: dict[int, _World] = {}
        self._world_ids = itertools.count()

    def run(
        self,
        fn: Callable[..., Any],
        world_size: int,
        args: tuple[Any, ...] | list[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        leaves_groups: bool = False,
    ) -> list[Any]:
        """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank; results in rank order."""
        task = _make_task(fn, args, kwargs, leaves_groups)
        _check_world_size(world_size)
        _check_timeout(timeout)
        with self._lock:
            world = self._get_world(world_size)
            try:
                replies, hung = self._dispatch(world, task, timeout)
                error = self._failure(world, task, timeout, replies, hung)
            except BaseException:  # e.g. pytest-timeout or Ctrl+C mid-call: state unknown
                self._retire(world)
                raise
            finally:
                self._replay_output(world)
            if error is not None:
                raise error
            leaks = {rank: reply["leaked"] for rank, reply in replies.items() if reply.get("leaked")}
            if leaks or leaves_groups or not all(reply["reusable"] for reply in replies.values()):
                self._retire(world)
            peaks = {rank: reply["peak_threads"] for rank, reply in replies.items()}
            if max(peaks.values()) > THREAD_BUDGET:
                raise _budget_error(task, world.size, peaks)
            if task["strict_leaks"] and any(leak["fails"] for leak in leaks.values()):
                raise _leak_error(task, world.size, leaks)
            if leaks:
                print(f"run_distributed: replaced the world after {task['module']}.{task['qualname']}: "
                      f"{leaks[min(leaks)]['text']}")
            return [replies[rank]["result"] for rank in range(world.size)]

    def prestart(self) -> None:
        """Start the zygote's one-off import in the background and return at once, so that it
        overlaps other work (e.g. non-distributed tests) instead of delaying the first call."""
        with self._lock:
            self._ensure_zygote()

    def shutdown(self) -> None:
        """Stop all workers and the zygote. The harness may be used again afterwards."""
        with self._lock:
            for world in list(self._worlds.values()):
                self._stop_world(world)
            if self._zygote is not None:
                self._zygote.close()
                self._zygote = None
            if self._rendezvous is not None:
                self._rendezvous.close()
                self._rendezvous = None

    # -- worlds ------------------------------------------------------------------------------

    def _get_world(self, world_size: int) -> _World:
        world = self._worlds.get(world_size)
        if world is not None and not world.looks_idle():
            self._retire(world)
            world = None
        if world is None:
            world = self._start_world(world_size)
            self._worlds[world_size] = world
        return world

    def _start_world(self, world_size: int) -> _World:
        zygote = self._ensure_zygote()
        world_id = next(self._world_ids)
        pids = zygote.spawn(world_id, world_size)
        conns: dict[int, Connection] = {}
        try:
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            store_port = self._accept_ranks(world_id, pids, conns, deadline, zygote)
            for rank in range(1, world_size):
                _send(conns[rank], ("join_store", store_port))
            _wait_until_ready(conns, deadline)
        except BaseException:
            zygote.signal(pids, signal.SIGKILL)
            for conn in conns.values():
                conn.close()
            raise
        return _World(world_id, world_size, pids, [conns[rank] for rank in range(world_size)])

    def _accept_ranks(
        self,
        world_id: int,
        pids: list[int],
        conns: dict[int, Connection],
        deadline: float,
        zygote: _Zygote,
    ) -> int:
        """Fill ``conns`` with each rank's connection; return rank 0's store port."""
        store_port = 0
        while len(conns) < len(pids):
            conn, (_, _, rank, _, port) = zygote.rendezvous.accept(
                deadline,
                lambda: zygote.check_workers_alive(pids),
                wanted=lambda hello: hello[0] == "worker" and hello[1] == world_id,
            )
            conns[rank] = conn
            store_port = port if rank == 0 else store_port
        return store_port

    def _ensure_zygote(self) -> _Zygote:
        if self._zygote is not None and not self._zygote.alive():
            # Its workers died with it (parent-death signal); forget them.
            for world in list(self._worlds.values()):
                world.close()
            self._worlds.clear()
            self._zygote.close()
            self._zygote = None
        if self._zygote is None:
            if self._rendezvous is None:
                self._rendezvous = _Rendezvous()
            self._zygote = _Zygote(self._rendezvous)
        return self._zygote

    def _retire(self, world: _World) -> None:
        """Kill a world whose state can no longer be trusted; the next call forks a new one."""
        if self._worlds.get(world.size) is world:
            del self._worlds[world.size]
        if self._zygote is not None:
            self._zygote.signal(world.pids, signal.SIGKILL)
        world.close()

    def _stop_world(self, world: _World) -> None:
        for conn in world.conns:
            try:
                _send(conn, ("shutdown",))
            except OSError:
                pass
        # Give them a moment to exit on their own before the kill.
        deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
        open_conns = list(world.conns)
        while open_conns and time.monotonic() < deadline:
            for conn in wait(open_conns, timeout=deadline - time.monotonic()):
                open_conns.remove(conn)
        self._retire(world)

    # -- calls -------------------------------------------------------------------------------

    def _dispatch(
        self, world: _World, task: dict[str, Any], timeout: float
    ) -> tuple[dict[int, dict[str, Any]], list[int]]:
        for conn in world.conns:
            _send(conn, ("run", task))
        return _collect_replies(world, time.monotonic() + timeout)

    def _failure(
        self,
        world: _World,
        task: dict[str, Any],
        timeout: float,
        replies: dict[int, dict[str, Any]],
        hung: list[int],
    ) -> DistributedRunError | None:
        """None if every rank succeeded; otherwise kill the world (its state is suspect: e.g.
        ranks that disagree on how many collectives ran) and describe what failed where."""
        if not hung and all(reply["status"] == "ok" for reply in replies.values()):
            return None
        stacks = self._dump_stacks(world, hung)
        self._retire(world)
        fn_name = f"{task['module']}.{task['qualname']}"
        return _call_error(fn_name, world.size, timeout, replies, hung, stacks)

    def _replay_output(self, world: _World) -> None:
        """Print what each rank printed during the call here, where pytest captures it for the
        calling test."""
        if self._zygote is None:
            return
        for rank in range(world.size):
            path = _scratch_path(self._zygote.scratch_dir, world.world_id, rank, "output")
            try:
                text = Path(path).read_text(errors="replace")
            except OSError:
                continue
            if text:
                body = text.rstrip("\n")
                sys.stdout.write(f"---- rank {rank} output ----\n{body}\n")

    def _dump_stacks(self, world: _World, ranks: list[int]) -> dict[int, str]:
        """Python stacks of ranks that are stuck, written by faulthandler in the worker."""
        if not ranks or self._zygote is None:
            return {}
        self._zygote.signal([world.pids[rank] for rank in ranks], _STACK_SIGNAL)
        time.sleep(_STACK_DUMP_WAIT_S)
        stacks = {}
        for rank in ranks:
            try:
                path = _scratch_path(self._zygote.scratch_dir, world.world_id, rank, "stack")
                stacks[rank] = Path(path).read_text(errors="replace")
            except OSError:
                stacks[rank] = "(no stack dump)"
        return stacks


def _wait_until_ready(conns: dict[int, Connection], deadline: float) -> None:
    """Wait for every rank's "ready"; fail as soon as one rank fails (the rest would hang)."""
    pending = {conn: rank for rank, conn in conns.items()}
    while pending:
        remaining = deadline - time.monotonic()
        ready = wait(list(pending), timeout=max(remaining, 0))
        if not ready:
            raise HarnessStartupError(
                f"{_ranks(sorted(pending.values()))} did not finish init_process_group in time"
            )
        for conn in ready:
            rank = pending.pop(conn)
            try:
                message = _recv(conn)
            except (EOFError, OSError) as exc:
                raise HarnessStartupError(f"rank {rank} exited while starting") from exc
            if message[0] != "ready":
                raise HarnessStartupError(
                    f"rank {rank} failed to initialise torch.distributed:\n{message[1]}"
                )


def _collect_replies(
    world: _World, deadline: float
) -> tuple[dict[int, dict[str, Any]], list[int]]:
    """Wait for every rank's reply; return the replies and the ranks still running."""
    pending = {conn: rank for rank, conn in enumerate(world.conns)}
    replies: dict[int, dict[str, Any]] = {}
    grace_deadline = math.inf
    while pending:
        remaining = min(deadline, grace_deadline) - time.monotonic()
        if remaining <= 0:
            break
        for conn in wait(list(pending), timeout=remaining):
            rank = pending.pop(conn)
            replies[rank] = _read_reply(conn, world.pids[rank])
            if replies[rank]["status"] != "ok" and grace_deadline == math.inf:
                grace_deadline = time.monotonic() + FAILURE_GRACE_S
    return replies, sorted(pending.values())


def _read_reply(conn: Connection, pid: int) -> dict[str, Any]:
    try:
        return _recv(conn)
    except (EOFError, OSError):
        return {"status": "error", "traceback": f"worker process {pid} exited without replying "
                                               "(crashed, called os._exit, or was killed)\n"}
    except Exception:
        return {"status": "error", "traceback": "the result could not be unpickled in the test "
                                               f"process:\n{traceback.format_exc()}"}


def _call_error(
    fn_name: str,
    world_size: int,
    timeout: float,
    replies: dict[int, dict[str, Any]],
    hung: list[int],
    stacks: dict[int, str],
) -> DistributedRunError:
    failures = {
        rank: reply["traceback"]
        for rank, reply in sorted(replies.items())
        if reply["status"] != "ok"
    }
    call = f"run_distributed({fn_name}, world_size={world_size})"
    if failures:
        lines = [f"{call} failed on {_ranks(list(failures))}."]
        lines += [f"\n---- rank {rank} traceback ----\n{text}" for rank, text in failures.items()]
        if hung:
            lines.append(f"\nKilled {_ranks(hung)}, still running {FAILURE_GRACE_S:g} s after the "
                         "failure (probably waiting in a collective).")
        error_type: type[DistributedRunError] = DistributedRunError
    else:
        lines = [f"{call} timed out after {timeout:g} s: {_ranks(hung)} did not finish "
                 "(deadlock in a collective?). The world's workers were killed; the next call "
                 "starts fresh ones."]
        error_type = DistributedTimeoutError
    lines += [f"\n---- rank {rank} stack when killed ----\n{text}" for rank, text in stacks.items()]
    return error_type("\n".join(lines), failures)


def _leak_error(task: dict[str, Any], world_size: int, leaks: dict[int, dict[str, Any]]) -> ThreadLeakError:
    lines = [f"{_current_test()} leaked: run_distributed({task['module']}.{task['qualname']}, "
             f"world_size={world_size}) returned, but its workers still hold more threads than a "
             "fresh worker after every group was destroyed and garbage collected: a module-level "
             "global or cache still references a process group, or a thread the call started still "
             "runs. The world was replaced."]
    lines += [f"  rank {rank}: {leak['text']}" for rank, leak in sorted(leaks.items())]
    return ThreadLeakError("\n".join(lines), {rank: leak["text"] for rank, leak in leaks.items()})


def _budget_error(task: dict[str, Any], world_size: int, peaks: dict[int, int]) -> ThreadLeakError:
    over = {rank: peak for rank, peak in sorted(peaks.items()) if peak > THREAD_BUDGET}
    lines = [f"{_current_test()} went over the suite's thread budget: during run_distributed("
             f"{task['module']}.{task['qualname']}, world_size={world_size}) a worker held more than "
             f"{THREAD_BUDGET} threads at once (a gloo group keeps 3 until its last reference goes): "
             "destroy each group, mesh or model-parallel state before making the next one."]
    lines += [f"  rank {rank}: {peak} threads" for rank, peak in over.items()]
    return ThreadLeakError("\n".join(lines), {rank: f"{peak} threads" for rank, peak in over.items()})


def _current_test() -> str:
    # pytest names the running test in the environment of the process that runs it.
    return os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0] or "the caller"


def _ranks(ranks: list[int]) -> str:
    """"rank 1" or "ranks 0, 2"."""
    noun = "rank" if len(ranks) == 1 else "ranks"
    return f"{noun} {', '.join(map(str, ranks))}"


_default_harness: DistributedHarness | None = None
_default_lock = threading.Lock()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...] | list[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    leaves_groups: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks.

    ``fn`` must be a module-level function (workers import it by module and name). Returns the
    results in rank order. Raises DistributedRunError naming the failed ranks and their
    tracebacks if ``fn`` raises anywhere, and DistributedTimeoutError (also a TimeoutError) if
    some rank is still running after ``timeout`` seconds; either way that world is killed and
    the next call starts a fresh one. ``leaves_groups=True``: the call may leave process groups
    held where no cleanup reaches (a run that fails after wrapping its model: the gradient hooks
    hold them); its world is replaced afterwards, and nothing is checked for leaks.
    """
    return _get_default_harness().run(fn, world_size, args=args, kwargs=kwargs, timeout=timeout,
                                      leaves_groups=leaves_groups)


def prestart_distributed() -> None:
    """Begin importing torch + megatron-core in the background for :func:`run_distributed`."""
    _get_default_harness().prestart()


def shutdown_distributed() -> None:
    """Stop the workers started by :func:`run_distributed` (also done at interpreter exit)."""
    global _default_harness
    with _default_lock:
        harness, _default_harness = _default_harness, None
    if harness is not None:
        harness.shutdown()


def _get_default_harness() -> DistributedHarness:
    global _default_harness
    with _default_lock:
        if _default_harness is None:
            _default_harness = DistributedHarness()
        return _default_harness


atexit.register(shutdown_distributed)  # a no-op unless workers are still running


# ---------------------------------------------------------------------------------------------
# Zygote process: imports once, then forks workers
# ---------------------------------------------------------------------------------------------


def _zygote_main(host: str, port: int, scratch_dir: str) -> None:
    token = bytes.fromhex(os.environ.pop(_TOKEN_ENV))
    _adopt_orphans()
    _preload()
    conn = _connect((host, port), token)
    _send(conn, ("zygote", os.getpid()))
    children: set[int] = set()
    try:
        while True:
            try:
                request = _recv(conn)
            except (EOFError, OSError):
                break  # the test process is gone
            _reap(children)
            if request[0] == "exit":
                break
            if request[0] == "spawn":
                _, world_id, world_size = request
                pids = [
                    _fork_worker(conn, (host, port), token, scratch_dir, world_id, rank, world_size)
                    for rank in range(world_size)
                ]
                children.update(pids)
                _send(conn, pids)
            elif request[0] == "signal":
                _signal_children(children, request[1], request[2])
                _send(conn, None)
            elif request[0] == "exited":
                _send(conn, [pid for pid in request[1] if pid not in children])
    finally:
        _stop_children(children)
        shutil.rmtree(scratch_dir, ignore_errors=True)


def _preload() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # import-time noise such as "Apex is not installed"
        for name in PRELOAD_MODULES:
            importlib.import_module(name)
        for name in OPTIONAL_PRELOAD_MODULES:
            with contextlib.suppress(ImportError):
                importlib.import_module(name)
    import torch

    torch.set_num_threads(1)
    with contextlib.suppress(ImportError):
        import tqdm

        # tqdm's monitor thread outlives the bars of megatron-core's and torch's checkpoint
        # writers; without it a bar still updates, on its own calls.
        tqdm.tqdm.monitor_interval = 0
    # The imports' objects never become garbage: out of the collector's sight, the full collection
    # after every call (_reset_shared_state) takes milliseconds instead of ~0.4 s.
    gc.collect()
    gc.freeze()


def _reap(children: set[int]) -> None:
    for pid in list(children):
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done = pid
        if done:
            children.discard(pid)
    _end_adopted_processes(children)


def _signal_children(children: set[int], pids: list[int], signum: int) -> None:
    for pid in pids:
        if pid not in children:
            continue  # already exited and reaped: the pid may now be someone else's
        os.kill(pid, signum)
        if signum == signal.SIGKILL:
            os.waitpid(pid, 0)
            children.discard(pid)
    if signum == signal.SIGKILL:
        _end_adopted_processes(children)


def _adopt_orphans() -> None:
    """Make the zygote the parent of whatever its workers started and left running when they
    ended (Linux's child subreaper), instead of init: megatron-core's torch_dist writer starts a
    multiprocessing Manager per process (~0.5 GB) and keeps it for the process's life, and a worker
    ends by os._exit or SIGKILL, which stop none of them. Best effort elsewhere."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(36, 1)  # 36 == PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def _end_adopted_processes(workers: set[int]) -> None:
    """SIGKILL and reap the zygote's children that are not workers: adopted from ended workers."""
    for task in Path("/proc/self/task").glob("*"):
        try:
            pids = [int(pid) for pid in (task / "children").read_text().split()]
        except OSError:
            continue
        for pid in pids:
            if pid in workers:
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


def _stop_children(children: set[int]) -> None:
    deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S / 2
    while children and time.monotonic() < deadline:
        _reap(children)
        time.sleep(0.05)
    _signal_children(children, list(children), signal.SIGKILL)


def _fork_worker(
    zygote_conn: Connection,
    address: tuple[str, int],
    token: bytes,
    scratch_dir: str,
    world_id: int,
    rank: int,
    world_size: int,
) -> int:
    zygote_pid = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    exit_code = 1
    try:
        zygote_conn.close()  # only the zygote itself may talk on that channel
        _die_with_parent(zygote_pid)
        _worker_main(address, token, scratch_dir, world_id, rank, world_size)
        exit_code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)  # never run the zygote's own clean-up code in a worker


def _die_with_parent(parent_pid: int) -> None:
    """Have the kernel kill this worker if the zygote dies, so no orphan stays stuck in a
    collective (Linux prctl; best effort elsewhere)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL))  # 1 == PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:
        os._exit(1)  # the zygote died before prctl took effect


# ---------------------------------------------------------------------------------------------
# Worker process: one rank of a world
# ---------------------------------------------------------------------------------------------


_shared_dir: str | None = None  # in a worker: a folder every worker of this session sees


def shared_dir() -> str | None:
    """In a worker: a folder that every worker of this session (every rank, every world) sees,
    removed with the session; elsewhere None. For caches that stay valid across calls."""
    return _shared_dir


def _worker_main(
    address: tuple[str, int],
    token: bytes,
    scratch_dir: str,
    world_id: int,
    rank: int,
    world_size: int,
) -> None:
    import torch.distributed as dist

    global _shared_dir
    _shared_dir = os.path.join(scratch_dir, "shared")

    # Lets the test process show where a stuck rank is before it kills it.
    stack_file = open(_scratch_path(scratch_dir, world_id, rank, "stack"), "w")  # noqa: SIM115
    faulthandler.register(_STACK_SIGNAL, file=stack_file, all_threads=True)
    conn = _connect(address, token)
    # Rank 0 hosts the store on a port the OS picks, so there is no race for a "free" port;
    # the test process forwards that port to the other ranks.
    store = None
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    _send(conn, ("worker", world_id, rank, os.getpid(), store.port if store else None))
    try:
        if store is None:
            _, port = _recv(conn)
            store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False)
        _set_rank_environment(rank, world_size, store.port)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    except Exception:
        _send(conn, ("init_failed", traceback.format_exc()))
        return
    _send(conn, ("ready",))
    _serve(conn, rank, world_size, _scratch_path(scratch_dir, world_id, rank, "output"))


def _set_rank_environment(rank: int, world_size: int, port: int) -> None:
    # For code that reads the torchrun-style variables instead of asking torch.distributed.
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )


def _serve(conn: Connection, rank: int, world_size: int, output_path: str) -> None:
    baseline_env = dict(os.environ)
    baseline_threads = _fresh_worker_threads()
    while True:
        try:
            message = _recv(conn)
        except (EOFError, OSError):
            return  # the test process is gone
        if message[0] == "shutdown":
            _shutdown_torch_distributed()
            return
        with _redirect_output(output_path):
            reply = _run_task(message[1], rank, world_size, baseline_env, baseline_threads)
        try:
            conn.send_bytes(_pickle_reply(reply))
        except OSError:
            return  # the test process is gone


@contextlib.contextmanager
def _redirect_output(path: str) -> Iterator[None]:
    """Send everything this process prints during a call (Python and C level) to ``path``, which
    the test process replays inside the calling test so pytest captures it there."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "wb") as sink:  # truncated: holds this call's output only
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, saved_fd in zip((1, 2), saved):
            os.dup2(saved_fd, fd)
            os.close(saved_fd)


def _pickle_reply(reply: dict[str, Any]) -> bytes:
    try:
        return pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # e.g. fn returned a lambda or a lock
        error = {"status": "error", "reusable": reply["reusable"],
                 "traceback": f"the result could not be pickled:\n{traceback.format_exc()}"}
        return pickle.dumps(error, protocol=pickle.HIGHEST_PROTOCOL)


def _run_task(
    task: dict[str, Any],
    rank: int,
    world_size: int,
    baseline_env: dict[str, str],
    baseline_threads: Counter[str],
) -> dict[str, Any]:
    with _PeakThreads() as peak:
        try:
            _prepare_for_call(task, baseline_env)
            fn = _resolve_function(task["module"], task["qualname"], task["file"])
            args, kwargs = pickle.loads(task["payload"])  # after fn's module: args may use its classes
            reply: dict[str, Any] = {"status": "ok", "result": fn(rank, world_size, *args, **kwargs)}
        except BaseException:  # SystemExit from a test is a failure too
            reply = {"status": "error", "traceback": traceback.format_exc()}
    reply["peak_threads"] = peak.most
    reply["reusable"] = _reset_shared_state()
    # A call that says it leaves groups held has its world replaced: no census (its search for what
    # holds them walks the whole heap, about 10 s on 2 cores).
    reply["leaked"] = None if task["leaves_groups"] else _threads_leaked(baseline_threads, task["leak_grace_s"])
    return reply


class _PeakThreads:
    """The most threads this process had while the block ran, sampled every ``interval`` seconds
    by a thread of its own (not counted), and once at the end."""

    def __init__(self, interval: float = 0.05) -> None:
        self.most = 0
        self._interval = interval
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, name="harness-peak-threads", daemon=True)

    def __enter__(self) -> "_PeakThreads":
        self._sampler.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._stop.set()
        self._sampler.join()
        _wait_for_os_threads_to_exit([self._sampler.native_id])

    def _sample(self) -> None:
        while True:
            self.most = max(self.most, _thread_count() - 1)
            if self._stop.wait(self._interval):
                self.most = max(self.most, _thread_count() - 1)
                return


def _thread_count() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("Threads:"))


def _prepare_for_call(task: dict[str, Any], baseline_env: dict[str, str]) -> None:
    import torch

    sys.path[:] = list(dict.fromkeys([*task["sys_path"], *sys.path]))
    os.chdir(task["cwd"])
    os.environ.clear()
    os.environ.update(baseline_env)
    torch.manual_seed(SEED)
    random.seed(SEED)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(SEED)
    torch.set_default_dtype(torch.float32)


def _resolve_function(module_name: str, qualname: str, file: str | None) -> Callable[..., Any]:
    target: Any = _import_module(module_name, file)
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


def _import_module(name: str, file: str | None) -> Any:
    if name == "__main__":
        return _import_main_script(file)
    module = sys.modules.get(name)
    if module is None:
        try:
            module = importlib.import_module(name)
        except ImportError:
            module = None
    if module is not None and _is_from_file(module, file):
        return module
    if file is None:
        raise ImportError(f"cannot import {name!r} in the worker")
    # e.g. a test module under tests/ that is not importable by its pytest-assigned name.
    return _import_from_file(name, file)


def _import_main_script(file: str | None) -> Any:
    """The caller's own script, loaded the way multiprocessing's spawn does: as __mp_main__ (so
    its ``if __name__ == "__main__"`` block stays off) and aliased as __main__, so pickles that
    name either module resolve here and in the caller."""
    module = sys.modules.get("__mp_main__")
    if module is None or not _is_from_file(module, file):
        if file is None:
            raise ImportError("cannot find the caller's __main__ script in the worker")
        module = _import_from_file("__mp_main__", file)
    sys.modules["__main__"] = module
    return module


def _is_from_file(module: Any, file: str | None) -> bool:
    module_file = getattr(module, "__file__", None)
    if file is None or module_file is None:
        return file is None
    return os.path.realpath(module_file) == os.path.realpath(file)


def _import_from_file(name: str, file: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {name!r} from {file}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # registered first, as import does, so pickles can refer to it
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _reset_shared_state() -> bool:
    """Undo what one call may leave behind; return whether this worker can serve another call.

    A gloo group's threads and sockets live until the last reference to the group goes, and
    destroy_process_group only unregisters it. So beyond destroying the call's groups, this drops
    every other holder: megatron-core's globals, DTensor's caches (keyed by meshes, which hold
    their groups), and reference cycles (a model and its hooks), which only a full collection
    frees."""
    try:
        import torch.distributed as dist
        from megatron.core import parallel_state

        from megatron_eopt.training.model.model_parallel import forget_model_parallel_groups

        subgroups = _live_subgroups()  # held here, so that their teardown runs below, all at once
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        forget_model_parallel_groups()
        _destroy_subgroups()
        _clear_dtensor_caches()
        gc.collect()
        _release_together(subgroups)
        return dist.is_initialized()  # False if the call destroyed the default group
    except Exception:
        traceback.print_exc()
        return False


def _clear_dtensor_caches() -> None:
    """DTensor's sharding-propagation and redistribution caches keep the meshes of their keys."""
    if "torch.distributed.tensor" not in sys.modules:
        return
    from torch.distributed.tensor import debug

    debug._clear_sharding_prop_cache()
    redistribute = sys.modules.get("torch.distributed.tensor._redistribute")
    if hasattr(redistribute, "clear_redistribute_planner_cache"):  # torch >= 2.11
        redistribute.clear_redistribute_planner_cache()
    if hasattr(redistribute, "_gen_transform_infos"):
        redistribute._gen_transform_infos.cache_clear()
    collective_utils = sys.modules.get("torch.distributed.tensor._collective_utils")
    if collective_utils is not None:
        collective_utils.MeshTopoInfo.build_from_mesh.cache_clear()


# Threads started once per process and kept by design: torch's autograd per-device threads, and
# jemalloc's background thread, which `import pyarrow` starts (torchtitan's and verl's data imports).
_PROCESS_LIFETIME_THREADS = ("pt_autograd_", "jemalloc_bg_thd")
# The name a native thread inherits from the process (a thread that never names itself).
_MAIN_THREAD_NAME = Path("/proc/self/comm").read_text().strip() if os.path.exists("/proc/self/comm") else "python"


def _dynamo_prefetch_pool() -> Any:
    """torch's dynamo prefetches with this module-level pool."""
    return getattr(sys.modules.get("torch.utils._functools"), "_prefetch_executor", None)


def _inductor_compile_pool() -> Any:
    """Inductor compiles in a pool it makes at its first compile (not on an FX graph cache hit)
    and caches for the process's life; None until then (asking must not make it)."""
    async_compile = sys.modules.get("torch._inductor.async_compile")
    if async_compile is None or not async_compile.AsyncCompile.pool.cache_info().currsize:
        return None
    return async_compile.AsyncCompile.pool()


# Thread pools torch keeps for the process's life, whose threads start at their first use.
_PROCESS_LIFETIME_POOLS = (_dynamo_prefetch_pool, _inductor_compile_pool)


def _thread_states() -> list[tuple[str, str]]:
    """(name, state letter: S sleeping, R running, ...) of this process's threads but the calling one (gloo
    names its own: gloo_tcp_loop, pt_gloo_runloop), the workers of the process-lifetime pools aside."""
    skipped = {thread.native_id for thread in _process_lifetime_pool_threads()} | {threading.get_native_id()}
    threads = []
    for task in os.listdir("/proc/self/task"):
        if int(task) in skipped:
            continue
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            name = Path(f"/proc/self/task/{task}/comm").read_text().strip()
            state = Path(f"/proc/self/task/{task}/stat").read_text().rsplit(")", 1)[1].split()[0]
            threads.append((name, state))
    return threads


def _thread_census() -> Counter[str]:
    """This process's threads by name, the calling one included (_thread_states)."""
    me = Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()
    return Counter([name for name, _ in _thread_states()] + [me])


def _all_asleep_but_me(names: Iterable[str] | None = None) -> bool:
    """Whether every other thread (of these names) sleeps: none is still starting, working or ending."""
    wanted = None if names is None else set(names)
    return all(state == "S" for name, state in _thread_states() if wanted is None or name in wanted)


def _wait_for(event: Callable[[], bool], poll: float, at_most: float = _EVENT_WAIT_S) -> bool:
    """Ask `event` every `poll` seconds until it holds (True) or `at_most` seconds passed (False: it did not come)."""
    deadline = time.monotonic() + at_most
    while not event():
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll)
    return True


def _process_lifetime_pool_threads() -> set[threading.Thread]:
    threads: set[threading.Thread] = set()
    for pool in _PROCESS_LIFETIME_POOLS:
        threads.update(getattr(pool(), "_threads", ()))
    return threads


def _fresh_worker_threads() -> Counter[str]:
    """The threads of a worker that has run one collective on its default group, once their names
    hold still: a native thread names itself after it starts (gloo's pt_gloo_runloop), and one
    counted under the process's name here would look like a leak later."""
    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.zeros(1))
    # A thread that has not run yet still bears the process's name (gloo's name themselves as they start):
    # once every other such thread sleeps, each has started. (Past the bound, _extra_threads still counts a
    # late rename as no new thread.)
    _wait_for(lambda: _all_asleep_but_me([_MAIN_THREAD_NAME]), poll=0.01)
    return _thread_census()


def _extra_threads(baseline: Counter[str]) -> Counter[str]:
    census = _thread_census()
    extra = census - baseline
    for name in list(extra):
        if name.startswith(_PROCESS_LIFETIME_THREADS):
            del extra[name]
    # A thread the baseline counted under the process's name that has named itself since is no new thread:
    # as many threads of new names as the process's name lost are renamed ones.
    renamed = max(baseline[_MAIN_THREAD_NAME] - census[_MAIN_THREAD_NAME], 0)
    for name, count in extra.most_common():  # the most numerous kind first: a lone gloo_tcp_loop stays a group
        taken = min(renamed, count)
        extra[name] -= taken
        renamed -= taken
    return +extra  # without the names counted down to 0


def _threads_leaked(baseline: Counter[str], grace_s: float = _LEAK_WAIT_S) -> dict[str, Any] | None:
    """What threads the call left beyond a fresh worker's, and what holds them (a chain from a
    loaded module to a live group, a Python thread still running); None if it left none."""
    extra = _extra_threads(baseline)
    # A group's threads end as its last reference goes (its destructor joins them), some a moment after:
    # a thread still on its way out is no leak. Wait until the extra threads are gone, or sleep as a live
    # group's do (then still `grace_s`); a leaked thread is still there after that.
    waited_from = time.monotonic()
    _wait_for(lambda: not _extra_threads(baseline) or (
        time.monotonic() - waited_from >= grace_s and _all_asleep_but_me(_extra_threads(baseline))), poll=0.01)
    extra = _extra_threads(baseline)
    if not extra:
        return None
    groups = extra["gloo_tcp_loop"]
    text = ", ".join(f"{count} {name}" for name, count in extra.most_common()) + " threads"
    if groups:
        text += f" (about {groups} gloo group(s) still alive)"
    pooled = _process_lifetime_pool_threads()
    started = [thread.name for thread in threading.enumerate()
               if thread is not threading.main_thread() and thread not in pooled]
    if started:
        text += f"; Python threads: {', '.join(started)}"
    chains = _chains_from_modules_to_groups(min(groups, 3)) if groups else []
    if chains:
        text += "; held by: " + "; ".join(chains)
    elif groups:
        text += "; no module reaches them: objects C++ keeps alive hold them (e.g. a gradient hook on a parameter)"
    # Only native threads of no known kind (torch's profiler starts one at its first use and keeps
    # it for the process's life): the world is replaced, the call does not fail.
    return {"text": text, "fails": bool(groups or started or set(extra) - {_MAIN_THREAD_NAME})}


def _chains_from_modules_to_groups(most: int) -> list[str]:
    """"module x -> dict -> list -> ProcessGroup": for up to ``most`` live groups other than the
    default one, how a module's namespace reaches it, found by walking references down from every
    loaded module, breadth first. The walk ends at the ``most``-th group found (the caller counts
    the live groups by their threads), else it covers the whole heap (9-12 s in a worker): a group
    none reaches is held only by objects C++ keeps alive, such as a gradient hook on a parameter of
    its own model."""
    import torch.distributed as dist

    roots = [module for module in list(sys.modules.values()) if module is not None]
    objects: dict[int, Any] = {id(root): root for root in roots}  # also keeps every id valid
    parent: dict[int, int] = {}
    queue = collections.deque(roots)  # breadth first: each chain found is a shortest one
    found: list[Any] = []
    while queue and len(found) < most:
        obj = queue.popleft()
        for referent in gc.get_referents(obj):
            is_group = isinstance(referent, dist.ProcessGroup)
            # Untracked objects (strings, numbers) refer to nothing; a group is untracked too.
            if id(referent) in objects or not (is_group or gc.is_tracked(referent)):
                continue
            objects[id(referent)] = referent
            parent[id(referent)] = id(obj)
            if not is_group:
                queue.append(referent)
            elif referent is not dist.group.WORLD:
                found.append(referent)
    return [_chain_to(group, parent, objects) for group in found]


def _chain_to(target: Any, parent: dict[int, int], objects: dict[int, Any]) -> str:
    steps, key = [], id(target)
    while key in parent:
        steps.append(type(objects[key]).__qualname__)
        key = parent[key]
    steps.append(f"module {getattr(objects[key], '__name__', '?')}")
    return " -> ".join(reversed(steps))


def _live_subgroups() -> list:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    # torch has no public list of live groups; pg_map is the registry destroy_process_group uses.
    return [group for group in getattr(distributed_c10d, "_world").pg_map if group is not dist.group.WORLD]


def _destroy_subgroups() -> None:
    import torch.distributed as dist

    for group in _live_subgroups():
        dist.destroy_process_group(group)


def _release_together(groups: list) -> None:
    """Drop these references to `groups` (emptying the list), each on a thread of its own. A gloo group's
    destructor waits about 20 ms for its transport's threads; one after another, megatron-core's ~20
    groups took ~300 ms after every call, together ~25 ms (measured on a 2-vCPU VM). A group someone
    else still holds stays alive, and the leak census below finds it."""
    holders = [[group] for group in groups]
    groups.clear()
    threads = [threading.Thread(target=holder.clear, name="harness-release", daemon=True) for holder in holders]
    del holders
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    _wait_for_os_threads_to_exit(thread.native_id for thread in threads)


def _wait_for_os_threads_to_exit(native_ids) -> None:
    """join() returns before the OS thread has quite exited; the leak census must not see it. Waits until
    each is gone (a joined thread always goes; the bound only ends a wait on a broken worker)."""
    for native_id in native_ids:
        _wait_for(lambda: not os.path.exists(f"/proc/self/task/{native_id}"), poll=0.001)


def _shutdown_torch_distributed() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__" and sys.argv[1:2] == ["--zygote"]:
    # Running as a script put tests/ first on sys.path; workers mirror the caller's path instead.
    del sys.path[0]
    _zygote_main(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: with torch and megatron-core loaded it takes seconds.
    os._exit(0)
