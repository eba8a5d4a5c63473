"""Negative-sample violations, the training-run series, and the approximation quality."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from analysis_reference import naive_rows, naive_scorer_rows, row_of

from mismatch_lab.analysis.approximation import (
    APPROXIMATION_COLUMNS,
    approximation_table,
)
from mismatch_lab.analysis.violations import (
    SERIES_COLUMNS,
    VIOLATION_COLUMNS,
    train_series,
    violations_table,
)
from mismatch_lab.store.reader import open_store
from mismatch_lab.store.synthetic import TRAIN_SERIES, SyntheticSpec, synthetic_store


def test_violation_shares_match_the_naive_reference_by_sign_and_direction(con, full_store):
    ref = naive_rows(full_store)
    table = violations_table(con)
    assert list(table.columns) == VIOLATION_COLUMNS
    signed = ref[ref["adv_sign"].notna()]
    for (rollout, scorer, sign), g in signed.groupby(["rollout", "scorer", "adv_sign"]):
        got = row_of(table, rollout=rollout, scorer=scorer, adv_sign=sign)
        ok = g[g["finite"]]
        out, down, up = ok["btv"] > 0.15, (ok["r"] < 1) & (ok["btv"] > 0.15), (ok["r"] > 1) & (ok["btv"] > 0.15)
        toward = down if sign == "negative" else up
        kl_dir = (ok["r"] < 1 if sign == "negative" else ok["r"] > 1) & (ok["bkl"] > 0.05)
        ratio = ok["r"] < 0.8 if sign == "negative" else ok["r"] > 1.28
        assert got["n_sequences"] == g["seq_id"].groupby(g["run_id"]).nunique().sum()
        assert got["n_tokens"] == len(ok) and got["n_nonfinite"] == len(g) - len(ok)
        for k, v in {"frac_tv_outside": out, "frac_tv_outside_down": down, "frac_tv_outside_up": up,
                     "frac_tv_violation": toward, "frac_kl_violation": kl_dir, "frac_ratio_violation": ratio}.items():  # fmt: skip
            assert got[k] == pytest.approx(v.mean(), rel=1e-12, abs=1e-15), (rollout, scorer, sign, k)


def test_planted_moves_are_counted_in_their_direction(con, full_store):
    planted = full_store.planted
    seqs = full_store.frames["sequences"]
    adv = seqs.set_index(["run_id", "seq_id"])["advantage"]
    planted = planted.assign(a=[adv[(r, s)] for r, s in zip(planted["run_id"], planted["seq_id"])])
    table = violations_table(con, scorer="hf:fp32")
    runs = full_store.frames["runs"].set_index("run_id")
    for sign, cond in (("negative", planted["a"] < 0), ("positive", planted["a"] > 0)):
        for rollout in ("vllm:bf16", "vllm:fp16"):
            run = runs.index[(runs["engine"] + ":" + runs["engine_dtype"]) == rollout][0]
            p = planted[cond & (planted["run_id"] == run)]
            got = row_of(table, rollout=rollout, scorer="hf:fp32", adv_sign=sign)
            # planted f = 0.5 moves pi down, f = 1.5 up, both beyond delta; nothing else leaves the region
            assert got["frac_tv_outside_down"] * got["n_tokens"] == pytest.approx((p["factor"] == 0.5).sum())
            assert got["frac_tv_outside_up"] * got["n_tokens"] == pytest.approx((p["factor"] == 1.5).sum())


def test_advantages_are_derived_from_rewards_when_only_rewards_are_stored(tmp_path):
    spec = SyntheticSpec(n_sequences=16, rewards="reward", n_planted=4, seed=5)
    store = synthetic_store(tmp_path / "rewards.duckdb", spec)
    assert "advantage" not in store.frames["sequences"]  # the store holds rewards only
    ref = naive_rows(store)
    con = open_store(store.path)
    table = violations_table(con)
    for sign, g in ref[ref["adv_sign"].notna()].groupby("adv_sign"):
        got = row_of(table, adv_sign=sign)
        assert got["n_tokens"] == g["finite"].sum()
        assert got["n_sequences"] == g["seq_id"].nunique()


def test_without_rewards_violations_are_empty_with_their_columns(plain_con):
    table = violations_table(plain_con)
    assert table.empty and list(table.columns) == VIOLATION_COLUMNS


def test_train_series_returns_every_logged_value_in_long_form(con, full_store):
    series = train_series(con)
    assert list(series.columns) == SERIES_COLUMNS
    steps = np.arange(full_store.spec.train_steps)
    for name, fn in TRAIN_SERIES.items():
        got = series[series["name"] == name].sort_values("step")
        assert list(got["step"]) == list(steps)
        assert got["value"].to_numpy() == pytest.approx(fn(steps))
    assert train_series(con, run_id="no-such-run").empty
    assert len(train_series(con, run_id="synthetic-train")) == len(series)


def test_without_train_metrics_the_series_is_empty(plain_con):
    assert train_series(plain_con).empty


def test_approximation_quality_matches_the_naive_reference(con, full_store):
    ref = naive_scorer_rows(full_store)
    table = approximation_table(con)
    assert list(table.columns) == APPROXIMATION_COLUMNS
    for rollout, g in ref.groupby("rollout"):
        got = row_of(table, rollout=rollout, scorer="hf:bf16", reference="hf:fp32")
        ok = g[g["finite"] & g["tv_exact_vs_ref"].notna()]
        ex, b = ok["tv_exact_vs_ref"], ok["btv"]
        assert got["n_tokens"] == len(g) and got["n_exact"] == len(ok)
        assert got["exact_tv_mean"] == pytest.approx(ex.mean(), rel=1e-9)
        assert got["binary_tv_corr"] == pytest.approx(np.corrcoef(b, ex)[0, 1], rel=1e-6)
        assert got["binary_tv_mae"] == pytest.approx((b - ex).abs().mean(), rel=1e-9)
        assert got["binary_tv_agree"] == pytest.approx(((b > 0.15) == (ex > 0.15)).mean())
        k = ok[ok["topk_tv"].notna()]
        assert got["n_topk_exact"] == len(k)
        assert got["topk_tv_corr"] == pytest.approx(np.corrcoef(k["topk_tv"], k["tv_exact_vs_ref"])[0, 1], rel=1e-6)
        assert got["topk_tv_mae"] == pytest.approx((k["topk_tv"] - k["tv_exact_vs_ref"]).abs().mean(), rel=1e-9)


def test_binary_and_top_k_tv_never_exceed_the_exact_tv(full_store):
    # TV of a coarsening is a lower bound: the synthetic store's distributions are real, so this holds
    ref = naive_scorer_rows(full_store)
    ok = ref[ref["finite"] & ref["tv_exact_vs_ref"].notna()]
    assert (ok["btv"] <= ok["tv_exact_vs_ref"] + 1e-12).all()
    assert (ok["topk_tv"].dropna() <= ok.loc[ok["topk_tv"].notna(), "tv_exact_vs_ref"] + 1e-12).all()
    assert (ok["topk_tv"].dropna() >= ok.loc[ok["topk_tv"].notna(), "btv"] - 1e-12).all()


def test_the_miss_rate_counts_exact_masks_the_approximation_does_not_fire(tmp_path):
    # two planted-exact rows: exact TV 0.3 with binary 0.1 (a miss) and exact 0.3 with binary 0.2 (a hit)
    from mismatch_lab.store.synthetic import write_store

    runs = pd.DataFrame([{"run_id": "r", "kind": "collect", "engine": "vllm", "engine_dtype": "bf16"}])
    tokens = pd.DataFrame([{"run_id": "r", "seq_id": 0, "pos": p, "token_id": p, "logp_rollout": np.log(0.5)} for p in range(2)])
    ref = [{"run_id": "r", "seq_id": 0, "pos": p, "scorer": "hf:fp32", "logp": np.log(0.5), "nonfinite": False} for p in range(2)]
    s = [{"run_id": "r", "seq_id": 0, "pos": 0, "scorer": "hf:bf16", "logp": np.log(0.6), "tv_exact_vs_ref": 0.3, "nonfinite": False},
         {"run_id": "r", "seq_id": 0, "pos": 1, "scorer": "hf:bf16", "logp": np.log(0.7), "tv_exact_vs_ref": 0.3, "nonfinite": False}]  # fmt: skip
    path = write_store(tmp_path / "miss.duckdb", {"runs": runs, "tokens": tokens, "scores": pd.DataFrame(ref + s)})
    row = approximation_table(open_store(path)).iloc[0]
    assert row["n_exact"] == 2 and row["frac_exact_gt_delta"] == 1.0
    assert row["binary_tv_miss"] == pytest.approx(0.5) and row["binary_tv_agree"] == pytest.approx(0.5)
    assert row["n_topk_exact"] == 0 and pd.isna(row["topk_tv_mae"])


def test_without_exact_tv_the_approximation_is_empty(plain_con):
    assert approximation_table(plain_con).empty  # one scorer: no pair to compare
