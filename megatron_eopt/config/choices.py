"""The closed sets of OptimizerConfig's string fields, importable without torch.

`megatron_eopt.config.optimizer_config` re-exports them; command-line parsers read them here so
that building a parser (and `--help`) does not import torch.
"""

from typing import Literal

ScaleMode = Literal["spectral", "unit_rms_norm", "shape_scaling"]
# 'auto': per matrix, the exact mode (duplicated, distributed, sharded) predicted cheapest.
TpMode = Literal["blockwise", "duplicated", "distributed", "sharded", "auto"]
# What muon_tp_mode='auto' predicts with: named figures ('h100'), or rates calibrated here ('cpu');
# ops/muon_cost.py holds them (tests/unit/library/ops/test_muon_cost.py checks the two agree).
HardwareProfileName = Literal["h100", "cpu"]
# What emerging_optimizers' `FP32MatmulPrecT` and `torch.set_float32_matmul_precision` accept
# (Megatron-LM's 'low' is neither); the one list of them: config checks and command-line choices
# read it, and tests/unit/library/config/test_optimizer_config.py checks it against the installed emerging_optimizers.
MatmulPrecision = Literal["highest", "high", "medium"]
ScalarOptimizer = Literal["adam", "lion"]
AdaptiveMoment2Method = Literal["adamuon", "normuon"]
