"""Sample, every --interval seconds until stopped, the thread count of every process whose command
line contains --match, and the load average; print the largest at each sample and a summary at the end.

    python tools/sample_threads.py --match pytest --out threads.tsv &   # while `make test` runs

Reads /proc: Linux only. Used for the suite's thread budget (docs/testing.md).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time


def _threads_by_process(match: str) -> dict[int, tuple[int, str]]:
    found = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            if match not in command:
                continue
            with open(f"/proc/{entry.name}/status") as f:
                threads = next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
        except (OSError, StopIteration):
            continue  # the process ended between the listing and the read
        found[int(entry.name)] = (threads, command[:120])
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--match", default="python", help="substring of the command lines to watch")
    parser.add_argument("--interval", type=float, default=20.0, help="seconds between samples")
    parser.add_argument("--out", default="-", help="file for one line per sample (default: stdout)")
    args = parser.parse_args()
    out = sys.stdout if args.out == "-" else open(args.out, "w")  # noqa: SIM115
    peak: tuple[int, int, str] = (0, 0, "")
    peak_load = 0.0
    stop = False

    def _stop(*_):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    start = time.monotonic()
    print("seconds\tload1\tprocesses\tmost_threads\tpid\tcommand", file=out, flush=True)
    while not stop:
        load = os.getloadavg()[0]
        found = _threads_by_process(args.match)
        most, pid, command = max(((n, p, c) for p, (n, c) in found.items()), default=(0, 0, ""))
        print(f"{time.monotonic() - start:.0f}\t{load:.1f}\t{len(found)}\t{most}\t{pid}\t{command}",
              file=out, flush=True)
        peak = max(peak, (most, pid, command))
        peak_load = max(peak_load, load)
        deadline = time.monotonic() + args.interval
        while not stop and time.monotonic() < deadline:
            time.sleep(0.5)
    print(f"# peak: {peak[0]} threads in pid {peak[1]} ({peak[2]}); peak load average {peak_load:.1f}",
          file=out, flush=True)


if __name__ == "__main__":
    main()
