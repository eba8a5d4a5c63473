"""Precision, sequence drift and the scorer noise floor against a naive numpy reference."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from analysis_reference import naive_rows, naive_scorer_rows, row_of

from mismatch_lab.analysis.precision import (
    DRIFT_COLUMNS,
    PRECISION_COLUMNS,
    noise_floor,
    precision_table,
    sequence_drift,
)
from mismatch_lab.analysis.stats import t_quantile
from mismatch_lab.store.synthetic import write_store

REQUIRED = [
    "rollout", "scorer", "n_tokens", "n_nonfinite", "abs_dp_mean", "abs_dp_max", "abs_dlogp_mean",
    "abs_dlogp_max", "kl_k1", "kl_k2", "kl_k3", "chi2", "frac_ratio_outside_clip",
    "frac_abs_r_minus_1_gt_0_1", "frac_abs_dp_gt_0_5",
]  # fmt: skip


def test_precision_has_one_row_per_pair_with_the_required_columns(con):
    table = precision_table(con)
    assert set(REQUIRED) <= set(table.columns)
    pairs = set(zip(table["rollout"], table["scorer"]))
    assert pairs == {(r, s) for r in ("vllm:bf16", "vllm:fp16") for s in ("hf:fp32", "hf:bf16")}


def test_every_token_metric_matches_the_naive_reference(con, full_store):
    ref = naive_rows(full_store)
    table = precision_table(con)
    for (rollout, scorer), g in ref.groupby(["rollout", "scorer"]):
        got = row_of(table, rollout=rollout, scorer=scorer)
        ok = g[g["finite"]]
        assert got["n_tokens"] == len(g)
        assert got["n_nonfinite"] == (~g["finite"]).sum()
        assert got["n_finite"] == len(ok)
        expect = {
            "abs_dp_mean": ok["btv"].mean(), "abs_dp_max": ok["btv"].max(), "dp_mean": ok["dp"].mean(),
            "abs_dlogp_mean": ok["dlogp"].abs().mean(), "abs_dlogp_max": ok["dlogp"].abs().max(),
            "dlogp_mean": ok["dlogp"].mean(), "kl_k1": ok["k1"].mean(), "kl_k2": ok["k2"].mean(),
            "kl_k3": ok["k3"].mean(), "chi2": (ok["r"] ** 2).mean() - 1.0, "r_mean": ok["r"].mean(),
            "binary_kl_mean": ok["bkl"].mean(),
            "frac_ratio_outside_clip": ((ok["r"] < 0.8) | (ok["r"] > 1.28)).mean(),
            "frac_abs_r_minus_1_gt_0_1": ((ok["r"] - 1).abs() > 0.1).mean(),
            "frac_abs_dp_gt_0_5": (ok["btv"] > 0.5).mean(),
        }  # fmt: skip
        for k, v in expect.items():
            assert got[k] == pytest.approx(v, rel=1e-9, abs=1e-15), (rollout, scorer, k)


def test_the_planted_share_outside_the_clip_range_is_recovered_exactly(con, full_store):
    table = precision_table(con)
    n_planted = full_store.spec.n_planted  # per run; every scorer carries the same planted ratio
    for row in table.itertuples():
        assert row.frac_ratio_outside_clip * row.n_finite == pytest.approx(n_planted)
        assert row.n_nonfinite >= full_store.spec.n_nonfinite  # + the tokens whose log mu is NULL


def test_nonfinite_rows_are_counted_not_averaged(con, full_store):
    spec = full_store.spec
    table = precision_table(con)
    # n_nonfinite score rows per (run, scorer) plus n_rollout_nonfinite NULL log mu per run (chosen apart)
    assert (table["n_nonfinite"] == spec.n_nonfinite + spec.n_rollout_nonfinite).all()
    assert table[["abs_dp_mean", "kl_k3", "chi2"]].notna().all().all()


def test_filters_accept_a_label_a_list_and_run_ids(con, full_store):
    one = precision_table(con, rollout="vllm:bf16", scorer="hf:fp32")
    assert list(zip(one["rollout"], one["scorer"])) == [("vllm:bf16", "hf:fp32")]
    both = precision_table(con, scorer=["hf:fp32", "hf:bf16"], rollout=["vllm:fp16"])
    assert set(both["scorer"]) == {"hf:fp32", "hf:bf16"} and set(both["rollout"]) == {"vllm:fp16"}
    run = full_store.frames["runs"]["run_id"].iloc[0]
    by_run = precision_table(con, run_ids=[run])
    assert set(by_run["rollout"]) == {"vllm:bf16"}
    assert precision_table(con, rollout="sglang:bf16").empty


def test_custom_clip_range_changes_the_share_outside_it(con, full_store):
    ref = naive_rows(full_store)
    ok = ref[ref["finite"] & (ref["rollout"] == "vllm:bf16") & (ref["scorer"] == "hf:bf16")]
    got = row_of(precision_table(con, clip_low=0.99, clip_high=1.01), rollout="vllm:bf16", scorer="hf:bf16")
    assert got["frac_ratio_outside_clip"] == pytest.approx(((ok["r"] < 0.99) | (ok["r"] > 1.01)).mean())


def test_sequence_drift_sums_log_ratios_per_sequence_and_skips_nonfinite_ones(con, full_store):
    ref = naive_rows(full_store)
    drift = sequence_drift(con)
    assert list(drift.columns) == DRIFT_COLUMNS
    for (rollout, scorer, run_id, seq_id), g in ref.groupby(["rollout", "scorer", "run_id", "seq_id"]):
        got = row_of(drift, rollout=rollout, scorer=scorer, run_id=run_id, seq_id=seq_id)
        assert got["response_len"] == len(g)
        assert got["n_nonfinite"] == (~g["finite"]).sum()
        if g["finite"].all():
            assert got["logratio_sum"] == pytest.approx(g["dlogp"].sum(), abs=1e-12)
            assert got["seq_kl_k1"] == pytest.approx(g["k1"].sum(), abs=1e-12)
            assert got["seq_kl_k3"] == pytest.approx(g["k3"].sum(), abs=1e-12)
        else:
            assert pd.isna(got["logratio_sum"]) and pd.isna(got["seq_kl_k1"])


def test_one_token_sequences_are_sequences_of_length_one(con, full_store):
    drift = sequence_drift(con)
    pairs = drift.groupby(["rollout", "scorer"])
    # every pair holds the planted one-token sequences of its run
    assert all((g["response_len"] == 1).sum() >= full_store.spec.n_one_token for _, g in pairs)


def test_the_drift_slope_is_the_least_squares_fit_per_1k_tokens(con, full_store):
    drift = sequence_drift(con)
    table = precision_table(con)
    for (rollout, scorer), g in drift.groupby(["rollout", "scorer"]):
        ok = g[g["logratio_sum"].notna()]
        (slope, intercept), cov = np.polyfit(ok["response_len"].astype(float), ok["logratio_sum"].astype(float), 1,
                                             cov=True)  # cov scaled by the residual variance over n - 2
        got = row_of(table, rollout=rollout, scorer=scorer)
        assert got["seq_n"] == len(ok) and got["seq_n_nonfinite"] == len(g) - len(ok)
        assert got["seq_logratio_slope_per_1k"] == pytest.approx(1000 * slope, rel=1e-8)
        half = 1000 * t_quantile(0.975, len(ok) - 2) * np.sqrt(cov[0, 0])
        assert got["seq_logratio_slope_ci_low_per_1k"] == pytest.approx(1000 * slope - half, rel=1e-6)
        assert got["seq_logratio_slope_ci_high_per_1k"] == pytest.approx(1000 * slope + half, rel=1e-6)
        x, y = ok["response_len"].to_numpy(float), ok["logratio_sum"].to_numpy(float)
        rate = (x * y).sum() / (x * x).sum()  # the line through the origin
        half0 = 1000 * t_quantile(0.975, len(ok) - 1) * np.sqrt(((y - rate * x) ** 2).sum() / (len(ok) - 1) / (x * x).sum())
        assert got["seq_logratio_rate_per_1k"] == pytest.approx(1000 * rate, rel=1e-8)
        assert (got["seq_logratio_rate_ci_low_per_1k"], got["seq_logratio_rate_ci_high_per_1k"]) == pytest.approx(
            (1000 * rate - half0, 1000 * rate + half0), rel=1e-6)
        assert got["seq_logratio_intercept"] == pytest.approx(intercept, rel=1e-8, abs=1e-12)
        assert got["seq_kl_k1_mean"] == pytest.approx(ok["seq_kl_k1"].mean())
        assert got["seq_len_mean"] == pytest.approx(ok["response_len"].mean())


def test_a_planted_per_token_drift_gives_the_planted_slope(tmp_path):
    # every token of every sequence has log pi - log mu = -0.001: the sum is -1 per 1K tokens exactly
    lengths = [1, 10, 100, 400]
    tokens, scores, seqs = [], [], []
    for s, n in enumerate(lengths):
        seqs.append({"run_id": "r", "seq_id": s, "prompt_id": "p", "response_len": n})
        for p in range(n):
            tokens.append({"run_id": "r", "seq_id": s, "pos": p, "token_id": 1, "token_text": " a", "category": "word", "logp_rollout": -0.5})
            scores.append({"run_id": "r", "seq_id": s, "pos": p, "scorer": "hf:fp32", "logp": -0.501, "nonfinite": False})
    runs = pd.DataFrame([{"run_id": "r", "kind": "collect", "engine": "vllm", "engine_dtype": "bf16"}])
    path = write_store(tmp_path / "drift.duckdb", {"runs": runs, "sequences": pd.DataFrame(seqs),
                                                    "tokens": pd.DataFrame(tokens), "scores": pd.DataFrame(scores)})  # fmt: skip
    from mismatch_lab.store.reader import open_store

    row = precision_table(open_store(path)).iloc[0]
    assert row["seq_logratio_slope_per_1k"] == pytest.approx(-1.0, rel=1e-9)
    # a perfect fit: the interval collapses onto the slope
    assert row["seq_logratio_slope_ci_low_per_1k"] == pytest.approx(-1.0, rel=1e-6)
    assert row["seq_logratio_slope_ci_high_per_1k"] == pytest.approx(-1.0, rel=1e-6)
    assert row["seq_logratio_rate_per_1k"] == pytest.approx(-1.0, rel=1e-9)  # the drift starts at 0 too
    assert row["seq_logratio_intercept"] == pytest.approx(0.0, abs=1e-12)
    assert row["seq_kl_k1_mean"] == pytest.approx(0.001 * np.mean(lengths), rel=1e-9)


def test_noise_floor_compares_each_scorer_with_the_reference_on_the_same_tokens(con, full_store):
    ref = naive_scorer_rows(full_store)
    floor = noise_floor(con)
    assert set(floor["reference"]) == {"hf:fp32"} and set(floor["scorer"]) == {"hf:bf16"}
    for rollout, g in ref.groupby("rollout"):
        got = row_of(floor, rollout=rollout, scorer="hf:bf16")
        ok = g[g["finite"]]
        assert got["n_tokens"] == len(g) and got["n_finite"] == len(ok)
        assert got["abs_dp_mean"] == pytest.approx(ok["btv"].mean(), rel=1e-9)
        assert got["abs_dlogp_max"] == pytest.approx(ok["dlogp"].abs().max(), rel=1e-9)
        assert got["kl_k3"] == pytest.approx((ok["r"] - ok["dlogp"] - 1).mean(), rel=1e-9)


def test_a_store_without_the_tables_gives_empty_frames_with_the_columns(tmp_path):
    import duckdb

    con = duckdb.connect(str(tmp_path / "empty.duckdb"))
    assert list(precision_table(con).columns) == PRECISION_COLUMNS and precision_table(con).empty
    assert sequence_drift(con).empty and noise_floor(con).empty
