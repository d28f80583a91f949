"""wait_bounded: an asynchronous collective that a peer never joins ends within the group's
timeout in one CollectiveTimeout naming the operation and the ranks, where a plain `Work.wait()`
would wait on; a collective that completes returns normally. group_timeout reads the timeout a
group was made with."""

import datetime
import time

import torch
import torch.distributed as dist

from megatron_eopt.ops.collectives import CollectiveTimeout, group_timeout, wait_bounded

TIMEOUT_S = 2.0


def _stuck_broadcast_body(rank: int, world_size: int) -> dict:
    # A group of its own, destroyed at the end: the broadcast rank 1 never joins leaves nothing behind
    # in the groups other tests reuse.
    group = dist.new_group(list(range(world_size)), timeout=datetime.timedelta(seconds=TIMEOUT_S))
    default = dist.new_group(list(range(world_size)))  # torch's default for gloo: 30 minutes
    result = {"timeout": group_timeout(group).total_seconds(), "default": group_timeout(default).total_seconds()}
    joined = torch.full((3,), float(rank))
    wait_bounded(dist.broadcast(joined, src=1, group=group, async_op=True), group, "a broadcast both ranks join")
    result["joined"] = joined.tolist()
    if rank == 0:
        started = time.monotonic()
        try:
            wait_bounded(dist.broadcast(torch.zeros(3), src=1, group=group, async_op=True), group,
                         "torch.distributed broadcast of test bucket 7")
        except CollectiveTimeout as error:
            result["message"], result["waited"] = str(error), time.monotonic() - started
    dist.barrier()  # over WORLD: rank 1 waits here for rank 0's timeout
    dist.destroy_process_group(group)
    dist.destroy_process_group(default)
    return result


def test_a_collective_a_peer_never_joins_ends_in_one_line_within_the_timeout(run_distributed) -> None:
    results = run_distributed(_stuck_broadcast_body, world_size=2, timeout=120)
    for result in results:
        assert result["timeout"] == TIMEOUT_S and result["default"] == 30 * 60
        assert result["joined"] == [1.0, 1.0, 1.0]
    message, waited = results[0]["message"], results[0]["waited"]
    assert message == (f"torch.distributed broadcast of test bucket 7 over ranks [0, 1] did not complete within "
                       f"{TIMEOUT_S:g} s (the process group's timeout)")
    print(f"a {TIMEOUT_S:g} s group timeout: the wait ended after {waited:.2f} s")
    assert TIMEOUT_S * 0.9 <= waited < TIMEOUT_S + 10, waited  # bounded (slack for a loaded machine)
