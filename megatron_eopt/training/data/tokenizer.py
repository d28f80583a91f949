"""Tokenizers for the trainer and tools/preprocess_data.py: `--tokenizer-type` and its flags.

- `NullTokenizer --vocab-size N`: whitespace-separated integer ids; end-of-document id N - 1.
- `ByteLevelTokenizer`: UTF-8 bytes plus end-of-document id 256.
- `HuggingFaceTokenizer --tokenizer-model PATH`: a local `tokenizer.json`, read with the
  `tokenizers` package; the end-of-document id is the first of `EOD_TOKENS` in its vocabulary.
- `GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt`: GPT-2's BPE from local
  files. Reading data needs only vocab.json; tokenizing text uses the `tokenizers` package.

As in Megatron-LM, `--vocab-file`/`--merge-file` do not imply a tokenizer type. Every tokenizer
has what megatron-core's GPTDataset reads: `vocab_size`, `eod`, `pad` (-1: none),
`unique_identifiers` and `tokenize(text) -> list[int]`. Nothing is downloaded.
"""

import json
import math
import os
from collections import OrderedDict
from typing import Any

from megatron_eopt.training.arguments.flags.data import BPE_FILES, TOKENIZER_TYPES  # noqa: F401 (re-exported)

BYTE_VOCAB_SIZE = 256
# End-of-document tokens of common tokenizer.json files (GPT-2, Llama, Llama 3, Gemma, ...).
EOD_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>")
GPT2_EOD_TOKEN = "<|endoftext|>"


def add_bpe_file_args(group) -> None:
    """GPT2BPETokenizer's files (tools/preprocess_data.py's flags; the trainer's table has them too)."""
    for row in BPE_FILES:
        group.add_argument(row.option, **row.kwargs())


def check_bpe_file_flags(tokenizer_type: Any, vocab_file: Any, merge_file: Any) -> None:
    """--vocab-file and --merge-file go together, with GPT2BPETokenizer only, and name files."""
    if not vocab_file and not merge_file:
        if tokenizer_type == "GPT2BPETokenizer":
            raise ValueError("--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file (a local "
                             "GPT-2 vocab.json and merges.txt; nothing is downloaded).")
        return
    if tokenizer_type is None:
        # Megatron-LM does not infer the type from the files: its build_tokenizer raises on None.
        raise ValueError("--vocab-file/--merge-file need --tokenizer-type GPT2BPETokenizer (Megatron-LM does "
                         "not infer it either).")
    if tokenizer_type != "GPT2BPETokenizer":
        flag = "--vocab-file" if vocab_file else "--merge-file"
        raise ValueError(f"{flag} is read by --tokenizer-type GPT2BPETokenizer only; got --tokenizer-type "
                         f"{tokenizer_type}.")
    if not vocab_file or not merge_file:
        given, missing = ("--vocab-file", "--merge-file") if vocab_file else ("--merge-file", "--vocab-file")
        raise ValueError(f"{given} needs {missing} too (GPT2BPETokenizer reads both).")
    for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
        if not os.path.isfile(path):
            raise ValueError(f"{flag} {path}: no such file (nothing is downloaded).")


def check_tokenizer_flags(tokenizer_type: str, vocab_size: Any, tokenizer_model: Any, vocab_file: Any = None,
                          merge_file: Any = None) -> None:
    """Parse-time checks (cheap, no import of megatron-core), errors naming the flags."""
    check_bpe_file_flags(tokenizer_type, vocab_file, merge_file)
    if tokenizer_type == "NullTokenizer" and (vocab_size is None or vocab_size < 2):
        raise ValueError(f"--tokenizer-type NullTokenizer needs --vocab-size N >= 2 (ids 0..N-2 and the "
                         f"end-of-document id N-1); got --vocab-size {vocab_size}.")
    if tokenizer_type == "HuggingFaceTokenizer":
        if not tokenizer_model:
            raise ValueError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model PATH (a local "
                             "tokenizer.json).")
        if not os.path.isfile(tokenizer_model):
            raise ValueError(f"--tokenizer-model {tokenizer_model}: no such file (give a local tokenizer.json; "
                             "nothing is downloaded).")
    elif tokenizer_model:
        raise ValueError(f"--tokenizer-model is read by --tokenizer-type HuggingFaceTokenizer only; "
                         f"got --tokenizer-type {tokenizer_type}.")


def build_tokenizer(tokenizer_type: str, vocab_size: Any = None, tokenizer_model: Any = None,
                    vocab_file: Any = None, merge_file: Any = None, for_text: bool = False):
    """The tokenizer the flags name. for_text: it will tokenize text (tools/preprocess_data.py),
    so a tokenizer that needs an optional package for that loads it now, before any output."""
    check_tokenizer_flags(tokenizer_type, vocab_size, tokenizer_model, vocab_file, merge_file)
    if tokenizer_type == "HuggingFaceTokenizer":
        return TokenizerJson(tokenizer_model)
    if tokenizer_type == "GPT2BPETokenizer":
        tokenizer = GPT2BPETokenizer(vocab_file, merge_file)
        if for_text:
            tokenizer.encoder()
        return tokenizer
    from megatron.core.tokenizers import MegatronTokenizer

    if tokenizer_type == "NullTokenizer":
        return MegatronTokenizer.from_pretrained(metadata_path={"library": "null-text"}, vocab_size=vocab_size)
    if tokenizer_type == "ByteLevelTokenizer":
        # pad -1: no pad id, so no byte is masked out of the loss by megatron-core's GPTDataset.
        return MegatronTokenizer.from_pretrained(metadata_path={"library": "byte-level"},
                                                 vocab_size=BYTE_VOCAB_SIZE + 1, _eos_id=BYTE_VOCAB_SIZE,
                                                 _pad_id=-1)
    raise ValueError(f"--tokenizer-type must be one of {', '.join(TOKENIZER_TYPES)}; got {tokenizer_type!r}.")


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel_size: int) -> int:
    """Megatron-LM's vocab_size_with_padding: the next multiple of divisible_by * TP."""
    if divisible_by < 1:
        raise ValueError(f"--make-vocab-size-divisible-by must be >= 1; got {divisible_by}.")
    multiple = divisible_by * tensor_parallel_size
    return int(math.ceil(vocab_size / multiple) * multiple)


class TokenizerJson:
    """A local tokenizer.json through the `tokenizers` package (no transformers, no network)."""

    def __init__(self, path: str) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ValueError(
                "--tokenizer-type HuggingFaceTokenizer needs the 'tokenizers' package, which is not "
                "installed in this environment (pyproject.toml's `scripts` extra installs it); install it "
                "or use --tokenizer-type ByteLevelTokenizer or NullTokenizer.") from None
        try:
            self._tokenizer = Tokenizer.from_file(path)
        except Exception as error:  # the package's own error types vary by version
            raise ValueError(f"--tokenizer-model {path}: not a readable tokenizer.json ({error}).") from None
        self.path = path
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        found = [token for token in EOD_TOKENS if token in vocab]
        if not found:
            raise ValueError(f"--tokenizer-model {path}: none of the end-of-document tokens "
                             f"{', '.join(EOD_TOKENS)} is in its vocabulary.")
        self.eod = vocab[found[0]]
        self.pad = -1

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict(cls=type(self).__name__, path=os.path.abspath(self.path), vocab_size=self.vocab_size,
                           eod=self.eod)


class GPT2BPETokenizer:
    """GPT-2's byte-level BPE from a local vocab.json and merges.txt (Megatron-LM's
    GPT2BPETokenizer). The vocabulary comes from vocab.json; text is tokenized by the `tokenizers`
    package's BPE model, loaded on first use, so a trainer that only reads preprocessed data
    needs no extra package."""

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        self.vocab_file, self.merge_file = vocab_file, merge_file
        vocab = _read_gpt2_vocab(vocab_file)
        if GPT2_EOD_TOKEN not in vocab:
            raise ValueError(f"--vocab-file {vocab_file}: no {GPT2_EOD_TOKEN} (the end-of-document token) in it.")
        self.eod = vocab[GPT2_EOD_TOKEN]
        # The embedding must cover the largest id (len(vocab) for GPT-2's dense ids 0..50256).
        self.vocab_size = max(vocab.values()) + 1
        self.pad = -1  # GPT-2 has no pad token: nothing is masked out of the loss
        self._encoder = None

    def encoder(self):
        """The `tokenizers` BPE model with GPT-2's byte-level pre-tokenizer (its regex, no prefix space)."""
        if self._encoder is None:
            self._encoder = _gpt2_bpe_encoder(self.vocab_file, self.merge_file)
        return self._encoder

    def tokenize(self, text: str) -> list[int]:
        return self.encoder().encode(text, add_special_tokens=False).ids

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict(cls=type(self).__name__, vocab_file=os.path.abspath(self.vocab_file),
                           merge_file=os.path.abspath(self.merge_file), vocab_size=self.vocab_size, eod=self.eod)


def _read_gpt2_vocab(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as file:
            vocab = json.load(file)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"--vocab-file {path}: not a readable GPT-2 vocab.json ({error}).") from None
    if not isinstance(vocab, dict) or not vocab or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in vocab.values()):
        raise ValueError(f"--vocab-file {path}: a GPT-2 vocab.json is a JSON object of token -> id >= 0.")
    return vocab


def _gpt2_bpe_encoder(vocab_file: str, merge_file: str):
    try:
        from tokenizers import Tokenizer, models, pre_tokenizers
    except ImportError:
        raise ValueError(
            "--tokenizer-type GPT2BPETokenizer needs the 'tokenizers' package to tokenize text, which is not "
            "installed in this environment (pyproject.toml's `scripts` extra installs it); install it, or "
            "tokenize elsewhere: the trainer reads GPT-2 data with --vocab-file/--merge-file alone.") from None
    try:
        encoder = Tokenizer(models.BPE.from_file(vocab_file, merge_file))
    except Exception as error:  # the package's own error types vary by version
        raise ValueError(f"--vocab-file {vocab_file} --merge-file {merge_file}: not a readable GPT-2 BPE "
                         f"({error}).") from None
    # As GPT-2's tokenizer.json: split by GPT-2's regex, bytes mapped to printable characters.
    encoder.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    # <|endoftext|> in text is the end-of-document id, as megatron-core's GPT-2 (HF) tokenizer reads it.
    encoder.add_special_tokens([GPT2_EOD_TOKEN])
    return encoder
