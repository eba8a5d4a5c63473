"""steps.step_series: the precision metrics per training step, against a pandas reference on a synthetic
store whose runs were spread over steps with a planted drift (log pi lowered by DRIFT * step)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from analysis_reference import naive_pair_rows

from mismatch_lab.analysis import definitions as d
from mismatch_lab.analysis import run_all
from mismatch_lab.analysis.steps import STEP_COLUMNS, has_steps, step_series
from mismatch_lab.store.reader import open_store
from mismatch_lab.store.synthetic import (
    SyntheticSpec,
    stepped_frames,
    synthetic_store,
    write_store,
)

SPEC = SyntheticSpec(
    rollouts=("vllm:bf16", "vllm:fp16", "vllm:fp32"),
    scorers=("hf:fp32", "hf:bf16"),
    n_sequences=24,
    max_len=20,
    n_one_token=2,
    n_planted=6,
    n_nonfinite=3,
    n_rollout_nonfinite=2,
    rewards="advantage",
    seed=4,
)
STEPS = 4
DRIFT = 0.3  # nats per step: far above the dtype noise (|log r| <= 0.04), so the step dominates |dlogp|
TRAIN, RECORDED, COLLECT = "synthetic-0-vllm-bf16", "synthetic-1-vllm-fp16", "synthetic-2-vllm-fp32"
KEYS = ["run_id", "rollout", "scorer", "step"]


@pytest.fixture(scope="module")
def stepped(tmp_path_factory):
    """(store path, frames): a train run over STEPS steps with the planted drift, a recorded run over 3 steps
    (dtype unknown, trl scorers, no drift), and a collect run without steps."""
    tmp = tmp_path_factory.mktemp("steps")
    base = synthetic_store(tmp / "base.duckdb", SPEC)
    frames = stepped_frames(base.frames, STEPS, run_ids=[TRAIN], kind="train", engine_dtype="bf16", drift=DRIFT)
    frames = stepped_frames(frames, 3, run_ids=[RECORDED], engine_dtype=None, scorers={"hf:fp32": "trl:fp32"})
    return write_store(tmp / "stepped.duckdb", frames), frames


@pytest.fixture()
def scon(stepped):
    c = open_store(stepped[0])
    yield c
    c.close()


def naive_steps(frames, clip=(d.CLIP_LOW, d.CLIP_HIGH)) -> pd.DataFrame:
    """The per-step table from the frames with pandas: means over finite rows, counts over all rows."""
    rows = naive_pair_rows(frames)
    rows = rows[rows["step"].notna()]
    rows = rows.assign(nonfinite=~rows["finite"], outside=((rows["r"] < clip[0]) | (rows["r"] > clip[1])).astype(float).where(rows["finite"]))
    g = rows.groupby(KEYS)
    out = pd.DataFrame({
        "n_tokens": g.size(), "n_nonfinite": g["nonfinite"].sum(),
        "abs_dp_mean": g["abs_dp"].mean(), "abs_dlogp_mean": g["abs_dlogp"].mean(), "kl_k3": g["k3"].mean(),
        "frac_ratio_outside_clip": g["outside"].mean(),
    })  # fmt: skip
    return out.reset_index()


def test_the_series_equals_the_pandas_reference_row_for_row(scon, stepped):
    got = step_series(scon)
    assert list(got.columns) == STEP_COLUMNS
    want = naive_steps(stepped[1])
    assert len(got) == len(want) == STEPS * 2 + 3 * 2  # the train run: 4 steps x 2 scorers; the recorded: 3 x 2
    merged = got.merge(want, on=KEYS, suffixes=("", "_ref"), validate="one_to_one")
    assert len(merged) == len(got)
    assert (merged["n_tokens"] == merged["n_tokens_ref"]).all()
    assert (merged["n_nonfinite"] == merged["n_nonfinite_ref"]).all() and merged["n_nonfinite"].sum() > 0
    assert (merged["n_finite"] == merged["n_tokens"] - merged["n_nonfinite"]).all()
    for c in ("abs_dp_mean", "abs_dlogp_mean", "kl_k3", "frac_ratio_outside_clip"):
        np.testing.assert_allclose(merged[c], merged[c + "_ref"], rtol=1e-9, atol=1e-15, err_msg=c)


def test_collect_runs_without_steps_are_left_out_and_labels_follow_the_runs(scon):
    got = step_series(scon)
    assert set(got["run_id"]) == {TRAIN, RECORDED}
    labels = set(zip(got["run_id"], got["rollout"], got["scorer"]))
    assert labels == {(TRAIN, "vllm:bf16", "hf:fp32"), (TRAIN, "vllm:bf16", "hf:bf16"), (RECORDED, "vllm", "trl:fp32"),
                      (RECORDED, "vllm", "hf:bf16")}  # fmt: skip
    assert got.groupby(["run_id", "scorer"])["step"].apply(list).to_dict()[(TRAIN, "hf:fp32")] == list(range(STEPS))


def test_the_planted_drift_grows_with_the_step(scon):
    s = step_series(scon, run_ids=TRAIN, scorer="hf:fp32").set_index("step")
    # every finite row of step k has dlogp = DRIFT * k + noise (|noise| <= 0.04, planted tokens aside)
    assert s["abs_dlogp_mean"].is_monotonic_increasing and s["kl_k3"].is_monotonic_increasing
    for k in range(1, STEPS):
        assert s.loc[k, "abs_dlogp_mean"] == pytest.approx(DRIFT * k, abs=0.1)
    assert s.loc[STEPS - 1, "frac_ratio_outside_clip"] == 1.0  # r = exp(-0.9) = 0.41: every token clipped
    assert s.loc[0, "frac_ratio_outside_clip"] < 0.3


def test_filters_and_clip_range_are_those_of_every_analysis(scon, stepped):
    only = step_series(scon, rollout="vllm", scorer=["trl:fp32"])
    assert set(zip(only["run_id"], only["scorer"])) == {(RECORDED, "trl:fp32")} and len(only) == 3
    assert step_series(scon, run_ids=[COLLECT]).empty
    wide = step_series(scon, clip_low=0.5, clip_high=2.0)
    want = naive_steps(stepped[1], clip=(0.5, 2.0)).set_index(KEYS)["frac_ratio_outside_clip"]
    np.testing.assert_allclose(wide.set_index(KEYS)["frac_ratio_outside_clip"].loc[want.index], want, rtol=1e-12)


def test_run_all_reports_the_series_under_steps(scon):
    out = run_all(scon)
    pd.testing.assert_frame_equal(out["steps"].reset_index(drop=True), step_series(scon), check_dtype=False, rtol=1e-12)


def test_a_store_without_steps_gives_an_empty_table_with_the_columns(con, plain_con):
    for c in (con, plain_con):
        assert not has_steps(c)
        table = step_series(c)
        assert table.empty and list(table.columns) == STEP_COLUMNS


def test_growth_is_the_least_squares_slope_per_step_with_its_interval(scon):
    from mismatch_lab.analysis.stats import t_quantile
    from mismatch_lab.analysis.steps import GROWTH_COLUMNS, growth

    series = step_series(scon)
    fits = growth(series, "abs_dp_mean")
    assert list(fits.columns) == GROWTH_COLUMNS and len(fits)
    for fit in fits.itertuples(index=False):
        g = series[(series["run_id"] == fit.run_id) & (series["rollout"] == fit.rollout) & (series["scorer"] == fit.scorer)]
        (slope, _), cov = np.polyfit(g["step"].astype(float), g["abs_dp_mean"].astype(float), 1, cov=True)
        half = t_quantile(0.975, len(g) - 2) * np.sqrt(cov[0, 0])
        assert fit.n_steps == len(g)
        y, k = g.sort_values("step")["abs_dp_mean"].to_numpy(float), max(1, len(g) // 4)  # a quarter, at least one
        assert (fit.first_mean, fit.last_mean) == pytest.approx((y[:k].mean(), y[-k:].mean()), rel=1e-12)
        assert fit.slope == pytest.approx(slope, rel=1e-9)
        assert (fit.ci_low, fit.ci_high) == pytest.approx((slope - half, slope + half), rel=1e-6)


def test_growth_needs_three_steps_and_recovers_a_planted_line():
    from mismatch_lab.analysis.steps import growth

    rows = [("a", "vllm:bf16", "hf:fp32", s, 0.01 + 0.002 * s) for s in range(5)]
    rows += [("b", "vllm:bf16", "hf:fp32", s, 0.5) for s in range(2)]  # two steps: no line to fit
    series = pd.DataFrame(rows, columns=["run_id", "rollout", "scorer", "step", "abs_dp_mean"])
    fits = growth(series)
    assert list(fits["run_id"]) == ["a"]
    assert fits.loc[0, "slope"] == pytest.approx(0.002, rel=1e-9)
    assert fits.loc[0, "ci_low"] == pytest.approx(0.002, rel=1e-6) and fits.loc[0, "ci_high"] == pytest.approx(0.002, rel=1e-6)
