"""The one percentile definition of every benchmark and of the demo.

**Nearest rank**: the ``q``-th percentile (``q`` in percent, 0 < q <= 100) of
``n`` values is the ``ceil(n * q / 100)``-th smallest of them (1-based). It is
always one of the measured values (never an interpolation), p100 is the
maximum, and p50 of an even count is the lower of the two middle values.
``docs/benchmarks.md`` states the same; once five functions had
five definitions (one took a fraction and ranked one higher), so figures were
not comparable.

Here, not in ``bench/``, because the demo (part of the package) reports
percentiles too and may not import the benches; ``bench/stats.py`` re-exports it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

__all__ = ["percentile", "percentiles"]


def percentile(values: Iterable[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile of ``values`` (``q`` in percent).

    Raises:
        ValueError: ``values`` is empty, or ``q`` is outside (0, 100]
            (a fraction such as 0.95 is refused: it would read as p0.95).
    """
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of no values")
    if not 0 < q <= 100:
        raise ValueError(f"q is a percentage in (0, 100], not {q}")
    # round() first: 0.95 * 100 style float noise must not push the rank up one.
    rank = math.ceil(round(len(ordered) * q / 100, 9))
    return ordered[max(1, rank) - 1]


def percentiles(values: Iterable[float], qs: Iterable[float]) -> dict[float, float]:
    """``{q: percentile(values, q)}``, sorting once."""
    ordered = sorted(values)
    return {q: percentile(ordered, q) for q in qs}
