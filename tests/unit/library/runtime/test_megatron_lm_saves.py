"""megatron_eopt.runtime.megatron_lm_saves without a loop: the non-persistent cleanup and the
resident-memory reading that replace megatron-core's (the loop's faults: tests/functional/test_megatron_lm_faults.py)."""

from megatron_eopt.runtime import megatron_lm_saves


def test_the_cleanup_keeps_the_checkpoint_latest_names_and_everything_newer(tmp_path) -> None:
    for iteration in (2, 4, 6, 8):  # 8: an async save still being written
        (tmp_path / f"iter_{iteration:07d}").mkdir()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("6")
    megatron_lm_saves.remove_checkpoints_before_the_latest(tmp_path)
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == ["iter_0000006", "iter_0000008"]


def test_the_cleanup_removes_nothing_while_latest_names_none(tmp_path) -> None:
    for iteration in (2, 4):
        (tmp_path / f"iter_{iteration:07d}").mkdir()
    megatron_lm_saves.remove_checkpoints_before_the_latest(tmp_path)
    assert len(list(tmp_path.glob("iter_*"))) == 2


def test_resident_bytes_reads_this_process() -> None:
    assert megatron_lm_saves.resident_bytes() > 1 << 20  # a Python process with torch holds more than 1 MiB
