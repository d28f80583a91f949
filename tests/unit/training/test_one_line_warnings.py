"""The run's warning policy (training/logging/warning_policy.py): one line each without Python's
source line; known harmless third-party warnings once, on rank 0; megatron_eopt's on rank 0 only,
except RankWarning; everything restored after the block."""

import warnings

import pytest

from megatron_eopt.runtime.once import RankWarning
from megatron_eopt.training.logging import warning_policy as policy

APEX = "Apex is not installed. Falling back to Torch Norm"


def test_a_warning_is_one_line_without_source() -> None:
    text = policy.format_warning(UserWarning("--muon-tp-mode sharded has no effect\n  with --optimizer adam"),
                                 UserWarning, "/x/validate.py", 153, "    warnings.warn(")
    assert text == "pretrain_gpt.py: warning: --muon-tp-mode sharded has no effect with --optimizer adam (UserWarning)\n"


def test_the_librarys_warnings_name_the_flags() -> None:
    # The factory's words (test_per_head_qkv.py checks them), as the trainer's user set the field.
    text = policy.format_warning(UserWarning(
        "OptimizerConfig.muon_split_qkv_per_head=True has no effect on this rank: it splits fused q/k/v weights "
        "only (linear_qkv, and those of docs/fsdp2.md's table), and none of the matrices 'muon' steps here is one "
        "(multi-latent attention's projections are orthogonalized per head and component without it; "
        "docs/tp-muon.md)."), UserWarning, "/x/factory.py", 1)
    assert text == ("pretrain_gpt.py: warning: --muon-split-qkv-per-head has no effect on this rank: it splits fused "
                    "q/k/v weights only (linear_qkv, and those of docs/fsdp2.md's table), and none of the matrices "
                    "'muon' steps here is one (multi-latent attention's projections are orthogonalized per head and "
                    "component without it; docs/tp-muon.md). (UserWarning)\n")


def _printed(rank_zero: bool) -> list[str]:
    """The lines printed under the policy for: a harmless third-party warning twice, one of
    megatron_eopt's, a RankWarning of megatron_eopt's, an unknown third-party one, and the
    SyntaxWarning Python raises compiling megatron-core's docstrings (silenced: none of them shows it)."""
    lines: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda *a, **k: lines.append(warnings.formatwarning(*a[:4]))
        with policy.warning_policy(rank_zero):
            for module in ("megatron.core.fusions.fused_layer_norm", "megatron.core.transformer.torch_norm"):
                warnings.warn_explicit(APEX, UserWarning, f"/{module}.py", 1, module=module)
            warnings.warn_explicit("--x has no effect", UserWarning, "/v.py", 2, module="arguments.v")
            warnings.warn_explicit("this rank's file", RankWarning, "/d.py", 3, module="megatron_eopt.training.d")
            warnings.warn_explicit("something new", FutureWarning, "/t.py", 4, module="torch.thing")
            source = "/venv/site-packages/megatron/core/inference/contexts/kv_block_allocator"  # as the compiler names it
            warnings.warn_explicit("invalid escape sequence '\\-'", SyntaxWarning, f"{source}.py", 426, module=source)
    return lines


def test_rank_zero_prints_each_known_harmless_text_once_and_ours() -> None:
    assert _printed(rank_zero=True) == [
        f"pretrain_gpt.py: warning: {APEX} (UserWarning)\n",
        "pretrain_gpt.py: warning: --x has no effect (UserWarning)\n",
        "pretrain_gpt.py: warning: this rank's file (RankWarning)\n",
        "pretrain_gpt.py: warning: something new (FutureWarning)\n",
    ]


def test_other_ranks_print_only_rank_warnings_and_unknown_third_party_ones() -> None:
    assert _printed(rank_zero=False) == [
        "pretrain_gpt.py: warning: this rank's file (RankWarning)\n",
        "pretrain_gpt.py: warning: something new (FutureWarning)\n",
    ]


def test_the_policy_is_undone_after_the_block() -> None:
    before = (warnings.formatwarning, warnings.showwarning, list(warnings.filters))
    with policy.warning_policy(rank_zero=False):
        assert warnings.formatwarning is policy.format_warning
    assert (warnings.formatwarning, warnings.showwarning, list(warnings.filters)) == before


def test_main_holds_it_from_the_start(monkeypatch) -> None:
    from megatron_eopt.training import pretrain

    seen = []

    def parse_args(argv):
        seen.append(warnings.formatwarning)
        raise SystemExit(2)

    monkeypatch.setattr(pretrain, "parse_args", parse_args)
    with pytest.raises(SystemExit):
        pretrain.main(["--lr", "1e-3"])
    assert seen == [policy.format_warning] and warnings.formatwarning is not policy.format_warning
