"""How the report states a figure that comes from samples and a ratio of two such figures.

A figure is the median of the pooled raw samples with its 95% interval and n
(``decodebench.stats.median_interval``), printed ``45.20 [44.80, 45.90] n=6`` in the figure's own unit
(the table's header names it). A ratio divides two medians and carries the interval from the samples of
both sides (``decodebench.stats.ratio_interval``), printed ``6.50x [6.00, 7.00] n=6/4`` (n of each side).
A ratio whose interval contains 1 is a difference nobody measured: it prints as "no measurable
difference" with its interval, never as a multiple. One that lies beyond 1 but closer to it than the
A/A noise floor of its environment (``reports.noise``) is marked "within the noise floor".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from decodebench.stats import Interval, differs, median_interval, ratio_interval

NO_DIFFERENCE = "no measurable difference"
WITHIN_FLOOR = "within the noise floor"
NO_INTERVAL = "[no interval]"  # fewer than two samples: no interval is made up


def decimals(digits: int) -> Callable[[float], str]:
    return lambda value: f"{value:.{digits}f}"


def bounds(interval: Interval, show: Callable[[float], str]) -> str:
    """``[low, high]`` in ``show``'s rounding, or ``[no interval]`` below two samples."""
    return f"[{show(interval.low)}, {show(interval.high)}]" if interval.known else NO_INTERVAL


def figure(interval: Interval, show: Callable[[float], str], unit: str = "") -> str:
    """``45.20 [44.80, 45.90] n=6``; with ``unit`` after the value: ``45.2 tok/s [44.8, 45.9] n=6``."""
    value = f"{show(interval.value)} {unit}".rstrip() if unit else show(interval.value)
    return f"{value} {bounds(interval, show)} n={interval.n}"


def shown(interval: Interval | None, digits: int = 2) -> str:
    """A sampled figure in a report table: ``–`` when nothing was measured (None, or pandas' NaN)."""
    return figure(interval, decimals(digits)) if isinstance(interval, Interval) else "–"


def scaled(interval: Interval, f: Callable[[float], float]) -> Interval:
    """``interval`` through a monotone ``f`` (bounds swapped when ``f`` decreases): a figure proportional
    or inversely proportional to a median has its interval at the median's bounds."""
    if not interval.known:
        return Interval(f(interval.value), None, None, interval.n)
    low, high = sorted((f(interval.low), f(interval.high)))
    return Interval(f(interval.value), low, high, interval.n)


def sampled(values: Sequence[float] | None) -> Interval | None:
    """The median of ``values`` with its 95% interval; None when there are none."""
    return median_interval(values) if values else None


@dataclass(frozen=True)
class Ratio:
    """median(top) / median(bottom) with its 95% interval; ``floor`` is the largest A/A spread (a fraction,
    e.g. 0.04 for 4%) measured in the environment of both sides, None when none was measured."""

    interval: Interval
    n_top: int
    n_bottom: int
    floor: float | None = None

    @property
    def value(self) -> float:
        return self.interval.value

    @property
    def differs(self) -> bool:
        """The whole interval lies on one side of 1 (``decodebench.stats.differs``)."""
        return differs(self.interval)

    @property
    def within_floor(self) -> bool:
        """A difference the interval shows, but no larger than the A/A spread of the same environment."""
        return self.differs and self.floor is not None and abs(self.value - 1) <= self.floor

    @property
    def measurable(self) -> bool:
        return self.differs and not self.within_floor

    def verdict(self) -> str:
        """``differs``, ``no measurable difference`` or ``within the noise floor``."""
        if not self.differs:
            return NO_DIFFERENCE
        return WITHIN_FLOOR if self.within_floor else "differs"

    def text(self) -> str:
        """``6.50x [6.00, 7.00] n=6/4``; ``no measurable difference [0.98, 1.15] n=6/4``; ``1.03x [1.01, 1.05]
        n=6/6, within the noise floor (A/A 4.0%)``."""
        show = decimals(2)
        n = f"n={self.n_top}/{self.n_bottom}"
        if not self.differs:
            return f"{NO_DIFFERENCE} {bounds(self.interval, show)} {n}"
        core = f"{show(self.value)}x {bounds(self.interval, show)} {n}"
        return f"{core}, {WITHIN_FLOOR} (A/A {self.floor:.1%})" if self.within_floor else core


def ratio(top: Sequence[float], bottom: Sequence[float], floor: float | None = None, paired: bool = False) -> Ratio:
    """The ratio of two sampled figures, unpaired unless the i-th samples of both sides belong together."""
    return Ratio(ratio_interval(top, bottom, paired=paired), len(top), len(bottom), floor)
