"""Megatron-LM's mixture-of-experts flags: settings and checks (the rows are in flags/moe.py).

Each flag's dest is the TransformerConfig field it sets (`moe_settings` hands them on through
GPTModelSettings); only `--num-experts` is spelled differently (`num_moe_experts`). The routing
is megatron-core's; training/model/moe.py only moves buffers and collectives off CUDA.

The checks run here, before any process group exists, because megatron-core's own are asserts
on every rank after start-up: a bad value or combination exits every rank with one line naming
the flags. The rules are megatron-core's, plus what this trainer cannot do on CPU, plus flags
that would be silently ignored (refused, or named at start-up by `moe_note_lines`).
`--moe-layer-freq` is parsed, not `eval`ed: an int N, a list of 0/1, and sums of `[..]*n`.
"""

from __future__ import annotations

import argparse
import math
import re
from typing import Any, Optional

from arguments import refuse_flags_without

DISPATCHERS = ("allgather", "alltoall")  # megatron-core's "flex" needs DeepEP
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "quantile_balancing", "none")
AUX_LOSS_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss")  # weighted by --moe-aux-loss-coeff
SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")
DROP_POLICIES = ("probs", "position")
# The logged loss of each aux-loss type, as Megatron-LM names it (training.py's track_names).
LOGGED_LOSS_OF_TYPE = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
                       "global_aux_loss": "global_load_balancing_loss"}

# MoE flags other than --num-experts, with the value argparse leaves when one is not given (the
# defaults are filled in by resolve_moe_flags, so that a flag given without --num-experts is seen).
_NOT_GIVEN = {"moe_router_topk": None, "moe_aux_loss_coeff": None, "moe_router_load_balancing_type": None,
              "moe_token_dispatcher_type": None, "expert_tensor_parallel_size": None, "moe_ffn_hidden_size": None,
              "moe_layer_freq": None, "moe_router_score_function": None, "moe_router_topk_scaling_factor": None,
              "moe_router_pre_softmax": None, "moe_router_dtype": None, "moe_router_num_groups": None,
              "moe_router_group_topk": None, "moe_input_jitter_eps": None, "moe_z_loss_coeff": None,
              "moe_router_enable_expert_bias": None, "moe_router_bias_update_rate": None,
              "moe_shared_expert_intermediate_size": None, "moe_shared_expert_overlap": None,
              "moe_shared_expert_gate": None, "moe_expert_capacity_factor": None,
              "moe_pad_expert_input_to_capacity": None, "moe_token_drop_policy": None}


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


# ------------------------------------------------------------------------------------------------
# --moe-layer-freq
# ------------------------------------------------------------------------------------------------

_FREQ_TOKENS = re.compile(r"\s*(\d+|[][()*+,])")
_MAX_PATTERN = 1 << 20  # far above any layer count; stops "[1]*10**9"-sized requests early


class _BadPattern(Exception):
    pass


def parse_moe_layer_freq(text: str) -> int | list[int]:
    """An int N (every Nth layer MoE, from layer 0), or a 0/1 list written as Megatron-LM
    documents it: "[0,1,1,1]", "([0]*1+[1]*3)", "([1]*3+[0]*2)*2". ValueError otherwise."""
    text = str(text).strip()
    if text.isdigit():
        return int(text)
    try:
        tokens = _freq_tokens(text)
        pattern, end = _parse_sum(tokens, 0)
        if end != len(tokens):
            raise _BadPattern
    except _BadPattern:
        raise ValueError(f"--moe-layer-freq {text!r}: expected an int N or a list of 0/1 such as '[0,1,1,1]' or "
                         f"'([0]*1+[1]*3)' (lists, '+', '*' by an int, parentheses).") from None
    if any(value not in (0, 1) for value in pattern):
        raise ValueError(f"--moe-layer-freq {text!r}: the list may hold only 0 (dense) and 1 (MoE); got {pattern}.")
    return pattern


def _freq_tokens(text: str) -> list[str]:
    tokens, at = [], 0
    while at < len(text):
        match = _FREQ_TOKENS.match(text, at)
        if match is None:
            if text[at:].strip():
                raise _BadPattern
            break
        tokens.append(match.group(1))
        at = match.end()
    return tokens


def _parse_sum(tokens: list[str], at: int) -> tuple[list[int], int]:
    """sum := product ('+' product)*"""
    total, at = _parse_product(tokens, at)
    while at < len(tokens) and tokens[at] == "+":
        more, at = _parse_product(tokens, at + 1)
        total = total + more
    return total, at


def _parse_product(tokens: list[str], at: int) -> tuple[list[int], int]:
    """product := atom ('*' int)*"""
    value, at = _parse_atom(tokens, at)
    while at < len(tokens) and tokens[at] == "*":
        if at + 1 >= len(tokens) or not tokens[at + 1].isdigit():
            raise _BadPattern
        count = int(tokens[at + 1])
        if len(value) * count > _MAX_PATTERN:
            raise _BadPattern
        value, at = value * count, at + 2
    return value, at


def _parse_atom(tokens: list[str], at: int) -> tuple[list[int], int]:
    """atom := '[' int (',' int)* ']' | '(' sum ')'"""
    if at >= len(tokens):
        raise _BadPattern
    if tokens[at] == "(":
        value, at = _parse_sum(tokens, at + 1)
        if at >= len(tokens) or tokens[at] != ")":
            raise _BadPattern
        return value, at + 1
    if tokens[at] != "[":
        raise _BadPattern
    values, at = [], at + 1
    while True:
        if at >= len(tokens) or not tokens[at].isdigit():
            raise _BadPattern
        values.append(int(tokens[at]))
        if at + 1 < len(tokens) and tokens[at + 1] == ",":
            at += 2
        elif at + 1 < len(tokens) and tokens[at + 1] == "]":
            return values, at + 2
        else:
            raise _BadPattern


def moe_layer_pattern(freq: int | list[int] | tuple[int, ...], num_layers: int) -> list[int]:
    """1 for each MoE layer, 0 for each dense one (0-based layers; megatron-core's reading)."""
    if isinstance(freq, int):
        return [1 if layer % freq == 0 else 0 for layer in range(num_layers)]
    return list(freq)


# ------------------------------------------------------------------------------------------------
# Flags
# ------------------------------------------------------------------------------------------------


def resolve_moe_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The MoE flags with Megatron-LM's defaults, after refusing those given without their
    feature (which needs them unfilled). `--num-experts 0` is Megatron-LM's spelling of dense."""
    experts = None if args.num_experts == 0 else args.num_experts
    if experts is None:
        _refuse_without_experts(args)
    elif experts < 0:
        raise ValueError(f"--num-experts must be >= 1 (or 0 for dense MLPs); got {experts}.")
    else:
        _refuse_without_their_feature(args)
    return dict(_defaults(args), num_experts=experts)


def check_moe_flags(args: argparse.Namespace, tp: int, dp: int, use_cuda: Optional[bool], num_layers: int) -> int:
    """Check the resolved MoE flags (`resolve_moe_flags`) against each other and the layout (`use_cuda`
    None: not known yet, its checks wait). Returns EP."""
    if args.num_experts is not None:
        _check_expert_flags(args, tp, dp, use_cuda)
        _check_router_flags(args)
        _check_balancing_flags(args)
        _check_shared_expert_flags(args, use_cuda)
        _check_capacity_flags(args)
        _check_layer_freq(args, num_layers)
    return args.expert_model_parallel_size


def _refuse_without_experts(args: argparse.Namespace) -> None:
    given = [_flag(dest) + (f" {getattr(args, dest)}" if dest == "expert_tensor_parallel_size" else "")
             for dest, unset in _NOT_GIVEN.items() if getattr(args, dest) is not unset]
    if args.expert_model_parallel_size != 1:
        given.insert(1, f"--expert-model-parallel-size {args.expert_model_parallel_size}")
    refuse_flags_without(given, "--num-experts (a mixture-of-experts model)")


# Flags that only mean something with another one (dest: the other flag's dest, what it turns on).
_NEEDS = {"moe_router_bias_update_rate": ("moe_router_enable_expert_bias", "aux-loss-free balancing"),
          "moe_shared_expert_gate": ("moe_shared_expert_intermediate_size", "shared experts"),
          "moe_shared_expert_overlap": ("moe_shared_expert_intermediate_size", "shared experts"),
          "moe_pad_expert_input_to_capacity": ("moe_expert_capacity_factor", "token dropping"),
          "moe_token_drop_policy": ("moe_expert_capacity_factor", "token dropping")}


def _refuse_without_their_feature(args: argparse.Namespace) -> None:
    for needed in dict.fromkeys(needed for needed, _ in _NEEDS.values()):
        if getattr(args, needed) is None:
            given = [_flag(dest) for dest, (other, _) in _NEEDS.items()
                     if other == needed and getattr(args, dest) is not None]
            feature = next(feature for other, feature in _NEEDS.values() if other == needed)
            refuse_flags_without(given, f"{_flag(needed)} ({feature})")


def _defaults(args: argparse.Namespace) -> dict[str, Any]:
    """Megatron-LM's defaults, filled in only after the refusals, which see what was given.
    One balancing type and one coefficient become plain values, as Megatron-LM does."""
    defaults = dict(moe_router_topk=2, moe_token_dispatcher_type="allgather", moe_router_score_function="softmax",
                    moe_router_bias_update_rate=1e-3, moe_token_drop_policy="probs", moe_layer_freq="1")
    values = {dest: default if getattr(args, dest) is None else getattr(args, dest) for dest, default in defaults.items()}
    for dest in ("moe_router_pre_softmax", "moe_router_enable_expert_bias", "moe_shared_expert_overlap",
                 "moe_shared_expert_gate", "moe_pad_expert_input_to_capacity"):
        values[dest] = bool(getattr(args, dest))
    types = args.moe_router_load_balancing_type or ["aux_loss"]
    coeffs = args.moe_aux_loss_coeff or [0.0]
    if len(types) != len(coeffs) and args.moe_aux_loss_coeff is not None:
        raise ValueError(f"--moe-aux-loss-coeff gives {len(coeffs)} value(s) for {len(types)} "
                         f"--moe-router-load-balancing-type(s): give one coefficient per type.")
    if len(types) > 1 and args.moe_aux_loss_coeff is None:
        coeffs = [0.0] * len(types)
    values["moe_router_load_balancing_type"] = types[0] if len(types) == 1 else list(types)
    values["moe_aux_loss_coeff"] = coeffs[0] if len(coeffs) == 1 else list(coeffs)
    values["moe_layer_freq"] = parse_moe_layer_freq(values["moe_layer_freq"])
    return values


def _check_expert_flags(args: argparse.Namespace, tp: int, dp: int, use_cuda: Optional[bool]) -> None:
    experts, ep = args.num_experts, args.expert_model_parallel_size
    if ep < 1 or experts % ep or dp % ep:
        raise ValueError(f"--expert-model-parallel-size {ep} must be >= 1 and divide --num-experts {experts} "
                         f"and the data-parallel size {dp}.")
    if args.expert_tensor_parallel_size not in (None, tp):
        raise ValueError(f"--expert-tensor-parallel-size {args.expert_tensor_parallel_size}: only the tensor-parallel "
                         f"size ({tp}) is offered by this trainer (experts split over TP like the dense layers).")
    for dest in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
        size = getattr(args, dest)
        if size is not None and (size < 1 or size % tp):
            raise ValueError(f"{_flag(dest)} must be >= 1 and divisible by --tensor-model-parallel-size {tp}; got {size}.")
    if args.moe_token_dispatcher_type == "alltoall" and use_cuda is False:
        raise ValueError("--moe-token-dispatcher-type alltoall needs CUDA (megatron-core's all-to-all "
                         "dispatcher creates CUDA streams); use allgather on CPU.")
    if tp > 1 and not args.sequence_parallel:
        raise ValueError(f"--num-experts with --tensor-model-parallel-size {tp} needs --sequence-parallel "
                         f"(megatron-core's MoELayer refuses tensor parallelism without it).")
    if not args.disable_bias_linear and use_cuda is False:
        raise ValueError("--num-experts on CPU needs --disable-bias-linear: megatron-core's expert MLP adds its "
                         "bias in place to the output of its row-parallel linear, which autograd refuses there.")


def _check_router_flags(args: argparse.Namespace) -> None:
    experts, topk = args.num_experts, args.moe_router_topk
    if not 1 <= topk <= experts:
        raise ValueError(f"--moe-router-topk must be in [1, --num-experts {experts}]; got {topk}.")
    if (topk == 1 and args.moe_router_score_function == "softmax" and not args.moe_router_pre_softmax
            and args.moe_router_load_balancing_type != "sinkhorn"):  # megatron-core's rule
        raise ValueError("--moe-router-topk 1 with the softmax score needs --moe-router-pre-softmax (a softmax over "
                         "one expert is 1 and gives the router no gradient).")
    _check_finite(args, "moe_router_topk_scaling_factor", above=0.0)
    eps = args.moe_input_jitter_eps
    if eps is not None and not 0.0 < eps < 1.0:
        raise ValueError(f"--moe-input-jitter-eps must be in (0, 1); got {eps}.")
    _check_group_limited_routing(args)


def _check_group_limited_routing(args: argparse.Namespace) -> None:
    groups, group_topk, topk, experts = (args.moe_router_num_groups, args.moe_router_group_topk,
                                         args.moe_router_topk, args.num_experts)
    if (groups is None) != (group_topk is None):
        raise ValueError("--moe-router-num-groups and --moe-router-group-topk go together (group-limited routing).")
    if groups is None:
        return
    if groups < 1 or experts % groups:
        raise ValueError(f"--moe-router-num-groups must be >= 1 and divide --num-experts {experts}; got {groups}.")
    # megatron-core scores a group by its best topk // group_topk experts, then picks topk experts
    # among the chosen groups' experts: both must be possible.
    if not 1 <= group_topk <= min(groups, topk) or topk > group_topk * (experts // groups):
        raise ValueError(f"--moe-router-group-topk must be in [1, min(--moe-router-num-groups {groups}, "
                         f"--moe-router-topk {topk})], with --moe-router-topk <= group-topk x {experts // groups} "
                         f"experts per group; got {group_topk}.")


def _check_balancing_flags(args: argparse.Namespace) -> None:
    types = _as_list(args.moe_router_load_balancing_type)
    coeffs = _as_list(args.moe_aux_loss_coeff)
    if len(set(types)) != len(types):
        raise ValueError(f"--moe-router-load-balancing-type {' '.join(types)}: each type at most once.")
    if "quantile_balancing" in types:
        raise ValueError("--moe-router-load-balancing-type quantile_balancing is not offered: megatron-core allocates "
                         "its bias buffers on CUDA and updates them in its own finalize_model_grads.")
    if "sinkhorn" in types and (len(types) > 1 or coeffs != [0.0]):
        raise ValueError("--moe-router-load-balancing-type sinkhorn balances by itself: give it alone, without "
                         "--moe-aux-loss-coeff (megatron-core refuses an aux loss with it).")
    for coeff in coeffs:
        if not (math.isfinite(coeff) and coeff >= 0.0):
            raise ValueError(f"--moe-aux-loss-coeff must be a finite number >= 0; got {coeff}.")
    _check_finite(args, "moe_z_loss_coeff", above=0.0, hint=" (megatron logs z-loss / coeff: leave the flag out "
                                                            "for no z-loss)")
    if args.moe_router_enable_expert_bias:
        if args.moe_router_score_function == "softmax":  # megatron-core's rule
            raise ValueError("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid or "
                             "sqrtsoftplus (megatron-core's aux-loss-free routing).")
        _check_finite(args, "moe_router_bias_update_rate", above=0.0)


def _check_shared_expert_flags(args: argparse.Namespace, use_cuda: Optional[bool]) -> None:
    if args.moe_shared_expert_overlap and use_cuda is False:
        raise ValueError("--moe-shared-expert-overlap needs CUDA (megatron-core runs the shared experts on a "
                         "torch.cuda.Stream); leave it out on CPU.")
    if args.moe_shared_expert_overlap and args.moe_token_dispatcher_type != "alltoall":
        raise ValueError("--moe-shared-expert-overlap needs --moe-token-dispatcher-type alltoall (megatron-core's rule).")


def _check_capacity_flags(args: argparse.Namespace) -> None:
    if args.moe_expert_capacity_factor is None:
        return
    _check_finite(args, "moe_expert_capacity_factor", above=0.0,
                  hint=" (Megatron-LM reads a negative factor as no capacity limit: leave the flag out for that)")
    types = _as_list(args.moe_router_load_balancing_type)
    if not set(types) <= {*AUX_LOSS_TYPES, "none"}:  # megatron-core's rule
        raise ValueError(f"--moe-expert-capacity-factor works with the load-balancing types aux_loss, seq_aux_loss, "
                         f"global_aux_loss and none; got {' '.join(types)}.")


def _check_layer_freq(args: argparse.Namespace, num_layers: int) -> None:
    freq = args.moe_layer_freq
    if isinstance(freq, int) and freq < 1:
        raise ValueError(f"--moe-layer-freq must be >= 1 (every Nth layer is MoE); got {freq}.")
    if isinstance(freq, list) and len(freq) != num_layers:
        raise ValueError(f"--moe-layer-freq lists {len(freq)} layers; --num-layers is {num_layers}.")
    if 1 not in moe_layer_pattern(freq, num_layers):
        raise ValueError("--moe-layer-freq makes no layer MoE; leave out --num-experts for a dense model.")


def _check_finite(args: argparse.Namespace, dest: str, above: Optional[float], hint: str = "") -> None:
    """A given float flag must be finite and > `above` (>= 0 when `above` is None)."""
    value = getattr(args, dest)
    if value is None:
        return
    ok = math.isfinite(value) and (value >= 0.0 if above is None else value > above)
    if not ok:
        bound = ">= 0" if above is None else f"> {above:g}"
        raise ValueError(f"{_flag(dest)} must be a finite number {bound}; got {value}{hint}.")


def _as_list(value: Any) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def moe_aux_loss_types(args: argparse.Namespace) -> list[str]:
    """The aux-loss types with a positive coefficient (the losses the router adds and logs)."""
    pairs = zip(_as_list(args.moe_router_load_balancing_type), _as_list(args.moe_aux_loss_coeff))
    return [kind for kind, coeff in pairs if kind in AUX_LOSS_TYPES and coeff > 0.0]


def logged_moe_losses(args: argparse.Namespace) -> list[str]:
    """The MoE losses Megatron-LM logs for these flags: one per aux-loss type given (its value is
    logged even with coefficient 0), and the z-loss when it has a coefficient."""
    types = _as_list(args.moe_router_load_balancing_type)
    names = [LOGGED_LOSS_OF_TYPE[kind] for kind in types if kind in LOGGED_LOSS_OF_TYPE]
    return names + (["z_loss"] if args.moe_z_loss_coeff is not None else [])


# GPTModelSettings fields (megatron-core TransformerConfig names) set from the flag of that name.
CONFIG_FIELDS = ("moe_router_topk", "moe_aux_loss_coeff", "moe_token_dispatcher_type", "moe_ffn_hidden_size",
                 "moe_layer_freq", "moe_router_load_balancing_type", "moe_z_loss_coeff", "moe_router_score_function",
                 "moe_router_topk_scaling_factor", "moe_router_pre_softmax", "moe_router_dtype",
                 "moe_router_num_groups", "moe_router_group_topk", "moe_input_jitter_eps",
                 "moe_router_enable_expert_bias", "moe_router_bias_update_rate",
                 "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_expert_capacity_factor",
                 "moe_pad_expert_input_to_capacity", "moe_token_drop_policy")


def moe_settings(args: argparse.Namespace) -> dict[str, Any]:
    """GPTModelSettings fields of the checked MoE flags (lists as tuples: the settings are frozen)."""
    if args.num_experts is None:
        return dict(num_moe_experts=None)
    fields = {name: getattr(args, name) for name in CONFIG_FIELDS}
    fields = {name: tuple(value) if isinstance(value, list) else value for name, value in fields.items()}
    return dict(num_moe_experts=args.num_experts, **fields)


def describe_moe(args: argparse.Namespace, num_layers: int) -> str:
    """One line for the run's log: what the MoE flags built."""
    ep, experts = args.expert_model_parallel_size, args.num_experts
    moe_layers = sum(moe_layer_pattern(args.moe_layer_freq, num_layers))
    parts = [f"MoE: {experts} experts in {moe_layers} of {num_layers} layers, top-{args.moe_router_topk} "
             f"({args.moe_router_score_function}{', pre-softmax' if args.moe_router_pre_softmax else ''})",
             f"EP {ep} ({experts // ep} experts per rank)", f"{args.moe_token_dispatcher_type} dispatcher"]
    if args.moe_router_num_groups is not None:
        parts.append(f"{args.moe_router_group_topk} of {args.moe_router_num_groups} expert groups per token")
    balancing = [f"{kind} {coeff:g}" for kind, coeff in zip(_as_list(args.moe_router_load_balancing_type),
                                                            _as_list(args.moe_aux_loss_coeff))]
    parts.append("load balancing " + ", ".join(balancing))
    if args.moe_z_loss_coeff is not None:
        parts.append(f"z-loss {args.moe_z_loss_coeff:g}")
    if args.moe_router_enable_expert_bias:
        parts.append(f"expert bias (update rate {args.moe_router_bias_update_rate:g})")
    if args.moe_shared_expert_intermediate_size is not None:
        parts.append(f"shared experts of size {args.moe_shared_expert_intermediate_size}"
                     + (" with a gate" if args.moe_shared_expert_gate else ""))
    if args.moe_expert_capacity_factor is not None:
        parts.append(f"capacity factor {args.moe_expert_capacity_factor:g} (drop by {args.moe_token_drop_policy}"
                     + (", padded to capacity)" if args.moe_pad_expert_input_to_capacity else ")"))
    return ", ".join(parts)


def moe_note_lines(args: argparse.Namespace) -> list[str]:
    """Flags Megatron-LM command lines give that change nothing in this combination, said at start-up."""
    if args.num_experts is None:
        return []
    notes = []
    if args.moe_router_pre_softmax and args.moe_router_score_function != "softmax":
        notes.append(f"--moe-router-pre-softmax: no effect with --moe-router-score-function "
                     f"{args.moe_router_score_function} (megatron-core applies it to softmax only)")
    unused = [f"{kind} {coeff:g}" for kind, coeff in zip(_as_list(args.moe_router_load_balancing_type),
                                                          _as_list(args.moe_aux_loss_coeff))
              if kind == "none" and coeff > 0.0]
    if unused:
        notes.append(f"--moe-aux-loss-coeff for load-balancing type none: no effect ({', '.join(unused)})")
    return notes
