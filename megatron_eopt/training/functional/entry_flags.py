"""A case's command line through its entry's own parser and checks, before the launcher starts a run.

`pretrain_gpt.py`: the trainer's `parse_args` (its flags, their checks against each other and the
installed packages). `pretrain_gpt_megatron_lm.py`: Megatron-LM's `parse_args` with the script's
flags and `validate_args` as `install()` puts it in place. Both as rank 0 of the case's world, in
its ENV_VARS. Their one-line refusal (or assertion) becomes a ValueError naming the case; what
they print otherwise is dropped.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from typing import Iterator, Optional

from megatron_eopt.training.functional.cases import Case, RunPaths, case_argv


def check_case_flags(case: Case, paths: RunPaths, world_size: int) -> None:
    """Every run's command line of `case` as its entry would take it on `world_size` ranks; a
    ValueError with the entry's own message where the entry refuses it."""
    check = _check_trainer_flags if case.script == "pretrain_gpt.py" else _check_megatron_lm_flags
    for run in case.phases():
        argv = case_argv(case, paths, run)
        with _as_rank_zero(case, world_size, argv):
            refusal = _refusal(check, argv)
        if refusal is not None:
            raise ValueError(f"case {case.name!r}: {case.script} refuses its MODEL_ARGS "
                             f"({case.directory / 'model_config.yaml'}): {refusal}")


def _refusal(check, argv: list[str]) -> Optional[str]:
    """What `check(argv)` refuses, in one line; None when it takes the command line."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(stderr):
            check(argv)
    except SystemExit as exit_:  # the entry's own one-line error, printed on "rank 0"
        return _last_error(stderr.getvalue()) if exit_.code else None
    except (ValueError, AssertionError) as error:  # ours, or Megatron-LM's flag checks
        return " ".join(str(error).split())
    return None


def _last_error(stderr: str) -> str:
    """The entry's one line without its `PROG: error: ` (else the end of what it printed)."""
    lines = [line.split(": error: ", 1)[1] for line in stderr.splitlines() if ": error: " in line]
    return lines[-1] if lines else " ".join(stderr.split()[-40:]) or "(no message)"


@contextlib.contextmanager
def _as_rank_zero(case: Case, world_size: int, argv: list[str]) -> Iterator[None]:
    """This process as the first rank of the case's world (torchrun's variables, the case's ENV_VARS,
    sys.argv as the entry sees it); all restored after."""
    saved_environment, saved_argv = dict(os.environ), sys.argv
    os.environ.update(case.env_vars, WORLD_SIZE=str(world_size), RANK="0", LOCAL_RANK="0")
    sys.argv = [case.script, *argv]
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved_environment)
        sys.argv = saved_argv


def _check_trainer_flags(argv: list[str]) -> None:
    from megatron_eopt.training.arguments.parser import parse_args

    parse_args(argv)


def _check_megatron_lm_flags(argv: list[str]) -> None:
    """As the script runs them: megatron_lm_cpu's stand-ins without CUDA (validate_args asks for
    the GPU's architecture), and install()'s validate_args unless megatron-core's optimizer is asked for."""
    import megatron.training.arguments as megatron_lm_arguments

    from megatron_eopt.integrations import megatron_lm
    from megatron_eopt.integrations.megatron_lm_gpt import add_script_args
    from megatron_eopt.runtime import megatron_lm_cpu

    ours = "--megatron-core-optimizer" not in argv
    with megatron_lm_cpu.installed(), (megatron_lm.installed() if ours else contextlib.nullcontext()):
        args = megatron_lm_arguments.parse_args(extra_args_provider=add_script_args)
        megatron_lm_arguments.validate_args(args, {})
