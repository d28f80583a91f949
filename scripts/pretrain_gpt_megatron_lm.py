"""Megatron-LM's own `pretrain()` for a GPT model, with megatron_eopt's optimizer (on CPU too).

    torchrun --nproc-per-node 8 scripts/pretrain_gpt_megatron_lm.py \
        --optimizer muon --use-distributed-optimizer --tensor-model-parallel-size 2 \
        --num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 \
        --max-position-embeddings 1024 --micro-batch-size 4 --global-batch-size 64 \
        --lr 3e-4 --train-iters 1000 --bf16 \
        --mock-data --tokenizer-type NullTokenizer --vocab-size 50304

Every Megatron-LM flag works, plus ours; see megatron_eopt/integrations/megatron_lm_gpt.py.
"""

from megatron_eopt.integrations.megatron_lm_gpt import main

if __name__ == "__main__":
    main()
