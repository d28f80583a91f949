"""Optimizer state off the accelerator (docs/memory.md); this package only holds its two modules.

host_resident.py: during the step (`optimizer_cpu_offload`): state and main weights of a fraction of
the parameters live on the host and stream to the device for their window of the step.
offload_to_cpu.py: between steps (megatron-core's `offload_to_cpu()` / `restore_from_cpu()`): all of
an optimizer's own tensors to the host and back, for RL loops that free the accelerator to generate.
"""
