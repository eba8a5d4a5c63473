"""`analysis.staleness`: μ-vs-π per policy lag, on a Recorder-written store whose lag is known."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mismatch_lab.analysis.staleness import staleness_table
from mismatch_lab.cli import main
from mismatch_lab.record import Recorder
from mismatch_lab.store.reader import open_store

SHIFT = 0.25  # lag-1 sequences: log pi moved by this much on top of the numerical noise
REL = 1e-12  # float64 means of a few hundred terms summed in another order


def _steps(seed: int = 0, B: int = 8, T: int = 16):
    """Two steps of [B, T] arrays: numerical noise everywhere, SHIFT more on the odd (lag-1) sequences."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(2):
        mu = np.log(rng.uniform(0.05, 0.6, (B, T)))  # <= log 0.6: pi stays a probability after the shift
        lag = np.arange(B) % 2
        pi = mu + rng.normal(0, 0.01, (B, T)) + SHIFT * lag[:, None]
        mask = rng.uniform(size=(B, T)) > 0.2
        out.append((mu, pi, mask, lag))
    return out


def _numpy_row(steps, lag: int) -> dict[str, float]:
    """The metrics of the lag's tokens, computed here without the store or SQL."""
    dl, dp = [], []
    for mu, pi, mask, lags in steps:
        keep = mask & (lags == lag)[:, None]
        dl.append((pi - mu)[keep])
        dp.append((np.exp(pi) - np.exp(mu))[keep])
    dl, dp = np.concatenate(dl), np.concatenate(dp)
    return {"n_finite": dl.size, "abs_dp_mean": np.abs(dp).mean(), "abs_dlogp_mean": np.abs(dl).mean(),
            "kl_k3": (np.exp(dl) - dl - 1).mean()}


@pytest.fixture()
def lag_store(tmp_path):
    steps = _steps()
    with Recorder(tmp_path / "store", "async-run", framework="test", rollout_engine="vllm") as rec:
        for step, (mu, pi, mask, lag) in enumerate(steps, start=1):
            rec.log_step(step, None, mask, mu, pi, policy_lag=lag)
    return tmp_path / "store", steps


def test_the_lag_0_row_is_the_numerical_mismatch_computed_in_numpy_and_lag_1_holds_the_shift(lag_store):
    path, steps = lag_store
    con = open_store(path)
    table = staleness_table(con)
    assert list(table["policy_lag"]) == [0, 1] and set(table["run_id"]) == {"async-run"}
    for lag in (0, 1):
        row, want = table.iloc[lag], _numpy_row(steps, lag)
        assert row["n_finite"] == want["n_finite"] and row["n_nonfinite"] == 0
        for name in ("abs_dp_mean", "abs_dlogp_mean", "kl_k3"):
            assert row[name] == pytest.approx(want[name], rel=REL), (lag, name)
    assert table.iloc[0]["abs_dlogp_mean"] < 0.02 < SHIFT * 0.9 < table.iloc[1]["abs_dlogp_mean"]


def test_analyze_json_carries_the_staleness_rows_and_a_store_without_lags_gives_none(lag_store, tmp_path):
    path, steps = lag_store
    target = tmp_path / "a.json"
    assert main(["analyze", "--db", str(path), "--json", str(target)]) == 0
    rows = json.loads(target.read_text())["staleness"]
    assert [r["policy_lag"] for r in rows] == [0, 1]
    assert rows[0]["abs_dlogp_mean"] == pytest.approx(_numpy_row(steps, 0)["abs_dlogp_mean"], rel=REL)
    mu, pi, mask, _ = steps[0]
    with Recorder(tmp_path / "plain", "sync-run", framework="test") as rec:
        rec.log_step(1, None, mask, mu, pi)
    assert staleness_table(open_store(tmp_path / "plain")).empty
