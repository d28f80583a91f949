"""Parallelism flags: process groups, tensor/sequence/data parallelism, FSDP2, Megatron-FSDP, gradient reduction
(`PARALLEL`) and pipeline parallelism (`PIPELINE`)."""

from megatron_eopt.training.arguments.flags.table import Flag, switch

BUCKET_NUMEL = 40_000_000  # megatron-core DDP's default bucket size, in elements

PARALLEL_TITLE = 'parallelism'
PARALLEL: tuple[Flag, ...] = (
    Flag('--distributed-backend', choices=('nccl', 'gloo'),
         help=('default: nccl (one GPU per rank) where CUDA is available, else gloo on CPU; gloo runs on CPU '
               'even where CUDA is available')),
    Flag('--distributed-timeout-minutes', float, 10.0,
         help='how long a collective may wait for the other ranks before failing'),
    Flag('--tensor-model-parallel-size', int, 1),
    Flag('--context-parallel-size', int, 1, help='only 1 here: context parallelism is not offered'),
    switch('--sequence-parallel',
           help=('split the activations outside attention and the MLP along the sequence over the tensor-parallel '
                 'ranks (off at TP 1, as in Megatron-LM)')),
    switch('--use-torch-fsdp2',
           help=('shard the model with torch FSDP2 (fully_shard each transformer layer, then the root) over the '
                 'data-parallel ranks (of each TP rank, with TP > 1); with --bf16 the sharded parameters and the '
                 'optimizer stay fp32 and FSDP2 computes in bf16 (MixedPrecisionPolicy: bf16 parameters in '
                 'forward/backward, gradients reduced in fp32)')),
    switch('--use-megatron-fsdp',
           help=('wrap the model with Megatron-FSDP (the megatron-fsdp package; each transformer layer one unit) '
                 'over all ranks; with --data-parallel-sharding-strategy optim_grads_params (the default); TP and PP 1')),
    Flag('--data-parallel-sharding-strategy', str, 'optim_grads_params',
         choices=('no_shard', 'optim', 'optim_grads', 'optim_grads_params'),
         help=("with --use-megatron-fsdp, what Megatron-FSDP shards: only 'optim_grads_params' (ZeRO-3: "
               'parameters, gradients and optimizer state) is supported; the others are refused')),
    switch('--overlap-grad-reduce',
           help=("start each gradient bucket's data-parallel all-reduce during the last micro-batch's backward, as"
                 ' soon as its gradients are complete (with --use-distributed-optimizer the optimizer then takes '
                 'averaged gradients instead of reducing onto owners; FSDP2 overlaps its reduce-scatter already)')),
    Flag('--ddp-bucket-size', int, help=f'elements per gradient all-reduce bucket (default {BUCKET_NUMEL})'),
    switch('--accumulate-allreduce-grads-in-fp32',
           help=('sum micro-batch gradients and all-reduce them over data-parallel ranks in fp32 '
                 '(param.main_grad); always on with --bf16, as in Megatron-LM; no effect on an fp32 model, whose '
                 'gradients are fp32 already')),
    switch('--grad-reduce-in-bf16',
           help=("with --bf16: sum micro-batch gradients and all-reduce them in bf16 (the parameters' dtype) "
                 'instead of fp32')),
)

PIPELINE_TITLE = 'pipeline parallelism'
PIPELINE: tuple[Flag, ...] = (
    Flag('--pipeline-model-parallel-size', int, 1,
         help="pipeline stages (torch.distributed.pipelining's 1F1B schedule)"),
    Flag('--num-layers-per-virtual-pipeline-stage', int,
         help='transformer layers per model chunk: several chunks per pipeline rank, interleaved 1F1B'),
    Flag('--num-virtual-stages-per-pipeline-rank', int,
         help='model chunks per pipeline rank (instead of --num-layers-per-virtual-pipeline-stage)'),
    Flag('--decoder-first-pipeline-num-layers', int,
         help='transformer layers on the first pipeline stage (the rest split evenly)'),
    Flag('--decoder-last-pipeline-num-layers', int,
         help='transformer layers on the last pipeline stage (the rest split evenly)'),
    switch('--account-for-embedding-in-pipeline-split',
           help='count the embedding as one layer when splitting layers over stages'),
    switch('--account-for-loss-in-pipeline-split',
           help='count the output layer and loss as one layer when splitting layers over stages'),
    Flag('--pipeline-model-parallel-layout',
         help=("megatron-core's layout string, e.g. 'Et*2|t*2L' (E embedding, t layer, L output layer and loss, "
               '| between stages); virtual stages follow from it')),
)
