"""Doctor's 'where it comes from' (doctor/attribution.py) and the support_bias check: the shares against a
naive numpy computation on synthetic stores (one with log S known by construction), and the attribution on
every stored study through the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import duckdb
import numpy as np
import pandas as pd
import pytest

from mismatch_lab.cli import main
from mismatch_lab.doctor import attribution as A
from mismatch_lab.doctor.report import diagnose, text_report
from mismatch_lab.store.reader import open_store
from mismatch_lab.store.synthetic import (
    DEFAULT_NOISE,
    SyntheticSpec,
    synthetic_store,
    write_store,
)

STUDIES = Path(__file__).resolve().parents[2] / "studies"
STORED = sorted(p.parent.name for p in STUDIES.glob("*/results") if any(p.glob("*.parquet")))
RTOL = 64 * np.finfo(np.float64).eps
"""Means of the same float64 values summed in another order: a few ulps per term, far below this."""


def _rows(dx) -> dict[tuple[str, str, str], dict]:
    return {(r["rollout"], r["scorer"], r["source"]): r for r in dx.attribution}


def _diagnose(path) -> object:
    con = open_store(path)
    try:
        return diagnose(con, str(path))
    finally:
        con.close()


def _joined(frames: dict[str, pd.DataFrame], rollout: str) -> pd.DataFrame:
    """The naive join: one row per token of `rollout` with log μ and each scorer's log π (NaN where non-finite)."""
    runs = frames["runs"].assign(label=lambda r: r["engine"] + ":" + r["engine_dtype"])
    run_id = runs.loc[runs["label"] == rollout, "run_id"].iloc[0]
    t = frames["tokens"][frames["tokens"]["run_id"] == run_id][["seq_id", "pos", "logp_rollout"]]
    t = t.assign(logp_rollout=t["logp_rollout"].astype(float))
    s = frames["scores"][frames["scores"]["run_id"] == run_id]
    for scorer, g in s.groupby("scorer"):
        lp = g["logp"].astype(float).where(~g["nonfinite"].astype(bool))
        t = t.merge(g[["seq_id", "pos"]].assign(**{scorer: lp.to_numpy()}), on=["seq_id", "pos"])
    return t


def _removal(t: pd.DataFrame, scorer: str, a: str, b: str, extra: float = 0.0) -> float:
    cols = [c for c in {"logp_rollout", scorer, a, b}]
    ok = np.all(np.isfinite(t[cols].to_numpy(dtype=float)), axis=1)
    m = np.mean(np.abs(t[scorer].to_numpy()[ok] - t["logp_rollout"].to_numpy()[ok]))
    without = np.mean(np.abs(t[a].to_numpy()[ok] - t[b].to_numpy()[ok])) + extra
    return max(0.0, m - without) / m


SPEC = SyntheticSpec(rollouts=("vllm:bf16-wfp8", "vllm:fp32"), scorers=("hf:fp32", "hf:bf16", "hf:fp32-wfp8"),
                     noise=DEFAULT_NOISE | {"bf16-wfp8": 0.05, "fp32-wfp8": 0.03}, n_sequences=24, n_nonfinite=3,
                     n_rollout_nonfinite=2, seed=7)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """SPEC's store with hf:fp32-wfp8 made the fp8 rollout's weights computed in fp32: its log π is the rollout's
    log μ scaled by 1 + 1e-3 (the generator's noise is independent per side, so no scorer shares the
    rollout's weight error otherwise); every other number as generated."""
    folder = tmp_path_factory.mktemp("attr")
    frames = synthetic_store(folder / "raw.duckdb", SPEC).frames
    tok, sc = frames["tokens"], frames["scores"].copy()
    lmu = sc[["run_id", "seq_id", "pos"]].merge(tok[["run_id", "seq_id", "pos", "logp_rollout"]], how="left")
    twin = (sc["scorer"] == "hf:fp32-wfp8") & (sc["run_id"] == "synthetic-0-vllm-bf16-wfp8") & sc["logp"].notna()
    twin &= lmu["logp_rollout"].notna().to_numpy()
    sc.loc[twin, "logp"] = lmu.loc[twin.to_numpy(), "logp_rollout"].astype(float).to_numpy() * (1 + 1e-3)
    frames["scores"] = sc
    write_store(folder / "s.duckdb", frames)
    return frames, _diagnose(folder / "s.duckdb")


def test_precision_and_weight_rounding_shares_equal_a_naive_numpy_computation(synthetic):
    frames, dx = synthetic
    rows = _rows(dx)
    fp8 = _joined(frames, "vllm:bf16-wfp8")
    fp32 = _joined(frames, "vllm:fp32")
    expected = {
        # the fp8 rollout's fp32 twin is hf:fp32-wfp8 (no vllm:fp32-wfp8 rollout: an upper bound)
        ("vllm:bf16-wfp8", "hf:bf16", "precision"): _removal(fp8, "hf:bf16", "hf:fp32", "hf:fp32-wfp8"),
        ("vllm:bf16-wfp8", "hf:fp32", "precision"): _removal(fp8, "hf:fp32", "hf:fp32", "hf:fp32-wfp8"),
        ("vllm:bf16-wfp8", "hf:fp32", "weight_rounding"): _removal(fp8, "hf:fp32", "hf:fp32-wfp8", "logp_rollout"),
        ("vllm:fp32", "hf:bf16", "precision"): _removal(fp32, "hf:bf16", "hf:fp32", "logp_rollout"),
        ("vllm:fp32", "hf:fp32-wfp8", "weight_rounding"): _removal(fp32, "hf:fp32-wfp8", "hf:fp32", "logp_rollout"),
    }
    for key, share in expected.items():
        assert rows[key]["share"] == pytest.approx(share, rel=RTOL, abs=RTOL), key
    assert rows[("vllm:fp32", "hf:bf16", "precision")]["share"] > 0.9  # the bf16 scorer's noise, all of it
    assert 0 < rows[("vllm:bf16-wfp8", "hf:bf16", "precision")]["share"] < 1
    assert rows[("vllm:bf16-wfp8", "hf:bf16", "precision")]["bound"] == "upper"
    assert rows[("vllm:fp32", "hf:fp32", "precision")]["share"] == 0.0  # both sides fp32
    assert rows[("vllm:bf16-wfp8", "hf:fp32-wfp8", "weight_rounding")]["share"] == 0.0  # already on rounded weights
    assert rows[("vllm:fp32", "hf:fp32", "weight_rounding")]["share"] == 0.0  # the same weights on both sides
    assert rows[("vllm:bf16-wfp8", "hf:fp32", "weight_rounding")]["share"] > 0.5  # the twin shares μ's weight error
    for key in [("vllm:bf16-wfp8", "hf:bf16", "weight_rounding"), ("vllm:fp32", "hf:fp32", "routing"),
                ("vllm:fp32", "hf:fp32", "support"), ("vllm:fp32", "hf:fp32", "staleness"),
                ("vllm:fp32", "hf:fp32", "batch_composition")]:
        assert math.isnan(rows[key]["share"]) and rows[key]["reason"], key


def test_the_unexplained_share_is_what_the_measured_shares_leave(synthetic):
    _, dx = synthetic
    for (rollout, scorer, source), r in _rows(dx).items():
        if source == A.UNEXPLAINED:
            measured = [x["share"] for x in dx.attribution if (x["rollout"], x["scorer"]) == (rollout, scorer)
                        and x["source"] != A.UNEXPLAINED and not math.isnan(x["share"])]
            assert r["share"] == pytest.approx(max(0.0, 1 - sum(measured)), rel=RTOL, abs=RTOL)


def test_a_pair_without_mismatch_gets_no_share_and_the_report_says_why(tmp_path):
    path = write_store(tmp_path / "equal.duckdb", {k: v for k, v in _equal_frames().items()})
    dx = _diagnose(path)
    rows = _rows(dx)
    assert math.isnan(rows[("vllm:fp32", "hf:fp32", A.UNEXPLAINED)]["share"])
    assert "the pair has no mismatch to share (1 of 1 pairs)" in text_report(dx)


def _equal_frames() -> dict[str, pd.DataFrame]:
    """One fp32 rollout whose scorer returns log μ bitwise: M = 0."""
    frames = synthetic_store_frames(SyntheticSpec(rollouts=("vllm:fp32",), n_sequences=4, seed=2))
    tok = frames["tokens"][["run_id", "seq_id", "pos", "logp_rollout"]]
    sc = frames["scores"].drop(columns="logp").merge(tok, on=["run_id", "seq_id", "pos"])
    frames["scores"] = sc.rename(columns={"logp_rollout": "logp"}).assign(nonfinite=False)
    return frames


def synthetic_store_frames(spec: SyntheticSpec) -> dict[str, pd.DataFrame]:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        return synthetic_store(Path(d) / "s.duckdb", spec).frames


def test_a_rollout_label_without_dtype_gets_no_weight_or_precision_share(tmp_path):
    """A recorded or imported run's rollout is '<engine>' alone: its weights and compute dtype are not known."""
    frames = synthetic_store_frames(SyntheticSpec(rollouts=("vllm:bf16",), n_sequences=4, seed=4))
    frames["runs"] = frames["runs"].assign(engine_dtype=None)
    rows = _rows(_diagnose(write_store(tmp_path / "rec.duckdb", frames)))
    for source in ("weight_rounding", "precision"):
        assert math.isnan(rows[("vllm", "hf:fp32", source)]["share"]) and rows[("vllm", "hf:fp32", source)]["reason"]
    assert rows[("vllm", "hf:fp32", A.UNEXPLAINED)]["share"] == 1.0


def test_support_bias_is_not_measured_without_log_s(synthetic):
    _, dx = synthetic
    assert not [c for c in dx.checks if c["check"] == "support_bias"]
    assert [n for n in dx.not_measured if n["check"] == "support_bias" and n["pair"] is None]


def _support_store(path: Path, low: float = 0.3) -> tuple[Path, pd.DataFrame]:
    """A processed-μ rollout: log μ = log μ_raw − log S; the scorer 'vllm:bf16' returns log μ_raw exactly (so its
    whole mismatch is log S), hf:fp32 its own noisy log π. log S = log(μ_raw + (1 − μ_raw) u), u in [low, 1)."""
    spec = SyntheticSpec(rollouts=("vllm:bf16",), scorers=("hf:fp32", "vllm:bf16"), n_sequences=20, seed=3)
    frames = synthetic_store(path.with_suffix(".raw.duckdb"), spec).frames
    tok, sc = frames["tokens"].copy(), frames["scores"].copy()
    raw = tok["logp_rollout"].astype(float).to_numpy()
    u = np.random.default_rng(5).uniform(low, 1.0, size=len(raw))
    log_s = np.log(np.exp(raw) + (1 - np.exp(raw)) * u)
    tok["logp_rollout"] = raw - log_s
    key = tok[["run_id", "seq_id", "pos"]].assign(raw=raw, log_s=log_s)
    sc = sc.merge(key, on=["run_id", "seq_id", "pos"])
    exact = sc["scorer"] == "vllm:bf16"
    sc.loc[exact, "logp"] = sc.loc[exact, "raw"]
    sc["log_support"] = sc["log_s"]
    sc["logp_support"] = sc["logp"].astype(float) - sc["log_s"]
    frames |= {"tokens": tok, "scores": sc.drop(columns=["raw", "log_s"]),
               "runs": frames["runs"].assign(engine_dtype="bf16-p0.9-processed")}
    write_store(path, frames)
    return path, sc


def test_the_support_share_and_check_are_known_by_construction(tmp_path):
    path, sc = _support_store(tmp_path / "support.duckdb")
    dx = _diagnose(path)
    rows = _rows(dx)
    rollout = "vllm:bf16-p0.9-processed"
    exact = rows[(rollout, "vllm:bf16", "support")]
    assert exact["share"] == 1.0 and exact["without"] == 0.0  # π raw = μ raw: log r is log S, all of it
    # the processed μ's fp32 twin is processed too: precision does not take the support's share
    assert rows[(rollout, "vllm:bf16", "precision")]["share"] < 0.05
    noisy = sc[sc["scorer"] == "hf:fp32"]
    lmu = noisy["raw"] - noisy["log_s"]
    m = np.mean(np.abs(noisy["logp"].astype(float) - lmu))
    without = np.mean(np.abs(noisy["logp_support"] - lmu))
    assert rows[(rollout, "hf:fp32", "support")]["share"] == pytest.approx(max(0, m - without) / m, rel=RTOL)
    check = {c["pair"]: c for c in dx.checks if c["check"] == "support_bias"}
    assert check[f"{rollout}/vllm:bf16"]["value"] == 1.0  # the support share: π on the rule is μ exactly
    assert check[f"{rollout}/vllm:bf16"]["verdict"] == "warn"
    assert check[f"{rollout}/hf:fp32"]["value"] == pytest.approx(max(0, m - without) / m, rel=RTOL)
    assert "sampling support 100 %" in text_report(dx)


def test_support_bias_is_ok_where_log_s_is_small_against_the_numerics(tmp_path):
    path, sc = _support_store(tmp_path / "small.duckdb", low=1 - 1e-4)  # S within 1e-4 of 1: log S ~ −1e-4 or less
    check = {c["pair"]: c for c in _diagnose(path).checks if c["check"] == "support_bias"}
    noisy = sc[sc["scorer"] == "hf:fp32"]
    lmu = noisy["raw"] - noisy["log_s"]
    m = np.mean(np.abs(noisy["logp"].astype(float) - lmu))
    ratio = max(0, m - np.mean(np.abs(noisy["logp_support"] - lmu))) / m  # the support share
    row = check["vllm:bf16-p0.9-processed/hf:fp32"]
    assert row["value"] == pytest.approx(ratio, rel=RTOL) and row["value"] < 0.5 and row["verdict"] == "ok"


def test_the_staleness_share_compares_lag_zero_sequences_with_all(tmp_path):
    store = synthetic_store(tmp_path / "lag.duckdb", SyntheticSpec(n_sequences=30, seed=11))
    con = duckdb.connect(str(store.path))
    con.execute("ALTER TABLE sequences ADD COLUMN IF NOT EXISTS policy_lag INTEGER")
    con.execute("UPDATE sequences SET policy_lag = seq_id % 3")
    con.close()
    t = _joined(store.frames, "vllm:bf16").merge(store.frames["sequences"][["seq_id"]], on="seq_id")
    d = np.abs(t["hf:fp32"] - t["logp_rollout"])
    m, fresh = d.mean(), d[t["seq_id"] % 3 == 0].mean()
    row = _rows(_diagnose(store.path))[("vllm:bf16", "hf:fp32", "staleness")]
    assert row["share"] == pytest.approx(max(0.0, m - fresh) / m, rel=RTOL)


@pytest.fixture(scope="module")
def study_docs(tmp_path_factory):
    out = {}
    for study in STORED:
        path = tmp_path_factory.mktemp(study) / "doctor.json"
        main(["doctor", "--db", str(STUDIES / study), "--json", str(path)])
        out[study] = json.loads(path.read_text())
    return out


@pytest.mark.parametrize("study", STORED)
def test_every_stored_study_gets_attribution_rows_with_shares_in_0_1_or_a_reason(study_docs, study):
    doc = study_docs[study]
    pairs = {c["pair"] for c in doc["checks"] if c["check"] == "abs_dp_mean"}
    rows = doc["attribution"]
    assert {f"{r['rollout']}/{r['scorer']}" for r in rows} == pairs
    for r in rows:
        assert (r["share"] is None and r["reason"]) or 0.0 <= r["share"] <= 1.0, r
        assert r["runs"] and r["evidence"] is not None
    assert {r["source"] for r in rows} == {*A.SOURCES, A.UNEXPLAINED}
    support = [c for c in doc["checks"] if c["check"] == "support_bias"]
    if study == "sampling-support":  # the one stored study with log S: measured on its processed rollouts
        assert support and all(c["pair"].split("/")[0].endswith("-processed") for c in support)
    else:
        assert not support and [n for n in doc["not_measured"] if n["check"] == "support_bias"]


def test_on_fp8_rollout_weight_rounding_is_the_largest_share_of_the_fp8_rollout_pair(study_docs):
    rows = [r for r in study_docs["fp8-rollout"]["attribution"]
            if (r["rollout"], r["scorer"]) == ("vllm:bf16-wfp8", "hf:fp32") and r["share"] is not None]
    assert max(rows, key=lambda r: r["share"])["source"] == "weight_rounding"


def test_on_batch_invariance_the_batch_share_is_the_rollouts_batch_variance_over_the_pairs_mismatch(study_docs):
    doc = study_docs["batch-invariance"]
    d = max(c["value"] for c in doc["checks"] if c["check"] == "batch_logp" and c["pair"] == "vllm:bf16")
    con = duckdb.connect()
    res = STUDIES / "batch-invariance" / "results"
    m = con.execute(f"""SELECT avg(abs(s.logp - t.logp_rollout)) FROM '{res}/tokens.parquet' t
        JOIN '{res}/scores.parquet' s USING (run_id, seq_id, pos) JOIN '{res}/runs.parquet' r USING (run_id)
        WHERE r.engine_dtype = 'bf16' AND s.scorer = 'hf:fp32' AND NOT coalesce(s.nonfinite, false)""").fetchall()[0][0]
    row = next(r for r in doc["attribution"] if (r["rollout"], r["scorer"], r["source"])
               == ("vllm:bf16", "hf:fp32", "batch_composition"))
    assert row["share"] == pytest.approx(min(1.0, d / m), rel=1e-9)


def test_advice_names_the_source_it_fixes(study_docs):
    recs = {r["rule"]: r for r in study_docs["precision-sweep"]["recommendations"]}
    assert recs["fp16"]["source"] == "precision"
    assert {r["rule"]: r["source"] for r in study_docs["batch-invariance"]["recommendations"]}.get("batch") \
        == "batch_composition"
