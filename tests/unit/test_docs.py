"""The README and docs/ stay short, their links resolve, and every code example in them runs.

Examples are fenced blocks:
- ```python: runs on CPU. A first line `# torchrun --nproc-per-node N this.py` runs it on N ranks
  (torchrun's environment variables set), else in one process. `29500` becomes a free port.
- ```bash: each command (lines joined at a trailing backslash) that starts with `python` or
  `torchrun` runs on CPU: `python X.py`, `python -c CODE` or `torchrun [options] X.py`, where
  `--nproc-per-node N` gives N ranks. A block's commands run in order in one scratch folder that
  holds `scripts/`, `tools/` and `benchmarks/`. Other lines (`make ...`) are not run.
- A block whose first line is `# needs CUDA: REASON` is not run: the test is skipped with that
  reason, after compiling a Python block or checking that a shell block's scripts exist.
Other blocks (```text, plain ```) are not examples.

To stay cheap, one subprocess imports torch and megatron-core once and forks a fresh process
per rank of each example; an example sees a process with nothing initialised.
"""

import json
import pathlib
import re
import shlex
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MAX_README_LINES = 300
CUDA_MARK = "# needs CUDA:"
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _examples() -> list[dict]:
    found = []
    for page in PAGES:
        text = page.read_text()
        for number, match in enumerate(FENCE.finditer(text)):
            language, body = match.group(1), match.group(2)
            if language not in ("python", "bash"):
                continue
            first = body.splitlines()[0] if body.strip() else ""
            line = text[: match.start()].count("\n") + 1
            found.append({"id": f"{page.relative_to(ROOT)}:{line}", "language": language, "code": body,
                          "cuda": first[len(CUDA_MARK):].strip() if first.startswith(CUDA_MARK) else None})
    return found


def _commands(code: str) -> list[list[str]]:
    """The shell commands of a block that start with python or torchrun, as argv lists."""
    commands = []
    for line in code.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if words and (words[0] in ("python", "torchrun") or words[0].endswith("/python")):
            commands.append(words)
    return commands


EXAMPLES = _examples()


def test_readme_is_at_most_300_lines() -> None:
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; move reference material to docs/."


def test_relative_links_resolve() -> None:
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken


RUNNER = textwrap.dedent(r'''
    import json, os, runpy, shlex, sys, tempfile, time, traceback
    import torch, torch.distributed, megatron.core.parallel_state, megatron.core.models.gpt  # paid once
    from tests.ports import free_port  # the runner starts in the repository's root
    root, examples = sys.argv[1], json.loads(sys.stdin.read())

    def ranks_of(words):
        for i, word in enumerate(words):
            if word.startswith("--nproc-per-node"):
                return int(word.split("=")[1] if "=" in word else words[i + 1])
        return 1

    def script_and_args(words):  # `python X.py ...` or `torchrun [--opts] X.py ...`
        if words[0] != "torchrun":
            return words[1], words[2:]
        i = 1
        while words[i].startswith("--"):
            i += 1 if "=" in words[i] or words[i] == "--standalone" else 2
        return words[i], words[i + 1:]

    def run(ranks, body, timeout=300):
        port, children = free_port(), []
        for rank in range(ranks):
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    if ranks > 1:
                        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                                          LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks))
                    body()
                    code = 0
                except SystemExit as error:
                    code = error.code if isinstance(error.code, int) else (0 if error.code is None else 1)
                except BaseException:
                    traceback.print_exc()
                finally:
                    sys.stdout.flush(); sys.stderr.flush()
                    os._exit(code)
            children.append(pid)
        deadline, codes = time.time() + timeout, []
        for pid in children:
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes.append(os.waitstatus_to_exitcode(status)); break
                if time.time() > deadline:
                    for other in children:
                        try: os.kill(other, 9)
                        except ProcessLookupError: pass
                    codes.append("timeout"); break
                time.sleep(0.05)
        return codes

    results = {}
    for example in examples:
        start = time.time()
        with tempfile.TemporaryDirectory() as scratch:
            for name in ("scripts", "tools", "benchmarks"):
                os.symlink(os.path.join(root, name), os.path.join(scratch, name))
            os.chdir(scratch)
            if example["language"] == "python":
                code = example["code"].replace("29500", str(free_port()))
                first = code.splitlines()[0]
                ranks = ranks_of(shlex.split(first[1:])) if first.startswith("# torchrun") else 1
                body = lambda: exec(compile(code, example["id"], "exec"), {"__name__": "__main__"})
                codes = run(ranks, body)
            else:
                codes = []
                for words in example["commands"]:
                    script, args = script_and_args(words)
                    def body(script=script, args=args):
                        if script == "-c":  # python -c CODE
                            sys.argv = ["-c", *args[1:]]
                            exec(compile(args[0], "<string>", "exec"), {"__name__": "__main__"})
                            return
                        sys.argv = [script, *args]
                        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python X.py`
                        runpy.run_path(script, run_name="__main__")
                    codes = run(ranks_of(words), body)
                    if any(codes):
                        break
            os.chdir(root)
        results[example["id"]] = {"codes": codes, "seconds": round(time.time() - start, 1)}
        print(f"{example['id']}: {codes} in {results[example['id']]['seconds']} s", file=sys.stderr, flush=True)
    print("RESULTS " + json.dumps(results))
''')


@pytest.fixture(scope="module")
def example_results() -> dict:
    runnable = []
    for example in EXAMPLES:
        if example["cuda"] is None:
            runnable.append({**example, "commands": _commands(example["code"]) if example["language"] == "bash" else []})
    result = subprocess.run([sys.executable, "-c", RUNNER, str(ROOT)], input=json.dumps(runnable), cwd=ROOT,
                            capture_output=True, text=True, timeout=900)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULTS ")]
    assert lines, result.stdout[-3000:] + result.stderr[-6000:]
    return {"results": json.loads(lines[-1][len("RESULTS "):]), "log": result.stdout[-4000:] + result.stderr[-8000:]}


@pytest.mark.parametrize("example", EXAMPLES, ids=[example["id"] for example in EXAMPLES])
def test_example_runs(example: dict, example_results: dict) -> None:
    if example["cuda"] is not None:
        if example["language"] == "python":
            compile(example["code"], example["id"], "exec")
        for words in _commands(example["code"]):
            scripts = [word for word in words if word.endswith(".py")]
            assert scripts and all((ROOT / script).exists() for script in scripts), words
        pytest.skip(f"needs CUDA: {example['cuda']}")
    outcome = example_results["results"][example["id"]]
    assert outcome["codes"] and all(code == 0 for code in outcome["codes"]), example_results["log"]


def test_readme_has_a_library_example_and_a_trainer_example() -> None:
    ids = [example["id"] for example in EXAMPLES if example["id"].startswith("README.md")]
    languages = {example["language"] for example in EXAMPLES if example["id"] in ids}
    assert languages == {"python", "bash"}, ids


# ---------------------------------------------------------------- facts the pages state, checked against the code


def test_recommended_muon_momentum_is_the_command_lines_default() -> None:
    """The recommended Muon command lines (README, docs/convergence.md) give the momentum the command
    lines default to, which the README says to keep (they said 0.95 while the text said keep 0.9)."""
    import argparse

    from arguments import add_optimizer_args

    default = add_optimizer_args(argparse.ArgumentParser()).get_default("muon_momentum")
    recommended = [(page.name, float(value)) for page in (ROOT / "README.md", ROOT / "docs" / "convergence.md")
                   for language, body in FENCE.findall(page.read_text()) if language == "text" and "--optimizer muon" in body
                   for value in re.findall(r"--muon-momentum (\S+)", body)]
    assert {page for page, _ in recommended} == {"README.md", "convergence.md"}, recommended
    assert all(value == default for _, value in recommended), (default, recommended)
    assert f"so keep {default}" in (ROOT / "README.md").read_text()


def _library_page_section(begin: str, end: str) -> str:
    text = (ROOT / "docs" / "library.md").read_text()
    return text.split(begin, 1)[1].split(end, 1)[0]


def test_library_page_gives_every_default_that_differs_between_config_and_command_lines() -> None:
    """docs/library.md's table: exactly the fields whose OptimizerConfig() default differs from the command
    lines', each with both values, where the command lines are our parser and Megatron-LM's with ours."""
    import argparse
    import dataclasses

    from arguments import add_optimizer_args
    from arguments.optimizer_args import FLAGS, _flag_value
    from megatron_eopt.config.choices import plain_value
    from megatron_eopt.config.optimizer_config import OptimizerConfig
    from megatron_eopt.integrations.megatron_lm import _parser_defaults_with_ours

    ours = add_optimizer_args(argparse.ArgumentParser())
    library = {field.name: plain_value(_flag_value(field.default)) for field in dataclasses.fields(OptimizerConfig)}
    differing = {flag.dest: (library[flag.dest], ours.get_default(flag.dest)) for flag in FLAGS
                 if flag.type is not None and not flag.hardware_default and library[flag.dest] != ours.get_default(flag.dest)}
    table = _library_page_section("<!-- defaults that differ: begin -->", "<!-- defaults that differ: end -->")
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in table.strip().splitlines()[2:]]
    stated = {re.match(r"`(\w+)`", field).group(1): (float(config), float(command_lines))
              for field, config, command_lines in rows}
    assert stated == differing, (stated, differing)
    megatron_lm = _parser_defaults_with_ours()
    assert {name: megatron_lm[name] for name in stated} == {name: values[1] for name, values in stated.items()}


def _refuses(call) -> bool:
    try:
        call()
    except ValueError:
        return True
    return False


def _build_and_step(**fields) -> None:
    from megatron_eopt import OptimizerConfig, get_megatron_optimizer
    from tests.small_model import small_model, step_on_random_grads

    config = OptimizerConfig(lr=1e-3, **fields)
    model = small_model(config)
    step_on_random_grads(model, get_megatron_optimizer(config, [model]), seed=1)


def _tensor_parallel_refused_where_the_table_says_no() -> None:
    """ValueError (refused, as the page says) when the flag checks refuse TP=2 for every optimizer the
    registry (the README's table) marks `no` there."""
    import argparse

    from arguments import add_optimizer_args, validate_args
    from megatron_eopt.registry import list_optimizers, optimizers_supporting

    parser = add_optimizer_args(argparse.ArgumentParser())
    unsupported = sorted(set(list_optimizers()) - set(optimizers_supporting("tensor_parallel")))
    refused = [name for name in unsupported
               if _refuses(lambda: validate_args(parser.parse_args(["--optimizer", name]), tensor_model_parallel_size=2))]
    if unsupported and refused == unsupported:
        raise ValueError(f"refused at TP=2: {refused}")


# What docs/library.md may call refused or not implemented, each with a call that must raise ValueError.
REFUSED = {
    "fp8 optimizer state": lambda: _build_and_step(use_precision_aware_optimizer=True, exp_avg_dtype=__import__("torch").uint8),
    "optimizer CUDA graphs": lambda: _build_and_step(optimizer_cuda_graph=True),
    "fp16 with emerging optimizers": lambda: _build_and_step(optimizer="muon", fp16=True),
    "tensor parallelism for the optimizers marked `no` in the README's support table": _tensor_parallel_refused_where_the_table_says_no,
}
# What it must not call so: features that work (the page once listed CPU offloading as refused).
WORKING = {
    "CPU offloading": lambda: _build_and_step(optimizer="muon", use_precision_aware_optimizer=True,
                                              optimizer_cpu_offload=True, optimizer_offload_fraction=0.5),
}


def test_library_page_calls_refused_only_what_is_refused() -> None:
    said = " ".join(_library_page_section("## Not implemented", "\n\n#").split())
    not_implemented = said.split("Each gives a clear error: ", 1)[1].split(". ", 1)[0]
    refused_fields = " ".join(_library_page_section("- Refused with an error: ", "\n").split()).rstrip(".")
    listed = [item for line in (not_implemented, refused_fields) for item in re.split(r", and |, | and ", line)]
    for item in listed:
        assert item not in WORKING, f"docs/library.md calls {item!r} refused, but it works"
        assert item in REFUSED, f"docs/library.md calls {item!r} refused: add how to check it to REFUSED"
        assert _refuses(REFUSED[item]), f"docs/library.md calls {item!r} refused, but it is not refused"
    for item, works in WORKING.items():
        assert not _refuses(works), item
