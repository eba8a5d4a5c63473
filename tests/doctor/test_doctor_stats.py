"""The slope's t-interval against a numpy reference, the t quantile against tabulated values, the verdict logic."""

from __future__ import annotations

import numpy as np
import pytest

from mismatch_lab.analysis.stats import slope_ci, t_quantile
from mismatch_lab.doctor import bands as B
from mismatch_lab.doctor.verdicts import gate_status, judge, worst


@pytest.mark.parametrize(("df", "t"), [(1, 12.7062), (2, 4.3027), (3, 3.1824), (4, 2.7764), (7, 2.3646),
                                       (10, 2.2281), (30, 2.0423), (120, 1.9799)])
def test_t_quantile_matches_the_table(df, t):
    assert t_quantile(0.975, df) == pytest.approx(t, abs=1e-4)


def test_slope_and_interval_equal_numpy(tmp_path):
    rng = np.random.default_rng(3)
    x = np.arange(12, dtype=float)
    y = 0.004 + 0.0007 * x + rng.normal(0, 0.001, size=12)
    fit = slope_ci(x, y)
    (slope, intercept), cov = np.polyfit(x, y, 1, cov="unscaled")
    resid = y - (intercept + slope * x)
    se = np.sqrt(cov[0, 0] * (resid @ resid) / (len(x) - 2))
    assert fit.slope == pytest.approx(slope, rel=1e-10) and fit.stderr == pytest.approx(se, rel=1e-10)
    assert (fit.ci_low, fit.ci_high) == pytest.approx((slope - 2.228139 * se, slope + 2.228139 * se), rel=1e-6)
    assert fit.ci_low > 0  # planted growth, 0.7 standard deviations of noise per step


def test_slope_needs_three_points_and_two_x():
    with pytest.raises(ValueError):
        slope_ci([0, 1], [0.0, 1.0])
    with pytest.raises(ValueError):
        slope_ci([2, 2, 2], [0.0, 1.0, 2.0])


@pytest.mark.parametrize(("value", "verdict"), [(0.0049, "ok"), (0.005, "warn"), (0.01, "warn"), (0.0101, "fail")])
def test_verl_band_edges(value, verdict):
    assert judge(value, B.ABS_DP) == verdict


@pytest.mark.parametrize(("band", "value", "verdict"), [
    (B.K3_KL, 0.015, "ok"), (B.K3_KL, 0.0151, "fail"), (B.BITWISE_EQUAL, 0.0, "ok"), (B.BITWISE_EQUAL, 1e-300, "fail"),
    (B.IS_WEIGHT_MEAN, 0.5, "ok"), (B.IS_WEIGHT_MEAN, 0.49, "warn"), (B.IS_WEIGHT_MEAN, 2.01, "warn"),
    (B.ESS, 0.3, "ok"), (B.ESS, 0.29, "warn"), (B.CHI2, 1.0, "ok"), (B.CHI2, 1.01, "warn"),
])
def test_band_kinds(band, value, verdict):
    assert judge(value, band) == verdict


def test_missing_values_are_not_judged():
    with pytest.raises(ValueError):
        judge(float("nan"), B.ABS_DP)


def test_gate_fails_only_on_its_own_failing_checks():
    rows = [{"gates": ["verl"], "verdict": "warn"}, {"gates": ["slime"], "verdict": "fail"}, {"gates": [], "verdict": "fail"}]
    assert gate_status(rows, "verl") == (0, [])
    assert gate_status(rows, "slime") == (1, [rows[1]])
    assert gate_status(rows, None) == (0, [])
    assert worst(["ok", "fail", "warn"]) == "fail" and worst([]) == "ok"


def test_the_slope_through_the_origin_equals_least_squares_without_an_intercept():
    from mismatch_lab.analysis.stats import origin_slope_ci

    rng = np.random.default_rng(3)
    x = rng.uniform(100, 1000, 40)
    y = -0.001 * x + rng.normal(0, 0.2, 40)
    (b,), res, *_ = np.linalg.lstsq(x[:, None], y, rcond=None)
    se = np.sqrt(res[0] / (len(x) - 1) / (x * x).sum())
    fit = origin_slope_ci(x, y)
    half = t_quantile(0.975, len(x) - 1) * se
    assert fit.slope == pytest.approx(b, rel=1e-12) and fit.stderr == pytest.approx(se, rel=1e-9)
    assert (fit.ci_low, fit.ci_high) == pytest.approx((b - half, b + half), rel=1e-9)
    assert fit.ci_low < -0.001 < fit.ci_high  # covers the planted rate
    with pytest.raises(ValueError, match="2 points"):
        origin_slope_ci([5.0], [1.0])


def _bisected_t_quantile(p: float, df: int) -> float:
    """The naive reference: bisection on the exact CDF to 1e-13 of the bracket."""
    from mismatch_lab.analysis.stats import _t_abs_cdf

    target, lo, hi = 2.0 * p - 1.0, 0.0, 1.0
    while _t_abs_cdf(hi, df) < target:
        hi *= 2.0
    while hi - lo >= 1e-13 * max(1.0, hi):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if _t_abs_cdf(mid, df) < target else (lo, mid)
    return 0.5 * (lo + hi)


@pytest.mark.parametrize("p", [0.55, 0.9, 0.975, 0.995, 0.9999])
@pytest.mark.parametrize("df", [1, 2, 3, 4, 5, 7, 10, 29, 30, 120, 999, 3200])
def test_t_quantile_equals_bisection(p, df):
    # Newton steps land where the bisection does, to the CDF's own rounding (its finite sum of df / 2 terms)
    assert t_quantile.__wrapped__(p, df) == pytest.approx(_bisected_t_quantile(p, df), rel=1e-11)
