"""megatron-core 0.19.2's optimizer checkpoint files, one module per writer: dist_checkpointing, its
DistributedOptimizer, its LayerWiseDistributedOptimizer, the fsdp_dtensor format; their table of layouts."""
