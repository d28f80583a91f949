"""The data and tokenizer flags' checks (docs/trainer.md lists the flags): torch-free, run before
torch is imported; data/datasets.py builds the data they describe and re-exports these names."""

import argparse
import json
import os
from typing import Optional

from megatron_eopt.training.arguments.flags.model import DEFAULT_RULE_VOCAB_SIZE
from megatron_eopt.training.data.tokenizer import (
    BYTE_VOCAB_SIZE,
    build_tokenizer,
    check_bpe_file_flags,
    check_tokenizer_flags,
    padded_vocab_size,
)

SPLITS = ("train", "valid", "test")
DEFAULT_SPLIT = "969, 30, 1"  # Megatron-LM's legacy default for --data-path without --split
PER_SPLIT_FLAGS = tuple(f"--{split}-data-path" for split in SPLITS)



def check_data_flags(args: argparse.Namespace) -> dict:
    """Parse-time checks (no megatron-core import); errors name the flags. Returns the defaults
    they resolve: vocab_size for the generated task and NullTokenizer --mock-data,
    tokenizer_type's, split's and dataloader_type's."""
    resolved = {"dataloader_type": _check_dataset_options(args)}
    lists = dataset_lists(args)
    if lists and args.mock_data:
        raise ValueError(f"{_data_source_flags(args)[0]} and --mock-data exclude each other; give one.")
    tokenizer_type, vocab_size = args.tokenizer_type, args.vocab_size
    if lists:
        resolved["split"] = _check_dataset_lists(args, lists)
        if tokenizer_type is None:
            check_bpe_file_flags(None, args.vocab_file, args.merge_file)  # names them when given
            raise ValueError(f"{_data_source_flags(args)[0]} needs --tokenizer-type (the tokenizer "
                             f"tools/preprocess_data.py used).")
    elif args.mock_data:
        resolved["split"] = args.split or DEFAULT_SPLIT
        split_weights(resolved["split"])
        check_bpe_file_flags(tokenizer_type, args.vocab_file, args.merge_file)  # before the default type
        tokenizer_type = tokenizer_type or "NullTokenizer"
        if tokenizer_type == "NullTokenizer" and vocab_size is None:
            vocab_size = DEFAULT_RULE_VOCAB_SIZE
    else:
        _check_generated_task_flags(args)
        return dict(resolved, vocab_size=DEFAULT_RULE_VOCAB_SIZE if vocab_size is None else vocab_size)
    if tokenizer_type != "NullTokenizer" and vocab_size is not None:
        raise ValueError(f"--vocab-size sets NullTokenizer's vocabulary; --tokenizer-type {tokenizer_type} "
                         f"has its own (got --vocab-size {vocab_size}).")
    check_tokenizer_flags(tokenizer_type, vocab_size, args.tokenizer_model, args.vocab_file, args.merge_file)
    return dict(resolved, tokenizer_type=tokenizer_type, vocab_size=vocab_size)


def _check_generated_task_flags(args: argparse.Namespace) -> None:
    """The generated task reads no files and has no end-of-document token: refuse the flags that need one."""
    needs_eod = [flag for flag, given in (("--eod-mask-loss", args.eod_mask_loss),
                                          ("--reset-position-ids", args.reset_position_ids),
                                          ("--reset-attention-mask", args.reset_attention_mask)) if given]
    if needs_eod:
        raise ValueError(f"{needs_eod[0]} needs --data-path or --mock-data (the generated task has no "
                         "end-of-document token).")
    for flag, value in (("--tokenizer-type", args.tokenizer_type), ("--tokenizer-model", args.tokenizer_model),
                        ("--vocab-file", args.vocab_file), ("--merge-file", args.merge_file),
                        ("--data-cache-path", args.data_cache_path), ("--split", args.split),
                        ("--dataloader-type cyclic", True if args.dataloader_type == "cyclic" else None)):
        if value is not None:
            raise ValueError(f"{flag} needs --data-path or --mock-data (the generated task has its own "
                             f"vocabulary, --vocab-size, and draws every batch afresh).")


def _check_dataset_options(args: argparse.Namespace) -> str:
    """Checks; returns --dataloader-type (default single, as in Megatron-LM)."""
    if args.dataloader_type == "external":
        raise ValueError("--dataloader-type external (the dataset is its own iterator) is not offered: this "
                         "trainer reads the samples itself; give single or cyclic.")
    if args.num_dataset_builder_threads < 1:
        raise ValueError(f"--num-dataset-builder-threads must be >= 1; got {args.num_dataset_builder_threads}.")
    if not args.mid_level_dataset_surplus >= 0:
        raise ValueError(f"--mid-level-dataset-surplus must be >= 0 (a fraction of extra samples); got "
                         f"{args.mid_level_dataset_surplus}.")
    return args.dataloader_type or "single"  # Megatron-LM's default


def _data_source_flags(args: argparse.Namespace) -> list[str]:
    """The flags naming dataset files that the command line gave."""
    given = [flag for flag in ("--data-path", "--data-args-path", *PER_SPLIT_FLAGS, "--per-split-data-args-path")
             if getattr(args, flag[2:].replace("-", "_")) is not None]
    return given


def dataset_lists(args: argparse.Namespace) -> dict[str, Optional[list[str]]]:
    """The --data-path words as {'all': words}, or each split's as {'train': words or None, 'valid':
    ..., 'test': ...}, read from --data-args-path / --per-split-data-args-path as Megatron-LM reads
    them (get_blend_and_blend_per_split); {} when no dataset files are named. Refuses the
    combinations Megatron-LM excludes: one list and its file, and a shared list with per-split ones."""
    given = _data_source_flags(args)
    shared = [flag for flag in given if flag in ("--data-path", "--data-args-path")]
    if len(shared) == 2 or (shared and len(given) > 1):
        other = given[1] if len(shared) == 2 else next(flag for flag in given if flag not in shared)
        raise ValueError(f"{shared[0]} and {other} exclude each other (one list split by --split, or each "
                         f"split its own); give one.")
    if "--per-split-data-args-path" in given and len(given) > 1:
        raise ValueError(f"{given[0]} and --per-split-data-args-path exclude each other (the file holds every "
                         f"split's list); give one.")
    if args.data_args_path is not None:
        return {"all": _read_text(args.data_args_path, "--data-args-path").split()}
    if args.data_path is not None:
        return {"all": args.data_path}
    if args.per_split_data_args_path is not None:
        return _read_per_split_file(args.per_split_data_args_path)
    if given:
        return {split: getattr(args, f"{split}_data_path") for split in SPLITS}
    return {}


def _read_text(path: str, flag: str) -> str:
    try:
        with open(path) as file:
            return file.read()
    except OSError as error:
        raise ValueError(f"{flag} {path}: cannot read it ({error.strerror}).") from None


def _read_per_split_file(path: str) -> dict[str, Optional[list[str]]]:
    """Megatron-LM's format: JSON with 'train', 'valid' and 'test' keys, each a --data-path list as
    one string or a list of strings (null: no such split)."""
    flag = "--per-split-data-args-path"
    try:
        content = json.loads(_read_text(path, flag))
    except json.JSONDecodeError as error:
        raise ValueError(f"{flag} {path}: not JSON ({error.msg} at line {error.lineno}).") from None
    if not isinstance(content, dict) or any(split not in content for split in SPLITS):
        raise ValueError(f"{flag} {path}: needs a JSON object with the keys 'train', 'valid' and 'test' (each a "
                         f"--data-path list, a string or a list of strings, or null).")
    lists = {}
    for split in SPLITS:
        words = content[split].split() if isinstance(content[split], str) else content[split]
        if words is not None and not (isinstance(words, list) and all(isinstance(w, str) for w in words)):
            raise ValueError(f"{flag} {path}: '{split}' must be a string, a list of strings or null; got {words!r}.")
        lists[split] = words
    return lists


def _check_dataset_lists(args: argparse.Namespace, lists: dict[str, Optional[list[str]]]) -> Optional[str]:
    """Every list well formed and its files there; --split only with a shared list (returned,
    with its default)."""
    source = _data_source_flags(args)[0]
    for key, words in lists.items():
        if words is not None:
            flag = "--data-path" if key == "all" else f"--{key}-data-path"
            blend_from_data_path(words, flag if source in ("--data-path", *PER_SPLIT_FLAGS) else f"{source} ({flag})")
    if "all" in lists:
        split_weights(args.split or DEFAULT_SPLIT)
        return args.split or DEFAULT_SPLIT
    if args.split is not None:
        raise ValueError(f"--split divides --data-path into splits; with {source} each split has its own "
                         f"datasets: leave --split out.")
    if lists["train"] is None and not getattr(args, "skip_train", False):
        raise ValueError(f"{source} gives no training datasets: give --train-data-path (or 'train' in the "
                         f"--per-split-data-args-path file), or --skip-train to only evaluate.")
    return None


def blend_from_data_path(data_path: list[str], flag: str = "--data-path") -> tuple[list[str], Optional[list[float]]]:
    """Megatron-LM's --data-path forms: PREFIX, PREFIX1 PREFIX2 ..., or W1 PREFIX1 W2 PREFIX2 ...
    -> (prefixes, weights or None). Checks every prefix has its .bin and .idx."""
    if not data_path:
        raise ValueError(f"{flag} needs at least one dataset prefix.")
    prefixes, weights = list(data_path), None
    if len(data_path) % 2 == 0 and _is_number(data_path[0]):
        weights = [_weight(w, flag) for w in data_path[0::2]]
        prefixes = list(data_path[1::2])
    for prefix in prefixes:
        if _is_number(prefix):
            raise ValueError(f"{flag} {' '.join(data_path)}: {prefix!r} stands where a dataset prefix "
                             "belongs; give W1 PREFIX1 W2 PREFIX2 ... (a weight before every prefix) or "
                             "prefixes only.")
        check_prefix(prefix, flag)
    return prefixes, weights


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _weight(text: str, flag: str) -> float:
    weight = float(text) if _is_number(text) else None
    if weight is None or not weight > 0:
        raise ValueError(f"{flag} weights must be positive numbers; got {text!r}.")
    return weight


def check_prefix(prefix: str, flag: str = "--data-path") -> None:
    """PREFIX.bin and PREFIX.idx must exist; a raw text file gets pointed at preprocessing."""
    missing = [suffix for suffix in (".bin", ".idx") if not os.path.isfile(prefix + suffix)]
    if not missing:
        return
    if prefix.endswith((".bin", ".idx")) and os.path.isfile(prefix):
        raise ValueError(f"{flag} takes dataset prefixes without .bin/.idx: give {prefix[:-4]}, not {prefix}.")
    if os.path.isfile(prefix):
        raise ValueError(f"{flag} {prefix} is a plain file, not an indexed dataset prefix: convert it "
                         f"first, e.g. `python tools/preprocess_data.py --input DOCS.jsonl --output-prefix "
                         f"PREFIX --tokenizer-type ByteLevelTokenizer --append-eod` (one JSON object with a "
                         f"'text' key a line), then give {flag} PREFIX.")
    raise ValueError(f"{flag} {prefix}: no indexed dataset there ({' and '.join(prefix + s for s in missing)} "
                     f"not found); tools/preprocess_data.py writes them.")


def split_weights(split: str) -> list[float]:
    """'969, 30, 1' -> [969.0, 30.0, 1.0] (missing parts are 0, as in Megatron-LM)."""
    parts = [part.strip() for part in split.replace("/", ",").split(",")]
    if not 1 <= len(parts) <= 3 or not all(_is_number(p) and float(p) >= 0 for p in parts):
        raise ValueError(f"--split takes up to three non-negative train, valid, test proportions like "
                         f"'969,30,1'; got {split!r}.")
    weights = [float(p) for p in parts] + [0.0] * (3 - len(parts))
    if weights[0] <= 0:
        raise ValueError(f"--split {split!r} gives the train split nothing; its first proportion must be > 0.")
    return weights


def model_vocab_size(args: argparse.Namespace, tensor_parallel_size: int) -> int:
    """The model's vocabulary: the generated task's --vocab-size as given, else the tokenizer's
    padded to --make-vocab-size-divisible-by * TP (Megatron-LM's padded_vocab_size)."""
    if not dataset_lists(args) and not args.mock_data:
        return args.vocab_size
    return padded_vocab_size(tokenizer_vocab_size(args), args.make_vocab_size_divisible_by, tensor_parallel_size)


def tokenizer_vocab_size(args: argparse.Namespace) -> int:
    if args.tokenizer_type == "NullTokenizer":
        return args.vocab_size
    if args.tokenizer_type == "ByteLevelTokenizer":
        return BYTE_VOCAB_SIZE + 1  # bytes and the end-of-document id
    return build_tokenizer(args.tokenizer_type, None, args.tokenizer_model, args.vocab_file,
                           args.merge_file).vocab_size
