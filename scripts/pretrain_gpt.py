"""Pretrain a megatron-core GPTModel with megatron_eopt's optimizer, from Megatron-LM's flags.

    torchrun --nproc-per-node 4 scripts/pretrain_gpt.py --tensor-model-parallel-size 2 \\
        --optimizer muon --use-distributed-optimizer --lr 3e-3 --min-lr 3e-4 --train-iters 100

`python scripts/pretrain_gpt.py ...` runs one process. The trainer is the package
`megatron_eopt.training`; docs/trainer.md describes its flags.
"""

from megatron_eopt.training.pretrain import main

if __name__ == "__main__":
    main()
