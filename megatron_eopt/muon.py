"""Deprecated import path, kept for old callers: `megatron_eopt.muon.get_megatron_muon_optimizer`.

Write `megatron_eopt.get_megatron_optimizer(config, model_chunks)` instead. The forwarding code
is integrations/deprecated_muon.py; Muon itself is optimizers/muon/tensor_parallel_muon.py.
"""

from megatron_eopt.integrations.deprecated_muon import get_megatron_muon_optimizer

__all__ = ["get_megatron_muon_optimizer"]
