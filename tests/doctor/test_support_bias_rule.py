"""doctor's support_bias check is the attribution's support share, and sees a temperature the trainer does not
apply: on a synthetic store with π on the rule known by construction (T 0.7, no cut: log S = 0, a two-signed
per-token bias), and on studies/sampling-support's committed results (read-only)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mismatch_lab.doctor.report import diagnose
from mismatch_lab.store.reader import open_store
from mismatch_lab.store.synthetic import SyntheticSpec, synthetic_store, write_store

STUDY = Path(__file__).resolve().parents[2] / "studies" / "sampling-support"
RTOL = 64 * np.finfo(np.float64).eps
"""Means of the same float64 values summed in another order: a few ulps per term, far below this."""
T = 0.7
PROCESSED, RAW = "vllm:fp32-t0.7-processed", "vllm:bf16-t0.7"


def _diagnose(path):
    con = open_store(path)
    try:
        return diagnose(con, str(path))
    finally:
        con.close()


def _tempered(path: Path):
    """Two rollouts scored by hf:fp32 (its log π = the synthetic one): π on the rule is log π / T + κ (κ the
    log normaliser, clipped to stay a log-prob) and log S = 0 (a temperature cuts nothing). The processed
    rollout's μ is π on the rule (exact numerics), the raw one's μ is π with numerical noise."""
    spec = SyntheticSpec(rollouts=("vllm:fp32", "vllm:bf16"), scorers=("hf:fp32",), n_sequences=20, seed=8)
    frames = synthetic_store(path.with_suffix(".raw.duckdb"), spec).frames
    tok, sc = frames["tokens"].copy(), frames["scores"].copy()
    lpi = sc["logp"].astype(float)
    kappa = (1 - 1 / T) * float(np.median(lpi))  # the bias (1 − 1/T)(log π − median) is two-signed, mean ~0
    sc["logp_support"] = np.minimum(lpi / T + kappa, 0.0)
    sc["log_support"] = 0.0
    noisy = np.minimum(lpi + np.random.default_rng(8).normal(0.0, 0.01, len(lpi)), 0.0)
    mu = sc[["run_id", "seq_id", "pos"]].assign(mu=np.where(sc["run_id"] == sc["run_id"].iloc[0], sc["logp_support"],
                                                            noisy))
    tok = tok.drop(columns="logp_rollout").merge(mu.rename(columns={"mu": "logp_rollout"}), on=["run_id", "seq_id", "pos"])
    runs = frames["runs"].copy()
    runs["engine_dtype"] = np.where(runs["run_id"] == sc["run_id"].iloc[0], "fp32-t0.7-processed", "bf16-t0.7")
    write_store(path, frames | {"tokens": tok, "scores": sc, "runs": runs})
    return path, sc, tok


@pytest.fixture(scope="module")
def tempered(tmp_path_factory):
    path, sc, tok = _tempered(tmp_path_factory.mktemp("tempered") / "t.duckdb")
    return _diagnose(path), sc.merge(tok, on=["run_id", "seq_id", "pos"])


def test_a_temperature_alone_fires_support_bias_though_log_s_is_zero_and_its_bias_two_signed(tempered):
    dx, j = tempered
    p = j[j["run_id"] == j["run_id"].iloc[0]]
    lpi, lmu, rule = p["logp"].astype(float), p["logp_rollout"].astype(float), p["logp_support"]
    bias = lpi - rule
    assert (bias > 0).any() and (bias < 0).any() and abs(bias.mean()) < 0.5 * np.abs(lpi - lmu).mean()
    m, m_rule = np.abs(lpi - lmu).mean(), np.abs(rule - lmu).mean()
    (row,) = [c for c in dx.checks if c["check"] == "support_bias"]
    assert row["pair"] == f"{PROCESSED}/hf:fp32" and row["verdict"] == "warn"
    assert row["value"] == pytest.approx(max(0.0, m - m_rule) / m, rel=RTOL) and row["value"] == 1.0


def test_the_check_is_the_attributions_support_share_and_a_raw_rollout_gets_no_row_and_share_zero(tempered):
    dx, _ = tempered
    share = {(r["rollout"], r["scorer"]): r["share"] for r in dx.attribution if r["source"] == "support"}
    checks = {c["pair"]: c["value"] for c in dx.checks if c["check"] == "support_bias"}
    assert checks == {f"{PROCESSED}/hf:fp32": share[(PROCESSED, "hf:fp32")]}
    assert share[(RAW, "hf:fp32")] == 0.0  # raw μ: π on the rule moves log π away from μ, it removes nothing


@pytest.mark.skipif(not (STUDY / "results").exists(), reason="studies/sampling-support has no results")
def test_on_the_sampling_support_study_every_processed_rollout_warns_with_the_attributions_share():
    dx = _diagnose(STUDY)
    checks = {c["pair"]: c for c in dx.checks if c["check"] == "support_bias"}
    share = {f"{r['rollout']}/{r['scorer']}": r["share"] for r in dx.attribution if r["source"] == "support"}
    processed = {c["pair"] for c in dx.checks if c["check"] == "abs_dp_mean" and "-processed/" in c["pair"]}
    assert processed and set(checks) == processed and any("-t0.7-" in p for p in processed)
    assert all(c["verdict"] == "warn" and c["value"] == share[p] for p, c in checks.items())
    raw = [p for p in share if "-processed/" not in p and share[p] == share[p]]  # raw rollouts with log S
    assert raw and all(share[p] == 0.0 for p in raw)
