"""A refusal that ends with a pointer to --help: one line, its punctuation not doubled (issue #84)."""

import argparse

import pytest

from megatron_eopt.runtime.rank_exit import exit_pointing_to_help


def _refusal(call, capsys, monkeypatch) -> str:
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as exit_info:
        call()
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    return line


@pytest.mark.parametrize("message,said", [
    ("--x must be > 0; got 0.", "--x must be > 0; got 0; see prog --help."),
    ("unknown --y (did you mean --x?)", "unknown --y (did you mean --x?); see prog --help."),
    ("no full stop", "no full stop; see prog --help."),
])
def test_the_pointer_follows_the_message_once_punctuated(message, said, capsys, monkeypatch) -> None:
    assert _refusal(lambda: exit_pointing_to_help(message, "prog"), capsys, monkeypatch) == f"prog: error: {said}"


def test_megatron_lms_loop_refuses_matmul_precision_low_in_one_line(capsys, monkeypatch) -> None:
    """scripts/pretrain_gpt_megatron_lm.py's parser: Megatron-LM's flags with ours (add_script_args)."""
    from megatron.training.arguments import add_megatron_arguments

    from megatron_eopt.integrations.megatron_lm_gpt import add_script_args

    parser = add_script_args(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
    line = _refusal(lambda: parser.parse_args(["--muon-fp32-matmul-prec", "low"]), capsys, monkeypatch)
    assert line.startswith("pretrain_gpt_megatron_lm.py: error: argument --muon-fp32-matmul-prec: 'low' is not"), line
    assert line.endswith("choose one of highest, high, medium; see pretrain_gpt_megatron_lm.py --help."), line
