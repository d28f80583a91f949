"""`--help` of Megatron-LM's loop lists every flag: help strings with a stray `%` are mended (issue #98)."""

import argparse
import contextlib
import io
import re

import pytest

from megatron_eopt.runtime.help_text import escape_stray_percent_signs


def _help_exit(parser: argparse.ArgumentParser) -> tuple[int, str]:
    """`prog --help` in process: (exit status, what it printed)."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--help"])
    return exit_info.value.code, printed.getvalue()


def test_only_stray_percent_signs_are_doubled() -> None:
    parser = argparse.ArgumentParser(prog="prog")
    parser.add_argument("--stray", type=float, default=1.1, help="headroom (e.g. 1.10 = 10%).")
    parser.add_argument("--named", type=int, default=7, help="a count (default: %(default)s, 100%% sure).")
    parser.add_argument("--unknown", help="%(nothing)s here, 5% there")
    with pytest.raises(ValueError, match="unsupported format character"):
        parser.format_help()
    assert escape_stray_percent_signs(parser) == ["--stray", "--unknown"]
    code, printed = _help_exit(parser)
    text = " ".join(printed.split())
    assert code == 0
    assert "headroom (e.g. 1.10 = 10%)." in text
    assert "a count (default: 7, 100% sure)." in text  # argparse's own conversions still expand
    assert "%(nothing)s here, 5% there" in text  # a conversion naming no attribute: the text as written
    assert escape_stray_percent_signs(parser) == []  # mended once


def test_megatron_lm_loop_help_lists_every_flag() -> None:
    """scripts/pretrain_gpt_megatron_lm.py's parser, as Megatron-LM's parse_args builds it: its flags, then
    ours (add_script_args). Megatron-LM 0.19.2's --moe-paged-stash-buffer-size-factor-cuda help made
    `--help` exit 2 ("unsupported format character ')'")."""
    from megatron.training.arguments import add_megatron_arguments

    from megatron_eopt.integrations.megatron_lm_gpt import add_script_args

    parser = add_script_args(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
    code, printed = _help_exit(parser)
    assert code == 0
    options = {option for action in parser._actions if action.help != argparse.SUPPRESS
               for option in action.option_strings}
    listed = set(re.findall(r"(?<![\w-])--?[\w-]+", printed))
    assert options <= listed, sorted(options - listed)
    assert "--moe-paged-stash-buffer-size-factor-cuda" in options and "(e.g. 1.10 = 10%)" in " ".join(printed.split())
    assert {"--megatron-core-optimizer", "--muon-match-adamw-rms", "--muon-tp-mode"} <= listed
