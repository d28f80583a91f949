"""--save and --load checked at start-up (training/checkpoint_paths.py), before any model is built.

A --save inside a file or where nothing can be written, a --ckpt-step the --load directory does
not hold, and an --exit-on-missing-checkpoint without a checkpoint are refused in one line
(`pretrain_gpt.py: error: ...`, status 2) by `main` before any process group or model exists;
the check itself imports no torch.
"""

import argparse
import os
import subprocess
import sys

import pytest

from megatron_eopt.training.checkpoint_paths import check_checkpoint_paths

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _args(save=None, load=None, ckpt_step=None, exit_on_missing_checkpoint=False) -> argparse.Namespace:
    return argparse.Namespace(save=save, load=load, ckpt_step=ckpt_step,
                              exit_on_missing_checkpoint=exit_on_missing_checkpoint)


def test_save_paths(tmp_path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=f"--save {tmp_path}/file/ckpt cannot be created: {tmp_path}/file is a file"):
        check_checkpoint_paths(_args(save=str(tmp_path / "file" / "ckpt")))
    with pytest.raises(ValueError, match=f"--save {tmp_path}/file is a file, not a directory"):
        check_checkpoint_paths(_args(save=str(tmp_path / "file")))
    with pytest.raises(ValueError, match="--save /proc/ckpt/a cannot be created: /proc is not writable"):
        check_checkpoint_paths(_args(save="/proc/ckpt/a"))  # nothing can be made there, not even by root
    check_checkpoint_paths(_args(save=str(tmp_path / "new" / "deeper")))
    check_checkpoint_paths(_args(save=str(tmp_path)))
    assert sorted(os.listdir(tmp_path)) == ["file"]  # nothing created, no probe left behind


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes regardless of permission bits")
def test_save_without_write_permission(tmp_path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    with pytest.raises(ValueError, match=f"--save {locked} is not writable"):
        check_checkpoint_paths(_args(save=str(locked)))
    with pytest.raises(ValueError, match=f"--save {locked}/ckpt cannot be created: {locked} is not writable"):
        check_checkpoint_paths(_args(save=str(locked / "ckpt")))


def test_load_paths_the_flags_need(tmp_path) -> None:
    (tmp_path / "iter_0000004").mkdir()
    (tmp_path / "iter_0000008").mkdir()
    check_checkpoint_paths(_args(load=str(tmp_path), ckpt_step=4))
    check_checkpoint_paths(_args(load=str(tmp_path), exit_on_missing_checkpoint=True))
    check_checkpoint_paths(_args(load=str(tmp_path / "missing")))  # Megatron-LM: trains from scratch
    with pytest.raises(ValueError, match=f"--ckpt-step 6: no checkpoint iter_0000006 in --load {tmp_path} "
                                         r"\(it holds iter_0000004, iter_0000008\)"):
        check_checkpoint_paths(_args(load=str(tmp_path), ckpt_step=6))
    with pytest.raises(ValueError, match=r"--ckpt-step 6: no checkpoint iter_0000006 .*\(it does not exist\)"):
        check_checkpoint_paths(_args(load=str(tmp_path / "missing"), ckpt_step=6))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"--exit-on-missing-checkpoint: no checkpoint in --load .*empty \(it holds no"):
        check_checkpoint_paths(_args(load=str(tmp_path / "empty"), exit_on_missing_checkpoint=True))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="--load .*file is not a directory"):
        check_checkpoint_paths(_args(load=str(tmp_path / "file")))


def test_the_check_imports_no_torch() -> None:
    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('paths', "
            "'megatron_eopt/training/checkpoint_paths.py'); spec.loader.exec_module(importlib.util.module_from_spec(spec)); "
            "print('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


@pytest.mark.parametrize("flags,message", [
    (["--save", "README.md/ckpt"], "--save README.md/ckpt cannot be created: "),
    (["--load", "nowhere", "--ckpt-step", "3"], "--ckpt-step 3: no checkpoint iter_0000003 in --load nowhere"),
])
def test_main_refuses_before_anything_is_built(flags, message, monkeypatch, capsys) -> None:
    import torch.distributed as dist

    from megatron_eopt.training import pretrain
    from megatron_eopt.training.loop import train
    from megatron_eopt.training.parallel import layout

    monkeypatch.chdir(ROOT)
    built = []
    monkeypatch.setattr(layout, "init_distributed", lambda *a: built.append("process group"))
    monkeypatch.setattr(train, "train", lambda *a: built.append("model"))
    with pytest.raises(SystemExit) as exit_info:
        pretrain.main(["--optimizer", "adam", "--lr", "1e-3", "--train-iters", "3"] + flags)
    assert exit_info.value.code == 2 and built == [] and not dist.is_initialized()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("pretrain_gpt.py")]
    assert len(lines) == 1 and lines[0].startswith(f"pretrain_gpt.py: error: {message}"), lines
