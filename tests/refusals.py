"""What a call that should refuse bad input raised, for tests to compare across ranks."""

from typing import Any, Callable


def error_of(call: Callable[[], Any]) -> tuple[str, str]:
    """(exception type name, message) of the TypeError/ValueError `call` raised, or ("none", "")."""
    try:
        call()
    except (TypeError, ValueError) as error:
        return type(error).__name__, str(error)
    return "none", ""
