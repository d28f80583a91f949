"""docs/trainer.md's list of refused engine combinations is the trainer's (issue #84: the docs said
MoE was refused on the sharded engines long after both trained it).

The list sits between `<!-- engine refusals: begin -->` and `<!-- engine refusals: end -->`, one
bullet per refusal: `- `ENGINE EXAMPLE`: why`, where ENGINE is the engine's flag and EXAMPLE the
flags that give the refusal, the refused one first. Each listed command line runs through the
trainer's parser in process and must exit 2 with one line saying that the engine does not support
the refused flag; and the list holds exactly the refusals of the code's table
(megatron_eopt/training/arguments/training.py's ENGINE_REFUSALS), so that neither drifts.
"""

import pathlib
import re
import shlex

import pytest

from megatron_eopt.training.arguments.training import ENGINE_REFUSALS

TRAINER_DOC = pathlib.Path(__file__).resolve().parents[3] / "docs" / "trainer.md"
LIST = re.compile(r"<!-- engine refusals: begin -->\n(.*?)<!-- engine refusals: end -->", re.S)
# Flags every listed line runs with: experts on CPU need bias-free linears, and at TP > 1 sequence
# parallelism (megatron-core's rules, refused earlier otherwise); 4 ranks fit TP 2 or PP 2 with DP 2.
COMMON = ["--optimizer", "adam", "--lr", "1e-3", "--disable-bias-linear", "--sequence-parallel"]
WORLD_SIZE = 4


def listed_refusals(text: str) -> list[tuple[str, str]]:
    """(engine flag, example) of each bullet in the marked list."""
    found = LIST.search(text)
    assert found, f"{TRAINER_DOC.name}: no `<!-- engine refusals: begin -->` ... `end -->` list"
    fragments = re.findall(r"^- `([^`]+)`", found.group(1), re.M)
    return [tuple(fragment.split(" ", 1)) for fragment in fragments]


LISTED = listed_refusals(TRAINER_DOC.read_text())


def test_the_list_is_the_codes() -> None:
    in_code = [(engine, refusal.example) for engine, (refusals, _) in ENGINE_REFUSALS.items() for refusal in refusals]
    assert sorted(LISTED) == sorted(in_code), (f"listed in docs/trainer.md, not refused by the code: "
                                              f"{sorted(set(LISTED) - set(in_code))}; refused by the code, not "
                                              f"listed: {sorted(set(in_code) - set(LISTED))}")


@pytest.mark.parametrize("engine,example", LISTED, ids=[" ".join(pair) for pair in LISTED])
def test_each_listed_combination_is_refused_in_one_line_naming_it(engine, example, monkeypatch, capsys) -> None:
    from megatron_eopt.training.arguments.parser import parse_args

    monkeypatch.setenv("WORLD_SIZE", str(WORLD_SIZE))
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as exit_info:
        parse_args(COMMON + [engine, *shlex.split(example)])
    assert exit_info.value.code == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    refused = example.split()[0]
    assert line.startswith(f"pretrain_gpt.py: error: {engine} does not support {refused}"), line
