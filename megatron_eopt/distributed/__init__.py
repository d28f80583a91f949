"""Process groups and, later, data-parallel distribution of the optimizer."""
