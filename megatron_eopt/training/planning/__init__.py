"""The Muon planner: per-rank Newton-Schulz FLOPs, bytes, state and time for a model and a layout."""
