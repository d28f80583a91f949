"""Megatron-LM's argument path into our optimizer, on CPU (megatron_eopt.integrations.megatron_lm).

For a table of real Megatron-LM command lines, each rank of a 2-rank gloo world runs what
Megatron-LM's `pretrain()` runs before its loop: `parse_args(extra_args_provider=
add_megatron_eopt_args)` with the command line in sys.argv and WORLD_SIZE/RANK set (the only
environment validate_args reads), `validate_args`, `get_megatron_optimizer_config`, `config.timers`
= Megatron-LM's Timers, then `megatron.training.training.get_megatron_optimizer(...)` with the
arguments `setup_model_and_optimizer` passes, after `install()`. The model is megatron-core's
GPTModel built from the parsed flags (megatron_eopt/training/model/gpt.py; TP from the flags, DP = the rest).
Gradients are averaged over data-parallel ranks as Megatron-LM's DDP does before the optimizer
runs. Each row then trains 10 steps on one fixed batch.

Expectations come from the command line, not from the code under test: the config fields and
optimizer class the flags ask for, the learning rate of decoupled groups, data-parallel
replicas bitwise equal after every step, and a loss that falls (last loss <= 0.8 x the first on a
batch a 2-layer model memorises: an optimizer that does nothing or diverges fails it).

Rows marked PENDING depend on changes of other helpers that land before this branch:
`muon_fp32_matmul_prec` accepting 'highest' and refusing 'low', and adam/sgd with
`use_distributed_optimizer=True` building the layer-wise optimizer.

One pytest process; every Megatron-LM import happens in the reused gloo workers (~20 s once).
"""

import contextlib
import hashlib
import io
import os
import sys
from unittest import mock

import pytest

MODEL_FLAGS = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --group-query-attention "
    "--num-query-groups 2 --ffn-hidden-size 48 --swiglu --seq-length 8 --max-position-embeddings 8 "
    "--micro-batch-size 2 --global-batch-size 4 --train-iters 10 --mock-data "
    "--tokenizer-type NullTokenizer --vocab-size 64 --min-lr 0 --weight-decay 0.01"
)
STEPS = 10
SEED = 5
MUON = "--optimizer muon --lr 0.02"
ADAM = "--optimizer adam --lr 0.01"
SGD = "--optimizer sgd --lr 0.5"
TP2 = "--tensor-model-parallel-size 2"

# (row id, extra flags, expected: config fields and "class" of the returned optimizer)
ROWS = [
    ("muon", MUON, {"optimizer": "muon", "use_layer_wise_distributed_optimizer": False,
                    "class": "ChainedOptimizer", "muon_tp_mode": "duplicated"}),
    ("muon-dist", f"{MUON} --use-distributed-optimizer",
     {"optimizer": "muon", "use_layer_wise_distributed_optimizer": True, "use_distributed_optimizer": False,
      "class": "LayerWiseDistributedOptimizer"}),
    ("dist_muon", "--optimizer dist_muon --lr 0.02",
     {"optimizer": "muon", "use_layer_wise_distributed_optimizer": True, "class": "LayerWiseDistributedOptimizer"}),
    *[(f"muon-tp2-{mode}", f"{MUON} {TP2} --muon-tp-mode {mode}", {"muon_tp_mode": mode, "tp": 2})
      for mode in ("blockwise", "duplicated", "distributed", "sharded")],
    ("muon-tp2-dist", f"{MUON} {TP2} --use-distributed-optimizer",
     {"muon_tp_mode": "duplicated", "tp": 2, "class": "LayerWiseDistributedOptimizer"}),
    ("adam", ADAM, {"optimizer": "adam", "class": "ChainedOptimizer", "use_distributed_optimizer": False}),
    ("adam-dist", f"{ADAM} --use-distributed-optimizer",  # PENDING: layer-wise for adam
     {"optimizer": "adam", "class": "LayerWiseDistributedOptimizer"}),
    ("sgd", SGD, {"optimizer": "sgd", "class": "ChainedOptimizer"}),
    ("sgd-dist", f"{SGD} --use-distributed-optimizer",  # PENDING: layer-wise for sgd
     {"optimizer": "sgd", "class": "LayerWiseDistributedOptimizer"}),
    ("adam-bf16", f"{ADAM} --bf16", {"bf16": True, "params_dtype": "torch.bfloat16"}),
    ("muon-bf16", f"{MUON} --bf16", {"bf16": True}),
    ("adam-fp16", f"{ADAM} --fp16 --initial-loss-scale 4096",
     {"fp16": True, "initial_loss_scale": 4096.0, "params_dtype": "torch.float16"}),
    ("adam-no-clip", f"{ADAM} --clip-grad 0", {"clip_grad": 0.0}),
    ("adam-decoupled-lr", f"{ADAM} --decoupled-lr 0.002 --decoupled-min-lr 0.0001",
     {"decoupled_lr": 0.002, "decoupled_group_lr": (0.002, 0.002, 0.0001)}),
    # Our flags, through add_megatron_eopt_args.
    ("muon-highest", f"{MUON} --muon-fp32-matmul-prec highest",  # PENDING: 'highest'
     {"muon_fp32_matmul_prec": "highest"}),
    ("muon-match-adamw-rms", f"{MUON} --muon-match-adamw-rms", {"muon_match_adamw_rms": True}),
    ("muon-skip-threshold", f"{MUON} --grad-norm-skip-threshold 1000", {"grad_norm_skip_threshold": 1000.0}),
    # (--soap-precondition-frequency is refused: emerging-optimizers 0.3.0's SOAP takes none; test_megatron_lm_fail_closed.py)
    ("soap", "--optimizer soap --lr 0.02 --soap-no-kl-shampoo --soap-shampoo-beta 0.9",
     {"optimizer": "soap", "soap_use_kl_shampoo": False, "soap_shampoo_beta": 0.9}),
    ("adaptive-muon", "--optimizer adaptive_muon --lr 0.02 --adaptive-muon-moment2-method normuon "
     "--adaptive-muon-beta2 0.9 --adaptive-muon-eps 1e-6",
     {"adaptive_muon_moment2_method": "normuon", "adaptive_muon_beta2": 0.9, "adaptive_muon_eps": 1e-6}),
]


# ---------------------------------------------------------------- worker side


def parse_megatron_lm(argv: str, rank: int, world_size: int, with_ours: bool = True):
    """Megatron-LM's parse_args + validate_args for `argv`, as its pretrain_gpt.py would run."""
    from megatron.training.arguments import parse_args, validate_args

    from megatron_eopt.integrations.megatron_lm import add_megatron_eopt_args
    from tests.megatron_lm_in_process import read_field_docstrings_once

    read_field_docstrings_once()  # help texts only, read from source at every parse otherwise
    # The environment validate_args reads: the world, and for TP > 1 on a pre-Blackwell GPU
    # CUDA_DEVICE_MAX_CONNECTIONS=1, which Megatron-LM's users set.
    os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank), CUDA_DEVICE_MAX_CONNECTIONS="1")
    saved_argv, sys.argv = sys.argv, ["pretrain_gpt.py", *argv.split()]
    try:
        # validate_args asks the GPU's architecture when TP > 1 (torch.cuda on CPU raises):
        # answer as a Hopper would; nothing else in it touches CUDA for these command lines.
        with contextlib.redirect_stdout(io.StringIO()), mock.patch(
            "megatron.training.arguments.get_device_arch_version", return_value=9
        ):  # (stdout: validate_args prints every argument)
            args = parse_args(extra_args_provider=add_megatron_eopt_args if with_ours else None)
            validate_args(args)
    finally:
        sys.argv = saved_argv
    return args


def build_through_megatron_lm(args, model):
    """What setup_model_and_optimizer does, through the name install() rebinds."""
    import megatron.training.training as megatron_lm_training
    from megatron.core.timers import Timers
    from megatron.training import global_vars

    global_vars.set_args(args)
    config, config_overrides = megatron_lm_training.get_megatron_optimizer_config(args)
    config.timers = Timers(args.timing_log_level, args.timing_log_option)
    return megatron_lm_training.get_megatron_optimizer(
        config,
        [model],
        config_overrides=config_overrides,
        use_gloo_process_groups=args.use_gloo_process_groups,
        dump_param_to_param_group_map=args.dump_param_to_param_group_map,
    )


def model_from_args(args):
    import torch

    from megatron_eopt.training.model.gpt import GPTModelSettings, build_gpt_model

    settings = GPTModelSettings(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups, ffn_hidden_size=args.ffn_hidden_size, swiglu=args.swiglu,
        seq_length=args.seq_length, vocab_size=args.vocab_size, bf16=args.bf16,
    )
    model = build_gpt_model(settings)
    return model.to(torch.float16) if args.fp16 else model


def fixed_batch(args):
    """One batch of rule sequences (megatron_eopt/training/data/datasets.py), identical on every rank."""
    import torch

    from megatron_eopt.training.data.datasets import rule_batch

    generator = torch.Generator().manual_seed(SEED)
    return rule_batch(args.global_batch_size, args.seq_length + 1, args.vocab_size, generator)


def _row_body(rank: int, world_size: int, argv: str) -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_eopt.integrations import megatron_lm
    from megatron_eopt.training.model.gpt import destroy_model_parallel, initialize_model_parallel
    from tests.gpt_training import train_steps

    args = parse_megatron_lm(argv, rank, world_size)
    initialize_model_parallel(args.tensor_model_parallel_size, seed=SEED)
    try:
        with megatron_lm.installed():
            model = model_from_args(args)
            optimizer = build_through_megatron_lm(args, model)
        dp_group = parallel_state.get_data_parallel_group()
        dp_rank, dp_size = dist.get_rank(dp_group), dist.get_world_size(dp_group)
        tokens = fixed_batch(args).chunk(dp_size)[dp_rank]
        checksums = []
        losses = train_steps(model, optimizer, tokens, STEPS, scale_loss=True,
                             average_grads_over=dp_group,  # Megatron-LM's DDP averages over DP first
                             after_step=lambda step: checksums.append(_checksum(model))).losses
        config = optimizer.config
        # megatron-core's standard overrides give embedding/output parameters max_lr/min_lr =
        # decoupled_lr/decoupled_min_lr (with is_decoupled_lr False, as megatron-core 0.19 does).
        decoupled = [(g["lr"], g["max_lr"], g["min_lr"]) for g in optimizer.param_groups
                     if any(getattr(p, "is_embedding_or_output_parameter", False) for p in g["params"])]
        return {
            "class": type(optimizer).__name__,
            "tp": parallel_state.get_tensor_model_parallel_world_size(),
            "fields": {name: getattr(config, name) for name in vars(config) if name != "timers"},
            "decoupled_group_lr": decoupled,
            "losses": losses,
            "checksums": checksums,
        }
    finally:
        destroy_model_parallel()
        from megatron.training import global_vars

        global_vars.set_args(None)


def _checksum(model) -> str:
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        digest.update(name.encode())
        digest.update(param.detach().float().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _parse_body(rank: int, world_size: int, argv: str, with_ours: bool = True) -> dict:
    """{'args': chosen attributes} or {'error': what argparse printed} for a bad command line."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args = parse_megatron_lm(argv, rank, world_size, with_ours)
    except SystemExit as exit_:
        return {"error": stderr.getvalue(), "code": exit_.code}
    from megatron.training.training import get_megatron_optimizer_config

    from megatron_eopt.integrations.megatron_lm import optimizer_config_from_megatron_lm

    from megatron_eopt.config.newton_schulz import coefficients_and_steps

    mcore_config, _ = get_megatron_optimizer_config(args)
    ours = optimizer_config_from_megatron_lm(args, mcore_config)
    from megatron_eopt.config.choices import is_megatron_core_default

    return {"ours": {k: v for k, v in vars(ours).items() if k != "timers"},
            "newton_schulz": coefficients_and_steps(ours),
            # Megatron-LM pickles args into checkpoints and loads them weights-only: plain values only.
            "marked_args": sorted(k for k, v in vars(args).items() if is_megatron_core_default(v))}


def _parsers_body(rank: int, world_size: int) -> dict:
    """Megatron-LM's parser before and after add_megatron_eopt_args, action by action."""
    import argparse

    from megatron.training.arguments import add_megatron_arguments

    import typing

    from megatron_eopt.config.optimizer_config import MatmulPrecision
    from megatron_eopt.integrations.megatron_lm import add_megatron_eopt_args
    from megatron_eopt.registry import list_optimizers

    def describe(parser):
        return {a.option_strings[0]: (tuple(a.option_strings), a.dest, a.default, a.nargs, a.const,
                                      None if a.choices is None else tuple(a.choices))
                for a in parser._actions if a.option_strings}

    theirs = describe(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
    ours = describe(add_megatron_eopt_args(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))))
    return {"theirs": theirs, "ours": ours, "registry": list(list_optimizers()),
            "precisions": typing.get_args(MatmulPrecision)}


def _install_body(rank: int, world_size: int) -> dict:
    import megatron.training.training as megatron_lm_training

    from megatron_eopt.integrations import megatron_lm

    def called_name():  # what setup_model_and_optimizer resolves when it runs
        return megatron_lm_training.setup_model_and_optimizer.__globals__["get_megatron_optimizer"]

    original = called_name()
    seen = {"before": called_name() is original}
    megatron_lm.install()
    megatron_lm.install()  # a second install changes nothing
    seen["installed"] = called_name() is megatron_lm.get_megatron_optimizer_for_megatron_lm
    megatron_lm.uninstall()
    seen["restored"] = called_name() is original
    with megatron_lm.installed():
        seen["inside"] = called_name() is megatron_lm.get_megatron_optimizer_for_megatron_lm
    seen["after"] = called_name() is original
    with megatron_lm.installed():
        seen["pre-parse installed"] = _pre_parse("--optimizer laprop --muon-tp-mode sharded")
    seen["pre-parse after"] = _pre_parse("--optimizer laprop")
    return seen


def _pre_parse(argv: str) -> str:
    """The optimizer Megatron-LM's parse with no provider reads from `argv`, as ft_integration.setup parses
    before pretrain()'s main parse; 'refused' where argparse exits."""
    from megatron.training import arguments

    saved_argv, sys.argv = sys.argv, ["pretrain_gpt.py", *argv.split()]
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return arguments.parse_args(ignore_unknown_args=True).optimizer
    except SystemExit:
        return "refused"
    finally:
        sys.argv = saved_argv


def _refuse_checkpoint_formats_body(rank: int, world_size: int, flag_lines: list[str]) -> list[str]:
    """Each of `flag_lines` after MODEL_FLAGS built through Megatron-LM's factory: the refusal's message."""
    from megatron_eopt.integrations import megatron_lm
    from megatron_eopt.training.model.gpt import destroy_model_parallel, initialize_model_parallel

    messages = []
    for flags in flag_lines:
        args = parse_megatron_lm(f"{MODEL_FLAGS} {flags}", rank, world_size)
        initialize_model_parallel(1, seed=SEED)
        try:
            with megatron_lm.installed():
                build_through_megatron_lm(args, model_from_args(args))
            messages.append("built")
        except ValueError as error:
            messages.append(str(error))
        finally:
            destroy_model_parallel()
    return messages


def _script_steps_body(rank: int, world_size: int) -> dict:
    """The script's dataset provider, forward step and loss function on CPU (the loop around them,
    Megatron-LM's, is tests/functional/test_megatron_lm_loop.py): its loss against cross entropy of
    the model's logits."""
    import torch
    import torch.nn.functional as F
    from megatron.training import global_vars

    from megatron_eopt.integrations import megatron_lm_gpt as script
    from megatron_eopt.training.model.gpt import destroy_model_parallel, initialize_model_parallel

    args = parse_megatron_lm(f"{MODEL_FLAGS} {ADAM}", rank, world_size)
    global_vars.set_args(args)
    global_vars._GLOBAL_TOKENIZER = None
    global_vars._build_tokenizer(args)  # what Megatron-LM's set_global_variables does
    initialize_model_parallel(1, seed=SEED)
    try:
        train, valid, test = script.datasets_provider(None)
        loader = lambda: iter(torch.utils.data.DataLoader(train, batch_size=args.micro_batch_size))
        model = model_from_args(args)
        output, loss_of = script.forward_step(loader(), model)
        loss, num_tokens, report = loss_of(output)
        batch = next(loader())
        with torch.no_grad():
            logits = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"))
            per_token = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), batch["labels"].reshape(-1),
                                        reduction="none")
            mask = batch["loss_mask"].reshape(-1).float()
            reference = (per_token * mask).sum().item()
        return {"sizes": [len(train), len(valid), len(test)], "loss": loss.item(), "reference": reference,
                "num_tokens": int(num_tokens), "mask_sum": int(mask.sum()), "report": report["lm loss"].tolist(), "report_keys": sorted(report)}
    finally:
        destroy_model_parallel()
        global_vars.set_args(None)
        global_vars._GLOBAL_TOKENIZER = None


def _flat_tensors(tree, prefix=""):
    """path -> tensor for every tensor in a nested state dict (lists and dicts)."""
    import torch

    if torch.is_tensor(tree):
        return {prefix: tree.detach().clone()}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    flat = {}
    for key, value in items:
        flat.update(_flat_tensors(value, f"{prefix}/{key}"))
    return flat


def _state_file_body(rank: int, world_size: int, directory: str) -> dict:
    """--ckpt-format torch with the layer-wise optimizer: Megatron-LM saves one file per DP rank
    (save_state_dict_to_file) and loads it back (load_state_dict_from_file)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_eopt.integrations import megatron_lm
    from megatron_eopt.training.model.gpt import destroy_model_parallel, initialize_model_parallel
    from tests.gpt_training import train_steps

    args = parse_megatron_lm(f"{MODEL_FLAGS} {MUON} --use-distributed-optimizer --ckpt-format torch", rank, world_size)
    initialize_model_parallel(1, seed=SEED)
    try:
        with megatron_lm.installed():
            model = model_from_args(args)
            optimizer = build_through_megatron_lm(args, model)
        dp_group = parallel_state.get_data_parallel_group()
        tokens = fixed_batch(args).chunk(2)[dist.get_rank(dp_group)]

        def train_step():
            train_steps(model, optimizer, tokens, 1, average_grads_over=dp_group)

        for _ in range(2):
            train_step()
        path = os.path.join(directory, f"layer_wise_optimizer_{dist.get_rank(dp_group)}.pt")
        optimizer.save_state_dict_to_file(path)
        saved = _flat_tensors(optimizer.state_dict())
        train_step()  # the live state moves on
        moved = _flat_tensors(optimizer.state_dict())
        optimizer.load_state_dict_from_file(path)
        loaded = _flat_tensors(optimizer.state_dict())
        return {
            "class": type(optimizer).__name__,
            "n_tensors": len(saved),
            "keys_equal": sorted(saved) == sorted(loaded),
            "changed_by_step": sum(not torch.equal(saved[k], moved[k]) for k in saved),
            "unequal_after_load": [k for k in saved if not torch.equal(saved[k], loaded[k])],
        }
    finally:
        destroy_model_parallel()
        from megatron.training import global_vars

        global_vars.set_args(None)


# ---------------------------------------------------------------- tests


# SOAP's row compiles its update (~10 s with a warm inductor cache): `make test-slow`. make test reads its flags
# into our config (test_each_flag_reaches_our_config below), and SOAP steps a GPT in test_emerging_factory.py.
@pytest.mark.parametrize("row", [pytest.param(row, marks=[pytest.mark.slow] if row[0] == "soap" else [], id=row[0])
                                 for row in ROWS])
def test_megatron_lm_command_line_trains(run_distributed, row) -> None:
    _, flags, expected = row
    results = run_distributed(_row_body, world_size=2, args=(f"{MODEL_FLAGS} {flags}",), timeout=600)
    for rank, result in enumerate(results):
        losses = result["losses"]
        assert losses[-1] <= 0.8 * losses[0], f"rank {rank}: loss did not fall: {losses}"
        for name, value in expected.items():
            if name in ("class", "tp"):
                assert result[name] == value, (name, result[name])
            elif name == "decoupled_group_lr":
                assert result[name] and all(group == pytest.approx(value) for group in result[name]), result[name]
            else:
                got = result["fields"][name]
                assert (str(got) if name == "params_dtype" else got) == value, (name, got)
    if results[0]["tp"] == 1:  # two data-parallel replicas: bitwise equal after every step
        assert results[0]["checksums"] == results[1]["checksums"]


def test_extra_args_provider_keeps_megatron_lm_flags(run_distributed) -> None:
    """Every Megatron-LM action keeps its spellings, dest, default and choices, except the
    documented ones; our flags come on top; --optimizer lists every registered optimizer."""
    result = run_distributed(_parsers_body, world_size=2)[0]
    theirs, ours = result["theirs"], result["ours"]
    changed = {option for option in theirs if ours[option] != theirs[option]}
    assert changed <= {"--optimizer", "--muon-tp-mode", "--muon-fp32-matmul-prec"}, changed
    assert set(theirs["--optimizer"][5]) < set(ours["--optimizer"][5])
    assert set(result["registry"]) <= set(ours["--optimizer"][5])
    assert ours["--muon-tp-mode"][5] == ("blockwise", "duplicated", "distributed", "sharded", "auto")
    assert ours["--muon-tp-mode"][2] == "duplicated"  # ours and newer Megatron-LM's default
    assert ours["--muon-fp32-matmul-prec"][5] == result["precisions"]  # exactly our config's
    added = set(ours) - set(theirs)
    assert added == {"--grad-norm-skip-threshold", "--muon-match-adamw-rms", "--muon-use-syrk", "--muon-gram-newton-schulz",
                     "--muon-gram-newton-schulz-package", "--muon-aol-preconditioner",
                     "--muon-split-qkv-per-head", "--muon-expert-tp-mode", "--muon-tp-hardware-profile",
                     "--soap-shampoo-beta", "--soap-precondition-frequency", "--soap-no-kl-shampoo",
                     "--adaptive-muon-moment2-method", "--adaptive-muon-beta2", "--adaptive-muon-eps",
                     "--no-emerging-optimizers-compile", "--no-store-param-remainders",
                     "--allow-optimizer-change-on-load"}, added


@pytest.mark.parametrize(
    "flags, field, value",
    [
        ("--muon-use-syrk", "muon_use_syrk", True),
        ("--muon-gram-newton-schulz", "muon_gram_newton_schulz", True),
        ("--muon-aol-preconditioner", "muon_aol_preconditioner", True),
        ("--muon-gram-newton-schulz --muon-gram-newton-schulz-package --muon-fp32-matmul-prec medium",
         "muon_gram_newton_schulz_package", True),
        ("--muon-split-qkv-per-head", "muon_split_qkv_per_head", True),
        ("--muon-match-adamw-rms", "muon_match_adamw_rms", True),
        ("--muon-tp-mode sharded", "muon_tp_mode", "sharded"),
        ("--muon-tp-mode auto", "muon_tp_mode", "auto"),
        ("--muon-expert-tp-mode distributed", "muon_expert_tp_mode", "distributed"),
        ("--muon-tp-hardware-profile h100", "muon_tp_hardware_profile", "h100"),
        ("", "muon_tp_mode", "duplicated"),
        ("--muon-fp32-matmul-prec highest", "muon_fp32_matmul_prec", "highest"),  # PENDING
        ("--grad-norm-skip-threshold 7.5", "grad_norm_skip_threshold", 7.5),
        ("--soap-no-kl-shampoo", "soap_use_kl_shampoo", False),
        ("--adaptive-muon-eps 1e-5", "adaptive_muon_eps", 1e-5),
        ("--no-emerging-optimizers-compile", "emerging_optimizers_compile", False),
        ("--muon-momentum 0.8", "muon_momentum", 0.8),  # one of Megatron-LM's own flags
    ],
)
def test_each_flag_reaches_our_config(run_distributed, flags, field, value) -> None:
    result = run_distributed(_parse_body, world_size=2, args=(f"{MODEL_FLAGS} {MUON} {flags}",))[0]
    assert result["ours"][field] == value


@pytest.mark.parametrize("flags, newton_schulz", [
    ("", ("quintic", 5)),
    ("--muon-aol-preconditioner", ("quintic", 4)),  # Turbo-Muon's, for what the command line left unset
    ("--muon-aol-preconditioner --muon-num-ns-steps 5", ("quintic", 5)),  # given: kept, though it is the default
    ("--muon-aol-preconditioner --muon-coefficient-type polar_express", ("polar_express", 4)),
])
def test_turbo_muon_defaults_through_megatron_lm(run_distributed, flags, newton_schulz) -> None:
    result = run_distributed(_parse_body, world_size=2, args=(f"{MODEL_FLAGS} {MUON} {flags}",))[0]
    assert result["newton_schulz"] == newton_schulz
    assert result["marked_args"] == []


# A command line: the flags install()'s start-up line names as without effect (None: no line). Given
# means recorded by the parser (even at its default) or off the parser's default.
OTHER_OPTIMIZERS_FLAGS = {
    "--optimizer adam --muon-momentum 0.8": "--muon-momentum 0.8",
    "--optimizer adam --muon-tp-mode sharded": "--muon-tp-mode sharded",
    "--optimizer adam --soap-shampoo-beta 0.9": "--soap-shampoo-beta 0.9",
    "--optimizer sgd --muon-momentum 0.5": "--muon-momentum 0.5",
    "--optimizer sgd --muon-momentum 0.9": "--muon-momentum 0.9",  # Megatron-LM's default, given
    "--optimizer sgd --muon-nesterov --soap-no-kl-shampoo --adam-beta1 0.8":
        "--adam-beta1 0.8, --muon-nesterov, --soap-no-kl-shampoo",
    "--optimizer soap --soap-shampoo-beta 0.9 --muon-momentum 0.8": "--muon-momentum 0.8",
    "--optimizer muon --muon-scalar-optimizer lion --adam-beta1 0.8 --lion-beta1 0.9": "--adam-beta1 0.8",
    "--optimizer adam": None,
    "--optimizer adam --adam-beta1 0.8 --sgd-momentum 0.5": "--sgd-momentum 0.5",
    "--optimizer muon --muon-momentum 0.8 --adam-beta1 0.8": None,  # Muon's scalar optimizer is adam
}


def _unread_flags_body(rank: int, world_size: int, argvs: list[str]) -> list:
    from megatron.training.training import get_megatron_optimizer_config

    from megatron_eopt.integrations.megatron_lm import flags_without_effect_line, optimizer_config_from_megatron_lm

    lines = []
    for argv in argvs:
        args = parse_megatron_lm(f"{MODEL_FLAGS} {argv}", rank, world_size)
        lines.append(flags_without_effect_line(args, optimizer_config_from_megatron_lm(
            args, get_megatron_optimizer_config(args)[0])))
    return lines


def test_flags_of_other_optimizers_are_named_as_without_effect(run_distributed) -> None:
    lines = run_distributed(_unread_flags_body, 2, args=(list(OTHER_OPTIMIZERS_FLAGS),))[0]
    for (argv, named), line in zip(OTHER_OPTIMIZERS_FLAGS.items(), lines):
        optimizer = argv.split()[1]
        if named is None:
            assert line is None, (argv, line)
        else:
            assert line is not None and line.startswith(f"{named}: no effect with --optimizer {optimizer}, which does not read"), (argv, line)


def test_matmul_precision_low_is_refused_with_the_reason(run_distributed) -> None:  # PENDING
    result = run_distributed(_parse_body, world_size=2, args=(f"{MODEL_FLAGS} {MUON} --muon-fp32-matmul-prec low",))[0]
    assert result.get("code") == 2, result
    assert "--muon-fp32-matmul-prec" in result["error"] and "'low'" in result["error"]
    allowed = result["error"].rsplit("choose one of", 1)[-1]
    assert all(p in allowed for p in ("highest", "high", "medium")) and "low" not in allowed, result["error"]


def test_megatron_lm_alone_still_parses_its_own_defaults(run_distributed) -> None:
    """Without our provider Megatron-LM's parser is untouched (blockwise default)."""
    result = run_distributed(_parse_body, world_size=2, args=(f"{MODEL_FLAGS} {MUON}", False))[0]
    assert result["ours"]["muon_tp_mode"] == "blockwise"


def test_install_rebinds_the_name_setup_model_and_optimizer_calls(run_distributed) -> None:
    seen = run_distributed(_install_body, world_size=2)[0]
    assert seen == {"before": True, "installed": True, "restored": True, "inside": True, "after": True,
                    "pre-parse installed": "laprop", "pre-parse after": "refused"}


def test_checkpoint_formats_our_optimizer_cannot_serve_are_refused(run_distributed) -> None:
    """The distributed optimizer with --ckpt-format torch; --allow-optimizer-change-on-load with
    --ckpt-format torch, whose load does not apply it (megatron-core's DistributedOptimizer's torch_dist:
    test_megatron_lm_loop.py's refusals)."""
    torch_format, opt_in = run_distributed(_refuse_checkpoint_formats_body, world_size=2, args=([
        f"{ADAM} --use-distributed-optimizer --ckpt-format torch",
        f"{MUON} --ckpt-format torch --allow-optimizer-change-on-load"],))[0]
    assert "--ckpt-format torch_dist" in torch_format and "save_parameter_state" in torch_format, torch_format
    assert "--ckpt-format torch load does not apply it" in opt_in and "--no-load-optim" in opt_in, opt_in


def test_script_data_and_loss_on_cpu(run_distributed) -> None:
    """Loss = sum over unmasked tokens of the cross entropy of the model's own logits (fp32,
    1e-5 relative: the same logits, two reductions); datasets as large as the run needs."""
    result = run_distributed(_script_steps_body, world_size=2)[0]
    train_needed = 10 * 4  # --train-iters x --global-batch-size
    assert result["sizes"][0] >= train_needed, result["sizes"]
    assert abs(result["loss"] - result["reference"]) <= 1e-5 * abs(result["reference"]), result
    assert result["num_tokens"] == result["mask_sum"] > 0
    assert result["report_keys"] == ["lm loss"]  # the key Megatron-LM logs as "lm loss"
    assert result["report"] == pytest.approx([result["loss"], result["num_tokens"]], rel=1e-6)


def test_layer_wise_state_files_round_trip(run_distributed, tmp_path) -> None:
    """What Megatron-LM's --ckpt-format torch does with the layer-wise optimizer: each DP rank's
    file brings back exactly the state it held (bitwise), after a step had changed it."""
    for result in run_distributed(_state_file_body, world_size=2, args=(str(tmp_path),)):
        assert result["class"] == "LayerWiseDistributedOptimizer"
        assert result["n_tensors"] > 0 and result["keys_equal"]
        assert result["changed_by_step"] > 0  # else the round trip would prove nothing
        assert result["unequal_after_load"] == []


def test_precision_aware_settings_reach_our_optimizer_past_megatron_cores_adam_only_check() -> None:
    """megatron-core's OptimizerConfig asserts --use-precision-aware-optimizer for its own Adam only
    (and needs Transformer Engine); with install(), Megatron-LM's config builder gives ours the
    settings for any optimizer, and leaves the checks to megatron-core where its DistributedOptimizer
    steps (--optimizer adam --use-distributed-optimizer without FSDP)."""
    from types import SimpleNamespace

    import megatron.training.training as training
    import torch

    from megatron_eopt.integrations import megatron_lm

    asked = dict(optimizer="muon", lr=0.01, use_precision_aware_optimizer=True, exp_avg_dtype=torch.bfloat16,
                 exp_avg_sq_dtype=torch.bfloat16)
    args = SimpleNamespace(**asked)
    with pytest.raises(AssertionError, match="only supported with adam"):
        training.get_megatron_optimizer_config(args)
    with megatron_lm.installed():
        config, _ = training.get_megatron_optimizer_config(args)
    assert vars(args) == asked  # the arguments as given
    assert (config.optimizer, config.use_precision_aware_optimizer, config.exp_avg_dtype,
            config.exp_avg_sq_dtype) == ("muon", True, torch.bfloat16, torch.bfloat16)
    steps = {flags: megatron_lm._megatron_core_steps(SimpleNamespace(optimizer=flags[0], use_distributed_optimizer=True,
                                                                     use_megatron_fsdp=flags[1]))
             for flags in (("adam", False), ("adam", True), ("muon", False))}
    assert steps == {("adam", False): True, ("adam", True): False, ("muon", False): False}


def test_a_cpu_initialized_model_moves_to_the_gpu_before_megatron_lms_ddp_wrap(monkeypatch) -> None:
    """Megatron-LM's model builder leaves a --use-cpu-initialization model on the CPU and relies on
    megatron-core's DistributedOptimizer re-mapping the parameters into DDP's CUDA buffers; our layer-wise
    optimizer's all-reducing DDP does not re-map them (measured on an H200: the first forward of
    `--optimizer muon --use-distributed-optimizer --use-cpu-initialization` met CPU weights). With
    install(), the chunks move to the current CUDA device before a DDP wrap, not before an FSDP one."""
    import torch
    from megatron.training.models import dist_utils

    from megatron_eopt.integrations import megatron_lm

    events = []

    class Chunk(torch.nn.Module):
        def cuda(self, device=None):
            events.append(("cuda", device))
            return self

    def ddp_wrap(model, data_parallel_random_init, ddp_config, overlap_param_gather_with_optimizer_step,
                 use_megatron_fsdp=False, use_torch_fsdp2=False, *, pg_collection):
        events.append(("wrap", use_megatron_fsdp, use_torch_fsdp2))
        return model

    monkeypatch.setattr(dist_utils, "_ddp_wrap", ddp_wrap)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    with megatron_lm.installed():
        dist_utils._ddp_wrap([Chunk()], False, None, False, pg_collection=None)
        dist_utils._ddp_wrap([Chunk()], False, None, False, True, pg_collection=None)
        dist_utils._ddp_wrap([Chunk()], False, None, False, use_torch_fsdp2=True, pg_collection=None)
    assert dist_utils._ddp_wrap is ddp_wrap  # uninstalled
    assert events == [("cuda", 3), ("wrap", False, False), ("wrap", True, False), ("wrap", False, True)]


def test_megatron_lms_initialization_meets_in_this_attempts_store_when_given_none(monkeypatch) -> None:
    """With install(), `pretrain()` given no store (Megatron-LM's pretrain_gpt.py) initializes torch.distributed
    over the job's store under this torchrun attempt's prefix, so a restart never reads the killed attempt's
    keys (runtime/torchrun_store.py); a store the caller gave, and a run outside torchrun, stay as they are."""
    from types import SimpleNamespace

    import megatron.training.initialize as initialize
    import torch.distributed as dist
    from megatron.training import global_vars

    from megatron_eopt.integrations import megatron_lm
    from tests.unit.library.runtime.test_torchrun_store import torchrun_agent_store

    agent = torchrun_agent_store(monkeypatch, attempt=2)
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", SimpleNamespace(rank=0, world_size=1, distributed_timeout_minutes=1))
    stores = []
    monkeypatch.setattr(initialize, "_initialize_distributed", lambda embedding, position, store, **kw: stores.append(store))
    given = dist.HashStore()
    with megatron_lm.installed():
        initialize._initialize_distributed(None, None, None, skip_model_parallel_init=False)
        initialize._initialize_distributed(None, None, given)
        monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
        initialize._initialize_distributed(None, None, None)
    attempt, kept, outside = stores
    attempt.set("0/cpu/rank_0", "this attempt's address")
    assert dist.PrefixStore("megatron_eopt/job/attempt_2/", agent).get("0/cpu/rank_0") == b"this attempt's address"
    assert not agent.check(["0/cpu/rank_0"])
    assert kept is given and outside is None
