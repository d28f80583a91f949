"""`recording_newton_schulz_calls()`: the input shape of every Newton-Schulz call made inside it
(megatron_eopt.ops.newton_schulz), for tests of what is batched into one call."""

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def recording_newton_schulz_calls() -> Iterator[list[tuple]]:
    from megatron_eopt.ops import newton_schulz

    calls: list[tuple] = []
    original = newton_schulz.NewtonSchulzSettings.orthogonalize

    def recording(self, x, **kwargs):
        calls.append(tuple(x.shape))
        return original(self, x, **kwargs)

    newton_schulz.NewtonSchulzSettings.orthogonalize = recording
    try:
        yield calls
    finally:
        newton_schulz.NewtonSchulzSettings.orthogonalize = original
