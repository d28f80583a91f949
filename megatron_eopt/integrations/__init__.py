"""Adapters that plug megatron_eopt into other trainers' own loops and older callers.

Each adapter is its own module and imports its trainer; this package imports nothing, so
`import megatron_eopt` never loads a trainer. Megatron-LM: `megatron_eopt.integrations.megatron_lm`
(and megatron_lm_gpt.py); Megatron-Bridge: `megatron_bridge.py` (`setup_optimizer`); torchtitan's
Trainer: `torchtitan.py` (`MegatronOptimizers.Config`); megatron-core's deprecated
`get_megatron_muon_optimizer`: `deprecated_muon.py` (also at `megatron_eopt.muon`).
"""
