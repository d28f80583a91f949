#!/usr/bin/env python
"""Run one functional-test case on any number of nodes, then compare with its golden values (or record them).

    python tools/run_functional_case.py gpt_muon_layerwise_dp2                       # one machine
    python tools/run_functional_case.py CASE --nnodes 2 --node-rank R --master-addr HOST0 --output SHARED
    sbatch --nodes 2 tools/functional_case.sbatch CASE                                # Slurm

Each node runs this once; it starts torchrun with the case's entry script and command line
(megatron_eopt/training/functional/cases.py: the function `make test` uses too), one torchrun per
run (two for TEST_TYPE ckpt-resume, the second resuming at half as Megatron-LM's runner does). Node
settings come from the flags, else MASTER_ADDR, MASTER_PORT, NNODES, NODE_RANK, else Slurm's
SLURM_NNODES, SLURM_NODEID, SLURM_JOB_NODELIST, else the case's recipe. Node 0 then reads the
TensorBoard events (--output must be shared between nodes) and compares them with the golden file
of this platform (`--record` writes it). Bad input (the case, its flags through the entry's own
parser, the golden file) is refused in one line before any run. Exit status: 0 passed, 1 a metric
or a run failed, 2 bad input. docs/functional-tests.md explains cases, goldens and tolerances.
"""

import argparse
import os
import pathlib
import shlex
import shutil
import subprocess
import sys
import time
from typing import Optional

from megatron_eopt.training.functional import goldens
from megatron_eopt.training.functional.cases import (ENTRIES, Case, RunPaths, case_argv, load_case, load_recipe,
                                                      prepare_resume)
from megatron_eopt.training.functional.entry_flags import check_case_flags

REPO = pathlib.Path(__file__).resolve().parents[1]
CASES = REPO / "tests" / "functional" / "test_cases" / "gpt"
RECIPE = REPO / "tests" / "functional" / "recipes" / "gpt.yaml"
EVENTS_WAIT_S = 60.0  # the writing rank may sit on another node; its file system may show the events late


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("case", help=f"a case's name (a folder of {CASES.relative_to(REPO)}) or its folder")
    parser.add_argument("--recipe", type=pathlib.Path, default=RECIPE, help="default: %(default)s")
    parser.add_argument("--output", type=pathlib.Path, help="where the runs write (default: runs/functional/CASE); "
                        "on several nodes a folder every node sees")
    parser.add_argument("--nnodes", type=int)
    parser.add_argument("--node-rank", type=int)
    parser.add_argument("--nproc-per-node", type=int, help="default: the recipe's nproc_per_node")
    parser.add_argument("--master-addr")
    parser.add_argument("--master-port", type=int)
    parser.add_argument("--data-path", default="", help="${DATA_PATH} (default: OUTPUT/data)")
    parser.add_argument("--data-cache-path", default="", help="${DATA_CACHE_PATH} (default: OUTPUT/data_cache)")
    parser.add_argument("--record", action="store_true", help="write golden_values_ENV_PLATFORM.json instead of comparing")
    parser.add_argument("--environment", default=goldens.ENVIRONMENT, help="golden file's environment (%(default)s)")
    parser.add_argument("--platform", help="golden file's platform (default: this machine's GPU or CPU model)")
    return parser.parse_args(argv)


def _first_slurm_host() -> str | None:
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not nodelist:
        return None
    if shutil.which("scontrol"):
        hosts = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True)
        if hosts.returncode == 0 and hosts.stdout.split():
            return hosts.stdout.split()[0]
    first = nodelist.split(",")[0]
    return None if "[" in first else first  # a compressed list ("node[01-04]") needs scontrol


def _setting(given, names: tuple[str, ...], default, kind=str):
    """The flag's value, else the first of the environment variables `names` that is set, else `default`."""
    if given is not None:
        return given
    for name in names:
        if os.environ.get(name):
            try:
                return kind(os.environ[name])
            except ValueError:
                raise ValueError(f"environment {name}={os.environ[name]!r} is not a valid {kind.__name__}") from None
    return default


def node_settings(args: argparse.Namespace, case: Case) -> dict:
    """torchrun's multi-node settings: flags, else the usual environment, else Slurm's, else the recipe."""
    nnodes = _setting(args.nnodes, ("NNODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"), case.nodes, int)
    node_rank = _setting(args.node_rank, ("NODE_RANK", "SLURM_NODEID"), 0, int)
    master_addr = _setting(args.master_addr, ("MASTER_ADDR",), None) or _first_slurm_host()
    master_port = _setting(args.master_port, ("MASTER_PORT",), 29500, int)
    nproc = args.nproc_per_node or case.nproc_per_node
    if nnodes < 1 or nproc < 1 or not 0 <= node_rank < nnodes:
        raise ValueError(f"--nnodes {nnodes}, --node-rank {node_rank}, --nproc-per-node {nproc}: need "
                         "nnodes >= 1, nproc-per-node >= 1 and 0 <= node-rank < nnodes")
    if nnodes > 1 and not master_addr:
        raise ValueError(f"{nnodes} nodes need the first node's address: --master-addr, MASTER_ADDR or "
                         "SLURM_JOB_NODELIST")
    # One node and no endpoint asked for: torchrun --standalone picks a free port.
    standalone = nnodes == 1 and master_addr is None and _setting(args.master_port, ("MASTER_PORT",), None) is None
    return {"nnodes": nnodes, "node_rank": node_rank, "nproc_per_node": nproc, "standalone": standalone,
            "master_addr": master_addr or "127.0.0.1", "master_port": master_port}


def torchrun_command(case: Case, paths: RunPaths, run: int, nodes: dict) -> list[str]:
    """One run's torchrun command on this node (static rendezvous at the first node; a port per run)."""
    rendezvous = ["--standalone"] if nodes["standalone"] else [
        "--nnodes", str(nodes["nnodes"]), "--node-rank", str(nodes["node_rank"]),
        "--master-addr", nodes["master_addr"], "--master-port", str(nodes["master_port"] + run - 1)]
    return [sys.executable, "-m", "torch.distributed.run", *rendezvous, "--nproc-per-node",
            str(nodes["nproc_per_node"]), str(REPO / ENTRIES[case.script]), *case_argv(case, paths, run)]


def run_case(case: Case, paths: RunPaths, nodes: dict) -> None:
    """Every run of the case on this node; raises RuntimeError when one fails."""
    environment = {**os.environ, **case.env_vars}
    environment.setdefault("OMP_NUM_THREADS", "1")  # as torchrun sets it for several processes, and make test
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), environment.get("PYTHONPATH")]))
    for run in case.phases():
        if run > 1 and nodes["node_rank"] == 0:  # the other nodes' ranks load after meeting node 0's
            prepare_resume(case, paths)
        command = torchrun_command(case, paths, run, nodes)
        print(f"> run {run} of {len(case.phases())} on node {nodes['node_rank']}: {' '.join(command)}", flush=True)
        status = subprocess.run(command, env=environment, cwd=REPO).returncode
        if status != 0:
            raise RuntimeError(f"case {case.name!r}: run {run} exited with status {status}")


def read_events(case: Case, paths: RunPaths) -> list[dict]:
    """Each run's metrics; waits for the last step to show up (written by a rank of another node)."""
    deadline = time.monotonic() + EVENTS_WAIT_S
    while True:
        try:
            actual = goldens.read_runs(case, paths)
            if actual[-1].get("lm loss", {}).get("values", {}).get(str(case.train_iters), "nan") != "nan":
                return actual
        except ValueError:
            if time.monotonic() > deadline:
                raise
        if time.monotonic() > deadline:
            return actual
        time.sleep(2.0)


def find_case(name: str, recipe_path: pathlib.Path) -> Case:
    directory = pathlib.Path(name) if pathlib.Path(name).is_dir() else CASES / name
    if not (directory / "model_config.yaml").is_file():
        known = sorted(p.parent.name for p in CASES.glob("*/model_config.yaml"))
        raise ValueError(f"no case {name!r}: give a case folder or one of {', '.join(known)}")
    return load_case(directory, load_recipe(recipe_path))


def golden_of(args: argparse.Namespace, case: Case) -> Optional[tuple[pathlib.Path, dict]]:
    """This platform's golden file and its values, read and checked before any run (None: --record)."""
    if args.record:
        return None
    import torch

    on_cuda = torch.cuda.is_available()
    reference = None if on_cuda else _cpu_reference(args.recipe)
    path = goldens.find_golden(case, args.platform or goldens.platform_name(), on_cuda, reference, args.environment,
                               record_command(args))
    return path, goldens.load_golden(path)


def record_command(args: argparse.Namespace) -> str:
    """The command that records this launch's golden file: the case as given (a copied folder's golden
    belongs in that folder, not in the repository's case of the same name), with the flags that
    choose the recipe and the golden file's name."""
    chosen = [(flag, value) for flag, value, default in (("--recipe", args.recipe, RECIPE),
                                                         ("--environment", args.environment, goldens.ENVIRONMENT),
                                                         ("--platform", args.platform, None)) if value != default]
    words = ["python", "tools/run_functional_case.py", args.case, *(w for pair in chosen for w in map(str, pair)),
             "--record"]
    return shlex.join(words)


def compare_or_record(args: argparse.Namespace, case: Case, actual: list[dict],
                      golden: Optional[tuple[pathlib.Path, dict]]) -> int:
    """Record the first run's values, or check every run (goldens.check_runs)."""
    import torch

    on_cuda = torch.cuda.is_available()
    if golden is None:
        platform = args.platform or goldens.platform_name()
        path = goldens.record(actual[0], case, goldens.golden_path(case, platform, args.environment), on_cuda)
        print(f"> recorded {path}")
        return 0
    path, values = golden
    verdicts = goldens.check_runs(case, values, actual, on_cuda)
    print(f"> {case.name}: compared with {path.name}")
    for verdict in verdicts:
        print(f"  {'PASSED' if verdict.passed else 'FAILED'} {verdict.message}")
    return 0 if all(verdict.passed for verdict in verdicts) else 1


def _cpu_reference(recipe_path: pathlib.Path) -> str | None:
    import yaml

    return yaml.safe_load(recipe_path.read_text())["spec"].get("cpu_reference_platform")


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        case = find_case(args.case, args.recipe)
        nodes = node_settings(args, case)
        paths = RunPaths(args.output or REPO / "runs" / "functional" / case.name, args.data_path, args.data_cache_path)
        if nodes["nnodes"] * nodes["nproc_per_node"] != case.world_size:
            print(f"> note: {nodes['nnodes']} x {nodes['nproc_per_node']} ranks, the recipe's {case.nodes} x "
                  f"{case.nproc_per_node}: another data-parallel size than the golden values'")
        # Bad input ends here, before any run: the golden file (node 0 compares), the flags.
        golden = golden_of(args, case) if nodes["node_rank"] == 0 else None
        check_case_flags(case, paths, nodes["nnodes"] * nodes["nproc_per_node"])
        if nodes["node_rank"] == 0:  # a fresh start: no checkpoint or events of an earlier launch
            for stale in ("tensorboard", "checkpoints"):
                shutil.rmtree(paths.output / stale, ignore_errors=True)
        run_case(case, paths, nodes)
        if nodes["node_rank"] != 0:
            return 0
        return compare_or_record(args, case, read_events(case, paths), golden)
    except ValueError as error:
        print(f"run_functional_case.py: error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    except RuntimeError as error:
        print(f"run_functional_case.py: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
