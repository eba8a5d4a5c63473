"""`analyze` key `support` (analysis/support.py): log S against log r per (rollout, scorer) pair and μ bucket,
on a real DuckDB store written by the real writer, against a pandas reference computed from the same arrays."""

from __future__ import annotations

import json

import duckdb
import numpy as np
import pandas as pd
import pytest

from mismatch_lab.analysis import definitions as d
from mismatch_lab.analysis.support import support_table
from mismatch_lab.store.writer import (
    SCORE_TYPES,
    SEQUENCE_TYPES,
    TOKEN_TYPES,
    StoreWriter,
)

N_SEQ, LEN = 12, 20


def _table(cols: dict, types: dict):
    import pyarrow as pa

    n = len(next(iter(cols.values())))
    return pa.table({c: pa.array(cols[c], t) if c in cols else pa.nulls(n, t) for c, t in types.items()})


def _run(writer, run_id: str, dtype: str, config: dict, rng, with_support: bool) -> pd.DataFrame:
    writer.start_run(run_id, study="s", kind="collect", model="m", weights_sha256="x", engine="vllm",
                     engine_dtype=dtype, device="cpu", versions={}, config=config)
    n = N_SEQ * LEN
    seq, pos = np.repeat(np.arange(N_SEQ), LEN), np.tile(np.arange(LEN), N_SEQ)
    lmu = np.log(rng.uniform(1e-7, 1.0, n))
    log_s = rng.uniform(-0.3, 0.0, n)
    lpi = np.minimum(lmu + log_s + rng.normal(0, 0.01, n), 0.0)
    lpi_s = lpi - log_s
    lpi_s[rng.random(n) < 0.1] = np.nan  # outside π's support
    nonfinite = rng.random(n) < 0.05
    lpi[nonfinite] = np.nan
    frame = pd.DataFrame({"seq_id": seq, "pos": pos, "lmu": lmu, "lpi": lpi, "log_s": log_s, "lpi_s": lpi_s,
                          "nonfinite": nonfinite})
    opt = lambda v: [None if not np.isfinite(x) else float(x) for x in v]
    sequences = _table({"run_id": [run_id] * N_SEQ, "seq_id": list(range(N_SEQ)), "response_len": [LEN] * N_SEQ},
                       SEQUENCE_TYPES)
    tokens = _table({"run_id": [run_id] * n, "seq_id": seq.tolist(), "pos": pos.tolist(), "token_id": [1] * n,
                     "logp_rollout": lmu.tolist()}, TOKEN_TYPES)
    scores = _table({"run_id": [run_id] * n, "seq_id": seq.tolist(), "pos": pos.tolist(), "scorer": ["hf:fp32"] * n,
                     "logp": opt(lpi), "nonfinite": nonfinite.tolist(),
                     **({"log_support": log_s.tolist(), "logp_support": opt(lpi_s)} if with_support else {})},
                    SCORE_TYPES)
    writer.write_chunk(run_id, 0, sequences=sequences, tokens=tokens, scores=scores, seconds=0.0)
    writer.set_status(run_id, "complete")
    return frame


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    db = tmp_path_factory.mktemp("support") / "s.duckdb"
    rng = np.random.default_rng(0)
    w = StoreWriter(db)
    frames = {"vllm:fp32-p0.9-processed": _run(w, "a", "fp32-p0.9-processed", {"top_p": 0.9, "logprobs_mode": "processed"},
                                              rng, True),
              "vllm:bf16": _run(w, "b", "bf16", {}, rng, False)}
    w.close()
    return db, frames


def _reference(f: pd.DataFrame) -> pd.DataFrame:
    """The definitions of the module docstring, in pandas."""
    f = f[~f.nonfinite & np.isfinite(f.lpi) & np.isfinite(f.lmu) & np.isfinite(f.log_s)].copy()
    edges = d.bucket_edges("log")
    mu = np.exp(f.lmu)
    f["bucket"] = [next(i for i, (lo, hi) in enumerate(edges) if m < hi or i == len(edges) - 1) for m in mu]
    f["r"] = f.lpi - f.lmu
    f["res"] = f.lpi_s - f.lmu
    agg = lambda g: pd.Series({"n_tokens": len(g), "log_s_mean": g.log_s.mean(), "dlogp_mean": g.r.mean(),
                               "residual_mean": g.res.mean(), "n_outside": int(g.lpi_s.isna().sum())})
    whole = agg(f).to_frame().T.assign(bucket=pd.NA)
    return pd.concat([whole, f.groupby("bucket").apply(agg).reset_index()], ignore_index=True)


def test_support_rows_equal_a_pandas_reference_per_pair_and_mu_bucket(store):
    db, frames = store
    con = duckdb.connect(str(db), read_only=True)
    got = support_table(con)
    con.close()
    assert set(got.rollout) == {"vllm:fp32-p0.9-processed"}  # the run without log S gives no row
    assert (got.scorer == "hf:fp32").all() and (got.logprobs_mode == "processed").all()
    want = _reference(frames["vllm:fp32-p0.9-processed"])
    assert list(got.view) == ["pair"] + ["mu_bucket"] * (len(want) - 1)
    assert got.mu_bucket.iloc[1:].tolist() == [int(b) for b in want.bucket.iloc[1:]]
    for c in ("n_tokens", "n_outside"):
        assert got[c].astype(int).tolist() == want[c].astype(int).tolist(), c
    for c in ("log_s_mean", "dlogp_mean", "residual_mean"):
        np.testing.assert_allclose(got[c].astype(float), want[c].astype(float), rtol=1e-12, err_msg=c)
    edges = d.bucket_edges("log")
    assert [(lo, hi) for lo, hi in zip(got.mu_lo[1:], got.mu_hi[1:])] == [edges[b] for b in got.mu_bucket[1:]]


def test_filters_select_the_pair_and_a_rollout_without_log_s_gives_no_rows(store):
    db, _ = store
    con = duckdb.connect(str(db), read_only=True)
    assert support_table(con, rollout="vllm:bf16").empty
    assert support_table(con, scorer="hf:bf16").empty
    assert len(support_table(con, rollout="vllm:fp32-p0.9-processed", scorer="hf:fp32")) > 1
    con.close()


def test_a_store_without_the_log_support_column_gives_an_empty_table(tmp_path):
    con = duckdb.connect(str(tmp_path / "old.duckdb"))
    con.execute("CREATE TABLE runs(run_id VARCHAR, kind VARCHAR, engine VARCHAR, engine_dtype VARCHAR, config JSON)")
    con.execute("CREATE TABLE tokens(run_id VARCHAR, seq_id BIGINT, pos INTEGER, logp_rollout DOUBLE)")
    con.execute("CREATE TABLE scores(run_id VARCHAR, seq_id BIGINT, pos INTEGER, scorer VARCHAR, logp DOUBLE)")
    out = support_table(con)
    con.close()
    assert out.empty and "log_s_mean" in out.columns


def test_analyze_json_holds_the_support_rows(store, tmp_path):
    from mismatch_lab.cli import main

    db, frames = store
    out = tmp_path / "a.json"
    assert main(["analyze", "--db", str(db), "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["support"]
    pair = [r for r in rows if r["view"] == "pair"]
    assert len(pair) == 1 and pair[0]["rollout"] == "vllm:fp32-p0.9-processed"
    assert pair[0]["n_tokens"] == int(_reference(frames["vllm:fp32-p0.9-processed"]).n_tokens[0])


def test_an_old_store_gains_the_optional_columns_when_a_writer_opens_it(tmp_path):
    db = tmp_path / "old.duckdb"
    w = StoreWriter(db)
    w.con.execute("ALTER TABLE scores DROP COLUMN log_support")
    w.close()
    StoreWriter(db).close()
    con = duckdb.connect(str(db), read_only=True)
    cols = [r[0] for r in con.execute("SELECT column_name FROM information_schema.columns WHERE table_name = 'scores'"
                                      ).fetchall()]
    con.close()
    assert "log_support" in cols
