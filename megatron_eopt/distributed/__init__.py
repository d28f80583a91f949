"""Data-parallel distribution of the optimizer: the layer-wise optimizer and FSDP2 (process groups: runtime/)."""
