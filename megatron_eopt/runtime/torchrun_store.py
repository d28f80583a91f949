"""A store of its own for each attempt of a job that torchrun restarts (`--max-restarts`).

torchrun's agent keeps one TCPStore for the whole job (static and c10d rendezvous alike), and
torch's env:// rendezvous adds no prefix per attempt ("a new TCPStore for every retry",
torch/distributed/rendezvous.py). Every process group reads and writes keys named after its
group number, the same on every attempt, so the keys the dead attempt wrote are still there:
gloo's rendezvous reads a dead peer's address (`Gloo connectFullMesh failed ... Connection
refused`, or a wait in `new_group`), and a non-zero rank of an NCCL group can read the dead
rank 0's ncclUniqueId before the new rank 0 overwrites it (docs/reliability.md). `restart_store`
gives each attempt its own key space (a PrefixStore per TORCHELASTIC_RESTART_COUNT); every group
made over the default group's store inherits it. Used by the trainer's `init_distributed` and
by Megatron-LM's loop with ours installed (integrations/megatron_lm.py's `store_per_restart`).
"""

import datetime
import os
from typing import Optional

import torch.distributed as dist


def restart_attempt() -> Optional[int]:
    """torchelastic's restart count (0 on the first attempt); None outside torchrun."""
    count = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    return int(count) if count is not None and count.isdigit() else None


def restart_store(rank: int, world_size: int, timeout: datetime.timedelta) -> Optional[dist.Store]:
    """Under torchrun: a client of the job's TCPStore (the agent's, or rank 0's without the agent
    store), its keys under this attempt's own prefix. None outside torchrun (env:// as before)."""
    attempt = restart_attempt()
    if attempt is None:
        return None
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True):
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    else:  # rank 0 hosts a store of its own, new for each attempt
        store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout, multi_tenant=True)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return dist.PrefixStore(f"megatron_eopt/{run_id}/attempt_{attempt}/", store)
