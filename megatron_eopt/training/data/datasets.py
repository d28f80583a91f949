"""Training data for the trainer: the generated "rule" language, or megatron-core's GPT datasets.

Generated task (the default; no files): each sequence follows x[t+1] = (a * x[t] + b) mod vocab
for a rule (a, b) drawn from `RULES`. Validation batches come from seeds no training iteration uses.

Megatron datasets: `--data-path`, `--split`, the per-split paths, `--data-args-path`,
`--per-split-data-args-path` or `--mock-data`, built by megatron-core's
BlendedMegatronDatasetBuilder and GPTDataset. Global batch k of a split is that split's samples
[k * global batch, (k + 1) * global batch) (`--dataloader-type single`), so a resumed run
continues with the same samples; `cyclic` follows Megatron-LM's random sampler.
`document_inputs` applies `--reset-position-ids` and `--reset-attention-mask` with
megatron-core's GPTDataset rule. docs/trainer.md lists the flags.
"""

import argparse
import itertools
import json
import os
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from megatron_eopt.training.arguments.flags.model import DEFAULT_RULE_VOCAB_SIZE  # noqa: F401 (re-exported)
from megatron_eopt.training.data.tokenizer import (
    BYTE_VOCAB_SIZE,
    build_tokenizer,
    check_bpe_file_flags,
    check_tokenizer_flags,
    padded_vocab_size,
)

RULES = [(3, 1), (5, 7), (7, 2), (11, 5)]
SPLITS = ("train", "valid", "test")
DEFAULT_SPLIT = "969, 30, 1"  # Megatron-LM's legacy default for --data-path without --split
PER_SPLIT_FLAGS = tuple(f"--{split}-data-path" for split in SPLITS)
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
        less with a growing batch, megatron_eopt/training/data/batch_schedule.py)."""
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
    """megatron-core's GPT datasets per split; samples as [rows, seq_length + 1] token tensors.
    `cyclic_micro_batch_size`: --dataloader-type cyclic (None: single, the samples in order)."""

    def __init__(self, datasets: dict, tokenizer, cyclic_micro_batch_size: Optional[int] = None) -> None:
        self.datasets, self.tokenizer = datasets, tokenizer
        self.splits = tuple(name for name in SPLITS if datasets.get(name) is not None and len(datasets[name]))
        self.orders = {name: CyclicOrder(len(datasets[name]), cyclic_micro_batch_size)
                       for name in self.splits} if cyclic_micro_batch_size else {}

    def samples(self, split: str, batch_index: int, global_batch_size: int, rows: slice,
                first_sample: Optional[int] = None) -> torch.Tensor:
        """first_sample: where the batch starts in the split (default batch_index * its size;
        batches of a growing size start at the samples consumed before them)."""
        dataset = self.datasets[split]
        first = batch_index * global_batch_size if first_sample is None else first_sample
        if split in self.orders:
            indices = self.orders[split].indices(first, global_batch_size)[rows]
        else:
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


class CyclicOrder:
    """--dataloader-type cyclic: a split's sample indices in the order Megatron-LM's
    MegatronPretrainingRandomSampler gives one data-parallel rank (a permutation seeded by the
    epoch, data sharding on, its default). The trainer takes each global batch from this one
    order and gives each data-parallel rank its rows, so every layout trains on the same global
    batches (Megatron-LM's sampler at DP > 1 shuffles each rank's own bucket instead)."""

    def __init__(self, dataset_size: int, micro_batch_size: int) -> None:
        self.dataset_size, self.micro_batch_size = dataset_size, micro_batch_size
        self._next_first, self._stream = None, iter(())

    def indices(self, first: int, count: int) -> list[int]:
        """The `count` indices after the first `first` ones (megatron's consumed samples)."""
        if first != self._next_first:  # not where the last call ended: start the sampler there
            self._stream = self._indices_from(first)
        self._next_first = first + count
        return list(itertools.islice(self._stream, count))

    def _indices_from(self, consumed: int) -> Iterator[int]:
        from megatron.training.datasets.data_samplers import (
            MegatronPretrainingRandomSampler,
        )

        while True:  # megatron's sampler yields the rest of one epoch; the next one starts after it
            sampler = MegatronPretrainingRandomSampler(
                None, total_samples=self.dataset_size, consumed_samples=consumed,
                micro_batch_size=self.micro_batch_size, data_parallel_rank=0, data_parallel_size=1,
                data_sharding=True)
            for micro_batch in sampler:
                yield from micro_batch
            consumed = sampler.consumed_samples


def document_inputs(inputs: torch.Tensor, eod: int, reset_position_ids: bool, reset_attention_mask: bool
                    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Position ids [b, s] and attention mask ([b, 1, s, s], True = masked, or None) of model
    inputs [b, s] under --reset-position-ids / --reset-attention-mask: megatron-core's GPTDataset
    rule (`_get_ltor_masks_and_position_ids`) row by row. A document ends with its end-of-document
    token; the next starts at position 0 and sees only itself."""
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    rows = [_get_ltor_masks_and_position_ids(row, eod, reset_position_ids, reset_attention_mask,
                                             eod_mask_loss=False, create_attention_mask=reset_attention_mask)
            for row in inputs]
    position_ids = torch.stack([position_ids for _, _, position_ids in rows])
    if not reset_attention_mask:
        return position_ids, None
    return position_ids, torch.stack([mask for mask, _, _ in rows])


def build_data_source(args: argparse.Namespace, counts: SampleCounts):
    """The generated task, or the datasets --data-path / --mock-data / the per-split flags name
    (every rank builds the same deterministic datasets; megatron-core writes the index caches once
    per cache folder)."""
    if not dataset_lists(args) and not args.mock_data:
        return GeneratedTask(args.seed, args.seq_length, args.vocab_size)
    from megatron.training.utils.common_utils import get_blend_and_blend_per_split

    tokenizer = build_tokenizer(args.tokenizer_type, args.vocab_size, args.tokenizer_model, args.vocab_file,
                                args.merge_file)
    blend, blend_per_split = get_blend_and_blend_per_split(args)  # Megatron-LM's reading of the flags and files
    datasets = build_gpt_datasets(
        tokenizer, None, args.split if blend_per_split is None else None, args.seq_length, args.seed, counts,
        args.data_cache_path, mmap_bin_files=args.mmap_bin_files, blend=blend, blend_per_split=blend_per_split,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus)
    cyclic = args.micro_batch_size if args.dataloader_type == "cyclic" else None
    return MegatronDatasets(datasets, tokenizer, cyclic_micro_batch_size=cyclic)


def build_gpt_datasets(tokenizer, data_path: Optional[list[str]], split: Optional[str], seq_length: int, seed: int,
                       counts: SampleCounts, cache_path: Optional[str] = None, mmap_bin_files: bool = True,
                       blend=None, blend_per_split=None, **builder_options) -> dict:
    """{'train'|'valid'|'test': GPTDataset, BlendedDataset or None} from megatron-core's builder:
    `data_path` (or a `blend`) split by `split`, or `blend_per_split` (split None); MockGPTDataset
    when none is given. `builder_options`: num_dataset_builder_threads, mid_level_dataset_surplus."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import (
        GPTDataset,
        GPTDatasetConfig,
        MockGPTDataset,
    )

    if data_path is not None:
        blend = blend_from_data_path(data_path)
    if split is not None:
        split_weights(split)
    # The trainer derives position ids and masks from the tokens itself (document_inputs), so the
    # dataset is asked for tokens only.
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, blend=blend, blend_per_split=blend_per_split, split=split,
        path_to_cache=cache_path, tokenizer=tokenizer, reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, create_attention_mask=False, mmap_bin_files=mmap_bin_files, **builder_options,
    )
    dataset_type = MockGPTDataset if blend is None and blend_per_split is None else GPTDataset
    sizes = [counts.train, counts.valid, counts.test]
    built = BlendedMegatronDatasetBuilder(dataset_type, sizes, lambda: True, config).build()
    return dict(zip(SPLITS, built))


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
