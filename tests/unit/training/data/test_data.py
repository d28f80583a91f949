"""megatron_eopt/training/data/datasets.py, megatron_eopt/training/data/tokenizer.py, tools/preprocess_data.py and the data/eval flags, in-process.

References are independent of the code under test: the documents' own UTF-8 bytes (read back
from the .bin/.idx with megatron-core's IndexedDataset), the document each training sample's
tokens come from (each document is a distinct repeated word), the blend weights given, and
GPT-2 BPE ids derived by hand from a tiny vocab.json/merges.txt (tokenized through the
`tokenizers` package, which the `scripts` extra installs).
"""

import json
import math
import pathlib
import re
import sys
import types

import numpy
import torch
import pytest

from megatron_eopt.training.data import datasets as data
from megatron_eopt.training.loop import evaluation
from megatron_eopt.training.data.tokenizer import build_tokenizer, padded_vocab_size
from megatron_eopt.training.data import preprocess

SEQ_LENGTH = 32


def _write_jsonl(path: pathlib.Path, texts: list[str]) -> pathlib.Path:
    path.write_text("".join(json.dumps({"text": text, "id": i}) + "\n" for i, text in enumerate(texts)))
    return path


def _preprocess(tmp_path: pathlib.Path, name: str, texts: list[str], *extra: str) -> str:
    source = _write_jsonl(tmp_path / f"{name}.jsonl", texts)
    prefixes = preprocess.main(["--input", str(source), "--output-prefix", str(tmp_path / name),
                                     "--append-eod", *extra])
    return prefixes["text"]


def _byte_docs(tmp_path: pathlib.Path, name: str, texts: list[str], workers: int = 1) -> str:
    return _preprocess(tmp_path, name, texts, "--tokenizer-type", "ByteLevelTokenizer", "--workers", str(workers))


def _doc_text(i: int) -> str:
    return f"w{i:03d} " * 20  # 100 bytes, a word no other document has


def _datasets(prefixes: list[str], split: str, counts: data.SampleCounts, tmp_path, mmap_bin_files: bool = True
              ) -> dict:
    return data.build_gpt_datasets(build_tokenizer("ByteLevelTokenizer"), prefixes, split, SEQ_LENGTH, 1234,
                                   counts, str(tmp_path / "cache"), mmap_bin_files=mmap_bin_files)


def _tokens(dataset, i: int) -> numpy.ndarray:
    return numpy.asarray(dataset[i]["tokens"])


def test_preprocess_writes_each_document_as_its_bytes_then_eod(tmp_path) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    texts = ["héllo wörld", "second document", "", "third"]  # the empty one is skipped
    prefix = _byte_docs(tmp_path, "docs", texts, workers=2)
    assert prefix == str(tmp_path / "docs_text_document")  # Megatron-LM's naming
    indexed = IndexedDataset(prefix)
    written = [list(indexed[i]) for i in range(len(indexed))]
    assert written == [list(t.encode("utf-8")) + [256] for t in texts if t]


def test_split_gives_disjoint_documents_and_the_sample_counts(tmp_path) -> None:
    """200 documents of 101 tokens, split 50/50/0: train samples come from documents 0-99 only,
    valid samples from 100-199; each split gives at least the samples asked for."""
    prefix = _byte_docs(tmp_path, "split", [_doc_text(i) for i in range(200)])
    datasets = _datasets([prefix], "50,50,0", data.SampleCounts(300, 14, 0), tmp_path)
    assert datasets["test"] is None and len(datasets["train"]) >= 300 and len(datasets["valid"]) >= 14

    def documents(dataset) -> set[int]:
        words = set()
        for i in range(len(dataset)):
            text = bytes(int(t) for t in _tokens(dataset, i) if t < 256).decode()
            words |= {int(m) for m in re.findall(r"w(\d{3})", text)}
        return words

    assert documents(datasets["train"]) <= set(range(100)) and documents(datasets["valid"]) <= set(range(100, 200))
    sample = datasets["train"][0]
    assert len(sample["tokens"]) == len(sample["labels"]) == SEQ_LENGTH
    assert list(sample["tokens"][1:]) == list(sample["labels"][:-1])  # labels are the tokens shifted by one

    # --no-mmap-bin-files: megatron-core reads the .bin file instead of mapping it; the same samples.
    unmapped = _datasets([prefix], "50,50,0", data.SampleCounts(300, 14, 0), tmp_path, mmap_bin_files=False)
    assert type(unmapped["train"].dataset.bin_reader).__name__ == "_FileBinReader"
    assert type(datasets["train"].dataset.bin_reader).__name__ == "_MMapBinReader"
    assert all((_tokens(unmapped["train"], i) == _tokens(datasets["train"], i)).all() for i in range(20))


def test_blend_draws_samples_in_proportion_to_the_weights(tmp_path) -> None:
    """--data-path 0.3 A 0.7 B: of 1000 training samples, those made of A's text are 30%."""
    a = _byte_docs(tmp_path, "a", ["a" * 200] * 50)
    b = _byte_docs(tmp_path, "b", ["b" * 200] * 50)
    blend = data.blend_from_data_path(["0.3", a, "0.7", b])
    assert blend == ([a, b], [0.3, 0.7])
    train = _datasets(["0.3", a, "0.7", b], "100,0,0", data.SampleCounts(1000, 0, 0), tmp_path)["train"]
    from_a = sum(ord("a") in _tokens(train, i) for i in range(1000))
    from_b = sum(ord("b") in _tokens(train, i) for i in range(1000))
    assert from_a + from_b == 1000
    # BlendedDataset assigns samples greedily to the dataset furthest below its share: exact to 1 sample.
    assert abs(from_a - 300) <= 1, from_a


def test_null_tokenizer_ids_are_below_vocab_size_and_eod_is_the_last(tmp_path) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    tokenizer = build_tokenizer("NullTokenizer", vocab_size=10)
    assert (tokenizer.vocab_size, tokenizer.eod) == (10, 9)
    assert tokenizer.tokenize("3 1 4 1 5") == [3, 1, 4, 1, 5]
    prefix = _preprocess(tmp_path, "null", ["3 1 4", "8 0"], "--tokenizer-type", "NullTokenizer", "--vocab-size", "10")
    indexed = IndexedDataset(prefix)
    assert [list(indexed[i]) for i in range(len(indexed))] == [[3, 1, 4, 9], [8, 0, 9]]
    assert padded_vocab_size(10, 128, 2) == 256  # Megatron-LM pads to 128 * TP


@pytest.mark.parametrize("text,message", [
    ("3 10", "--input line 1: token id 10 is outside the vocabulary 0..9 (--vocab-size)."),
    ("3 x", "--input line 1: NullTokenizer text must be integers separated by single spaces"),
])
def test_preprocess_rejects_bad_null_tokenizer_text(tmp_path, capsys, text: str, message: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _preprocess(tmp_path, "bad", [text], "--tokenizer-type", "NullTokenizer", "--vocab-size", "10")
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("preprocess_data.py: error: ") and message in lines[0], lines


def test_hugging_face_tokenizer_without_the_package_says_so(tmp_path, monkeypatch) -> None:
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as when it is not installed
    with pytest.raises(ValueError, match="needs the 'tokenizers' package, which is not installed"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "tokenizer.json"))


def test_hugging_face_tokenizer_reads_the_file_through_the_tokenizers_package(tmp_path, monkeypatch) -> None:
    """A stand-in `tokenizers` module records what the adapter asks of it."""
    opened = []

    class Encoding:
        def __init__(self, text: str) -> None:
            self.ids = [len(word) for word in text.split()]

    class Tokenizer:
        @staticmethod
        def from_file(path: str) -> "Tokenizer":
            opened.append(path)
            return Tokenizer()

        def get_vocab(self, with_added_tokens: bool) -> dict:
            return {"a": 0, "</s>": 7, "<|endoftext|>": 5}

        def get_vocab_size(self, with_added_tokens: bool) -> int:
            return 8

        def encode(self, text: str, add_special_tokens: bool) -> Encoding:
            assert add_special_tokens is False
            return Encoding(text)

    monkeypatch.setitem(sys.modules, "tokenizers", types.SimpleNamespace(Tokenizer=Tokenizer))
    path = tmp_path / "tokenizer.json"
    path.write_text("{}")
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(path))
    assert opened == [str(path)]
    assert (tokenizer.vocab_size, tokenizer.eod, tokenizer.pad) == (8, 5, -1)  # <|endoftext|> comes first
    assert tokenizer.tokenize("ab c") == [2, 1]



# GPT2BPETokenizer: a tiny GPT-2 vocab.json/merges.txt; expected ids derived by hand below.
# ------------------------------------------------------------------------------------------------

# Byte-level symbols (GPT-2 maps the space byte to "Ġ"), then one token per merge in rank order.
GPT2_VOCAB = {"d": 0, "e": 1, "h": 2, "l": 3, "o": 4, "r": 5, "w": 6, "Ġ": 7,
              "ll": 8, "he": 9, "hell": 10, "hello": 11, "Ġw": 12, "or": 13, "<|endoftext|>": 14,
              "!": 15}  # the end-of-document id is not the last
GPT2_MERGES = ["l l", "h e", "he ll", "hell o", "Ġ w", "o r"]
# By hand: GPT-2's regex splits "hello world" into "hello", " world" ("Ġworld"). "hello": l l ->
# ll, h e -> he, he ll -> hell, hell o -> hello = [11]. "Ġworld": Ġ w -> Ġw, o r -> or; no merge
# takes "l d" = [12, 13, 3, 0]. "Ġhello": no "Ġ h" merge, so Ġ then hello = [7, 11].
GPT2_HAND = {"hello world": [11, 12, 13, 3, 0], "world hello": [6, 13, 3, 0, 7, 11],
             "hello<|endoftext|>hello": [11, 14, 11]}


def _gpt2_files(folder: pathlib.Path) -> tuple[str, str]:
    vocab, merges = folder / "vocab.json", folder / "merges.txt"
    vocab.write_text(json.dumps(GPT2_VOCAB), encoding="utf-8")
    merges.write_text("#version: 0.2\n" + "".join(m + "\n" for m in GPT2_MERGES), encoding="utf-8")
    return str(vocab), str(merges)


def _gpt2_flags(folder: pathlib.Path) -> list[str]:
    vocab, merges = _gpt2_files(folder)
    return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges]


def test_gpt2_bpe_vocabulary_and_eod_come_from_vocab_json_without_the_package(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # the trainer reads GPT-2 data without it
    vocab, merges = _gpt2_files(tmp_path)
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    assert (tokenizer.vocab_size, tokenizer.eod, tokenizer.pad) == (16, GPT2_VOCAB["<|endoftext|>"], -1)
    with pytest.raises(ValueError, match="GPT2BPETokenizer needs the 'tokenizers' package to tokenize text"):
        tokenizer.tokenize("hello")


def test_preprocess_gpt2_bpe_without_the_package_exits_with_one_line(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(SystemExit):
        _preprocess(tmp_path, "gpt2", ["hello"], *_gpt2_flags(tmp_path))
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "needs the 'tokenizers' package" in lines[0], lines
    assert not list(tmp_path.glob("gpt2_text_document.*"))  # it stopped before writing


def test_gpt2_bpe_tokenizes_as_derived_by_hand(tmp_path) -> None:
    vocab, merges = _gpt2_files(tmp_path)
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    assert {text: tokenizer.tokenize(text) for text in GPT2_HAND} == GPT2_HAND


def test_preprocess_gpt2_bpe_writes_the_hand_derived_ids_then_eod(tmp_path) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    texts = ["hello world", "world hello"]
    indexed = IndexedDataset(_preprocess(tmp_path, "gpt2", texts, *_gpt2_flags(tmp_path), "--workers", "2"))
    assert [list(indexed[i]) for i in range(len(indexed))] == [GPT2_HAND[t] + [14] for t in texts]


def _write_ids(prefix: str, documents: list[list[int]]) -> str:
    """An indexed dataset written directly (the GPT-2 ids above, no `tokenizers` needed)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
    for ids in documents:
        builder.add_document(numpy.array(ids, dtype=numpy.uint16), [len(ids)])
    builder.finalize(prefix + ".idx")
    return prefix


def test_trainer_runs_on_gpt2_data_with_vocab_and_merge_files(tmp_path, run_distributed) -> None:
    """Megatron-LM's GPT-3 example's data flags: --data-path, --split, --vocab-file, --merge-file."""
    from tests.pretrain_gpt_in_process import run_pretrain_gpt

    documents = [GPT2_HAND["hello world"] + [14], GPT2_HAND["world hello"] + [14]] * 40
    prefix = _write_ids(str(tmp_path / "gpt2_text_document"), documents)
    argv = ["--data-path", prefix, "--split", "98,2,0", *_gpt2_flags(tmp_path), "--num-layers", "1",
            "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "4",
            "--global-batch-size", "4", "--train-iters", "8", "--lr", "1e-2", "--log-interval", "1",
            "--eval-iters", "0", "--data-cache-path", str(tmp_path / "cache")]
    losses = [r["loss"] for r in run_distributed(run_pretrain_gpt, 1, args=(argv,))[0]]
    # Two repeated sentences over 7 ids: the model learns them within 8 steps at this rate.
    assert len(losses) == 8 and losses[-1] < losses[0] - 1.0, losses


def test_validation_line_has_megatron_lms_format() -> None:
    # Megatron-LM's evaluate_and_print_results, written out: ' validation loss at {prefix} | ' then
    # '{key} value: {:.6E} | ' and '{key} PPL: {:.6E} | ' with PPL = exp(min(20, loss)).
    line = evaluation.validation_line("iteration 100", 2.5)
    assert line == f" validation loss at iteration 100 | lm loss value: {2.5:.6E} | lm loss PPL: {math.exp(2.5):.6E} | "
    assert evaluation.validation_line("iteration 1", 50.0).endswith(f"PPL: {math.exp(20):.6E} | ")
    rule, middle, rule_again = evaluation.validation_block("iteration 100", 2.5).split("\n")
    assert middle == line and rule == rule_again == "-" * (len(line) + 1)


def test_sample_counts_follow_megatron_lm() -> None:
    # train_iters * gbs; (train_iters // eval_interval + 1) * eval_iters * gbs; eval_iters * gbs
    assert data.SampleCounts.for_run(100, 8, 30, 5) == data.SampleCounts(800, 4 * 5 * 8, 5 * 8)


# ------------------------------------------------------------------------------------------------
# Flags: each wrong one exits with one line naming it (before any process group exists).
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prefix(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("prefix")
    return _byte_docs(folder, "docs", ["some text"] * 4)


def _bad_flags(tmp_path: pathlib.Path, prefix: str) -> list[tuple[list[str], str]]:
    text = tmp_path / "plain.txt"
    text.write_text("just text\n")
    tokenizer_json = tmp_path / "tokenizer.json"
    tokenizer_json.write_text("{}")
    byte = ["--tokenizer-type", "ByteLevelTokenizer"]
    vocab, merges = _gpt2_files(tmp_path)
    gpt2 = ["--tokenizer-type", "GPT2BPETokenizer"]
    return [
        (["--data-path", str(text), *byte], f"--data-path {text} is a plain file, not an indexed dataset prefix: "
                                            "convert it first, e.g. `python tools/preprocess_data.py"),
        (["--data-path", prefix + ".bin", *byte],
         f"--data-path takes dataset prefixes without .bin/.idx: give {prefix}"),
        (["--data-path", str(tmp_path / "none"), *byte], f"--data-path {tmp_path / 'none'}: no indexed dataset there"),
        (["--data-path", "0.3", prefix, "-1", prefix, *byte],
         "--data-path weights must be positive numbers; got '-1'."),
        (["--data-path", "0.3", prefix, "0.7", *byte], "stands where a dataset prefix belongs"),
        (["--data-path", prefix, *byte, "--mock-data"], "--data-path and --mock-data exclude each other"),
        (["--data-path", prefix], "--data-path needs --tokenizer-type"),
        (["--data-path", prefix, *byte, "--split", "90,x"], "--split takes up to three non-negative"),
        (["--data-path", prefix, *byte, "--split", "0,1,1"], "its first proportion must be > 0"),
        (["--data-path", prefix, *byte, "--vocab-size", "300"], "--vocab-size sets NullTokenizer's vocabulary"),
        (["--data-path", prefix, "--tokenizer-type", "NullTokenizer"],
         "--tokenizer-type NullTokenizer needs --vocab-size"),
        (["--data-path", prefix, "--tokenizer-type", "HuggingFaceTokenizer"],
         "--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model PATH"),
        (["--data-path", prefix, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path / "x")],
         f"--tokenizer-model {tmp_path / 'x'}: no such file"),
        (["--data-path", prefix, *byte, "--tokenizer-model", str(tokenizer_json)],
         "--tokenizer-model is read by --tokenizer-type HuggingFaceTokenizer only"),
        # Megatron-LM's build_tokenizer also rejects a missing --tokenizer-type: no GPT-2 inferred.
        (["--data-path", prefix, "--vocab-file", vocab, "--merge-file", merges],
         "--vocab-file/--merge-file need --tokenizer-type GPT2BPETokenizer"),
        (["--mock-data", "--vocab-file", vocab, "--merge-file", merges],
         "--vocab-file/--merge-file need --tokenizer-type GPT2BPETokenizer"),
        (["--data-path", prefix, *gpt2], "--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file"),
        (["--data-path", prefix, *gpt2, "--vocab-file", vocab], "--vocab-file needs --merge-file too"),
        (["--data-path", prefix, *gpt2, "--merge-file", merges], "--merge-file needs --vocab-file too"),
        (["--data-path", prefix, *gpt2, "--vocab-file", str(tmp_path / "x"), "--merge-file", merges],
         f"--vocab-file {tmp_path / 'x'}: no such file"),
        (["--data-path", prefix, *gpt2, "--vocab-file", vocab, "--merge-file", str(tmp_path / "x")],
         f"--merge-file {tmp_path / 'x'}: no such file"),
        (["--data-path", prefix, *gpt2, "--vocab-file", str(text), "--merge-file", merges],
         f"--vocab-file {text}: not a readable GPT-2 vocab.json"),
        (["--data-path", prefix, *byte, "--vocab-file", vocab, "--merge-file", merges],
         "--vocab-file is read by --tokenizer-type GPT2BPETokenizer only; got --tokenizer-type ByteLevelTokenizer"),
        (["--data-path", prefix, *byte, "--merge-file", merges],
         "--merge-file is read by --tokenizer-type GPT2BPETokenizer only"),
        (["--vocab-file", vocab], "--vocab-file needs --data-path or --mock-data"),
        (["--data-path", prefix, *byte, "--make-vocab-size-divisible-by", "0"],
         "--make-vocab-size-divisible-by must be >= 1"),
        (["--tokenizer-type", "ByteLevelTokenizer"], "--tokenizer-type needs --data-path or --mock-data"),
        (["--data-cache-path", str(tmp_path)], "--data-cache-path needs --data-path or --mock-data"),
        (["--eval-interval", "0"], "--eval-interval must be >= 1; got 0."),
        (["--eval-iters", "-1"], "--eval-iters must be >= 0 (0: no evaluation); got -1."),
        (["--data-path", prefix, "--train-data-path", prefix, *byte],
         "--data-path and --train-data-path exclude each other"),
        (["--data-path", prefix, "--data-args-path", str(text), *byte],
         "--data-path and --data-args-path exclude each other"),
        (["--valid-data-path", prefix, "--per-split-data-args-path", str(text), *byte],
         "--valid-data-path and --per-split-data-args-path exclude each other"),
        (["--train-data-path", prefix, "--split", "1,1,0", *byte], "with --train-data-path each split has its own"),
        (["--valid-data-path", prefix, *byte], "--valid-data-path gives no training datasets"),
        (["--train-data-path", prefix, "--mock-data"], "--train-data-path and --mock-data exclude each other"),
        (["--train-data-path", str(tmp_path / "none"), *byte], f"--train-data-path {tmp_path / 'none'}: no indexed"),
        (["--per-split-data-args-path", str(text), *byte], "--per-split-data-args-path " + str(text) + ": not JSON"),
        (["--per-split-data-args-path", str(tokenizer_json), *byte], "needs a JSON object with the keys 'train'"),
        (["--data-args-path", str(tmp_path / "none"), *byte], "--data-args-path " + str(tmp_path / "none")
         + ": cannot read it"),
        (["--train-data-path", prefix], "--train-data-path needs --tokenizer-type"),
        (["--data-path", prefix, *byte, "--dataloader-type", "external"], "--dataloader-type external"),
        (["--data-path", prefix, *byte, "--num-dataset-builder-threads", "0"], "--num-dataset-builder-threads must"),
        (["--data-path", prefix, *byte, "--mid-level-dataset-surplus", "-1"], "--mid-level-dataset-surplus must"),
        (["--reset-position-ids"], "--reset-position-ids needs --data-path or --mock-data"),
        (["--reset-attention-mask"], "--reset-attention-mask needs --data-path or --mock-data"),
        (["--dataloader-type", "cyclic"], "--dataloader-type cyclic needs --data-path or --mock-data"),
        (["--split", "1,1,0"], "--split needs --data-path or --mock-data"),
        (["--mock-data", "--reset-attention-mask", "--pipeline-model-parallel-size", "1", "--num-layers", "2",
          "--tensor-model-parallel-size", "1", "--skip-train", "--eval-iters", "0"],
         "--skip-train only evaluates, and --eval-iters 0"),
    ]


def test_bad_data_tokenizer_and_eval_flags_exit_with_one_line(tmp_path, prefix, monkeypatch, capsys) -> None:
    from megatron_eopt.training.arguments.parser import parse_args

    monkeypatch.setenv("WORLD_SIZE", "1")
    for argv, message in _bad_flags(tmp_path, prefix):
        with pytest.raises(SystemExit) as exit_info:
            parse_args([*argv, "--lr", "1e-3"])
        assert exit_info.value.code == 2, argv
        lines = [line for line in capsys.readouterr().err.strip().splitlines() if "No CUDA runtime" not in line]
        assert len(lines) == 1 and lines[0].startswith("pretrain_gpt.py: error: "), (argv, lines)
        assert message in lines[0], (argv, lines)


def test_good_data_flags_set_the_model_vocabulary(prefix, tmp_path, monkeypatch) -> None:
    from megatron_eopt.training.arguments.parser import parse_args

    monkeypatch.setenv("WORLD_SIZE", "2")
    cases = [
        (["--data-path", prefix, *_gpt2_flags(tmp_path)], 256),  # vocab.json's 16 ids -> 128 * 2
        ([], 64),  # the generated task, --vocab-size default
        (["--vocab-size", "100"], 100),  # the generated task is not padded
        (["--data-path", prefix, "--tokenizer-type", "ByteLevelTokenizer"], 512),  # 257 -> 2 * 128 * 2
        (["--data-path", "1", prefix, "2", prefix, "--tokenizer-type", "ByteLevelTokenizer",
          "--make-vocab-size-divisible-by", "1"], 258),
        (["--mock-data"], 256),  # NullTokenizer, vocabulary 64 -> padded
        (["--mock-data", "--vocab-size", "1000"], 1024),
    ]
    for argv, vocab in cases:
        _, settings, _ = parse_args([*argv, "--tensor-model-parallel-size", "2", "--lr", "1e-3"])
        assert settings.vocab_size == vocab, argv


def test_mock_data_samples_are_the_sequences_megatron_core_generates(tmp_path) -> None:
    """--mock-data: MockGPTDataset documents are 1, 2, 3, ... (mod vocab) then the eod id; the
    trainer's [rows, seq + 1] tokens are GPTDataset's tokens plus the last label."""
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=64)
    datasets = data.build_gpt_datasets(tokenizer, None, "99,1,0", SEQ_LENGTH, 1234, data.SampleCounts(40, 8, 0))
    source = data.MegatronDatasets(datasets, tokenizer)
    assert source.splits == ("train", "valid", "test")  # MockGPTDataset builds every split
    rows = source.samples("train", 1, 16, slice(4, 8))  # samples 20..23 of the train split
    assert rows.shape == (4, SEQ_LENGTH + 1)
    for row, index in zip(rows, range(20, 24)):
        sample = datasets["train"][index]
        assert list(row[:-1]) == list(sample["tokens"]) and list(row[1:]) == list(sample["labels"])
        # Within a mock document each token is the previous + 1 (mod 63 ids), else an eod boundary.
        for previous, token in zip(row[:-1].tolist(), row[1:].tolist()):
            assert token == (previous + 1) % 64 or 63 in (previous, token) or token == 1, row.tolist()


def test_generated_task_validation_uses_its_own_seed_stream() -> None:
    """The task has only 4 rules x 64 start tokens = 256 distinct sequences, so validation
    measures the same distribution from batches drawn apart from training's, not unseen text."""
    task = data.GeneratedTask(seed=1234, seq_length=16, vocab_size=64)
    train = [task.samples("train", k, 8, slice(0, 8)) for k in range(50)]
    valid = [task.samples("valid", k, 8, slice(0, 8)) for k in range(3)]
    # Training batch k is the stream the trainer has always used for iteration k + 1.
    generator = torch.Generator().manual_seed(data.SEED_STRIDE * 1234 + 1)
    assert torch.equal(train[0], data.rule_batch(8, 17, 64, generator))
    assert not any(torch.equal(v, t) for v in valid for t in train)
    assert torch.equal(task.samples("valid", 1, 8, slice(2, 5)), valid[1][2:5])  # rows of the same batch


# ------------------------------------------------------------------------------------------------
# Per-split datasets, the flags' files, --dataloader-type cyclic, per-document positions and masks
# ------------------------------------------------------------------------------------------------


def _megatron_core_split_tokens(prefix: str, split_vector: str, counts, tmp_path) -> dict:
    """Reference: megatron-core's builder called directly on one prefix split by `split_vector`
    ('1,0,0' puts every document in train), not through megatron_eopt/training/data/datasets.py."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    config = GPTDatasetConfig(random_seed=1234, sequence_length=SEQ_LENGTH, blend=([prefix], None),
                              split=split_vector, path_to_cache=str(tmp_path / "reference_cache"),
                              tokenizer=build_tokenizer("ByteLevelTokenizer"), reset_position_ids=False,
                              reset_attention_mask=False, eod_mask_loss=False)
    built = BlendedMegatronDatasetBuilder(GPTDataset, [counts.train, counts.valid, counts.test], lambda: True,
                                          config).build()
    return dict(zip(data.SPLITS, built))


def test_per_split_paths_and_their_files_give_megatron_cores_samples_of_each_split(tmp_path, monkeypatch) -> None:
    """--train/valid/test-data-path: each split reads all of its own prefix, the samples megatron-core's
    builder gives that prefix split wholly into that split; --per-split-data-args-path (JSON) and
    --data-args-path (a file of --data-path words) are read as Megatron-LM reads them."""
    from megatron_eopt.training.arguments.parser import parse_args

    monkeypatch.setenv("WORLD_SIZE", "1")
    prefixes = {split: _byte_docs(tmp_path, split, [_doc_text(i + 100 * k) for i in range(12)])
                for k, split in enumerate(data.SPLITS)}
    counts = data.SampleCounts(24, 8, 4)
    common = ["--tokenizer-type", "ByteLevelTokenizer", "--seq-length", str(SEQ_LENGTH), "--lr", "1e-3",
              "--data-cache-path", str(tmp_path / "cache")]
    (tmp_path / "splits.json").write_text(json.dumps({"train": prefixes["train"], "valid": [prefixes["valid"]],
                                                      "test": f"1 {prefixes['test']}"}))
    flags = [arg for split in data.SPLITS for arg in (f"--{split}-data-path", prefixes[split])]
    for argv in (flags, ["--per-split-data-args-path", str(tmp_path / "splits.json")]):
        args, _, _ = parse_args([*argv, *common])
        source = data.build_data_source(args, counts)
        assert source.splits == data.SPLITS, argv
        for split, split_vector, count in (("train", "1,0,0", counts.train), ("valid", "0,1,0", counts.valid),
                                           ("test", "0,0,1", counts.test)):
            reference = _megatron_core_split_tokens(prefixes[split], split_vector, counts, tmp_path)[split]
            rows = source.samples(split, 0, count, slice(0, count))
            for i in range(count):
                expected = numpy.concatenate([_tokens(reference, i), numpy.asarray(reference[i]["labels"])[-1:]])
                assert rows[i].tolist() == expected.tolist(), (argv, split, i)
    # --data-args-path: the same blend as the --data-path words it holds.
    (tmp_path / "data_args.txt").write_text(f"0.3 {prefixes['train']}\n0.7 {prefixes['valid']}\n")
    # (No test part: megatron-core loops forever building a split that has no document but is asked for samples.)
    split, no_test = ["--split", "50,50,0"], data.SampleCounts(24, 8, 0)
    from_file, _, _ = parse_args(["--data-args-path", str(tmp_path / "data_args.txt"), *split, *common])
    from_flags, _, _ = parse_args(["--data-path", "0.3", prefixes["train"], "0.7", prefixes["valid"],
                                                *split, *common])
    file_rows = data.build_data_source(from_file, no_test).samples("train", 0, 24, slice(0, 24))
    assert torch.equal(file_rows, data.build_data_source(from_flags, no_test).samples("train", 0, 24, slice(0, 24)))


def test_cyclic_order_is_megatron_lms_random_sampler_at_one_rank() -> None:
    """--dataloader-type cyclic: the indices of each global batch are what megatron's
    MegatronPretrainingRandomSampler yields one data-parallel rank, epoch after epoch (its
    permutation written out here: randperm seeded by the epoch over the whole micro-batches)."""
    order = data.CyclicOrder(dataset_size=10, micro_batch_size=2)
    expected = []
    for epoch in range(3):
        expected += torch.randperm(10, generator=torch.Generator().manual_seed(epoch)).tolist()
    got = [i for k in range(7) for i in order.indices(4 * k, 4)]  # global batches of 4, across epochs
    assert got == expected[:28]
    assert data.CyclicOrder(10, 2).indices(12, 4) == expected[12:16]  # a resumed run starts mid-stream


def _hand_document_inputs(row: list[int], eod: int) -> tuple[list[int], torch.Tensor]:
    """Positions restart after each eod; a token attends to earlier tokens of its own document
    (the eod closes a document) — True marks what is masked, as megatron's masks do."""
    positions, document, position, documents = [], 0, 0, []
    for token in row:
        positions.append(position)
        documents.append(document)
        position += 1
        if token == eod:
            document, position = document + 1, 0
    s = len(row)
    allowed = torch.tensor([[j <= i and documents[j] == documents[i] for j in range(s)] for i in range(s)])
    return positions, ~allowed


def _packed_documents_body(rank: int, world_size: int) -> dict:
    """One packed row of three documents through a megatron GPTModel with reset positions and a
    document mask, against each document run alone (positions from 0, causal only)."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: F401 (megatron imported)
    from megatron_eopt.training.model.gpt import GPTModelSettings, build_gpt_model, destroy_model_parallel, initialize_model_parallel

    eod = 63
    documents = [[5, 9, 2, eod], [7, 7, 1, 3, 8, eod], [4, 6, 11, 12, 13, 14]]
    row = torch.tensor([sum(documents, [])])
    initialize_model_parallel(1, seed=1234)
    try:
        model = build_gpt_model(GPTModelSettings(seq_length=row.size(1), vocab_size=64)).eval()
        position_ids, mask = data.document_inputs(row, eod, True, True)
        positions, hand_mask = _hand_document_inputs(row[0].tolist(), eod)
        with torch.no_grad():
            packed = model(input_ids=row, position_ids=position_ids, attention_mask=mask)
            plain = model(input_ids=row, position_ids=torch.arange(row.size(1))[None], attention_mask=None)
            alone = torch.cat([model(input_ids=torch.tensor([d]), position_ids=torch.arange(len(d))[None],
                                     attention_mask=None) for d in documents], dim=1)
        return dict(positions_ok=position_ids[0].tolist() == positions, mask_ok=torch.equal(mask[0, 0], hand_mask),
                    packed_vs_alone=(packed - alone).abs().max().item(),
                    plain_vs_alone=(plain - alone).abs().max().item())
    finally:
        destroy_model_parallel()


def test_reset_position_ids_and_attention_mask_make_packed_documents_independent(run_distributed) -> None:
    result = run_distributed(_packed_documents_body, 1)[0]
    assert result["positions_ok"] and result["mask_ok"], result
    # fp32 on CPU: the same per-token arithmetic up to summation order in the attention (measured ~1e-6).
    assert result["packed_vs_alone"] < 1e-5, result
    assert result["plain_vs_alone"] > 1e-2, result  # without them the later documents see the earlier ones


def _per_split_runs_body(rank: int, world_size: int, prefix: str, cache: str) -> dict:
    from megatron_eopt.training import pretrain

    common = ["--tokenizer-type", "ByteLevelTokenizer", "--num-layers", "1", "--hidden-size", "32",
              "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "4", "--train-iters", "4",
              "--lr", "1e-2", "--log-interval", "1", "--eval-iters", "0", "--data-cache-path", cache]
    losses = lambda argv: [r["loss"] for r in pretrain.main([*argv, *common])]  # noqa: E731
    masked = ["--data-path", prefix, "--split", "1,0,0", "--eod-mask-loss"]
    return dict(per_split=losses(["--train-data-path", prefix]),
                data_path=losses(["--data-path", prefix, "--split", "1,0,0"]),
                cyclic=losses(["--train-data-path", prefix, "--dataloader-type", "cyclic"]),
                masked=losses(masked), documents=losses([*masked, "--reset-position-ids", "--reset-attention-mask"]))


def test_per_split_run_equals_the_data_path_run_with_the_same_samples(tmp_path, run_distributed) -> None:
    """--train-data-path A trains on the samples --data-path A --split 1,0,0 gives: the same losses.
    The trainer passes --dataloader-type cyclic and the document flags on: other samples, other losses."""
    prefix = _byte_docs(tmp_path, "docs", [_doc_text(i)[: 10 + 7 * i] for i in range(20)])
    result = run_distributed(_per_split_runs_body, 1, args=(prefix, str(tmp_path / "cache")))[0]
    assert len(result["per_split"]) == 4 and result["per_split"] == result["data_path"], result
    assert result["cyclic"] != result["per_split"], result
    assert result["documents"][0] != result["masked"][0], result  # the first loss: same weights, other inputs
