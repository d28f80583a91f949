"""One command line, the same settings in our trainer as in Megatron-LM's loop (issue 75 item 1).

Each command line of ROWS is parsed by Megatron-LM's parser with install()'s flags and its validate_args
(tests/megatron_lm_parity.py), and by our trainer's parser, in-process; every OptimizerConfig field, every
TransformerConfig field our trainer sets, the scheduler's arguments, our model settings and every other
argument both hold must agree, except the settings docs/trainer.md's table of allowed differences names with a reason.
Megatron-LM's parser is the reference: the expected values are its, not ours.
"""

import pathlib
import re

import pytest

from tests.megatron_lm_parity import differences, resolved_by_megatron_lm, resolved_by_ours

MODEL = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
         "--micro-batch-size 2 --global-batch-size 8 --train-iters 4 --lr 1e-3 --mock-data --tokenizer-type "
         "NullTokenizer --vocab-size 256").split()
# (name, flags beyond MODEL, world size)
ROWS = [
    ("dense-adam", "", 1),
    ("dense-muon", "--optimizer muon", 1),
    ("llama-style", "--optimizer muon --swiglu --normalization RMSNorm --position-embedding-type rope --no-rope-fusion "
                    "--disable-bias-linear --untie-embeddings-and-output-weights --group-query-attention "
                    "--num-query-groups 2 --qk-layernorm --rotary-base 500000 --rotary-percent 0.5", 1),
    ("moe-ep2", "--optimizer muon --num-experts 4 --moe-router-topk 2 --disable-bias-linear "
                "--expert-model-parallel-size 2 --moe-aux-loss-coeff 0.01", 2),
    ("mla", "--optimizer muon --multi-latent-attention --q-lora-rank 32 --kv-lora-rank 16 --qk-head-dim 16 "
            "--qk-pos-emb-head-dim 8 --v-head-dim 16 --position-embedding-type rope", 1),
    ("tp2-sequence-parallel", "--optimizer muon --tensor-model-parallel-size 2 --sequence-parallel --vocab-size 300", 2),
    ("pp2", "--optimizer muon --pipeline-model-parallel-size 2 --num-layers 4", 2),
    ("tp2-pp2-distributed-optimizer", "--optimizer muon --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
                                      "--num-layers 4 --use-distributed-optimizer --global-batch-size 16", 8),
    ("bf16", "--optimizer muon --bf16", 1),
    ("fp16", "--fp16 --initial-loss-scale 4096", 1),
    ("schedule", "--lr-decay-style cosine --lr-warmup-iters 2 --min-lr 1e-4 --weight-decay 0.1 --clip-grad 0.5 "
                 "--seed 7 --adam-beta2 0.95", 1),
]
TRAINER_DOC = pathlib.Path(__file__).parents[3] / "docs" / "trainer.md"


def _allowed() -> dict[str, str]:
    """{setting: its row} of docs/trainer.md's table of allowed differences."""
    text = TRAINER_DOC.read_text()
    table = text.split("<!-- allowed differences: begin -->")[1].split("<!-- allowed differences: end -->")[0]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    return {name: row for row in rows for name in re.findall(r"`([\w.]+)`", row.split("|")[1])}


@pytest.fixture(scope="module")
def registered_rows():
    from megatron_eopt.registry import list_optimizers

    return [(f"optimizer-{name}", f"--optimizer {name}", 1) for name in list_optimizers()]


def _differences(flags: str, world_size: int) -> dict:
    argv = MODEL + flags.split()
    return differences(resolved_by_ours(argv, world_size), resolved_by_megatron_lm(argv, world_size))


@pytest.mark.parametrize("name, flags, world_size", ROWS, ids=[row[0] for row in ROWS])
def test_a_command_line_resolves_as_in_megatron_lms_loop(name: str, flags: str, world_size: int) -> None:
    unexplained = {key: values for key, values in _differences(flags, world_size).items() if key not in _allowed()}
    assert not unexplained, (f"{name}: settings that differ from Megatron-LM's (ours, Megatron-LM's) without a "
                             f"row in docs/trainer.md's table: {unexplained}")


def test_every_registered_optimizer_resolves_as_in_megatron_lms_loop(registered_rows) -> None:
    found = {name: {k: v for k, v in _differences(flags, ws).items() if k not in _allowed()}
             for name, flags, ws in registered_rows}
    assert not any(found.values()), {name: found for name, found in found.items() if found}


def test_muon_momentum_is_megatron_lms_parser_default() -> None:
    """The difference the issue found: OptimizerConfig (megatron-core) has 0.95, Megatron-LM's parser 0.9."""
    import argparse

    import megatron.training.arguments as megatron_lm_arguments

    from megatron_eopt.config.optimizer_config import OptimizerConfig

    parser = megatron_lm_arguments.add_megatron_arguments(argparse.ArgumentParser())
    megatron_lm_default = parser.get_default("muon_momentum")
    assert megatron_lm_default != OptimizerConfig().muon_momentum  # else this row has nothing to show
    argv = MODEL + ["--optimizer", "muon"]
    assert resolved_by_ours(argv, 1)["OptimizerConfig.muon_momentum"] == megatron_lm_default
    assert resolved_by_megatron_lm(argv, 1)["OptimizerConfig.muon_momentum"] == megatron_lm_default


def test_every_row_of_the_table_is_a_difference_found() -> None:
    """No stale rows: each allowed difference occurs for some command line (the device-chosen one only
    where the device makes it differ)."""
    found = set().union(*(_differences(flags, ws) for _, flags, ws in ROWS))
    stale = {name for name, row in _allowed().items() if name not in found and "device" not in row}
    assert not stale, f"rows of docs/trainer.md's table that no command line shows: {sorted(stale)}"
