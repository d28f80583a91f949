"""The functional-test cases of tests/functional/test_cases/gpt/, run in the harness's workers.

`run_and_read` runs one case (tests/golden_cases_in_process.py) and reads its TensorBoard events
into the golden schema, as the launcher (tools/run_functional_case.py) does after torchrun.

As a script it runs every case (or those named) in one session and writes each case's values:

    .venv/bin/python -m tests.functional.golden_cases --record            # CPU goldens, this platform
    .venv/bin/python -m tests.functional.golden_cases --dump DIR [CASES]  # values only (spread)

`--bf16-products` runs them as a CPU with native bf16 products computes (tests/bf16_numerics.py).
"""

import argparse
import json
import pathlib
import sys
import tempfile
import time

from megatron_eopt.training.functional import goldens
from megatron_eopt.training.functional.cases import Case, RunPaths, load_cases, load_recipe

ROOT = pathlib.Path(__file__).resolve().parents[2]
CASES_ROOT = ROOT / "tests" / "functional" / "test_cases" / "gpt"
RECIPE = ROOT / "tests" / "functional" / "recipes" / "gpt.yaml"


def cases() -> dict[str, Case]:
    return {case.name: case for case in load_cases(CASES_ROOT, RECIPE)}


def cpu_reference_platform() -> str:
    import yaml

    return yaml.safe_load(RECIPE.read_text())["spec"]["cpu_reference_platform"]


def run_and_read(case: Case, output: pathlib.Path, run_distributed, drop_momentum: bool = False,
                 bf16_products: bool = False, timeout: float = 600) -> list[dict]:
    """Run `case` on its ranks in the harness's workers; each run's metrics in the golden schema
    (goldens.read_runs: a ckpt-resume's second run from half on)."""
    from tests.golden_cases_in_process import run_case

    run_distributed(run_case, case.world_size, args=(case, str(output)),
                    kwargs={"drop_momentum": drop_momentum, "bf16_products": bf16_products}, timeout=timeout)
    return goldens.read_runs(case, RunPaths(output))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--record", action="store_true", help="write golden_values_dev_<this CPU>.json per case")
    action.add_argument("--dump", type=pathlib.Path, help="write each case's values to DIR/<case>.json")
    parser.add_argument("--bf16-products", action="store_true")
    parser.add_argument("names", nargs="*", help="cases (default: all)")
    args = parser.parse_args(argv)
    from tests.distributed_harness import run_distributed, shutdown_distributed

    chosen = [case for name, case in cases().items() if not args.names or name in args.names]
    try:
        for case in chosen:
            started = time.perf_counter()
            with tempfile.TemporaryDirectory() as output:
                actual = run_and_read(case, pathlib.Path(output), run_distributed, bf16_products=args.bf16_products)
            if args.record:
                path = goldens.record(actual[0], case, goldens.golden_path(case, goldens.platform_name("cpu")), False)
            else:
                args.dump.mkdir(parents=True, exist_ok=True)
                path = args.dump / f"{case.name}.json"
                path.write_text(json.dumps(actual[0], indent=1))  # the values a golden file holds
            print(f"{case.name}: {time.perf_counter() - started:.1f} s -> {path}", flush=True)
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    main(sys.argv[1:])
