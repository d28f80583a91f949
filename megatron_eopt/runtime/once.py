"""What a process says only once: warnings and log lines keyed by a short name.

A trainer builds optimizers many times (every test, every rebuild after a load); a setting that
deserves a warning deserves it once per process, not once per build. Every such message of the
library goes through `warn_once` or `first_time`, so one set records what has been said.
"""

import warnings



class RankWarning(UserWarning):
    """A warning about one rank alone (its data, its device): a trainer that prints the run's
    warnings on rank 0 only prints these on every rank."""


_GIVEN: set[str] = set()  # keys this process has said something about


def first_time(key: str) -> bool:
    """True the first time this process asks about `key`, False after that."""
    if key in _GIVEN:
        return False
    _GIVEN.add(key)
    return True


def warn_once(key: str, message: str, category: type[Warning] = UserWarning, stacklevel: int = 2) -> None:
    """`warnings.warn(message, category)` the first time `key` comes up in this process.

    `stacklevel` counts as if the caller called `warnings.warn` itself.
    """
    if first_time(key):
        warnings.warn(message, category, stacklevel=stacklevel + 1)
