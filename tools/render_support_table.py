"""Rewrite the README's optimizer support table from the registry.

The table lies between `<!-- support-table:start -->` and `<!-- support-table:end -->`;
tests/unit/library/test_optimizer_support.py fails when it differs from
`megatron_eopt.registry.support_table_markdown()`. `--check` only reports a difference.
"""

import argparse
import pathlib
import sys

from megatron_eopt.registry import support_table_markdown

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
START, END = "<!-- support-table:start -->\n", "<!-- support-table:end -->"


def with_table(text: str, table: str) -> str:
    """`text` with the part between the markers replaced by `table`."""
    if text.count(START) != 1 or text.count(END) != 1:
        raise ValueError(f"README.md must contain {START.strip()!r} and {END!r} once each.")
    head, rest = text.split(START)
    _, tail = rest.split(END)
    return head + START + table + END + tail


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the README's table is stale")
    args = parser.parse_args()
    text = README.read_text()
    updated = with_table(text, support_table_markdown())
    if args.check:
        print("up to date" if updated == text else "README.md's support table is stale")
        return 0 if updated == text else 1
    README.write_text(updated)
    return 0


if __name__ == "__main__":
    sys.exit(main())
