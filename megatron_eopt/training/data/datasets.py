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
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from megatron_eopt.training.arguments.data import (  # noqa: F401 (the flag checks, re-exported)
    DEFAULT_SPLIT,
    PER_SPLIT_FLAGS,
    SPLITS,
    blend_from_data_path,
    check_data_flags,
    check_prefix,
    dataset_lists,
    model_vocab_size,
    split_weights,
    tokenizer_vocab_size,
)
from megatron_eopt.training.arguments.flags.model import DEFAULT_RULE_VOCAB_SIZE  # noqa: F401 (re-exported)
from megatron_eopt.training.data.tokenizer import build_tokenizer

RULES = [(3, 1), (5, 7), (7, 2), (11, 5)]
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
                train_samples: Optional[int] = None, final_eval_iters: Optional[int] = None):
        """train_samples: what the iterations consume (default train_iters * global_batch_size;
        less with a growing batch, megatron_eopt/training/data/batch_schedule.py). final_eval_iters:
        the final validation's batches, from the split's start (--final-eval-iters)."""
        evaluations = (train_iters // eval_interval if eval_interval else 0) + 1  # periodic + final
        train = train_iters * global_batch_size if train_samples is None else train_samples
        valid_batches = max(evaluations * eval_iters, final_eval_iters or 0)
        return cls(train, valid_batches * global_batch_size, eval_iters * global_batch_size)


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
