"""The math of `mismatch-lab layers` (mismatch_lab/layers/metrics.py) against naive loops in plain Python."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mismatch_lab.layers import metrics


def naive_rel_err(h, ref) -> float:
    diff = sum((a - b) ** 2 for row_h, row_r in zip(h, ref) for a, b in zip(row_h, row_r))
    norm = sum(b ** 2 for row in ref for b in row)
    return math.sqrt(diff) / math.sqrt(norm)


def naive_tv_kl(logits, ref_logits):
    tvs, kls = [], []
    for row, ref_row in zip(logits, ref_logits):
        zp, zq = sum(math.exp(x) for x in row), sum(math.exp(x) for x in ref_row)
        p, q = [math.exp(x) / zp for x in row], [math.exp(x) / zq for x in ref_row]
        tvs.append(0.5 * sum(abs(a - b) for a, b in zip(p, q)))
        kls.append(sum(b * (math.log(b) - math.log(a)) for a, b in zip(p, q)))
    return tvs, kls


def test_rel_err_equals_the_naive_frobenius_ratio_to_float64_rounding():
    rng = np.random.default_rng(0)
    ref = rng.normal(size=(7, 5))
    h = ref + rng.normal(scale=1e-3, size=ref.shape)
    want = naive_rel_err(h.tolist(), ref.tolist())
    assert metrics.rel_err(h, ref) == pytest.approx(want, rel=64 * np.finfo(np.float64).eps)


def test_rel_err_pooled_over_sequences_is_the_ratio_of_the_summed_squares_not_a_mean_of_ratios():
    rng = np.random.default_rng(1)
    ref_a, ref_b = rng.normal(size=(3, 4)), 10 * rng.normal(size=(6, 4))
    h_a, h_b = ref_a + 0.1, ref_b + 0.1
    sums = [metrics.squared_norms(h_a, ref_a), metrics.squared_norms(h_b, ref_b)]
    pooled = metrics.rel_err_from_sums(sum(s[0] for s in sums), sum(s[1] for s in sums))
    stacked = naive_rel_err(np.vstack([h_a, h_b]).tolist(), np.vstack([ref_a, ref_b]).tolist())
    assert pooled == pytest.approx(stacked, rel=64 * np.finfo(np.float64).eps)
    assert pooled != pytest.approx((metrics.rel_err(h_a, ref_a) + metrics.rel_err(h_b, ref_b)) / 2, rel=1e-3)


def test_rel_err_of_identical_arrays_is_exactly_zero_and_of_a_zero_reference_is_nan():
    x = np.arange(12.0).reshape(3, 4)
    assert metrics.rel_err(x, x) == 0.0
    assert math.isnan(metrics.rel_err(x, np.zeros_like(x)))
    with pytest.raises(ValueError, match="shapes differ"):
        metrics.squared_norms(x, x[:2])


def test_token_tv_and_kl_equal_the_naive_softmax_sums_per_token():
    rng = np.random.default_rng(2)
    ref = rng.normal(scale=3.0, size=(4, 9))
    logits = ref + rng.normal(scale=0.2, size=ref.shape)
    tv, kl = metrics.token_tv_kl(logits, ref)
    want_tv, want_kl = naive_tv_kl(logits.tolist(), ref.tolist())
    assert tv.shape == kl.shape == (4,)
    np.testing.assert_allclose(tv, want_tv, rtol=1e-12)
    np.testing.assert_allclose(kl, want_kl, rtol=1e-9)


def test_token_tv_and_kl_of_equal_logits_are_exactly_zero_even_for_huge_logits():
    logits = np.array([[1000.0, -1000.0, 3.0], [0.0, 0.0, 0.0]])
    tv, kl = metrics.token_tv_kl(logits, logits.copy())
    assert tv.tolist() == [0.0, 0.0] and kl.tolist() == [0.0, 0.0]


def test_growth_ratios_divide_each_error_by_the_previous_and_skip_a_zero_previous():
    assert metrics.growth_ratios([0.0, 2.0, 4.0, 1.0]) == [None, None, 2.0, 0.25]
    assert metrics.growth_ratios([1.0, math.nan, 3.0]) == [None, None, None]


def test_fastest_growth_is_the_layer_with_the_largest_ratio_to_the_one_before():
    assert metrics.fastest_growth([1e-3, 2e-3, 2e-2, 3e-2]) == 2  # x10 beats x2 and x1.5
    assert metrics.fastest_growth([1.0, 3.0, 9.0]) == 1  # a tie: the first
    assert metrics.fastest_growth([0.0, 0.0, 0.0]) is None
