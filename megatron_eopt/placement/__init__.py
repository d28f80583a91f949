"""Where a sharded model's parameters lie: facts the optimizer (distributed/) and the checkpoints both read."""
