"""megatron_eopt.runtime.megatron_lm_saves without a loop: the non-persistent cleanup and the
resident-memory reading that replace megatron-core's (the loop's faults: tests/functional/test_megatron_lm_faults.py)."""

import multiprocessing

import torch

from megatron_eopt.runtime import megatron_lm_cpu, megatron_lm_saves


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


def test_a_synchronous_torch_dist_save_starts_no_process_and_loads(tmp_path, monkeypatch) -> None:
    """With install(), a synchronous torch_dist save's write results go through an in-process
    queue: megatron-core's writer starts no Manager server (a child process), and the save loads
    (on CPU through megatron_lm_cpu, as in Megatron-LM's loop)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    monkeypatch.setattr(filesystem_async, "_results_queue", None)  # as in a process that never saved
    saved = torch.arange(6.0).reshape(2, 3)
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    megatron_lm_saves.install()
    try:
        with megatron_lm_cpu.installed():
            before = set(multiprocessing.active_children())
            dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", saved)}, str(tmp_path))
            started = set(multiprocessing.active_children()) - before
            loaded = dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3))},
                                             str(tmp_path))
    finally:
        megatron_lm_saves.uninstall()
        torch.distributed.destroy_process_group()
    assert started == set() and filesystem_async._results_queue is None
    assert torch.equal(loaded["w"], saved)
