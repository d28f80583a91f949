"""Parameters by name: per-parameter overrides (overrides.py: ParamKey, ParamGroupOverride), the
param groups and routing built from them (groups.py), and name helpers (names.py).

This package re-exports nothing: `from megatron_eopt import ParamKey`.
"""
