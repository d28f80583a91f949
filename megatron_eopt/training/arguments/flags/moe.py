"""Mixture-of-experts flags: the `MOE` table (dest == megatron-core TransformerConfig field,
except `--num-experts`).

Every flag but `--num-experts` is parsed as None and needs it; arguments/moe.py fills in
Megatron-LM's defaults and checks the combinations.
"""

from megatron_eopt.training.arguments.flags.table import Flag, switch
from megatron_eopt.training.arguments.moe import DISPATCHERS, DROP_POLICIES, LOAD_BALANCING_TYPES, SCORE_FUNCTIONS

MOE_TITLE = 'moe'
MOE: tuple[Flag, ...] = (
    Flag('--num-experts', int,
         help="experts per MoE layer (megatron-core's MoELayer, SequentialMLP experts); default: dense MLPs"),
    Flag('--moe-layer-freq', needs='num_experts',
         help=('MoE layers: an int N (every Nth layer, from the first; default 1) or a 0/1 list such as '
               "'([0]*1+[1]*3)' (0: a dense MLP)")),
    Flag('--moe-ffn-hidden-size', int, needs='num_experts', help="each expert's FFN size (default --ffn-hidden-size)"),
    Flag('--moe-router-topk', int, needs='num_experts', help='experts per token (default 2)'),
    Flag('--expert-model-parallel-size', int, 1, needs='num_experts',
         help='ranks the experts of a layer are split over, out of the data-parallel ranks'),
    Flag('--expert-tensor-parallel-size', int, needs='num_experts',
         help=("only the tensor-parallel size here (Megatron-LM's default): the experts' linears are split over "
               'the TP ranks like the dense ones')),
    Flag('--moe-token-dispatcher-type', choices=DISPATCHERS, needs='num_experts',
         help='default allgather; alltoall needs CUDA'),
    Flag('--moe-router-score-function', choices=SCORE_FUNCTIONS, needs='num_experts',
         help="the router's score of each expert (default softmax)"),
    Flag('--moe-router-topk-scaling-factor', float, needs='num_experts',
         help='multiplies the top-k routing probabilities (default none)'),
    switch('--moe-router-pre-softmax', default=None, needs='num_experts',
           help='softmax over all experts before the top-k (else over the top-k); allows top-1'),
    Flag('--moe-router-dtype', choices=('fp32', 'fp64'), needs='num_experts',
         help="the router's logits and scores in this precision (default: the model's)"),
    Flag('--moe-router-num-groups', int, needs='num_experts',
         help='group-limited routing: the experts split into this many groups'),
    Flag('--moe-router-group-topk', int, needs='num_experts',
         help="group-limited routing: groups each token's experts are chosen from"),
    Flag('--moe-input-jitter-eps', float, needs='num_experts',
         help="multiplies the router's input by uniform noise in [1 - eps, 1 + eps] while training"),
    Flag('--moe-router-load-balancing-type', choices=LOAD_BALANCING_TYPES, nargs='+', needs='num_experts',
         help=('aux_loss (default), seq_aux_loss, global_aux_loss, sinkhorn or none; several aux-loss types with'
               ' one --moe-aux-loss-coeff each')),
    Flag('--moe-aux-loss-coeff', float, nargs='+', needs='num_experts',
         help='weight of the load-balancing loss (default 0), one per --moe-router-load-balancing-type'),
    Flag('--moe-z-loss-coeff', float, needs='num_experts', help='weight of the router z-loss (default none)'),
    switch('--moe-router-enable-expert-bias', default=None, needs='num_experts',
           help='aux-loss-free balancing: a per-expert bias on the routing scores, updated every step'),
    Flag('--moe-router-bias-update-rate', float, needs='num_experts',
         help="the expert bias's step per iteration (default 1e-3)"),
    Flag('--moe-shared-expert-intermediate-size', int, needs='num_experts',
         help='FFN size of the shared experts every token goes through (default: none)'),
    switch('--moe-shared-expert-gate', default=None, needs='num_experts',
           help="a learned sigmoid gate on the shared experts' output"),
    switch('--moe-shared-expert-overlap', default=None, needs='num_experts',
           help='overlap the shared experts with the dispatch (CUDA streams; alltoall)'),
    Flag('--moe-expert-capacity-factor', float, needs='num_experts',
         help='each expert takes at most factor x its even share of the tokens; the rest are dropped'),
    switch('--moe-pad-expert-input-to-capacity', default=None, needs='num_experts',
           help='fill every expert to its capacity (with zero-weight tokens)'),
    Flag('--moe-token-drop-policy', choices=DROP_POLICIES, needs='num_experts',
         help='which tokens an expert over capacity drops: lowest probs (default) or last position'),
)
