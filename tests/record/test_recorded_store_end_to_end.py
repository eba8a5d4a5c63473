"""A run written through the Recorder is a store like any other: `analyze --db DIR`, `figures DIR` and the
app (`app --study DIR`) read it, and its per-step series shows the mismatch it was recorded with."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mismatch_lab.cli import main
from mismatch_lab.record import Recorder

APP = Path(__file__).resolve().parents[2] / "apps" / "streamlit_app.py"

STEPS, B, T = 4, 6, 9
NOISE = (0.01, 0.02, 0.04, 0.08)  # |log pi - log mu| grows with the step, as a drifting run's would


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """Two ranks, four steps; returns the store and the per-step mean |dlogp| computed by numpy."""
    root = tmp_path_factory.mktemp("rec") / "store"
    want = {}
    recs = [Recorder(root, "grpo-1", framework="trl", rollout_engine="vllm", trainer_dtype="fp32",
                     rollout_dtype="bf16", rank=r) for r in (0, 1)]  # fmt: skip
    for step in range(STEPS):
        vals = []
        for rank, rec in enumerate(recs):
            rng = np.random.default_rng(10 * step + rank)
            mask = rng.random((B, T)) < 0.8
            lmu = np.log(rng.uniform(0.05, 0.9, (B, T)))  # <= log 0.9: log pi = log mu +- 0.08 stays <= 0
            lpi = lmu + rng.choice([-1, 1], (B, T)) * NOISE[step]
            rewards = (rng.random(B) < 0.5).astype(float)
            rec.log_step(step, rng.integers(0, 1000, (B, T)), mask, lmu, lpi, advantages=rewards - rewards.mean(),
                         rewards=rewards)
            vals.append(np.abs(lpi - lmu)[mask])
        want[step] = float(np.concatenate(vals).mean())
    for rec in recs:
        rec.close()
    return root, want


def test_analyze_reads_a_recorded_store_and_its_steps_equal_numpy(recorded, tmp_path, capsys):
    root, want = recorded
    out = tmp_path / "a.json"
    assert main(["analyze", "--db", str(root), "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    steps = sorted(data["steps"], key=lambda r: r["step"])
    assert [r["step"] for r in steps] == list(range(STEPS))
    assert {(r["rollout"], r["scorer"]) for r in steps} == {("vllm:bf16", "trl:fp32")}
    np.testing.assert_allclose([r["abs_dlogp_mean"] for r in steps], [want[s] for s in range(STEPS)], rtol=1e-9)
    prec = [r for r in data["precision"] if r["comparison"] == "rollout_vs_scorer"]
    assert len(prec) == 1 and prec[0]["n_tokens"] == sum(r["n_tokens"] for r in steps)


def test_figures_draw_a_recorded_store(recorded, tmp_path):
    root, _ = recorded
    assert main(["figures", str(root), "--out", str(tmp_path), "--format", "png"]) == 0
    drawn = {p.stem for p in tmp_path.glob("*.png")}
    assert any(s.startswith("fig9_mismatch_over_steps") for s in drawn), drawn  # the per-step figure
    assert any(s.startswith("fig1") for s in drawn), drawn  # token figures read recorded runs too


def test_the_app_opens_a_recorded_store_down_to_its_training_page(recorded, monkeypatch):
    from streamlit.testing.v1 import AppTest

    root, want = recorded
    monkeypatch.setenv("MISMATCH_LAB_STUDY", str(root))
    at = AppTest.from_file(str(APP), default_timeout=60)
    at.run()
    assert not at.exception, at.exception
    at.switch_page("app_pages/training.py").run()
    assert not at.exception, at.exception
    per_step = next(df.value for df in at.dataframe if {"step", "abs_dlogp_mean"} <= set(df.value.columns))
    got = per_step.sort_values("step")
    np.testing.assert_allclose(got["abs_dlogp_mean"], [want[s] for s in range(STEPS)], rtol=1e-9)
