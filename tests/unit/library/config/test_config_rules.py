"""OptimizerConfig's value rules (config/rules.py): torch-free, the config's own checks, and
usable on a command line's flags before the defaults are known (None: not given)."""

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from megatron_eopt import OptimizerConfig
from megatron_eopt.config.rules import check_values

BAD = [
    dict(fp16=True, bf16=True),
    dict(lr=0.1, min_lr=1.0),
    dict(adam_beta1=1.5),
    dict(loss_scale=0.0),
    dict(muon_match_adamw_rms=True, muon_scale_mode="unit_rms_norm"),
    dict(optimizer="adam", muon_gram_newton_schulz=True),
    dict(overlap_param_gather=True),
    dict(qk_clip_alpha=1.0),
]


@pytest.mark.parametrize("bad", BAD, ids=[",".join(bad) for bad in BAD])
def test_the_config_and_the_given_flags_fail_alike(bad) -> None:
    with pytest.raises(ValueError) as from_config:
        OptimizerConfig(**bad)
    with pytest.raises(ValueError) as from_flags:  # only the fields given; the rest unknown (None)
        check_values(SimpleNamespace(**bad))
    assert str(from_flags.value) == str(from_config.value)


def test_rules_on_unknown_fields_wait() -> None:
    check_values(SimpleNamespace())  # nothing given: nothing to refuse
    check_values(SimpleNamespace(min_lr=1.0))  # lr not known yet
    check_values(SimpleNamespace(muon_gram_newton_schulz=True))  # the optimizer not known yet


def test_importing_the_rules_imports_no_torch() -> None:
    code = "import sys\nimport megatron_eopt.config.rules\nprint(__import__('json').dumps('torch' in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(result.stdout) is False
