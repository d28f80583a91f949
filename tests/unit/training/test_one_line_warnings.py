"""pretrain_gpt.py prints warnings as one line each, without Python's source line (training/errors.py)."""

import os
import warnings

import pytest

from megatron_eopt.training import errors

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_a_warning_is_one_line_without_source() -> None:
    text = errors.format_warning(UserWarning("--muon-tp-mode sharded has no effect\n  with --optimizer adam"),
                                 UserWarning, "/x/validate.py", 153, "    warnings.warn(")
    assert text == "pretrain_gpt.py: warning: --muon-tp-mode sharded has no effect with --optimizer adam (UserWarning)\n"


def test_main_installs_it_first(monkeypatch) -> None:
    from megatron_eopt.training import pretrain

    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # restored after the test
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit):
        pretrain.main(["--optimizer", "adam", "--lr", "1e-3", "--save", "README.md/ckpt"])
    assert warnings.formatwarning is errors.format_warning
