"""Start-up of pretrain_gpt.py's --help and flag errors, and of `import megatron_eopt`.

Each case runs in a fresh interpreter of this checkout (`--python`, default the running one,
`--root` the checkout): wall seconds (median of `--repeats` runs), peak RSS (MiB, largest) and,
from one more run under `python -X importtime`, the cumulative import seconds of the heavy
top-level modules and of all imports together. Prints numbers; asserts nothing.

    python benchmarks/startup.py [--repeats 3] [--python PATH] [--root DIR] [--json PATH]
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

CASES = {
    "--help": ["scripts/pretrain_gpt.py", "--help"],
    "--optimizer muonn": ["scripts/pretrain_gpt.py", "--optimizer", "muonn", "--lr", "1e-3"],
    "--lr abc": ["scripts/pretrain_gpt.py", "--lr", "abc"],
    "import megatron_eopt": ["-c", "import megatron_eopt"],
    "import get_megatron_optimizer": ["-c", "from megatron_eopt import get_megatron_optimizer"],
}
HEAVY = ("torch", "megatron.core", "transformer_engine")
IMPORT_LINE = re.compile(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)")


def run_once(python: str, root: str, argv: list[str], importtime: bool = False) -> tuple[float, float, str]:
    """(wall seconds, peak RSS in MiB, stderr) of one fresh interpreter."""
    command = [python, *(["-X", "importtime"] if importtime else []), *argv]
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "RANK": "0", "WORLD_SIZE": "1"})
    stderr = process.stderr.read()
    _, _, usage = os.wait4(process.pid, 0)
    process.returncode = 0  # reaped above
    return time.perf_counter() - start, usage.ru_maxrss / 1024, stderr


def import_seconds(stderr: str) -> dict[str, float]:
    """Cumulative seconds of each heavy package's import (wherever it is first imported), and of
    every outermost import together ('all')."""
    seconds = {"all": 0.0}
    for match in IMPORT_LINE.finditer(stderr):
        cumulative = int(match[2]) / 1e6
        if len(match[3]) == 1:  # an outermost import: the nested ones are inside its cumulative time
            seconds["all"] += cumulative
        if match[4] in HEAVY:
            seconds[match[4]] = cumulative
    return {name: round(value, 2) for name, value in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", metavar="PATH", help="also write the numbers here")
    args = parser.parse_args()
    results = {}
    for name, argv in CASES.items():
        runs = [run_once(args.python, args.root, argv) for _ in range(args.repeats)]
        *_, stderr = run_once(args.python, args.root, argv, importtime=True)
        results[name] = {"wall_s": round(statistics.median(run[0] for run in runs), 2),
                         "peak_rss_mib": round(max(run[1] for run in runs)), "imports_s": import_seconds(stderr)}
        print(f"{name:22s} {results[name]['wall_s']:7.2f} s  {results[name]['peak_rss_mib']:6d} MiB  "
              f"imports {results[name]['imports_s']}", flush=True)
    if args.json:
        with open(args.json, "w") as file:
            json.dump(results, file, indent=1)


if __name__ == "__main__":
    main()
