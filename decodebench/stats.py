"""Uncertainty of repeated measurements: a 95% confidence interval for a median, and for a ratio of two.

Both are bootstrap intervals from ``scipy.stats.bootstrap`` (percentile method: BCa needs more repeats
than a benchmark usually has, and degenerates at n = 2), with a fixed seed so the same samples always
give the same interval. A ratio's interval resamples both sides: together (``paired``, the i-th sample
of one side taken with the i-th of the other, as the two calls of one repeat pair are) or independently.
With fewer than two samples on a side there is no interval (None), never a made-up one.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

CONFIDENCE = 0.95
RESAMPLES = 2000
SEED = 20261130


@dataclass(frozen=True)
class Interval:
    """A central value with its 95% confidence interval (None when there are too few samples)."""

    value: float
    low: float | None
    high: float | None
    n: int

    @property
    def known(self) -> bool:
        return self.low is not None and self.high is not None

    def contains(self, x: float) -> bool:
        """Whether ``x`` lies inside the interval (an unknown interval contains everything)."""
        return not self.known or self.low <= x <= self.high


def _median(*samples: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.median(samples[0], axis=axis)


def median_interval(values: Sequence[float]) -> Interval:
    """The median of ``values`` with a bootstrap 95% interval (none below two values)."""
    data = np.asarray(values, dtype=float)
    center = float(statistics.median(data))
    if len(data) < 2 or np.ptp(data) == 0:
        same = center if len(data) >= 2 else None
        return Interval(center, same, same, len(data))
    res = stats.bootstrap((data,), _median, confidence_level=CONFIDENCE, n_resamples=RESAMPLES, method="percentile",
                          vectorized=True, random_state=np.random.default_rng(SEED))  # fmt: skip
    return Interval(center, float(res.confidence_interval.low), float(res.confidence_interval.high), len(data))


def _ratio(top: np.ndarray, bottom: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.median(top, axis=axis) / np.median(bottom, axis=axis)


def ratio_interval(top: Sequence[float], bottom: Sequence[float], *, paired: bool = False) -> Interval:
    """median(top) / median(bottom) with a bootstrap 95% interval from the samples of both sides."""
    a, b = np.asarray(top, dtype=float), np.asarray(bottom, dtype=float)
    center = float(statistics.median(a) / statistics.median(b))
    if paired and len(a) != len(b):
        raise ValueError(f"a paired ratio needs as many samples on each side ({len(a)} against {len(b)})")
    if min(len(a), len(b)) < 2:
        return Interval(center, None, None, min(len(a), len(b)))
    if np.ptp(a) == 0 and np.ptp(b) == 0:
        return Interval(center, center, center, min(len(a), len(b)))
    res = stats.bootstrap((a, b), _ratio, paired=paired, confidence_level=CONFIDENCE, n_resamples=RESAMPLES,
                          method="percentile", vectorized=True, random_state=np.random.default_rng(SEED))  # fmt: skip
    low, high = float(res.confidence_interval.low), float(res.confidence_interval.high)
    return Interval(center, low, high, min(len(a), len(b)))


def differs(ratio: Interval) -> bool:
    """A ratio is a measurable difference only when its whole interval lies on one side of 1."""
    return ratio.known and not ratio.contains(1.0)
