"""Tokenizers for the trainer and tools/preprocess_data.py: `--tokenizer-type` and its flags.

- `NullTokenizer --vocab-size N`: the text is whitespace-separated integer ids; megatron-core's
  NullTokenizer, as the installed Megatron-LM builds it: the vocabulary is N and the
  end-of-document id is N - 1 (so documents use ids 0 .. N - 2 and N - 1 closes each one).
- `ByteLevelTokenizer`: UTF-8 bytes 0..255 plus the end-of-document id 256 (megatron-core's
  byte-level tokenizer; vocabulary 257, no download, no file).
- `HuggingFaceTokenizer --tokenizer-model PATH`: a local `tokenizer.json`, read with the
  `tokenizers` package when it is installed (it is not a dependency of this project); the
  end-of-document id is the first of `EOD_TOKENS` in its vocabulary. Nothing is downloaded.

Every tokenizer here has what megatron-core's GPTDataset reads: `vocab_size`, `eod`, `pad`
(-1: none), `unique_identifiers`, and `tokenize(text) -> list[int]`.
"""

import math
import os
from collections import OrderedDict
from typing import Any

TOKENIZER_TYPES = ("NullTokenizer", "ByteLevelTokenizer", "HuggingFaceTokenizer")
BYTE_VOCAB_SIZE = 256
# End-of-document tokens of common tokenizer.json files (GPT-2, Llama, Llama 3, Gemma, ...).
EOD_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>")


def add_tokenizer_args(parser) -> None:
    """Megatron-LM's flag names; --vocab-size is the trainer's (a model flag)."""
    group = parser.add_argument_group(title="tokenizer")
    group.add_argument("--tokenizer-type", default=None, choices=TOKENIZER_TYPES,
                       help="how the --data-path documents were tokenized (default: NullTokenizer "
                            "with --mock-data)")
    group.add_argument("--tokenizer-model", default=None, help="HuggingFaceTokenizer: a local tokenizer.json")
    group.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                       help="pad the model's vocabulary to a multiple of this times TP (not for the generated task)")


def check_tokenizer_flags(tokenizer_type: str, vocab_size: Any, tokenizer_model: Any) -> None:
    """Parse-time checks (cheap, no import of megatron-core), errors naming the flags."""
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


def build_tokenizer(tokenizer_type: str, vocab_size: Any = None, tokenizer_model: Any = None):
    """The tokenizer the flags name (call check_tokenizer_flags first)."""
    check_tokenizer_flags(tokenizer_type, vocab_size, tokenizer_model)
    if tokenizer_type == "HuggingFaceTokenizer":
        return TokenizerJson(tokenizer_model)
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
                "installed in this environment (it is not a dependency of megatron_eopt); install it "
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
