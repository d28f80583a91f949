"""Data flags: datasets and the generated task (`DATA`), tokenizers (`TOKENIZER`, with `BPE_FILES`
shared with tools/preprocess_data.py) and validation (`VALIDATION`)."""

from megatron_eopt.training.arguments.flags.table import Flag, switch

TOKENIZER_TYPES = ("NullTokenizer", "ByteLevelTokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer")

# GPT2BPETokenizer's files: the trainer's flags and tools/preprocess_data.py's.
BPE_FILES: tuple[Flag, ...] = (
    Flag('--vocab-file', help='GPT2BPETokenizer: a local GPT-2 vocab.json'),
    Flag('--merge-file', help='GPT2BPETokenizer: a local GPT-2 merges.txt'),
)

DATA_TITLE = 'data'
DATA: tuple[Flag, ...] = (
    Flag('--data-path', nargs='*',
         help=('[W1] PREFIX1 [W2 PREFIX2 ...]: indexed datasets (PREFIX.bin/.idx from tools/preprocess_data.py),'
               ' blended by the weights; default: the generated task')),
    Flag('--split', help="train, valid, test proportions of --data-path (default '969, 30, 1')"),
    Flag('--train-data-path', nargs='*',
         help="[W1] PREFIX1 ...: the training split's own datasets (instead of --data-path and --split)"),
    Flag('--valid-data-path', nargs='*',
         help="[W1] PREFIX1 ...: the validation split's own datasets (instead of --data-path and --split)"),
    Flag('--test-data-path', nargs='*',
         help="[W1] PREFIX1 ...: the test split's own datasets (instead of --data-path and --split)"),
    Flag('--data-args-path',
         help='a file holding the --data-path list (whitespace-separated), instead of --data-path'),
    Flag('--per-split-data-args-path',
         help=("a JSON file with 'train', 'valid' and 'test' keys, each a --data-path list (a string or a list "
               'of strings), instead of --train/valid/test-data-path')),
    Flag('--num-dataset-builder-threads', int, 1, help="threads megatron-core's dataset builder uses per rank"),
    Flag('--mid-level-dataset-surplus', float, 0.005,
         help='extra samples megatron-core builds for each dataset of a blend'),
    Flag('--dataloader-type', choices=('single', 'cyclic', 'external'),
         help=('single (default): the training samples in order; cyclic: in a new random order every epoch '
               "(Megatron-LM's MegatronPretrainingRandomSampler)")),
    switch('--reset-position-ids', help='positions start again at 0 after each end-of-document token'),
    switch('--reset-attention-mask',
           help='tokens attend only within their own document (end-of-document token included)'),
    Flag('--data-cache-path', help='where the dataset index caches are written'),
    switch('--mock-data', help="megatron-core's MockGPTDataset"),
    switch('--eod-mask-loss', help='labels that are the end-of-document token do not count in the loss'),
    Flag('--no-mmap-bin-files', action="store_false", dest='mmap_bin_files',
         help='read the .bin files with file reads instead of memory-mapping them'),
)

TOKENIZER_TITLE = 'tokenizer'
TOKENIZER: tuple[Flag, ...] = (
    Flag('--tokenizer-type', choices=TOKENIZER_TYPES,
         help='how the --data-path documents were tokenized (default: NullTokenizer with --mock-data)'),
    Flag('--tokenizer-model', help='HuggingFaceTokenizer: a local tokenizer.json'),
    *BPE_FILES,
    Flag('--make-vocab-size-divisible-by', int, 128,
         help="pad the model's vocabulary to a multiple of this times TP (not for the generated task)"),
)

VALIDATION_TITLE = 'validation'
VALIDATION: tuple[Flag, ...] = (
    Flag('--eval-interval', int, 1000, help='evaluate on the validation split every this many iterations'),
    Flag('--eval-iters', int, 100, help='global batches per evaluation (0: none, also no final validation/test)'),
    Flag('--final-eval-iters', int, None,
         help=('global batches of the final validation, read from the start of the validation split: a fixed '
               'held-out set, the same for every run on the data, whose per-batch losses go to --metrics-jsonl '
               '(default: --eval-iters batches after those the periodic evaluations read, as Megatron-LM)')),
    switch('--skip-train',
           help='no training: evaluate the (--load) model on the validation and test splits, then exit'),
)
