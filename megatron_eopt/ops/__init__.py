"""Pure tensor operations: Newton-Schulz over TP shards, fused-weight splits, ownership."""
