"""The tier markers (tests/tiers.py) come from what a test's code starts, read through the helpers it calls."""

import subprocess
import sys

from tests import distributed_harness, tiers


def _starts_an_interpreter() -> None:
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def _calls_a_helper_that_starts_one() -> None:
    _starts_an_interpreter()


def _hands_a_body_to_the_workers() -> None:
    distributed_harness.run_distributed(_calls_a_helper_that_starts_one, 2)


def _computes() -> int:
    return sum(range(3))


# In a dict, so that this test's own code names none of them (it would be marked by what they start).
SAMPLES = {"interpreter": _starts_an_interpreter, "helper": _calls_a_helper_that_starts_one,
           "workers": _hands_a_body_to_the_workers, "compute": _computes}


def test_what_a_function_starts_is_found_through_its_helpers() -> None:
    assert tiers.starts(SAMPLES["interpreter"]) == {"subprocess"}
    assert tiers.starts(SAMPLES["helper"]) == {"subprocess"}
    assert tiers.starts(SAMPLES["workers"]) == {"multirank", "subprocess"}
    assert tiers.starts(SAMPLES["compute"]) == set()


def test_the_library_is_megatron_eopt_without_the_trainer() -> None:
    modules = tiers.library_modules()
    assert "megatron_eopt.factory" in modules and "megatron_eopt.runtime.process_groups" in modules
    assert not [m for m in modules if m.startswith("megatron_eopt.training")]
