"""The synthetic stores follow the data contract and keep what they plant; definitions' SQL pieces."""

from __future__ import annotations

import math

import duckdb
import numpy as np
import pytest
from analysis_reference import naive_binary_kl, naive_topk

from mismatch_lab.analysis import definitions as d
from mismatch_lab.store.reader import open_store
from mismatch_lab.store.schema import DDL
from mismatch_lab.store.synthetic import (
    SyntheticSpec,
    build_benchmark_store,
    synthetic_store,
)


def _contract_columns() -> dict[str, set[str]]:
    con = duckdb.connect()
    for stmt in DDL:
        con.execute(stmt)
    rows = con.execute("SELECT table_name, column_name FROM information_schema.columns").fetchall()
    out: dict[str, set[str]] = {}
    for t, c in rows:
        out.setdefault(t, set()).add(c)
    return out


def test_the_synthetic_store_has_the_contract_tables_and_consistent_rows(con, full_store):
    for table, cols in _contract_columns().items():
        have = {r[0] for r in con.execute(f"DESCRIBE {table}").fetchall()}
        assert cols <= have, table
    spec = full_store.spec
    n_tok = con.execute("SELECT count(*) FROM tokens").fetchone()[0]
    assert con.execute("SELECT count(*) FROM scores").fetchone()[0] == n_tok * len(spec.scorers)
    lens = con.execute("SELECT sum(response_len) FROM sequences").fetchone()[0]
    assert lens == n_tok  # response_len counts the tokens of the sequence
    nonfinite = con.execute("SELECT count(*) FROM scores WHERE nonfinite AND logp IS NULL").fetchone()[0]
    assert nonfinite == spec.n_nonfinite * len(spec.rollouts) * len(spec.scorers)
    probs = con.execute("SELECT max(logp), max(logp_rollout) FROM scores JOIN tokens USING (run_id, seq_id, pos)").fetchone()
    assert probs[0] <= 0 and probs[1] <= 0


def test_top_k_lists_are_the_largest_probabilities_and_sum_below_one(con):
    rows = con.execute("SELECT topk_logps_rollout FROM tokens WHERE topk_logps_rollout IS NOT NULL").fetchall()
    for (lps,) in rows:
        assert list(lps) == sorted(lps, reverse=True) and sum(math.exp(x) for x in lps) <= 1 + 1e-12


def test_the_same_seed_builds_the_same_store(tmp_path):
    spec = SyntheticSpec(n_sequences=5, topk=3, rewards="advantage", seed=7)
    a = synthetic_store(tmp_path / "a.duckdb", spec).frames["scores"]
    b = synthetic_store(tmp_path / "b.duckdb", spec).frames["scores"]
    assert a["logp"].equals(b["logp"]) and len(a) > 0


def test_an_existing_path_is_never_overwritten(tmp_path, full_store):
    with pytest.raises(FileExistsError):
        synthetic_store(full_store.path, SyntheticSpec())


def test_exact_tv_needs_the_reference_scorer():
    with pytest.raises(ValueError, match="hf:fp32"):
        SyntheticSpec(scorers=("hf:bf16",), exact_tv=True)


def test_the_benchmark_store_holds_exactly_the_tokens_asked_for_in_three_pairs(tmp_path):
    path = build_benchmark_store(tmp_path / "bench.duckdb", n_tokens=20_001, topk=3, threads=1)
    con = open_store(path)
    assert con.execute("SELECT count(*) FROM tokens").fetchone()[0] == 20_001
    pairs = con.execute(
        "SELECT DISTINCT engine || ':' || engine_dtype, scorer FROM tokens JOIN scores USING (run_id, seq_id, pos) "
        "JOIN runs USING (run_id) ORDER BY ALL"
    ).fetchall()
    assert pairs == [("vllm:bf16", "hf:bf16"), ("vllm:bf16", "hf:fp32"), ("vllm:fp16", "hf:fp32")]
    lens = con.execute("SELECT sum(response_len) FROM sequences").fetchone()[0]
    assert lens == 20_001
    assert con.execute("SELECT count(*) FROM train_metrics").fetchone()[0] > 0


# -- definitions ---------------------------------------------------------------------------------------
def test_sql_buckets_agree_with_the_documented_edges():
    rng = np.random.default_rng(0)
    mu = np.concatenate([rng.uniform(0, 1, 500), 10 ** rng.uniform(-8, 0, 500), [1.0, 1e-7]])
    con = duckdb.connect()
    con.register("m", {"lmu": np.log(mu)})
    for scale in ("linear", "log"):
        got = [r[0] for r in con.execute(f"SELECT {d.bucket_sql(scale)} FROM m").fetchall()]
        edges = d.bucket_edges(scale)
        for m, b in zip(mu, got):
            lo, hi = edges[b]
            assert lo * (1 - 1e-12) <= m <= hi * (1 + 1e-12), (scale, m, b)


def test_binary_kl_follows_its_conventions_at_the_edges():
    con = duckdb.connect()
    expr = d.token_metrics_sql("lmu", "lpi")["bkl"]
    for mu, pi in [(0.3, 0.5), (1.0, 0.5), (0.5, 1.0), (0.999, 0.9), (1e-9, 1e-3)]:
        got = con.execute(f"SELECT {expr} FROM (SELECT ln(?::DOUBLE) AS lmu, ln(?::DOUBLE) AS lpi)", [mu, pi]).fetchone()[0]
        want = naive_binary_kl(mu, pi)
        assert got == pytest.approx(want, rel=1e-9) if math.isfinite(want) else got == math.inf


@pytest.mark.parametrize(
    "ids, a, b, tok",
    [
        ([3, 1, 2], [math.log(0.5), math.log(0.2), math.log(0.1)], [math.log(0.4), math.log(0.25), math.log(0.1)], 7),
        ([3, 1, 2], [math.log(0.5), math.log(0.2), math.log(0.1)], [math.log(0.4), math.log(0.25), math.log(0.1)], 1),
        ([0, 1], [math.log(0.6), math.log(0.4)], [math.log(0.5), math.log(0.3)], 0),  # mu has no 'other' mass
    ],
)
def test_top_k_tv_and_kl_match_a_loop_with_the_sampled_token_in_or_out(ids, a, b, tok):
    a_lp, b_lp = (a[ids.index(tok)], b[ids.index(tok)]) if tok in ids else (math.log(0.05), math.log(0.08))
    con = duckdb.connect()
    parts = d.topk_anchor_sql("ids", "a", "tok")
    pair = d.topk_pair_sql("b")
    inner = f"SELECT *, {', '.join(f'{e} AS {n}' for n, e in parts.items())} FROM (SELECT ?::INTEGER[] ids, ?::DOUBLE[] a, ?::DOUBLE[] b, ?::INTEGER tok, ?::DOUBLE a_lp, ?::DOUBLE b_lp)"
    mid = f"SELECT *, {', '.join(f'{e} AS {n}' for n, e in pair.items())} FROM ({inner})"
    got = con.execute(f"SELECT ({d.topk_sql('a_lp', 'b_lp')}) FROM ({mid})", [ids, a, b, tok, a_lp, b_lp]).fetchone()[0]
    tv, kl = naive_topk(ids, a, b, tok, a_lp, b_lp)
    assert got["tv"] == pytest.approx(tv, rel=1e-12) and got["kl"] == pytest.approx(kl, rel=1e-12)


def test_top_k_is_null_when_the_lists_disagree_in_length_or_hold_nulls():
    con = duckdb.connect()
    parts = d.topk_anchor_sql("ids", "a", "tok")
    pair = d.topk_pair_sql("b")
    inner = f"SELECT *, {', '.join(f'{e} AS {n}' for n, e in parts.items())} FROM (SELECT ?::INTEGER[] ids, ?::DOUBLE[] a, ?::DOUBLE[] b, 5 tok)"
    mid = f"SELECT *, {', '.join(f'{e} AS {n}' for n, e in pair.items())} FROM ({inner})"
    sql = f"SELECT ({d.topk_sql('-3.0', '-3.0')}) FROM ({mid})"
    assert con.execute(sql, [[1, 2], [-1.0, -2.0], [-1.0]]).fetchone()[0] is None
    assert con.execute(sql, [[1, 2], [-1.0, -2.0], [-1.0, None]]).fetchone()[0] is None
    assert con.execute(sql, [[1, 2], [-1.0, -2.0], None]).fetchone()[0] is None
    assert con.execute(sql, [[1, 2], [-1.0, -2.0], [-1.0, -2.0]]).fetchone()[0]["tv"] == pytest.approx(0.0)
