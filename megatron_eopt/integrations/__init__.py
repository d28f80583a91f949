"""Adapters that plug megatron_eopt into other trainers' own loops.

Each adapter is its own module and imports its trainer; this package imports nothing, so
`import megatron_eopt` never loads a trainer. Megatron-LM: `megatron_eopt.integrations.megatron_lm`.
"""
