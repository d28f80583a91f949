"""Muon's step, for tensor-parallel shards, fused weights and FSDP2 row shards.

- step.py: the step: emerging_optimizers' orthogonalized step (labelled copies) with one
  `orthogonalize_all_fn` call for every parameter.
- shards.py: where each matrix lives (layouts, row shards), its TP mode, and the
  orthogonalize function the step is given.
- tensor_parallel_muon.py, tensor_parallel_adaptive_muon.py: the optimizers.
- megatron_core_args.py: megatron-core's TensorParallelMuon arguments in our terms.
Newton-Schulz itself and how the shards of a matrix meet are ops/newton_schulz.py and ops/row_shards.py.
"""
