"""Training data for the scripts: the generated "rule" language, or megatron-core's GPT datasets.

Generated task (the default; no files): each rule sequence follows x[t+1] = (a * x[t] + b) mod
vocab for a rule (a, b) drawn from `RULES`, so a model can learn everything but the first token.
Its validation batches come from seeds that no training iteration uses.

Megatron datasets (Megatron-LM's flags): `--data-path [W1] PREFIX1 [W2 PREFIX2 ...]` names
indexed datasets (PREFIX.bin / PREFIX.idx, written by tools/preprocess_data.py), split by
`--split` into train/valid/test and blended by the weights, or `--mock-data` (megatron-core's
MockGPTDataset); both through megatron-core's BlendedMegatronDatasetBuilder and GPTDataset.
Global batch k of a split is that split's samples [k * global batch, (k + 1) * global batch),
as Megatron-LM's sampler reads them, so a resumed run continues with the same samples.
"""

import argparse
import os
from dataclasses import dataclass
from typing import Optional

import torch

from scripts.tokenizer import (BYTE_VOCAB_SIZE, build_tokenizer, check_bpe_file_flags, check_tokenizer_flags,
                               padded_vocab_size)

RULES = [(3, 1), (5, 7), (7, 2), (11, 5)]
DEFAULT_RULE_VOCAB_SIZE = 64
SPLITS = ("train", "valid", "test")
# Generated task: training batch k draws from seed stream SEED_STRIDE * seed + k + 1; validation
# batch k from that + HELD_OUT_OFFSET, which no training iteration (< 1e12) reaches.
SEED_STRIDE = 1_000_003
HELD_OUT_OFFSET = 10**12


def rule_batch(batch_size: int, length: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """Sequences x[t+1] = (a x[t] + b) mod vocab, each with a random rule and start token."""
    rules = torch.tensor(RULES)[torch.randint(len(RULES), (batch_size,), generator=generator)]
    tokens = torch.empty(batch_size, length, dtype=torch.long)
    tokens[:, 0] = torch.randint(vocab, (batch_size,), generator=generator)
    for t in range(1, length):
        tokens[:, t] = (rules[:, 0] * tokens[:, t - 1] + rules[:, 1]) % vocab
    return tokens


# ------------------------------------------------------------------------------------------------
# Flags
# ------------------------------------------------------------------------------------------------


def add_data_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="data")
    group.add_argument("--data-path", nargs="*", default=None,
                       help="[W1] PREFIX1 [W2 PREFIX2 ...]: indexed datasets (PREFIX.bin/.idx from "
                            "tools/preprocess_data.py), blended by the weights; default: the generated task")
    group.add_argument("--split", default="969, 30, 1", help="train, valid, test proportions of --data-path")
    group.add_argument("--data-cache-path", default=None, help="where the dataset index caches are written")
    group.add_argument("--mock-data", action="store_true", help="megatron-core's MockGPTDataset")
    group.add_argument("--eod-mask-loss", action="store_true",
                       help="labels that are the end-of-document token do not count in the loss")
    group.add_argument("--no-mmap-bin-files", action="store_false", dest="mmap_bin_files",
                       help="read the .bin files with file reads instead of memory-mapping them")


def check_data_flags(args: argparse.Namespace) -> None:
    """Parse-time checks (no megatron-core import); errors name the flags. Sets args.vocab_size
    for the generated task and NullTokenizer --mock-data, and args.tokenizer_type's default."""
    if args.data_path is not None and args.mock_data:
        raise ValueError("--data-path and --mock-data exclude each other; give one.")
    if args.data_path is not None:
        blend_from_data_path(args.data_path)  # raises on a bad list or missing files
        split_weights(args.split)
        if args.tokenizer_type is None:
            check_bpe_file_flags(None, args.vocab_file, args.merge_file)  # names them when given
            raise ValueError("--data-path needs --tokenizer-type (the tokenizer tools/preprocess_data.py used).")
    elif args.mock_data:
        check_bpe_file_flags(args.tokenizer_type, args.vocab_file, args.merge_file)  # before the default type
        args.tokenizer_type = args.tokenizer_type or "NullTokenizer"
        if args.tokenizer_type == "NullTokenizer" and args.vocab_size is None:
            args.vocab_size = DEFAULT_RULE_VOCAB_SIZE
    else:
        if args.eod_mask_loss:
            raise ValueError("--eod-mask-loss needs --data-path or --mock-data (the generated task has no "
                             "end-of-document token).")
        for flag, value in (("--tokenizer-type", args.tokenizer_type), ("--tokenizer-model", args.tokenizer_model),
                            ("--vocab-file", args.vocab_file), ("--merge-file", args.merge_file),
                            ("--data-cache-path", args.data_cache_path)):
            if value is not None:
                raise ValueError(f"{flag} needs --data-path or --mock-data (the generated task has its own "
                                 f"vocabulary, --vocab-size).")
        if args.vocab_size is None:
            args.vocab_size = DEFAULT_RULE_VOCAB_SIZE
        return
    if args.tokenizer_type != "NullTokenizer" and args.vocab_size is not None:
        raise ValueError(f"--vocab-size sets NullTokenizer's vocabulary; --tokenizer-type {args.tokenizer_type} "
                         f"has its own (got --vocab-size {args.vocab_size}).")
    check_tokenizer_flags(args.tokenizer_type, args.vocab_size, args.tokenizer_model, args.vocab_file,
                          args.merge_file)


def blend_from_data_path(data_path: list[str]) -> tuple[list[str], Optional[list[float]]]:
    """Megatron-LM's --data-path forms: PREFIX, PREFIX1 PREFIX2 ..., or W1 PREFIX1 W2 PREFIX2 ...
    -> (prefixes, weights or None). Checks every prefix has its .bin and .idx."""
    if not data_path:
        raise ValueError("--data-path needs at least one dataset prefix.")
    prefixes, weights = list(data_path), None
    if len(data_path) % 2 == 0 and _is_number(data_path[0]):
        weights = [_weight(w) for w in data_path[0::2]]
        prefixes = list(data_path[1::2])
    for prefix in prefixes:
        if _is_number(prefix):
            raise ValueError(f"--data-path {' '.join(data_path)}: {prefix!r} stands where a dataset prefix "
                             "belongs; give W1 PREFIX1 W2 PREFIX2 ... (a weight before every prefix) or "
                             "prefixes only.")
        check_prefix(prefix)
    return prefixes, weights


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _weight(text: str) -> float:
    weight = float(text) if _is_number(text) else None
    if weight is None or not weight > 0:
        raise ValueError(f"--data-path weights must be positive numbers; got {text!r}.")
    return weight


def check_prefix(prefix: str) -> None:
    """PREFIX.bin and PREFIX.idx must exist; a raw text file gets pointed at preprocessing."""
    missing = [suffix for suffix in (".bin", ".idx") if not os.path.isfile(prefix + suffix)]
    if not missing:
        return
    if prefix.endswith((".bin", ".idx")) and os.path.isfile(prefix):
        raise ValueError(f"--data-path takes dataset prefixes without .bin/.idx: give {prefix[:-4]}, not {prefix}.")
    if os.path.isfile(prefix):
        raise ValueError(f"--data-path {prefix} is a plain file, not an indexed dataset prefix: convert it "
                         f"first, e.g. `python tools/preprocess_data.py --input DOCS.jsonl --output-prefix "
                         f"PREFIX --tokenizer-type ByteLevelTokenizer --append-eod` (one JSON object with a "
                         f"'text' key a line), then give --data-path PREFIX.")
    raise ValueError(f"--data-path {prefix}: no indexed dataset there ({' and '.join(prefix + s for s in missing)} "
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


# ------------------------------------------------------------------------------------------------
# Sources of global batches
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SampleCounts:
    """Samples each split needs (Megatron-LM's train_val_test_num_samples)."""

    train: int
    valid: int
    test: int

    @classmethod
    def for_run(cls, train_iters: int, global_batch_size: int, eval_interval: Optional[int], eval_iters: int,
                train_samples: Optional[int] = None):
        """train_samples: what the iterations consume (default train_iters * global_batch_size;
        less with a growing batch, scripts/batch_schedule.py)."""
        evaluations = (train_iters // eval_interval if eval_interval else 0) + 1  # periodic + final
        train = train_iters * global_batch_size if train_samples is None else train_samples
        return cls(train, evaluations * eval_iters * global_batch_size, eval_iters * global_batch_size)


class GeneratedTask:
    """The rule language: train batches from the seed and the batch index, valid ones held out."""

    splits = ("train", "valid")

    def __init__(self, seed: int, seq_length: int, vocab_size: int) -> None:
        self.seed, self.length, self.vocab_size = seed, seq_length + 1, vocab_size

    def samples(self, split: str, batch_index: int, global_batch_size: int, rows: slice,
                first_sample: Optional[int] = None) -> torch.Tensor:
        # Training batch k is iteration k + 1's, seeded as the trainer has always seeded it (its
        # own stream whatever its size, so first_sample is not needed).
        stream = SEED_STRIDE * self.seed + batch_index + 1 + (HELD_OUT_OFFSET if split == "valid" else 0)
        generator = torch.Generator().manual_seed(stream)
        return rule_batch(global_batch_size, self.length, self.vocab_size, generator)[rows]


class MegatronDatasets:
    """megatron-core's GPT datasets per split; samples as [rows, seq_length + 1] token tensors."""

    def __init__(self, datasets: dict, tokenizer) -> None:
        self.datasets, self.tokenizer = datasets, tokenizer
        self.splits = tuple(name for name in SPLITS if datasets.get(name) is not None and len(datasets[name]))

    def samples(self, split: str, batch_index: int, global_batch_size: int, rows: slice,
                first_sample: Optional[int] = None) -> torch.Tensor:
        """first_sample: where the batch starts in the split (default batch_index * its size;
        batches of a growing size start at the samples consumed before them)."""
        dataset = self.datasets[split]
        first = batch_index * global_batch_size if first_sample is None else first_sample
        indices = range(first + rows.start, first + rows.stop)
        return torch.stack([self._tokens(dataset[i % len(dataset)]) for i in indices])

    @staticmethod
    def _tokens(sample: dict) -> torch.Tensor:
        """GPTDataset's (tokens, labels) of seq_length each back to the seq_length + 1 tokens."""
        if not bool(torch.as_tensor(sample["loss_mask"]).all()):
            # GPTDataset masks only pad labels and padded samples, neither of which this trainer
            # asks for (pad id -1, drop_last_partial_validation_sequence, eod_mask_loss False).
            raise ValueError("a dataset sample has masked labels; this trainer's loss counts every token.")
        tokens, labels = torch.as_tensor(sample["tokens"]), torch.as_tensor(sample["labels"])
        return torch.cat([tokens, labels[-1:]]).long()


def build_data_source(args: argparse.Namespace, counts: SampleCounts):
    """The generated task, or the datasets --data-path / --mock-data name (every rank builds the
    same deterministic datasets; megatron-core writes the index caches once per cache folder)."""
    if args.data_path is None and not args.mock_data:
        return GeneratedTask(args.seed, args.seq_length, args.vocab_size)
    tokenizer = build_tokenizer(args.tokenizer_type, args.vocab_size, args.tokenizer_model, args.vocab_file,
                                args.merge_file)
    datasets = build_gpt_datasets(tokenizer, args.data_path, args.split, args.seq_length, args.seed,
                                  counts, args.data_cache_path, mmap_bin_files=args.mmap_bin_files)
    return MegatronDatasets(datasets, tokenizer)


def build_gpt_datasets(tokenizer, data_path: Optional[list[str]], split: str, seq_length: int, seed: int,
                       counts: SampleCounts, cache_path: Optional[str] = None, mmap_bin_files: bool = True) -> dict:
    """{'train'|'valid'|'test': GPTDataset, BlendedDataset or None} from megatron-core's builder;
    MockGPTDataset when data_path is None."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    blend = blend_from_data_path(data_path) if data_path is not None else None
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, blend=blend, split=split, path_to_cache=cache_path,
        tokenizer=tokenizer, reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        create_attention_mask=False, mmap_bin_files=mmap_bin_files,
    )
    split_weights(split)
    dataset_type = GPTDataset if blend is not None else MockGPTDataset
    sizes = [counts.train, counts.valid, counts.test]
    built = BlendedMegatronDatasetBuilder(dataset_type, sizes, lambda: True, config).build()
    return dict(zip(SPLITS, built))


def model_vocab_size(args: argparse.Namespace, tensor_parallel_size: int) -> int:
    """The model's vocabulary: the generated task's --vocab-size as given, else the tokenizer's
    padded to --make-vocab-size-divisible-by * TP (Megatron-LM's padded_vocab_size)."""
    if args.data_path is None and not args.mock_data:
        return args.vocab_size
    return padded_vocab_size(tokenizer_vocab_size(args), args.make_vocab_size_divisible_by, tensor_parallel_size)


def tokenizer_vocab_size(args: argparse.Namespace) -> int:
    if args.tokenizer_type == "NullTokenizer":
        return args.vocab_size
    if args.tokenizer_type == "ByteLevelTokenizer":
        return BYTE_VOCAB_SIZE + 1  # bytes and the end-of-document id
    return build_tokenizer(args.tokenizer_type, None, args.tokenizer_model, args.vocab_file,
                           args.merge_file).vocab_size
