"""Runs over steps (planted growth and none) and batch invariance (planted differences and none)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from doctor_stores import Pair

from mismatch_lab.analysis.steps import step_series
from mismatch_lab.doctor.report import diagnose
from mismatch_lab.store.reader import open_store
from mismatch_lab.store.synthetic import (
    SyntheticSpec,
    stepped_frames,
    synthetic_store,
    write_store,
)


def _training_store(tmp_path, name: str, drift: float) -> str:
    base = synthetic_store(tmp_path / f"{name}-base.duckdb", SyntheticSpec(n_sequences=96, seed=5))
    path = tmp_path / f"{name}.duckdb"
    write_store(path, stepped_frames(base.frames, 8, kind="train", engine_dtype="bf16", drift=drift))
    return str(path)


def _checks(path: str) -> tuple[list[dict], list[dict]]:
    con = open_store(path)
    try:
        dx = diagnose(con, path)
        return dx.checks, dx.recommendations
    finally:
        con.close()


@pytest.mark.parametrize(("drift", "verdict"), [(0.02, "warn"), (0.0, "ok")])
def test_growth_of_the_per_step_mismatch(tmp_path, drift, verdict):
    path = _training_store(tmp_path, f"d{drift}", drift)
    checks, advice = _checks(path)
    (row,) = [r for r in checks if r["check"] == "growth"]
    con = open_store(path)
    series = step_series(con)
    con.close()
    slope = np.polyfit(series["step"].to_numpy(float), series["abs_dp_mean"].to_numpy(float), 1)[0]
    assert row["value"] == pytest.approx(slope, rel=1e-9)
    assert row["verdict"] == verdict and row["run_id"] == "synthetic-0-vllm-bf16"
    assert "over 8 steps" in row["detail"]
    assert any(a["rule"] == "growth" for a in advice) == (verdict == "warn")


def _batch_pairs(mu_b: float, token_b=None) -> list[Pair]:
    cfg = {"chunk_prompts": 8, "samples": 1}
    return [Pair(config=cfg | {"gen_batch": 1}, run_id="b1"),
            Pair(config=cfg | {"gen_batch": 8}, run_id="b8", mu=mu_b, tokens=token_b)]


def test_batch_invariant_rollouts_pass(store):
    checks, _ = _checks(store(*_batch_pairs(0.5)))
    got = {r["check"]: (r["value"], r["verdict"]) for r in checks if r["check"].startswith("batch")}
    assert got == {"batch_tokens": (0.0, "ok"), "batch_logp": (0.0, "ok")}


def test_batch_dependent_rollouts_fail_the_bitwise_gate(store):
    diverge = lambda s, pos: 99 if (s == 2 and pos == 5) else pos  # one sequence changes at token 5
    checks, advice = _checks(store(*_batch_pairs(0.6, diverge)))
    got = {r["check"]: (r["value"], r["verdict"], r["detail"]) for r in checks if r["check"].startswith("batch")}
    assert got["batch_tokens"][:2] == (pytest.approx(1 / 8), "fail")
    assert got["batch_logp"][:2] == (pytest.approx(np.log(0.6 / 0.5)), "fail")
    assert got["batch_logp"][2] == "batch 1 vs 8: 8 sequences, 75 prefix tokens"  # 7 × 10 + the 5 before the change
    assert [a["rule"] for a in advice if a["rule"] == "batch"] == ["batch"]


def test_runs_differing_in_more_than_the_batch_are_not_compared(store):
    """A seed (or temperature, prompts, model) changes the samples for reasons batching has nothing to do
    with: such runs give no batch-invariance number, however much their tokens differ."""
    diverge = lambda s, pos: 99 if pos == 5 else pos
    b1, b8 = _batch_pairs(0.6, diverge)
    b8.config = b8.config | {"seed": 7}
    checks, advice = _checks(store(b1, b8))
    assert not [r for r in checks if r["check"].startswith("batch")]
    assert not [a for a in advice if a["rule"] == "batch"]


def test_a_store_without_steps_or_batches_says_what_would_measure_them(store):
    con = open_store(store(Pair()))
    dx = diagnose(con)
    con.close()
    assert {n["check"] for n in dx.not_measured} == {"growth", "batch_tokens", "batch_logp", "support_bias"}
    assert all(n["needs"] for n in dx.not_measured)


def test_whole_chunk_runs_of_different_chunk_sizes_are_compared():
    """With gen_batch 0 the batch is chunk_prompts x samples: runs differing in chunk_prompts are batch sizes."""
    from mismatch_lab.figures.batch import _comparable

    a = json.dumps({"gen_batch": 0, "chunk_prompts": 8, "samples": 1, "seed": 0})
    b = json.dumps({"gen_batch": 0, "chunk_prompts": 32, "samples": 1, "seed": 0})
    assert _comparable(a, "m") == _comparable(b, "m")
    assert _comparable(a, "m") != _comparable(a.replace('"seed": 0', '"seed": 1'), "m")
    assert _comparable(a, "m") != _comparable(a, "other-model")
