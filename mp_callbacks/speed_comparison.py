"""`SpeedComparison`: is one way of training faster than another, given noise?

Timings on a shared machine drift: a slow spell can hit one run and not
the other, and identical epochs vary by 30 %. So speed is compared round by
round: in each round both contenders run, close together in time, and the
round gives one ratio (baseline time / candidate time). The verdict is read
from the spread of those ratios, never from one number:

* "faster": the spread of the ratios lies above 1 and the median reaches
  `min_speedup` (clearly worth switching for);
* "slower": the spread lies below 1;
* "tie": anything else. A tie is reported as a tie.

The spread is the middle half of the ratios (25th to 75th percentile) once
there are five rounds or more, and all of them (smallest to largest) below
that, where quartiles would claim a precision two or three rounds do not
have.

`mp.autotune` and `mp-callbacks bench` both decide by this rule.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = ["MIN_SPEEDUP", "SpeedComparison"]

#: The median speed-up a faster candidate must reach to be worth using.
MIN_SPEEDUP = 1.1


@dataclass
class SpeedComparison:
    """The paired ratios of one candidate against a baseline.

    Args:
        ratios: one per round, baseline time / candidate time (above 1:
            the candidate was faster in that round).
        min_speedup: the median a "faster" verdict needs. Defaults to
            `MIN_SPEEDUP` (1.1).

    Example:

    ```python
    from mp_callbacks import SpeedComparison

    print(SpeedComparison([1.31, 1.28, 1.35, 1.30, 1.29]).verdict)  # faster
    print(SpeedComparison([0.94, 1.47]).verdict)  # tie
    ```
    """

    ratios: Sequence[float]
    min_speedup: float = MIN_SPEEDUP
    _values: list[float] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._values = [float(r) for r in self.ratios if r is not None and np.isfinite(r) and r > 0]

    @property
    def rounds(self) -> int:
        return len(self._values)

    @property
    def median(self) -> float | None:
        return statistics.median(self._values) if self._values else None

    @property
    def quartiles(self) -> tuple[float, float] | None:
        """The spread: the 25th and 75th percentiles of the ratios, or
        their smallest and largest under five rounds."""
        if not self._values:
            return None
        if len(self._values) < 5:
            return min(self._values), max(self._values)
        low, high = np.percentile(self._values, [25, 75])
        return float(low), float(high)

    @property
    def verdict(self) -> str:
        """ "faster", "slower" or "tie" (also with fewer than two rounds)."""
        if self.rounds < 2:
            return "tie"
        low, high = self.quartiles  # type: ignore[misc]
        if low > 1.0 and self.median >= self.min_speedup:  # type: ignore[operator]
            return "faster"
        if high < 1.0:
            return "slower"
        return "tie"

    @property
    def decided(self) -> bool:
        """True when more rounds are unlikely to change the verdict: the
        spread lies clear of 1 (and, if faster, of `min_speedup`)."""
        if self.rounds < 2:
            return False
        low, high = self.quartiles  # type: ignore[misc]
        return low >= self.min_speedup or high < 1.0

    def describe(self) -> str:
        if not self._values:
            return "not measured"
        low, high = self.quartiles  # type: ignore[misc]
        what = "middle half" if self.rounds >= 5 else "range"
        return f"{self.median:.2f}x ({what} of {self.rounds} paired rounds: {low:.2f}-{high:.2f})"
