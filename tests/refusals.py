"""What a call that should refuse bad input raised, for tests to compare across ranks."""

from typing import Any, Callable


def error_of(call: Callable[[], Any]) -> tuple[str, str]:
    """(exception type name, message) of the TypeError/ValueError `call` raised, or ("none", "")."""
    try:
        call()
    except (TypeError, ValueError) as error:
        return type(error).__name__, str(error)
    return "none", ""


def assert_one_error_line(stderr: str, rank: int, program: str, message: str, where: Any) -> None:
    """A refused run's stderr on `rank`: on rank 0 one line, `program: error: ...` holding `message`
    (no traceback); on the other ranks no error line at all."""
    errors = [line for line in stderr.splitlines() if "error" in line.lower() or "Traceback" in line]
    if rank == 0:
        assert len(errors) == 1 and errors[0].startswith(f"{program}: error: "), (where, errors)
        assert message in errors[0], (where, errors)
    else:
        assert errors == [], (where, errors)
