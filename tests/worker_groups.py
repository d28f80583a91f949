"""Which tests share a test process when pytest-xdist runs the suite in several (`make test`).

A module-scoped fixture (a trainer's data run, the parity matrix's runs, the docs' forked examples)
is computed once in each process that runs a test using it. So the tests that share one are sent to
one process together: each gets an `xdist_group` named after its module, which `--dist loadgroup`
keeps together. Every other test goes to whichever process is free. Without xdist the marks do nothing.
"""

from __future__ import annotations

import pytest

# A session fixture (the harness's workers, tmp_path_factory) is each process's own whatever the grouping.
SHARED_SCOPES = {"module", "class"}


@pytest.hookimpl(tryfirst=True)  # before xdist reads the marks (it appends the group to the test id)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if uses_a_shared_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


def uses_a_shared_fixture(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)  # absent on items that are not functions (doctests)
    if info is None:
        return False
    return any(definition.scope in SHARED_SCOPES
               for definitions in info.name2fixturedefs.values() for definition in definitions)
