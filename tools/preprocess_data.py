"""Tokenize a JSONL corpus into a megatron-core indexed dataset (.bin/.idx), as Megatron-LM's tool.

    python tools/preprocess_data.py --input docs.jsonl --output-prefix data/docs \
        --tokenizer-type ByteLevelTokenizer --append-eod --workers 2

The flags and the code: megatron_eopt/training/data/preprocess.py (`--help` lists them).
"""

from megatron_eopt.training.data.preprocess import main

if __name__ == "__main__":
    main()
