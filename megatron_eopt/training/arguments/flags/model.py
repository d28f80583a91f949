"""Model flags (megatron-core's GPT model and multi-latent attention): the `MODEL` and `MLA` tables.

MLA flags other than `--multi-latent-attention` and `--rope-type` are parsed as None and need
`--multi-latent-attention`; their Megatron-LM defaults are `MLA_DEFAULTS` (arguments/mla.py).
"""

from megatron_eopt.training.arguments.flags.table import Flag, switch

DEFAULT_RULE_VOCAB_SIZE = 64  # the generated task's vocabulary

MODEL_TITLE = 'model'
MODEL: tuple[Flag, ...] = (
    Flag('--num-layers', int, 2),
    Flag('--hidden-size', int, 64),
    Flag('--num-attention-heads', int, 4),
    switch('--group-query-attention', help='grouped-query attention with --num-query-groups key/value groups'),
    Flag('--num-query-groups', int, help='with --group-query-attention (default then: 1)'),
    Flag('--ffn-hidden-size', int, help='default: 4 * hidden size; with --swiglu int(8 * hidden size / 3 / 64) * 64'),
    switch('--swiglu'),
    switch('--squared-relu', help="the MLP's activation is relu(x)^2"),
    switch('--quick-geglu', help='the MLP is a gated unit with quick GELU, x * sigmoid(1.702 x)'),
    switch('--untie-embeddings-and-output-weights',
           help="a separate output layer (default: it shares the input embedding's weight)"),
    switch('--disable-bias-linear', help='no biases in the linear layers'),
    switch('--add-qkv-bias', help='with --disable-bias-linear: biases on the QKV projection only'),
    Flag('--norm-epsilon', float, 1e-05, help='the epsilon of every LayerNorm/RMSNorm'),
    Flag('--normalization', default='LayerNorm', choices=('LayerNorm', 'RMSNorm')),
    Flag('--hidden-dropout', float, 0.0, help="default 0 (Megatron-LM's is 0.1): layouts then train identically"),
    Flag('--attention-dropout', float, 0.0, help="default 0 (Megatron-LM's is 0.1): layouts then train identically"),
    Flag('--init-method-std', float, 0.02),
    Flag('--embedding-init-method-std', float, help="the embeddings' N(0, std) (default: --init-method-std)"),
    switch('--init-method-xavier-uniform',
           help="draw every weight from Xavier's uniform distribution instead of N(0, --init-method-std)"),
    Flag('--position-embedding-type', default='learned_absolute', choices=('learned_absolute', 'rope', 'none')),
    switch('--use-rotary-position-embeddings',
           help="Megatron-LM's deprecated spelling of --position-embedding-type rope"),
    Flag('--rotary-base', int, help="RoPE's base period (default 10000)"),
    Flag('--rotary-percent', float, help="the fraction of each head's dimensions RoPE rotates (default 1.0)"),
    switch('--rotary-interleaved',
           help='RoPE rotates neighbouring pairs of dimensions instead of the two halves of a head'),
    Flag('--rotary-seq-len-interpolation-factor', int,
         help='RoPE: positions divided by this (position interpolation)'),
    switch('--use-rope-scaling',
           help="RoPE: Llama 3.x's frequency scaling (long wavelengths divided by --rope-scaling-factor)"),
    Flag('--rope-scaling-factor', float, help='with --use-rope-scaling (default 8)'),
    Flag('--kv-channels', int, help="each attention head's width (default: hidden size / attention heads)"),
    switch('--qk-layernorm', help="normalise each head's query and key (--normalization's kind) before attention"),
    switch('--apply-layernorm-1p',
           help="norms store gamma - 1 (initialised to 0) and scale by weight + 1 (megatron's zero-centred gamma)"),
    Flag('--seq-length', int, 32),
    Flag('--max-position-embeddings', int, help='default: seq length'),
    Flag('--vocab-size', int,
         help=(f"the generated task's vocabulary (default {DEFAULT_RULE_VOCAB_SIZE}) or NullTokenizer's; with a "
               "tokenizer the model's is its vocabulary, padded")),
    Flag('--transformer-impl', choices=('local', 'transformer_engine'),
         help=("megatron-core's local layers or Transformer Engine's (CUDA and TE needed); default: Transformer "
               'Engine on CUDA when installed, else local')),
)

MLA_TITLE = 'multi-latent attention'
MLA: tuple[Flag, ...] = (
    switch('--multi-latent-attention',
           help=("megatron-core's multi-latent attention (DeepSeek-V2/V3, Kimi-K2): queries, keys and values "
                 'projected through low-rank latents')),
    Flag('--q-lora-rank', int, needs='multi_latent_attention',
         help="the query latent's width (default: none, one query projection)"),
    Flag('--kv-lora-rank', int, needs='multi_latent_attention', help="the key/value latent's width (default 32)"),
    Flag('--qk-head-dim', int, needs='multi_latent_attention',
         help="each head's query/key width without RoPE (default 128)"),
    Flag('--qk-pos-emb-head-dim', int, needs='multi_latent_attention',
         help="each head's query/key width rotated by RoPE (default 64; the key part is shared by all heads)"),
    Flag('--v-head-dim', int, needs='multi_latent_attention', help="each head's value width (default 128)"),
    Flag('--rope-type', choices=('rope', 'yarn'), help="MLA's rotary embedding (default yarn; without MLA only rope)"),
    Flag('--rotary-scaling-factor', float, needs='multi_latent_attention',
         help="YaRN's context-extension factor (default 1.0: the original frequencies)"),
    Flag('--mscale', float, needs='multi_latent_attention', help="YaRN's mscale (default 1.0)"),
    Flag('--mscale-all-dim', float, needs='multi_latent_attention',
         help="YaRN's mscale_all_dim (default 0.0); also scales MLA's softmax"),
)
