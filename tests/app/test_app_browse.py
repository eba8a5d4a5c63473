"""The app's browsing queries (mismatch_lab.analysis.browse) against naive pandas/numpy references."""

from __future__ import annotations

import math

import duckdb
import numpy as np
import pandas as pd
import pytest

from mismatch_lab.analysis import browse
from mismatch_lab.analysis.definitions import DELTA_TV, EPS_HIGH, EPS_LOW
from mismatch_lab.store.reader import open_store
from mismatch_lab.store.schema import create_schema


@pytest.fixture(params=["duckdb", "parquet"])
def con(request, duckdb_store, parquet_store):
    c = open_store(duckdb_store if request.param == "duckdb" else parquet_store)
    yield c
    c.close()


def _joined(con) -> pd.DataFrame:
    """Tokens joined with scores, read whole and combined in pandas (the naive reference)."""
    t = con.execute("SELECT run_id, seq_id, pos, logp_rollout FROM tokens").df()
    s = con.execute("SELECT run_id, seq_id, pos, scorer, logp, nonfinite FROM scores").df()
    j = t.merge(s, on=["run_id", "seq_id", "pos"])
    j["abs_dp"] = (np.exp(j["logp"]) - np.exp(j["logp_rollout"])).abs()
    return j


def test_list_runs_counts_match_the_tables(con):
    runs = browse.list_runs(con).set_index("run_id")
    tokens = con.execute("SELECT run_id, count(*) AS n FROM tokens GROUP BY run_id").df().set_index("run_id")["n"]
    seqs = con.execute("SELECT run_id, count(*) AS n FROM sequences GROUP BY run_id").df().set_index("run_id")["n"]
    nonfinite = (
        con.execute("SELECT run_id, count(*) FILTER (WHERE nonfinite) AS n FROM scores GROUP BY run_id")
        .df()
        .set_index("run_id")["n"]
    )
    assert set(runs.index) == {"collect-vllm-bf16", "collect-hf-fp16", "train-dppo", "train-grpo"}
    for run_id, row in runs.iterrows():
        assert row.n_tokens == tokens[run_id]
        assert row.n_sequences == seqs[run_id]
        assert row.n_nonfinite == nonfinite[run_id]
    assert runs.loc["collect-vllm-bf16", "rollout"] == "vllm:bf16"
    assert runs.loc["collect-vllm-bf16", "scorers"] == "hf:bf16, hf:fp32"
    assert runs.loc["train-dppo", "steps"] == 3 and runs.loc["collect-hf-fp16", "steps"] == 0


def test_list_pairs_names_each_rollout_scorer_pair_once(con):
    pairs = browse.list_pairs(con)
    assert list(zip(pairs.rollout, pairs.scorer)) == [
        ("hf:fp16", "hf:fp32"),
        ("vllm:bf16", "hf:bf16"),
        ("vllm:bf16", "hf:fp32"),
    ]
    assert pairs["n_tokens"].sum() == con.execute("SELECT count(*) FROM scores").fetchone()[0]


def test_worst_sequences_ranks_by_the_naive_max_abs_dp(con):
    j = _joined(con)
    naive = j.groupby(["run_id", "seq_id"])["abs_dp"].max().sort_values(ascending=False)
    worst = browse.worst_sequences(con, n=5)
    assert len(worst) == 5
    np.testing.assert_allclose(worst["max_abs_dp"], naive.iloc[:5].to_numpy(), rtol=1e-12)
    first = worst.iloc[0]
    at = j[
        (j.run_id == first.run_id)
        & (j.seq_id == first.seq_id)
        & (j.pos == first.worst_pos)
        & (j.scorer == first.worst_scorer)
    ]
    assert at["abs_dp"].iloc[0] == pytest.approx(first.max_abs_dp)


def test_worst_sequences_filters_by_run_and_scorer_and_counts_nonfinite(con):
    worst = browse.worst_sequences(con, run_id="collect-vllm-bf16", scorer="hf:bf16", n=100)
    assert set(worst.run_id) == {"collect-vllm-bf16"} and set(worst.worst_scorer) == {"hf:bf16"}
    assert len(worst) == 8
    assert worst.set_index("seq_id").loc[0, "n_nonfinite"] == 1
    assert worst["max_abs_dp"].is_monotonic_decreasing


def test_sequence_tokens_ratio_masks_and_track_match_a_numpy_loop(con):
    run_id, seq_id = "train-dppo", 1
    out = browse.sequence_tokens(con, run_id, seq_id)
    adv = con.execute("SELECT advantage FROM sequences WHERE run_id = ? AND seq_id = ?", [run_id, seq_id]).fetchone()[0]
    assert adv != 0 and out["advantage"].eq(adv).all()
    lmu = out["logp_rollout"].to_numpy()
    lpi = out["logp"].to_numpy()
    mu, pi, r = np.exp(lmu), np.exp(lpi), np.exp(lpi - lmu)
    for k in range(len(out)):
        if adv > 0:
            ppo, dppo = r[k] > 1 + EPS_HIGH, pi[k] - mu[k] > DELTA_TV
        else:
            ppo, dppo = r[k] < 1 - EPS_LOW, mu[k] - pi[k] > DELTA_TV
        assert bool(out["ppo_clipped"][k]) == ppo
        assert bool(out["dppo_masked"][k]) == dppo
    np.testing.assert_allclose(out["ratio"], r, rtol=1e-12)
    np.testing.assert_allclose(out["abs_dp"], np.abs(pi - mu), rtol=1e-12)
    np.testing.assert_allclose(out["cum_log_ratio"], np.cumsum(lpi - lmu), rtol=1e-10, atol=1e-12)
    assert out["pos"].tolist() == list(range(len(out)))


def test_sequence_tokens_without_advantage_use_both_sides_and_skip_nonfinite(con):
    out = browse.sequence_tokens(con, "collect-vllm-bf16", 0)
    assert out["advantage"].isna().all()
    assert set(out["scorer"]) == {"hf:bf16", "hf:fp32"}
    bad = out[out["nonfinite"]]
    assert len(bad) == 1 and bad["ratio"].isna().all() and bad["ppo_clipped"].isna().all()
    for scorer, part in out.groupby("scorer"):
        d = (part["logp"] - part["logp_rollout"]).fillna(0.0).to_numpy()  # a NULL term adds nothing
        np.testing.assert_allclose(part["cum_log_ratio"], np.cumsum(d), rtol=1e-10, atol=1e-12)
        r = part["ratio"].to_numpy()
        expected = (r < 1 - EPS_LOW) | (r > 1 + EPS_HIGH)
        finite = ~np.isnan(r)
        assert (part["ppo_clipped"].to_numpy()[finite].astype(bool) == expected[finite]).all()
        assert (
            part["dppo_masked"].to_numpy()[finite].astype(bool) == (part["abs_dp"].to_numpy()[finite] > DELTA_TV)
        ).all()


def test_a_reward_without_advantage_gets_the_group_baseline_sign(tmp_path):
    con = duckdb.connect(str(tmp_path / "r.duckdb"))
    create_schema(con)
    con.execute("INSERT INTO runs (run_id, kind, engine, engine_dtype) VALUES ('t', 'train', 'vllm', 'bf16')")
    # one prompt group at step 0: rewards 1 and 0 -> advantages +0.5 and -0.5
    con.execute(
        "INSERT INTO sequences (run_id, seq_id, prompt_id, step, reward) VALUES "
        "('t', 0, 'p', 0, 1.0), ('t', 1, 'p', 0, 0.0), ('t', 2, 'q', 0, 1.0)"
    )
    for seq_id in (0, 1, 2):
        con.execute(
            "INSERT INTO tokens (run_id, seq_id, pos, token_text, logp_rollout) VALUES ('t', ?, 0, 'x', ?)",
            [seq_id, math.log(0.5)],
        )
        # pi - mu = -0.3: outside delta downwards only
        con.execute(
            "INSERT INTO scores (run_id, seq_id, pos, scorer, logp, nonfinite) VALUES ('t', ?, 0, 'hf:fp32', ?, false)",
            [seq_id, math.log(0.2)],
        )
    got = {s: browse.sequence_tokens(con, "t", s).iloc[0] for s in (0, 1, 2)}
    assert got[0].advantage == pytest.approx(0.5) and not got[0].dppo_masked and not got[0].ppo_clipped
    assert got[1].advantage == pytest.approx(-0.5) and got[1].dppo_masked and got[1].ppo_clipped
    # alone in its group: A = 0 carries no gradient, so no rule fires (the registry's sign rule)
    assert got[2].advantage == pytest.approx(0.0) and not got[2].dppo_masked and not got[2].ppo_clipped


def test_token_topk_returns_the_stored_lists_with_texts(con):
    raw = con.execute(
        "SELECT topk_ids_rollout, topk_logps_rollout FROM tokens "
        "WHERE run_id = 'collect-vllm-bf16' AND seq_id = 3 AND pos = 2"
    ).fetchone()
    topk = browse.token_topk(con, "collect-vllm-bf16", 3, 2)
    own = topk[(topk["list"] == "rollout") & (topk["by"] == "rollout")]
    assert own["token_id"].tolist() == list(raw[0])
    np.testing.assert_allclose(own["p"], np.exp(raw[1]))
    assert own["token_text"].notna().all()
    assert set(topk["list"]) == {"rollout", "hf:bf16", "hf:fp32"}
    assert set(topk[topk["list"] == "rollout"]["by"]) == {"rollout", "hf:bf16", "hf:fp32"}


def test_token_topk_is_empty_for_a_run_without_topk(con):
    topk = browse.token_topk(con, "collect-hf-fp16", 0, 0)
    assert topk.empty and list(topk.columns) == ["list", "by", "rank", "token_id", "token_text", "logp", "p"]


def test_training_queries_name_objectives_and_count_steps(con):
    train = browse.train_runs(con).set_index("run_id")
    assert train.loc["train-dppo", "objective"] == "dppo_binary_tv" and train.loc["train-grpo", "objective"] == "grpo"
    steps = browse.training_steps(con, "train-dppo")
    assert steps["step"].tolist() == [0, 1, 2]
    assert steps["n_sequences"].tolist() == [4, 4, 4]
    seqs = con.execute(
        "SELECT step, sum(response_len) AS n, avg(reward) AS r FROM sequences "
        "WHERE run_id = 'train-dppo' GROUP BY step ORDER BY step"
    ).df()
    assert steps["n_tokens"].tolist() == seqs["n"].tolist()
    np.testing.assert_allclose(steps["mean_reward"], seqs["r"])
    assert browse.list_sequences(con, "train-dppo", step=2)["step"].eq(2).all()
    assert browse.training_steps(con, "collect-vllm-bf16").empty
    assert browse.train_metric_names(con, ["train-dppo"]) == [
        "mask/negative_adv/frac",
        "mismatch/abs_dp/mean",
        "reward/mean",
    ]


def test_find_stores_and_figures_follow_the_study_layout(study_dir, tmp_path):
    root = study_dir.parent
    assert study_dir in browse.find_stores(root)
    assert [p.name for p in browse.study_figures(study_dir / "results")] == [
        "fig1_ratio_vs_mu.png",
        "fig2_clipping_by_category.png",
    ]
    live = tmp_path / "live"
    live.mkdir()
    (live / "live.duckdb").write_bytes(b"")
    assert browse.find_stores(tmp_path) == [live / "live.duckdb"]
    assert browse.study_dir(live / "live.duckdb") == live
    assert browse.find_stores(tmp_path / "absent") == []
