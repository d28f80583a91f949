"""Help texts argparse cannot print, mended in the parser at run time (never in the installed package).

argparse formats every help string with `%`, as in `%(default)s`, so a literal percent sign must be
written `%%`. Megatron-LM 0.19.2 builds some flags' help from megatron-core's docstrings, and one of
them, `--moe-paged-stash-buffer-size-factor-cuda`'s "(e.g. 1.10 = 10%)", has a bare `%`: `--help`
then fails with "unsupported format character" and exits 2, after the whole import. The extra-
arguments provider of Megatron-LM's loop (`megatron_lm.add_megatron_eopt_args`) calls
`escape_stray_percent_signs` on the parser it is given, so `--help` lists every flag, whatever
Megatron-LM release brings such a string.
"""

import argparse
import re

# What argparse reads in a help string: `%%`, a named conversion such as `%(default)s` or `%(prog)s`,
# or else a stray `%`.
_PERCENT = re.compile(r"%%|%\(\w+\)[-#0 +]*\d*(?:\.\d+)?[diouxXeEfFgGcrsa]|%")


def escape_stray_percent_signs(parser: argparse.ArgumentParser) -> list[str]:
    """Double every `%` that argparse would not read in the help of `parser`'s arguments, so that
    `--help` prints it as it stands; help strings that format already stay as they are. Returns the
    options whose help changed."""
    mended = []
    for action in parser._actions:  # argparse offers no public list of its arguments
        if isinstance(action.help, str) and not _formats(parser, action):
            written = action.help
            action.help = _PERCENT.sub(lambda match: "%%" if match.group(0) == "%" else match.group(0), written)
            if not _formats(parser, action):  # a conversion naming no attribute: the text as written
                action.help = written.replace("%", "%%")
            mended.append(action.option_strings[0] if action.option_strings else action.dest)
    return mended


def _formats(parser: argparse.ArgumentParser, action: argparse.Action) -> bool:
    """Whether argparse's help formatter expands `action`'s help without an error."""
    try:
        parser._get_formatter()._expand_help(action)  # what format_help() calls for each argument
    except (ValueError, TypeError, KeyError):
        return False
    return True
