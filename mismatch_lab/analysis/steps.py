"""Mismatch over training steps: the precision metrics per step of the runs whose sequences carry a step.

Train runs, and runs recorded in or imported from a user's RL framework, store `sequences.step`; collect
runs leave it NULL and are not part of this table. One row per (run_id, rollout, scorer, step), over the
(token, scorer) rows of the run's sequences of that step (the rollout row set of `relations`, which carries
each token's sequence step; a token whose sequence row is missing or has no step is left out):
* n_tokens       (token, scorer) rows of the step, non-finite ones included
* n_nonfinite    rows excluded as non-finite (definitions.finite_sql)
* n_finite       n_tokens - n_nonfinite: the denominator of every mean and share below
* abs_dp_mean    mean |pi - mu|                      (probability space)
* abs_dlogp_mean mean |log pi - log mu|              (log space, nats)
* kl_k3          mean k3 = r - log r - 1             (token-level estimate of KL(mu || pi), nats)
* frac_ratio_outside_clip  share with r < clip_low or r > clip_high (default [0.8, 1.28])
The metrics are those of `precision.token_metrics`, computed from the same additive sums (`rows.Rows.step_sums`,
or run_all's grid of `rows.Rows.grid` rolled up by step), so a step's row equals the precision table of that
step's tokens alone.

`growth(series, metric)`: per (run_id, rollout, scorer) with at least 3 steps, the OLS slope of the metric
on the step number (per step) with its two-sided 95 % t-interval (n_steps − 2 degrees of freedom;
stats.slope_ci): does a run's mismatch grow as it trains? The steps are points of one run, not independent
draws, so the interval reads as "how well a line fits", not as a test across runs.
"""

from __future__ import annotations

import duckdb
import numpy as np
import pandas as pd

from mismatch_lab.analysis import definitions as d
from mismatch_lab.analysis.precision import token_metrics
from mismatch_lab.analysis.relations import Filters, empty, query, table_columns
from mismatch_lab.analysis.rows import PRECISION_SUMS, Rows, Thresholds, rollup

METRIC_COLUMNS = ["abs_dp_mean", "abs_dlogp_mean", "kl_k3", "frac_ratio_outside_clip"]
STEP_COLUMNS = ["run_id", "rollout", "scorer", "step", "n_tokens", "n_nonfinite", "n_finite", *METRIC_COLUMNS]


def has_steps(con: duckdb.DuckDBPyConnection) -> bool:
    """Whether any sequence of the store carries a training step."""
    if "step" not in table_columns(con, "sequences"):
        return False
    return con.execute("SELECT EXISTS (SELECT 1 FROM sequences WHERE step IS NOT NULL)").fetchone()[0]


def step_series(
    con: duckdb.DuckDBPyConnection,
    *,
    rollout=None,
    scorer=None,
    run_ids=None,
    clip_low: float = d.CLIP_LOW,
    clip_high: float = d.CLIP_HIGH,
    _rows: Rows | None = None,
) -> pd.DataFrame:
    """Per (run_id, rollout, scorer, step) of the runs over steps: counts, mean |dp|, mean |dlogp|, mean k3
    and the share of r outside [clip_low, clip_high] over the step's finite (token, scorer) rows (module
    doc). Ordered by run_id, rollout, scorer, step; empty (with these columns) when no sequence has a step.
    `rollout` / `scorer` / `run_ids` filter as in every analysis (a label, a list, or None for all)."""
    rows = _rows or Rows(con, Filters.make(rollout, scorer, run_ids), topk=False)  # _rows: run_all's row set
    if not rows.ok or not has_steps(con):
        return empty(STEP_COLUMNS)
    # the row set carries each token's sequence step (relations.advantage_sql): run_all's grid keeps it; a
    # call of its own sums the steps alone
    t = Thresholds(clip_low=clip_low, clip_high=clip_high)
    keys = ["run_id", "rollout", "scorer", "step"]
    if _rows is None:
        s = rows.step_sums(t)[keys + list(PRECISION_SUMS)]
    else:
        grid = rows.grid(t)
        s = rollup(grid[grid["step"].notna()], keys)
    return series_of(s)


def series_of(s: pd.DataFrame) -> pd.DataFrame:
    """STEP_COLUMNS from PRECISION_SUMS per (run_id, rollout, scorer, step) (`step_series`; a shard store's
    Overview merges them from its units, `store.units_overview`)."""
    if s.empty:
        return empty(STEP_COLUMNS)
    keys = ["run_id", "rollout", "scorer", "step"]
    out = pd.concat([s[keys].reset_index(drop=True), token_metrics(s).reset_index(drop=True)], axis=1)
    out["step"] = out["step"].astype("int64")
    return out.sort_values(["run_id", "rollout", "scorer", "step"]).reset_index(drop=True)[STEP_COLUMNS]


def step_counts(con: duckdb.DuckDBPyConnection) -> pd.DataFrame:
    """`browse.training_steps` of every run with sequences on `con`, with its run_id first: per (run_id, step)
    the sequence and token counts and reward means (the Training page's step list, kept per unit by
    `store.units`). One query for every run."""
    from mismatch_lab.analysis.browse import training_steps_sql

    return query(con, training_steps_sql(con, "true", ["run_id", "step"]))[["run_id", *STEP_COUNT_COLUMNS]]


def step_sequences(con: duckdb.DuckDBPyConnection) -> pd.DataFrame:
    """`browse.list_sequences` of every run with sequences on `con`, with its run_id first (the Training page's
    sequences of a step, kept per unit by `store.units`). One query for every run."""
    from mismatch_lab.analysis.browse import sequences_sql

    return query(con, sequences_sql(con, "true", ["run_id", "seq_id"]))


STEP_COUNT_COLUMNS = ["step", "n_sequences", "n_tokens", "n_rewarded", "mean_reward", "mean_advantage"]


def quarter(n_steps: int) -> int:
    """How many steps first_mean / last_mean of `growth` average: a quarter of them, at least one."""
    return max(1, int(n_steps) // 4)


GROWTH_COLUMNS = ["run_id", "rollout", "scorer", "n_steps", "slope", "ci_low", "ci_high", "first_mean", "last_mean"]


def growth(series: pd.DataFrame, metric: str = "abs_dp_mean") -> pd.DataFrame:
    """GROWTH_COLUMNS from a step_series frame: the per-step slope of `metric` and its 95 % t-interval, for
    every (run_id, rollout, scorer) with at least 3 steps where the metric is not null; first_mean /
    last_mean: the metric's mean over the first / last quarter of those steps (at least one step)."""
    from mismatch_lab.analysis.stats import slope_ci

    out = []
    for (run_id, rollout, scorer), g in series.groupby(["run_id", "rollout", "scorer"], sort=True):
        g = g[g[metric].notna()].sort_values("step")
        if g["step"].nunique() < 3:
            continue
        fit = slope_ci(g["step"], g[metric])
        y, k = g[metric].to_numpy(float), quarter(len(g))
        out.append([run_id, rollout, scorer, len(g), fit.slope, fit.ci_low, fit.ci_high,
                    float(np.mean(y[:k])), float(np.mean(y[-k:]))])
    return pd.DataFrame(out, columns=GROWTH_COLUMNS)
