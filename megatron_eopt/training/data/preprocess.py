"""Tokenize a JSONL corpus into a megatron-core indexed dataset (.bin/.idx), as Megatron-LM's tool:
tools/preprocess_data.py's code (it runs `main`), called in-process by training/corpus.py.

    python tools/preprocess_data.py --input docs.jsonl --output-prefix data/docs \\
        --tokenizer-type ByteLevelTokenizer --append-eod --workers 2
    python tools/preprocess_data.py --input docs.jsonl --output-prefix data/gpt2 \\
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt --append-eod

Each line of --input is a JSON object; its --json-keys (default `text`) are tokenized (see
megatron_eopt/training/data/tokenizer.py) and written, one document per line, with megatron-core's
IndexedDatasetBuilder to `{output-prefix}_{key}_document.bin/.idx` (Megatron-LM's naming); the
trainer then takes `--data-path {output-prefix}_{key}_document`. `--append-eod` ends each
document with the tokenizer's end-of-document id. Empty documents are skipped.
"""

import argparse
import json
import multiprocessing
import os
import sys
from typing import Iterator, NoReturn, Optional

from megatron_eopt.training.data.tokenizer import TOKENIZER_TYPES, add_bpe_file_args, build_tokenizer, check_tokenizer_flags

PROG = "preprocess_data.py"
_worker_encoder = None  # the Encoder a forked worker inherits


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0].removesuffix(":"))
    parser.add_argument("--input", required=True, help="a JSONL file, one document a line")
    parser.add_argument("--output-prefix", required=True, help="writes {prefix}_{key}_document.bin/.idx")
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="keys to tokenize (default: text)")
    parser.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    parser.add_argument("--tokenizer-model", default=None, help="HuggingFaceTokenizer: a local tokenizer.json")
    add_bpe_file_args(parser)
    parser.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer's vocabulary")
    parser.add_argument("--append-eod", action="store_true", help="end every document with the end-of-document id")
    parser.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    parser.add_argument("--log-interval", type=int, default=10000, help="report every this many documents")
    return parser


def error(message: str) -> NoReturn:
    sys.stderr.write(f"{PROG}: error: {message}\n")
    raise SystemExit(2)


def check_args(args: argparse.Namespace) -> None:
    if not os.path.isfile(args.input):
        raise ValueError(f"--input {args.input}: no such file.")
    if args.workers < 1:
        raise ValueError(f"--workers must be >= 1; got {args.workers}.")
    if args.log_interval < 1:
        raise ValueError(f"--log-interval must be >= 1; got {args.log_interval}.")
    if args.tokenizer_type != "NullTokenizer" and args.vocab_size is not None:
        raise ValueError(f"--vocab-size sets NullTokenizer's vocabulary; --tokenizer-type {args.tokenizer_type} "
                         f"has its own (got --vocab-size {args.vocab_size}).")
    folder = os.path.dirname(os.path.abspath(args.output_prefix))
    if not os.path.isdir(folder):
        raise ValueError(f"--output-prefix {args.output_prefix}: the folder {folder} does not exist.")
    check_tokenizer_flags(args.tokenizer_type, args.vocab_size, args.tokenizer_model, args.vocab_file,
                          args.merge_file)


class Encoder:
    """One JSONL line -> {key: token ids} (with the end-of-document id when asked)."""

    def __init__(self, tokenizer, json_keys: list[str], append_eod: bool) -> None:
        self.tokenizer, self.json_keys, self.append_eod = tokenizer, json_keys, append_eod

    def encode(self, numbered_line: tuple[int, str]) -> dict:
        number, line = numbered_line
        try:
            document = json.loads(line)
        except json.JSONDecodeError as failure:
            raise ValueError(f"--input line {number}: not JSON ({failure.msg}).") from None
        if not isinstance(document, dict):
            raise ValueError(f"--input line {number}: a JSON object is needed, got {type(document).__name__}.")
        return {key: self._ids(document, key, number) for key in self.json_keys}

    def _ids(self, document: dict, key: str, number: int) -> list[int]:
        text = document.get(key)
        if not isinstance(text, str):
            raise ValueError(f"--input line {number}: no string under the key {key!r} (--json-keys).")
        try:
            ids = list(self.tokenizer.tokenize(text)) if text else []
        except ValueError:
            raise ValueError(f"--input line {number}: NullTokenizer text must be integers separated by single "
                             f"spaces; got {text[:60]!r}.") from None
        vocab_size = self.tokenizer.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab_size]
        if bad:
            raise ValueError(f"--input line {number}: token id {bad[0]} is outside the vocabulary "
                             f"0..{vocab_size - 1} (--vocab-size).")
        if ids and self.append_eod:
            ids.append(self.tokenizer.eod)
        return ids


def _encode_in_worker(numbered_line: tuple[int, str]) -> dict:
    return _worker_encoder.encode(numbered_line)


def encoded_documents(encoder: Encoder, path: str, workers: int) -> Iterator[dict]:
    """Documents in file order; workers > 1 tokenize in forked processes (which inherit the
    tokenizer, so no process imports megatron-core again)."""
    global _worker_encoder
    with open(path, encoding="utf-8") as lines:
        numbered = ((number, line) for number, line in enumerate(lines, start=1) if line.strip())
        if workers == 1:
            yield from map(encoder.encode, numbered)
            return
        _worker_encoder = encoder
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            yield from pool.imap(_encode_in_worker, numbered, chunksize=32)


def preprocess(args: argparse.Namespace) -> dict[str, str]:
    """Write one indexed dataset per JSON key; returns {key: dataset prefix}."""
    import numpy
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    tokenizer = build_tokenizer(args.tokenizer_type, args.vocab_size, args.tokenizer_model, args.vocab_file,
                                args.merge_file, for_text=True)
    encoder = Encoder(tokenizer, args.json_keys, args.append_eod)
    prefixes = {key: f"{args.output_prefix}_{key}_document" for key in args.json_keys}
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    builders = {key: IndexedDatasetBuilder(prefix + ".bin", dtype=dtype) for key, prefix in prefixes.items()}
    counts = {key: [0, 0] for key in prefixes}  # documents, tokens
    for number, document in enumerate(encoded_documents(encoder, args.input, args.workers), start=1):
        for key, ids in document.items():
            if ids:
                builders[key].add_document(numpy.array(ids, dtype=dtype), [len(ids)])
                counts[key][0] += 1
                counts[key][1] += len(ids)
        if number % args.log_interval == 0:
            print(f"processed {number} documents", flush=True)
    for key, builder in builders.items():
        builder.finalize(prefixes[key] + ".idx")
        print(f"wrote {prefixes[key]}.bin/.idx: {counts[key][0]} documents, {counts[key][1]} tokens "
              f"(--data-path {prefixes[key]})", flush=True)
    return prefixes


def main(argv: Optional[list[str]] = None) -> dict[str, str]:
    args = build_parser().parse_args(argv)
    try:
        check_args(args)
        return preprocess(args)
    except ValueError as failure:
        error(str(failure))
