"""Small statistics without scipy: the Student t quantile and an OLS slope with its t-interval.

    t_quantile(p, df)           the p-quantile of Student's t with integer df >= 1 (exact CDF; Newton steps on
                                its density, kept inside a bisection bracket: the CDF's finite sum costs O(df),
                                and 30,000 sequences took ~50 bisection steps, 60 ms, a fit)
    slope_ci(x, y, level=0.95)  ordinary least squares y = a + b x: b, its standard error and the
                                two-sided `level` t-interval b ± t_{(1+level)/2, n-2} · se(b)
    origin_slope_ci(x, y, ...)  the same for the line through the origin y = b x (no intercept):
                                b = Σxy / Σx², se(b)² = Σ(y − bx)² / (n − 1) / Σx², n − 1 degrees of freedom
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np


def _t_abs_cdf(t: float, df: int) -> float:
    """P(|T| < t) for Student's t with integer df (Abramowitz & Stegun 26.7.3-4, finite sums)."""
    theta = math.atan(t / math.sqrt(df))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if df % 2 == 0:
        term, total = 1.0, 1.0
        for k in range(2, df, 2):  # 1 + 1/2 c² + (1·3)/(2·4) c⁴ + ... up to c^(df-2)
            term *= c2 * (k - 1) / k
            total += term
        return s * total
    if df == 1:
        return 2.0 * theta / math.pi
    term, total = 1.0, 1.0
    for k in range(3, df, 2):  # 1 + 2/3 c² + (2·4)/(3·5) c⁴ + ... up to c^(df-3)
        term *= c2 * (k - 1) / k
        total += term
    return 2.0 / math.pi * (theta + s * math.cos(theta) * total)


def _t_density2(t: float, df: int) -> float:
    """d/dt P(|T| < t) = 2 f(t), f the density of Student's t with df degrees of freedom."""
    log_c = math.lgamma((df + 1) / 2.0) - math.lgamma(df / 2.0) - 0.5 * math.log(df * math.pi)
    return 2.0 * math.exp(log_c - (df + 1) / 2.0 * math.log1p(t * t / df))


@functools.lru_cache(maxsize=4096)
def t_quantile(p: float, df: int) -> float:
    """The p-quantile (0.5 < p < 1) of Student's t with `df` >= 1 degrees of freedom, to ~1e-13 relative where the
    CDF's finite sum is that exact (its rounding grows with df: a few 1e-11 at df 30,000 in the far tail): Newton
    steps on P(|T| < t) = 2p - 1 from the bracket's midpoint, each kept inside the bracket [lo, hi] the CDF's
    sign narrows (a step leaving it is a bisection step instead)."""
    if not 0.5 < p < 1.0 or df < 1:
        raise ValueError(f"t_quantile needs 0.5 < p < 1 and df >= 1, got p={p}, df={df}")
    target, lo, hi = 2.0 * p - 1.0, 0.0, 1.0
    while _t_abs_cdf(hi, df) < target:
        lo, hi = hi, 2.0 * hi
    t = 0.5 * (lo + hi)
    for _ in range(200):
        below = _t_abs_cdf(t, df) - target
        lo, hi = (t, hi) if below < 0 else (lo, t)
        step = t - below / _t_density2(t, df)
        step = step if lo < step < hi else 0.5 * (lo + hi)
        if abs(step - t) < 1e-13 * max(1.0, t) or hi - lo < 1e-13 * max(1.0, hi):
            return step
        t = step
    return t


@dataclass(frozen=True)
class SlopeFit:
    slope: float
    stderr: float
    ci_low: float
    ci_high: float
    n: int


def slope_ci(x, y, level: float = 0.95) -> SlopeFit:
    """OLS slope of y on x with its two-sided `level` t-interval (n - 2 degrees of freedom). Needs at
    least 3 points and two distinct x. With a perfect fit the interval collapses to the slope."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    n = len(x)
    if n < 3 or np.ptp(x) == 0:
        raise ValueError(f"a slope with a confidence interval needs 3 points and 2 distinct x, got n={n}")
    xc = x - x.mean()
    sxx = float((xc * xc).sum())
    slope = float((xc * (y - y.mean())).sum() / sxx)
    resid = y - (y.mean() + slope * xc)
    stderr = math.sqrt(float((resid * resid).sum()) / (n - 2) / sxx)
    half = t_quantile(0.5 + level / 2.0, n - 2) * stderr
    return SlopeFit(slope, stderr, slope - half, slope + half, n)


def origin_slope_ci(x, y, level: float = 0.95) -> SlopeFit:
    """OLS slope of y = b x (through the origin) with its two-sided `level` t-interval (n - 1 degrees of
    freedom). Needs at least 2 points and some x != 0."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    n = len(x)
    sxx = float((x * x).sum())
    if n < 2 or sxx == 0:
        raise ValueError(f"a slope through the origin with an interval needs 2 points and a non-zero x, got n={n}")
    slope = float((x * y).sum() / sxx)
    resid = y - slope * x
    stderr = math.sqrt(float((resid * resid).sum()) / (n - 1) / sxx)
    half = t_quantile(0.5 + level / 2.0, n - 1) * stderr
    return SlopeFit(slope, stderr, slope - half, slope + half, n)
