"""Free TCP ports for a server that another process binds later (torchrun's `--master-port`).

`bind(("127.0.0.1", 0))` hands out a port of the kernel's ephemeral range, where every outgoing
connection takes its local port too: between choosing such a port and the server binding it, a
connection of the other test process (`make test` runs two, tests/worker_groups.py) can take it. So
the ports come from below that range, where only a server's explicit bind goes, drawn at random by
the operating system's generator (the tests seed `random`), and are checked free.
"""

from __future__ import annotations

import random
import socket

LOWEST = 10000  # below it sit the well-known and registered services' usual ports
_DRAW = random.SystemRandom()


def free_port(count: int = 1) -> int:
    """The first of `count` consecutive ports, each free now."""
    highest = _ephemeral_low() - count
    if highest <= LOWEST:
        return _kernel_port()
    for _ in range(200):
        first = _DRAW.randrange(LOWEST, highest)
        if all(_is_free(port) for port in range(first, first + count)):
            return first
    raise RuntimeError(f"no {count} free consecutive port(s) found in {LOWEST}-{highest + count}")


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            return int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _kernel_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
