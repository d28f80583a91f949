"""The suite's shared modules (`from tests import ...`). A regular package, not a namespace one: verl 0.9.1's
wheel installs a top-level `tests` package into site-packages, and a regular package anywhere on the path
wins over a namespace package; this one, on the path before site-packages, wins over verl's."""
