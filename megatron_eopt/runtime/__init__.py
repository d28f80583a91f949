"""The bottom layer: what the process runs on and with, imported by every layer above.

process_groups.py: the parallel groups of a run and one helper for each group's size and rank
(`group_size(None) == 1`); hardware.py: device capabilities (native bf16 matmul); once.py:
warnings given once per process; rank_exit.py: a refused run's one line on rank 0 and exit status
on every rank; torchrun_store.py: a store key space per torchrun restart (the trainer's and
Megatron-LM's loop's). They import no other megatron_eopt module. The run-time CPU
patches of megatron-core's packages, applied only by their `install()` and only without CUDA:
megatron_fsdp_cpu.py (Megatron-FSDP) and megatron_lm_cpu.py (Megatron-LM's loop), with the
stand-ins they share in cpu_stand_ins.py; megatron_core_torch_adam.py mends megatron-core's
DistributedOptimizer with torch's Adam (no TE or Apex), on CPU through megatron_lm_cpu and on a GPU
through its own `install()`; help_text.py doubles the stray `%` of help strings (Megatron-LM's) that
argparse cannot print.
"""
