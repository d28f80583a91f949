"""Megatron-LM's multi-latent attention flags (the MLA table, flags/model.py): defaults and checks.

Each flag's dest is the MLATransformerConfig field it sets (megatron_eopt/training/model/mla.py hands them on), with
Megatron-LM's defaults (which differ from MLATransformerConfig's: --kv-lora-rank 32,
--rotary-scaling-factor 1.0, --q-lora-rank unset = no query compression). `--rope-type` defaults
to yarn with MLA, as in Megatron-LM; without MLA only `rope` (what the trainer does anyway) is
accepted. Megatron-LM's `--yarn-*` flags configure YaRN for non-MLA attention only (MLA reads
its own config fields, which Megatron-LM's command line does not set): MLA's YaRN uses
megatron-core's defaults beta_fast 32, beta_slow 1, original max positions 4096 here too.

The flags are parsed with `None` defaults so that a flag given without `--multi-latent-attention`
is refused in one line; `mla_settings` fills in Megatron-LM's defaults.
"""

from __future__ import annotations

import argparse
from typing import Any, Optional

from arguments import refuse_flags_without
from megatron_eopt.training.arguments.flags.model import MLA
from megatron_eopt.training.arguments.flags.table import given_needing

# dest: Megatron-LM's default (None for --q-lora-rank means no query compression).
MLA_DEFAULTS: dict[str, Any] = {"q_lora_rank": None, "kv_lora_rank": 32, "qk_head_dim": 128,
                                "qk_pos_emb_head_dim": 64, "v_head_dim": 128, "rotary_scaling_factor": 1.0,
                                "mscale": 1.0, "mscale_all_dim": 0.0}


def mla_settings(args: argparse.Namespace, local_spec: Optional[bool]) -> dict[str, Any]:
    """GPTModelSettings fields of the MLA flags ({} without --multi-latent-attention).
    ``local_spec``: megatron-core's local layers will be built (no Transformer Engine); None: not
    known yet (before torch is imported), the check that needs it waits."""
    if not args.multi_latent_attention:
        refuse_flags_without(given_needing(args, MLA, "multi_latent_attention"), "--multi-latent-attention")
        if args.rope_type == "yarn":
            raise ValueError("--rope-type yarn only applies with --multi-latent-attention (other attention takes "
                             "rope, as in Megatron-LM).")
        return {}
    _check_mla_combinations(args, local_spec)
    values = {dest: default if getattr(args, dest) is None else getattr(args, dest)
              for dest, default in MLA_DEFAULTS.items()}
    return dict(multi_latent_attention=True, rope_type=args.rope_type or "yarn", **values)


def _check_mla_combinations(args: argparse.Namespace, local_spec: Optional[bool]) -> None:
    if args.group_query_attention:
        raise ValueError("--group-query-attention and --multi-latent-attention exclude each other (as in "
                         "Megatron-LM: every MLA head has its own key and value).")
    if args.qk_layernorm and args.q_lora_rank is None and local_spec is True:
        raise ValueError("--qk-layernorm with --multi-latent-attention needs --q-lora-rank with megatron-core's "
                         "local layers (without a query latent megatron puts the query norm into Transformer "
                         "Engine's fused norm+linear).")
    refused = [flag for flag, on in (("--rotary-interleaved", args.rotary_interleaved),
                                     ("--use-rope-scaling", args.use_rope_scaling),
                                     ("--rotary-seq-len-interpolation-factor",
                                      args.rotary_seq_len_interpolation_factor is not None)) if on]
    if refused:
        raise ValueError(f"{' and '.join(refused)} do not apply with --multi-latent-attention (its RoPE takes "
                         f"--rope-type, --rotary-base, --rotary-percent and the YaRN flags).")
    if args.rotary_percent is not None and args.rope_type != "rope":
        raise ValueError("--rotary-percent with --multi-latent-attention only applies with --rope-type rope "
                         "(YaRN rotates the whole --qk-pos-emb-head-dim).")
    if args.rope_type == "rope" and args.mscale is not None:
        raise ValueError("--mscale only applies with --rope-type yarn (got rope).")
