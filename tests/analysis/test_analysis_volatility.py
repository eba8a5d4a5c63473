"""Volatility by mu bucket against planted answers and a naive numpy reference."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from analysis_reference import naive_rows, row_of

from mismatch_lab.analysis import browse, quantiles, volatility
from mismatch_lab.analysis import definitions as d
from mismatch_lab.analysis.rows import Rows
from mismatch_lab.analysis.volatility import VOLATILITY_COLUMNS, volatility_table
from mismatch_lab.store.reader import open_store
from mismatch_lab.store.synthetic import write_store


def _bucket(mu: np.ndarray, scale: str) -> np.ndarray:
    """Naive bucket index by searching the documented edges."""
    edges = d.bucket_edges(scale)
    out = np.empty(len(mu), dtype=int)
    for i, m in enumerate(mu):
        out[i] = next(j for j, (lo, hi) in enumerate(edges) if lo <= m < hi or (j == len(edges) - 1 and m <= hi))
    return out


@pytest.fixture()
def planted_con(tmp_path):
    """Bucket [0.1, 0.2): 10 tokens at mu = 0.15 with r = 1 + s, 1 - s alternately (s = 0.05);
    bucket [0.5, 0.6): 4 tokens with r = 1 exactly; bucket [0.9, 1]: one token; one token with NULL
    log mu; one score flagged non-finite in the first bucket."""
    s = 0.05
    mus = [0.15] * 10 + [0.55] * 4 + [0.95, None, 0.15]
    rs = [1 + s if i % 2 == 0 else 1 - s for i in range(10)] + [1.0] * 4 + [1.1, 1.0, 1.0]
    tokens, scores = [], []
    for p, (mu, r) in enumerate(zip(mus, rs)):
        lmu = math.log(mu) if mu is not None else None
        tokens.append({"run_id": "r", "seq_id": 0, "pos": p, "token_id": p, "token_text": " x", "category": "word", "logp_rollout": lmu})
        bad = p == len(mus) - 1
        lpi = None if (lmu is None or bad) else lmu + math.log(r)
        scores.append({"run_id": "r", "seq_id": 0, "pos": p, "scorer": "hf:fp32", "logp": lpi, "nonfinite": bad})
    runs = pd.DataFrame([{"run_id": "r", "kind": "collect", "engine": "vllm", "engine_dtype": "bf16"}])
    path = write_store(tmp_path / "vol.duckdb", {"runs": runs, "tokens": pd.DataFrame(tokens), "scores": pd.DataFrame(scores)})
    c = open_store(path)
    yield c, s
    c.close()


def test_the_planted_per_bucket_std_is_recovered(planted_con):
    con, s = planted_con
    table = volatility_table(con)
    b1 = row_of(table, bucket=1)
    assert b1["n_tokens"] == 10 and b1["n_nonfinite"] == 1
    assert b1["r_std"] == pytest.approx(s * math.sqrt(10 / 9), rel=1e-9)  # sample std of +-s
    assert b1["r_mean"] == pytest.approx(1.0, abs=1e-12)
    assert b1["frac_r_outside_eps"] == 0.0
    b5 = row_of(table, bucket=5)
    assert b5["r_std"] == pytest.approx(0.0, abs=1e-9) and b5["r_p50"] == pytest.approx(1.0)
    b9 = row_of(table, bucket=9)
    assert b9["n_tokens"] == 1 and pd.isna(b9["r_std"])  # one token has no sample std
    assert b9["r_p01"] == pytest.approx(1.1) and b9["bucket_label"] == "[0.9, 1]"


def test_every_bucket_is_listed_and_empty_ones_have_zero_counts(planted_con):
    con, _ = planted_con
    table = volatility_table(con)
    assert list(table.columns) == VOLATILITY_COLUMNS
    assert list(table["bucket"]) == [-1, *range(10)]
    empty = table[~table["bucket"].isin([-1, 1, 5, 9])]
    assert (empty["n_tokens"] == 0).all() and empty["r_mean"].isna().all()


def test_tokens_with_nonfinite_log_mu_get_their_own_row(planted_con):
    con, _ = planted_con
    bad = row_of(volatility_table(con), bucket=-1)
    assert bad["bucket_label"] == "mu non-finite" and bad["n_tokens"] == 0 and bad["n_nonfinite"] == 1


def test_log_buckets_reach_down_to_one_in_a_million(planted_con):
    con, _ = planted_con
    table = volatility_table(con, buckets="log")
    assert list(table["bucket"]) == [-1, *range(d.N_LOG_BUCKETS + 1)]
    assert row_of(table, bucket=0)["mu_hi"] == pytest.approx(1e-6)
    assert row_of(table, bucket=d.N_LOG_BUCKETS)["mu_hi"] == 1.0
    assert table["n_tokens"].sum() == 15  # every finite row lands in exactly one bucket


@pytest.mark.parametrize("path", ["live", "materialized, bracketed"])
def test_bucket_statistics_match_the_naive_reference(con, full_store, path, monkeypatch):
    """Both row sets; the second also with the quantiles' brackets placed from a small sample (analysis.
    quantiles keeps every value of a group with fewer sampled values than MIN_SAMPLE)."""
    rows = None
    if path != "live":
        monkeypatch.setattr(quantiles, "MIN_SAMPLE", 5)
        monkeypatch.setattr(quantiles, "SAMPLE_ROWS", 300)
        placed, real = [], quantiles._bracket
        monkeypatch.setattr(quantiles, "_bracket", lambda v, q: placed.append(real(v, q)) or placed[-1])
        rows = Rows(con, materialize=True)
    ref = naive_rows(full_store)
    ok = ref[ref["finite"]].copy()
    for scale in ("linear", "log"):
        table = volatility_table(con, buckets=scale, _rows=rows)
        ok["bucket"] = _bucket(ok["mu"].to_numpy(), scale)
        for (rollout, scorer, b), g in ok.groupby(["rollout", "scorer", "bucket"]):
            got = row_of(table, rollout=rollout, scorer=scorer, bucket=b)
            assert got["n_tokens"] == len(g)
            assert got["mu_mean"] == pytest.approx(g["mu"].mean(), rel=1e-9)
            assert got["r_mean"] == pytest.approx(g["r"].mean(), rel=1e-9)
            if len(g) > 1:
                assert got["r_std"] == pytest.approx(g["r"].std(ddof=1), rel=1e-6, abs=1e-12)
            qs = np.quantile(g["r"], d.RATIO_QUANTILES)
            assert [got[f"r_p{round(q * 100):02d}"] for q in d.RATIO_QUANTILES] == pytest.approx(qs, rel=1e-9)
            assert got["frac_r_outside_eps"] == pytest.approx(((g["r"] < 0.8) | (g["r"] > 1.28)).mean())
            assert got["binary_tv_mean"] == pytest.approx(g["btv"].mean(), rel=1e-9)
            assert got["binary_tv_p99"] == pytest.approx(np.quantile(g["btv"], 0.99), rel=1e-9)
            k = g["topk_tv"].dropna()
            assert got["n_topk"] == len(k)
            assert got["topk_tv_mean"] == pytest.approx(k.mean(), rel=1e-9)
            assert got["topk_tv_p99"] == pytest.approx(np.quantile(k, 0.99), rel=1e-9)
            ex = g["tv_exact_vs_ref"].dropna()
            assert got["n_exact"] == len(ex)
            assert got["tv_exact_vs_ref_mean"] == pytest.approx(ex.mean(), rel=1e-9, abs=1e-15)
        assert table["n_tokens"].sum() == len(ok)
    if path != "live":
        assert any(np.isfinite(a) for a, _ in placed), "no bracket was placed: the test would not test them"


def test_without_top_k_or_exact_tv_those_columns_are_empty(plain_con):
    table = volatility_table(plain_con)
    assert (table["n_topk"] == 0).all() and table["topk_tv_mean"].isna().all()
    assert (table["n_exact"] == 0).all() and table["tv_exact_vs_ref_mean"].isna().all()
    assert table["n_tokens"].sum() > 0


def test_an_unknown_bucket_scale_is_refused(con):
    with pytest.raises(ValueError, match="linear' or 'log"):
        volatility_table(con, buckets="quadratic")


# -- one pair's tables from its tokens (the app's Volatility page) ----------------------------------------

MEANS = ["mu_mean", "r_mean", "r_std", "binary_tv_mean", "topk_tv_mean", "tv_exact_vs_ref_mean"]
EPS = float(np.finfo(np.float64).eps)


def assert_same_table(got: pd.DataFrame, want: pd.DataFrame) -> None:
    """Every column and dtype bit for bit but the means and the std, which divide sums: DuckDB adds a sum's
    terms in no fixed order (two runs of volatility_table on the same 500,000 tokens differ in the last bit),
    so each side's sum of n terms carries up to n - 1 roundings of u = EPS / 2 of the sum of its |terms|.
    Hence: a mean of n non-negative terms within (n + 1) EPS relative; r_mean = 1 + sum(r - 1) / n within
    n EPS rms + 2 EPS r_mean absolute (sum |r - 1| <= n rms, rms = sqrt(mean (r - 1)^2)); the variance, a
    difference of two such sums over n - 1, within 4 n EPS rms^2, so the std within the smaller of its square
    root and it divided by the std."""
    assert list(got.columns) == list(want.columns) == VOLATILITY_COLUMNS
    exact = [c for c in VOLATILITY_COLUMNS if c not in MEANS]
    pd.testing.assert_frame_equal(got[exact], want[exact], check_exact=True)
    assert got[MEANS].dtypes.tolist() == want[MEANS].dtypes.tolist()
    n = want["n_tokens"].to_numpy(float)
    for c in ("mu_mean", "binary_tv_mean", "topk_tv_mean", "tv_exact_vs_ref_mean"):
        _close(got[c], want[c], (n + 1) * EPS * want[c].abs().to_numpy(), c)
    mean, std = want["r_mean"].to_numpy(float), want["r_std"].fillna(0).to_numpy(float)
    rms2 = np.where(n > 1, std**2 * (n - 1) / np.maximum(n, 1), 0) + (mean - 1) ** 2
    _close(got["r_mean"], want["r_mean"], n * EPS * np.sqrt(rms2) + 2 * EPS * np.abs(mean), "r_mean")
    dvar = 4 * n * EPS * rms2
    with np.errstate(divide="ignore", invalid="ignore"):
        _close(got["r_std"], want["r_std"], np.fmin(np.sqrt(dvar), dvar / std) + EPS * std, "r_std")


def _close(got: pd.Series, want: pd.Series, atol: np.ndarray, name: str) -> None:
    g, w = got.to_numpy(float), want.to_numpy(float)
    assert np.array_equal(np.isnan(g), np.isnan(w)), name
    ok = np.isnan(w) | (np.abs(g - w) <= atol)
    assert ok.all(), f"{name}: {g[~ok]} vs {w[~ok]} (allowed {atol[~ok]})"


SETTINGS = [("linear", None, 0.2, 0.28), ("linear", 4, 0.1, 0.28), ("linear", 40, 0.2, 0.05), ("log", None, 0.1, 0.28),
            ("log", 5, 0.2, 0.05)]  # fmt: skip


def test_a_pairs_table_from_its_tokens_is_the_volatility_table_at_every_bucketing(con, plain_con):
    """Every setting on a pair of the full store with top-K, exact TV, non-finite scores and rollout log-probs
    (the 'mu non-finite' row); one setting each on its other pairs and on the plain store's pair (neither
    top-K nor exact TV: pair_tokens keeps no such column)."""
    cases = []
    for c in (con, plain_con):
        pairs = browse.list_pairs(c)
        cases += [(c, rollout, scorer) for rollout, scorer in zip(pairs["rollout"], pairs["scorer"], strict=True)]
    first = (con, "vllm:bf16", "hf:bf16")
    cases.remove(first)
    kinds = set()
    for i, (c, rollout, scorer) in enumerate([first, *cases]):
        tokens = volatility.pair_tokens(c, rollout, scorer)
        for scale, n_buckets, eps_low, eps_high in SETTINGS if i == 0 else [SETTINGS[i % len(SETTINGS)]]:
            got = volatility.volatility_of_pair(tokens, scale, n_buckets, eps_low, eps_high)
            want = volatility_table(c, rollout=rollout, scorer=scorer, buckets=scale, n_buckets=n_buckets,
                                    eps_low=eps_low, eps_high=eps_high)
            assert_same_table(got, want)
            kinds.add((tuple(tokens.table.column_names), bool((want["bucket"] == -1).any()), i == 0))
    assert {names for names, _, _ in kinds} == {("lmu", "lpi", "finite", "topk_tv", "tv_exact"), ("lmu", "lpi", "finite")}
    assert (("lmu", "lpi", "finite", "topk_tv", "tv_exact"), True, True) in kinds


def test_a_pair_without_tokens_has_an_empty_table_as_the_volatility_table(con):
    tokens = volatility.pair_tokens(con, "sglang:fp8", "hf:fp32")
    assert tokens.table.num_rows == 0
    got = volatility.volatility_of_pair(tokens, "log", 6)
    want = volatility_table(con, rollout="sglang:fp8", scorer="hf:fp32", buckets="log", n_buckets=6)
    assert got.empty and want.empty and list(got.columns) == list(want.columns) == VOLATILITY_COLUMNS
