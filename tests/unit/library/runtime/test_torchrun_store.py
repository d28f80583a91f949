"""runtime/torchrun_store.py: each torchrun attempt meets under a key prefix of its own, in the
one store torchrun's agent keeps for the whole job (docs/reliability.md)."""

import datetime

import torch.distributed as dist

from megatron_eopt.runtime.torchrun_store import restart_store
from tests.ports import free_port

TIMEOUT = datetime.timedelta(seconds=30)


def torchrun_agent_store(monkeypatch, attempt: int) -> dist.TCPStore:
    """The job's store as torchrun's agent keeps it (run id "job"), and the environment torchrun gives
    the workers of attempt `attempt`."""
    port = free_port()
    agent = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=TIMEOUT)
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": "job",
                        "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": str(attempt)}.items():
        monkeypatch.setenv(name, value)
    return agent


def test_an_attempt_never_reads_the_keys_an_earlier_attempt_left_in_the_agents_store(monkeypatch) -> None:
    agent = torchrun_agent_store(monkeypatch, attempt=0)
    restart_store(1, 2, TIMEOUT).set("0/cpu/rank_1", "the killed attempt's address")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    restarted = restart_store(1, 2, TIMEOUT)
    assert not restarted.check(["0/cpu/rank_1"])  # gloo's group 0 would read it, and connect to a dead peer
    assert dist.PrefixStore("megatron_eopt/job/attempt_0/", agent).get("0/cpu/rank_1") == b"the killed attempt's address"


def test_outside_torchrun_there_is_no_store_of_ours(monkeypatch) -> None:
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert restart_store(0, 1, TIMEOUT) is None
