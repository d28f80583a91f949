"""Shared pytest fixtures.

``bf16_products``: the test runs bf16 products as a CPU with native bf16 does, on every CPU
(tests/bf16_numerics.py); every test whose subject is bf16 behaviour uses it (a multi-rank body
enters ``bf16_numerics()`` itself).

``run_distributed`` runs a function on N CPU ranks (gloo). Importing torch + megatron-core costs
~15-20 s of CPU per process, so the worker processes are started once per session and reused
across tests rather than per test; see tests/distributed_harness.py.
"""

import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

# emerging_optimizers' `@torch.compile`d updates run eagerly in the suite, in every process it starts
# (they inherit the environment): inductor compiled them on every rank of every test that stepped
# them (a 4-rank test: 82 CPU s with an empty compile cache, 32 eagerly). test_compiled_step.py
# compiles each and holds it to the eager update. TORCH_COMPILE_DISABLE=0 compiles everywhere
# (docs/testing.md, "Compiled updates run eagerly").
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")

import pytest  # noqa: E402

from tests import distributed_harness
from tests.bf16_numerics import bf16_numerics
from tests.megatron_lm_in_process import read_field_docstrings_once
from tests.tiers import (  # noqa: F401 (the tier markers' hooks: tests/tiers.py)
    pytest_addoption,
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_sessionfinish,
)

pytest_plugins = ("tests.worker_groups",)  # which tests share a process under pytest-xdist


def pytest_collection_finish(session: pytest.Session) -> None:
    # Overlap the workers' one-off import with the tests that run before the first distributed
    # one, instead of making that test wait for it.
    if session.config.option.collectonly:
        return
    if any("run_distributed" in getattr(item, "fixturenames", ()) for item in session.items):
        distributed_harness.prestart_distributed()


def pytest_runtest_setup(item: pytest.Item) -> None:
    # Megatron-LM's parser reads its help texts from source at every parse; in-process tests parse
    # hundreds of times (tests/megatron_lm_in_process.py). Only once a test has imported it.
    if "megatron.training.argument_utils" in sys.modules:
        read_field_docstrings_once()


@pytest.fixture(scope="session")
def run_distributed() -> Iterator[Callable[..., list[Any]]]:
    """``run_distributed(fn, world_size, args=(), kwargs=None, timeout=300) -> list``.

    ``fn`` is a module-level function, called as ``fn(rank, world_size, *args, **kwargs)`` on
    every rank with torch.distributed initialised; the results come back in rank order.
    """
    yield distributed_harness.run_distributed
    distributed_harness.shutdown_distributed()


@pytest.fixture
def bf16_products() -> Iterator[None]:
    with bf16_numerics():
        yield
