"""Functional-test cases in Megatron-LM's layout: `<model>/<case>/model_config.yaml` plus a recipe.

A case's `model_config.yaml` holds only keys Megatron-LM's own case files use (ENV_VARS, MODEL_ARGS,
TEST_TYPE, METRICS, ...). What Megatron-LM keeps in its recipes (tests/test_utils/recipes/) sits in
our recipe: the entry script, nodes and processes per node, and the per-metric checks.
`case_argv` turns a case into one phase's command line, and `prepare_resume` does Megatron-LM's step
between a ckpt-resume's runs; the launcher (tools/run_functional_case.py) and the in-process runner of
`make test` both call them. docs/functional-tests.md describes the files and the flow.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import shutil
from typing import Any, Literal, Optional

# Top-level keys of Megatron-LM's model_config.yaml files (read from its tests/functional_tests/test_cases).
MEGATRON_LM_CASE_KEYS = ("ENV_VARS", "MODEL_ARGS", "TEST_TYPE", "METRICS", "LAUNCHER", "MODE", "BEFORE_SCRIPT",
                         "AFTER_SCRIPT", "MODEL_ENV_VARS", "BASE_MODEL_ARGS", "TEST_EVALUATION",
                         "THROUGHPUT_TEST_PARAMS")
# The ones this runner acts on; the rest are refused with this list, so that no key is silently ignored.
CASE_KEYS = ("ENV_VARS", "MODEL_ARGS", "TEST_TYPE", "METRICS")
TEST_TYPES = ("regular", "ckpt-resume")
PLACEHOLDERS = ("TENSORBOARD_PATH", "CHECKPOINT_SAVE_PATH", "CHECKPOINT_LOAD_PATH", "DATA_PATH", "DATA_CACHE_PATH")
METRIC_NAMES = ("lm loss", "num-zeros", "mem-allocated-bytes", "mem-max-allocated-bytes", "iteration-time")
DEFAULT_METRICS = ("iteration-time", "lm loss", "num-zeros")  # Megatron-LM's, for a case without METRICS
# The entries a recipe may name: ours, and Megatron-LM's pretrain_gpt.py with install().
ENTRIES = {"pretrain_gpt.py": "scripts/pretrain_gpt.py",
           "pretrain_gpt_megatron_lm.py": "scripts/pretrain_gpt_megatron_lm.py"}
RECIPE_KEYS = ("test_case", "nodes", "nproc_per_node", "script", "checks")
CHECK_KEYS = ("type", "rtol", "atol", "failing_steps")
_PLACEHOLDER = re.compile(r"\$\{([^}]*)\}")

TestType = Literal["regular", "ckpt-resume"]


@dataclasses.dataclass(frozen=True)
class Check:
    """How one metric is compared: `deterministic` (equal) or `approximate` (|a - g| <= atol + rtol |g|
    at all but `failing_steps` steps; None: Megatron-LM's min(max(steps // 100, 1), 50))."""

    type: Literal["deterministic", "approximate"]
    rtol: float = 0.0
    atol: float = 0.0
    failing_steps: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    directory: pathlib.Path
    env_vars: dict[str, str]
    model_args: dict[str, Any]
    test_type: TestType
    metrics: tuple[str, ...]
    script: str  # a key of ENTRIES
    nodes: int
    nproc_per_node: int
    checks: dict[str, Check]

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node

    @property
    def train_iters(self) -> int:
        return int(self.model_args["--train-iters"])

    def phases(self) -> tuple[int, ...]:
        """Run numbers: 1, or 1 and 2 for ckpt-resume (the second resumes the first's save at half)."""
        return (1, 2) if self.test_type == "ckpt-resume" else (1,)


def _yaml(path: pathlib.Path) -> Any:
    import yaml

    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    with open(path) as stream:
        try:
            return yaml.safe_load(stream)
        except yaml.YAMLError as error:
            mark = getattr(error, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            raise ValueError(f"{path}: not valid YAML{where}: {getattr(error, 'problem', None) or error}") from None


def _check_keys(where: str, given, allowed) -> None:
    unknown = [key for key in given if key not in allowed]
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(allowed)}")


def load_recipe(path: pathlib.Path) -> dict[str, dict[str, Any]]:
    """test_case -> its settings, the recipe's `spec` under each product (checks merged per metric)."""
    recipe = _yaml(path)
    _check_keys(str(path), recipe, ("spec", "products"))
    spec = recipe["spec"]
    _check_keys(f"{path}: spec", spec, ("model", *RECIPE_KEYS[1:], "cpu_reference_platform"))
    settings = {}
    for product in recipe["products"]:
        _check_keys(f"{path}: product {product.get('test_case')}", product, RECIPE_KEYS)
        merged = {**spec, **{k: v for k, v in product.items() if k != "checks"}}
        merged["checks"] = {metric: {**spec.get("checks", {}).get(metric, {}), **check}
                            for metric, check in {**spec.get("checks", {}), **product.get("checks", {})}.items()}
        for name in product["test_case"]:
            settings[name] = merged
    return settings


def _check(where: str, metric: str, raw: dict[str, Any]) -> Check:
    _check_keys(f"{where}: checks[{metric!r}]", raw, CHECK_KEYS)
    if metric not in METRIC_NAMES:
        raise ValueError(f"{where}: checks for unknown metric {metric!r}; metrics: {', '.join(METRIC_NAMES)}")
    if raw.get("type") not in ("deterministic", "approximate"):
        raise ValueError(f"{where}: checks[{metric!r}].type must be 'deterministic' or 'approximate'; "
                         f"got {raw.get('type')!r}")
    return Check(raw["type"], float(raw.get("rtol", 0.0)), float(raw.get("atol", 0.0)), raw.get("failing_steps"))


def load_case(directory: pathlib.Path, recipe: dict[str, dict[str, Any]]) -> Case:
    """The case in `directory` (its model_config.yaml) with its recipe entry; ValueError naming what is wrong."""
    directory = pathlib.Path(directory)
    path = directory / "model_config.yaml"
    config = _yaml(path)
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a mapping of {', '.join(CASE_KEYS)}; got {type(config).__name__}")
    _check_keys(str(path), config, CASE_KEYS)
    for key in ("ENV_VARS", "MODEL_ARGS", "TEST_TYPE"):
        if key not in config:
            raise ValueError(f"{path}: {key} is missing; a case holds {', '.join(CASE_KEYS)} (METRICS optional)")
    if config["TEST_TYPE"] not in TEST_TYPES:
        raise ValueError(f"{path}: TEST_TYPE {config['TEST_TYPE']!r} is not one of {', '.join(TEST_TYPES)}")
    metrics = tuple(config.get("METRICS", DEFAULT_METRICS))
    _check_keys(f"{path}: METRICS", metrics, METRIC_NAMES)
    model_args = dict(config["MODEL_ARGS"])
    bad_flags = [flag for flag in model_args if not str(flag).startswith("--")]
    if bad_flags:
        raise ValueError(f"{path}: MODEL_ARGS keys must be flags starting with '--'; got {bad_flags}")
    for flag, value in model_args.items():
        for name in _PLACEHOLDER.findall(str(value)):
            if name not in PLACEHOLDERS:
                raise ValueError(f"{path}: MODEL_ARGS {flag}: unknown placeholder ${{{name}}}; "
                                 f"placeholders: {', '.join('${' + p + '}' for p in PLACEHOLDERS)}")
    if "--train-iters" not in model_args:
        raise ValueError(f"{path}: MODEL_ARGS needs --train-iters (the golden values' last step)")
    name = directory.name
    if name not in recipe:
        raise ValueError(f"case {name!r} is in no recipe product; add `- test_case: [{name}]` to the recipe")
    settings = recipe[name]
    if settings.get("script") not in ENTRIES:
        raise ValueError(f"case {name!r}: recipe script {settings.get('script')!r} is not one of {', '.join(ENTRIES)}")
    checks = {metric: _check(f"case {name!r}", metric, raw) for metric, raw in settings.get("checks", {}).items()}
    missing = [metric for metric in metrics if metric not in checks]
    if missing:
        raise ValueError(f"case {name!r}: no check declared for METRICS {missing}; declare them in the recipe's checks")
    case = Case(name, directory, {str(k): str(v) for k, v in (config["ENV_VARS"] or {}).items()}, model_args,
                config["TEST_TYPE"], metrics, settings["script"], int(settings.get("nodes", 1)),
                int(settings.get("nproc_per_node", 1)), checks)
    if case.test_type == "ckpt-resume":
        _check_resumable(case, path)
    return case


def _check_resumable(case: Case, path: pathlib.Path) -> None:
    half = case.train_iters // 2
    needs = ("--save", "--load", "--save-interval")
    if any(flag not in case.model_args for flag in needs) or case.train_iters % 2:
        raise ValueError(f"{path}: a ckpt-resume case needs {', '.join(needs)} and an even --train-iters")
    if half % int(case.model_args["--save-interval"]):
        raise ValueError(f"{path}: --save-interval {case.model_args['--save-interval']} must divide half of "
                         f"--train-iters ({half}): the first run saves there, and the second resumes there")


def load_cases(root: pathlib.Path, recipe_path: pathlib.Path) -> list[Case]:
    """Every case under `root` (a model's folder of cases), by name."""
    recipe = load_recipe(recipe_path)
    directories = sorted(p.parent for p in pathlib.Path(root).glob("*/model_config.yaml"))
    names = {d.name for d in directories}
    orphans = sorted(set(recipe) - names)
    if orphans:
        raise ValueError(f"{recipe_path}: test_case(s) {orphans} have no folder under {root}")
    return [load_case(directory, recipe) for directory in directories]


@dataclasses.dataclass(frozen=True)
class RunPaths:
    """Where a run writes: the placeholders' values (TENSORBOARD_PATH per run number)."""

    output: pathlib.Path
    data_path: str = ""
    data_cache_path: str = ""

    def tensorboard(self, run: int) -> pathlib.Path:
        return self.output / "tensorboard" / f"run_{run}"

    def values(self, run: int) -> dict[str, str]:
        checkpoints = self.output / "checkpoints"
        return {"TENSORBOARD_PATH": str(self.tensorboard(run)), "CHECKPOINT_SAVE_PATH": str(checkpoints),
                # The first run finds no checkpoint there (it trains from scratch); the second resumes.
                "CHECKPOINT_LOAD_PATH": str(checkpoints),
                "DATA_PATH": self.data_path or str(self.output / "data"),
                "DATA_CACHE_PATH": self.data_cache_path or str(self.output / "data_cache")}


def _substitute(value: str, values: dict[str, str]) -> str:
    return _PLACEHOLDER.sub(lambda match: values[match.group(1)], value)


def case_argv(case: Case, paths: RunPaths, run: int = 1) -> list[str]:
    """The command line of run `run` (1, or 2 for ckpt-resume's second; the same for both): Megatron-LM's
    reading of MODEL_ARGS (`true` is a switch, a list gives several values), placeholders filled in."""
    if run not in case.phases():
        raise ValueError(f"case {case.name!r} ({case.test_type}) has run(s) {case.phases()}; got {run}")
    values = paths.values(run)
    argv: list[str] = []
    for flag, value in case.model_args.items():
        if value is True:
            argv.append(flag)
        elif value is False or value is None:
            raise ValueError(f"case {case.name!r}: MODEL_ARGS {flag}: {value!r}; write `true` for a switch "
                             "and leave a flag out to keep it off")
        elif isinstance(value, list):
            argv += [flag, *(_substitute(str(item), values) for item in value)]
        else:
            argv += [flag, _substitute(str(value), values)]
    return argv


# Megatron-LM's checkpoint tracker: the iteration a run started with --load resumes from.
TRACKER = "latest_checkpointed_iteration.txt"


def prepare_resume(case: Case, paths: RunPaths) -> pathlib.Path:
    """What Megatron-LM's runner (run_ci_test.sh) does between a ckpt-resume case's runs, on one node:
    remove the first run's checkpoints after half of --train-iters (its last, `iter_<train-iters>` in
    --save, among them) and point Megatron-LM's tracker at half, where the second run resumes.
    Returns the --save folder; RuntimeError when the first run left no last checkpoint."""
    save = pathlib.Path(_substitute(str(case.model_args["--save"]), paths.values(1)))
    last = save / f"iter_{case.train_iters:07d}"
    if not last.is_dir():
        raise RuntimeError(f"case {case.name!r}: the first run left no {last} (it saves at the end of "
                           f"--train-iters); found {sorted(p.name for p in save.glob('*')) if save.is_dir() else 'no --save folder'}")
    rewind(save, case.train_iters // 2)
    return save


def rewind(save: pathlib.Path, iteration: int) -> None:
    """Remove the checkpoints in `save` after `iteration` and point Megatron-LM's tracker at it, so a
    run with `--load save` resumes there (a second call finds nothing to remove)."""
    for later in save.glob("iter_*"):
        number = later.name.removeprefix("iter_")
        if later.is_dir() and number.isdigit() and int(number) > iteration:
            shutil.rmtree(later)
    (save / TRACKER).write_text(f"{iteration}\n")


def case_environment(case: Case, base: Optional[dict[str, str]] = None) -> dict[str, str]:
    """`base` (default: this process's environment) with the case's ENV_VARS."""
    return {**(os.environ if base is None else base), **case.env_vars}
