"""The closest of several allowed words to a mistyped one, for "did you mean ...?" in error messages.

Imports neither torch nor anything of megatron_eopt, so command-line errors can use it at once.
"""

import difflib
from typing import Iterable, Optional


def closest(word: str, candidates: Iterable[str]) -> Optional[str]:
    """The one candidate that `word` begins, else the most similar candidate, ignoring case;
    None when none is close."""
    lower = {candidate.lower(): candidate for candidate in candidates}
    starting = [candidate for candidate in lower if candidate.startswith(word.lower())]
    if len(starting) == 1:
        return lower[starting[0]]
    matches = difflib.get_close_matches(word.lower(), list(lower), n=1)
    return lower[matches[0]] if matches else None


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """'; did you mean X?' for the closest candidate, or '' when none is close."""
    guess = closest(word, candidates)
    return f"; did you mean {guess}?" if guess else ""
