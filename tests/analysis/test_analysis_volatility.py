"""Volatility by mu bucket against planted answers and a naive numpy reference."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from analysis_reference import naive_rows, row_of

from mismatch_lab.analysis import definitions as d
from mismatch_lab.analysis import quantiles
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
