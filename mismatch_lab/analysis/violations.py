"""Violations on negative samples: tokens already outside the trust region before any update.

DPPO's finding: instability comes from a small share of updates on negative-advantage samples that push
probability far down. At identical parameters, a token of a negative-advantage sequence with pi < mu by
more than delta (binary TV) is already outside the region in the direction its update will push; DPPO
masks it, PPO's ratio clip may not. One row per (rollout, scorer, adv_sign):
* frac_tv_outside       |pi - mu| > delta_tv, either direction
* frac_tv_outside_down  pi < mu and |pi - mu| > delta_tv       * frac_tv_outside_up  pi > mu and ...
* frac_tv_violation     outside in the advantage's direction (down for negative, up for positive)
* frac_kl_violation     binary KL(mu || pi) > delta_kl in the advantage's direction
* frac_ratio_violation  PPO's one-sided clip in the advantage's direction (r < 1 - eps_low for negative,
                        r > 1 + eps_high for positive)
Denominator: finite tokens of the sequences with that advantage sign (`n_tokens`). Empty without
rewards/advantages. `train_series` returns the per-step metrics a training run logged.
"""

from __future__ import annotations

import duckdb
import pandas as pd

from mismatch_lab.analysis import definitions as d
from mismatch_lab.analysis.relations import Filters, empty, query, table_columns
from mismatch_lab.analysis.rows import Rows, Thresholds, rollup

VIOLATION_COLUMNS = [
    "rollout", "scorer", "adv_sign", "n_sequences", "n_tokens", "n_nonfinite",
    "frac_tv_outside", "frac_tv_outside_down", "frac_tv_outside_up",
    "frac_tv_violation", "frac_kl_violation", "frac_ratio_violation",
]  # fmt: skip
SERIES_COLUMNS = ["run_id", "step", "name", "value"]


def violations_table(
    con: duckdb.DuckDBPyConnection,
    *,
    rollout=None,
    scorer=None,
    run_ids=None,
    delta_tv: float = d.DELTA_TV,
    delta_kl: float = d.DELTA_KL,
    eps_low: float = d.EPS_LOW,
    eps_high: float = d.EPS_HIGH,
    _rows: Rows | None = None,
) -> pd.DataFrame:
    """Per (rollout, scorer, adv_sign in negative/positive): shares of tokens outside the trust region
    before any update (module doc). Empty DataFrame with these columns when no advantage is stored."""
    rows = _rows or Rows(con, Filters.make(rollout, scorer, run_ids), topk=False)  # _rows: run_all's
    if not rows.ok:
        return empty(VIOLATION_COLUMNS)
    grid = rows.grid(Thresholds(1.0 - eps_low, 1.0 + eps_high, delta_tv, delta_kl))
    grid = grid[grid["adv_sign"].notna()]
    if grid.empty:
        return empty(VIOLATION_COLUMNS)
    s = rollup(grid, ["rollout", "scorer", "adv_sign"])
    seqs = rows.sequences("rollout")
    n_seq = seqs.groupby(["rollout", "scorer", "adv_sign"]).size().rename("n_sequences").reset_index()
    n = s["n"].astype(float)
    neg = s["adv_sign"] == "negative"  # a negative advantage pushes pi down, a positive one up
    out = pd.DataFrame(
        {
            "rollout": s["rollout"], "scorer": s["scorer"], "adv_sign": s["adv_sign"],
            "n_tokens": s["n"], "n_nonfinite": s["n_nonfinite"],
            "frac_tv_outside": s["c_tv"] / n,
            "frac_tv_outside_down": s["c_tv_down"] / n,
            "frac_tv_outside_up": s["c_tv_up"] / n,
            "frac_tv_violation": s["c_tv_down"].where(neg, s["c_tv_up"]) / n,
            "frac_kl_violation": s["c_kl_down"].where(neg, s["c_kl_up"]) / n,
            "frac_ratio_violation": s["c_lo"].where(neg, s["c_hi"]) / n,
        }
    )  # fmt: skip
    out = out.merge(n_seq, on=["rollout", "scorer", "adv_sign"], how="left")
    out["n_sequences"] = out["n_sequences"].fillna(0).astype("int64")
    return out.sort_values(["rollout", "scorer", "adv_sign"]).reset_index(drop=True)[VIOLATION_COLUMNS]


def train_series(con: duckdb.DuckDBPyConnection, run_id: str | list[str] | None = None) -> pd.DataFrame:
    """Long-form rows (run_id, step, name, value) of `train_metrics`, ordered; empty when none stored.
    Names are slash paths ending in the reduction (e.g. mismatch/abs_dp/mean, mask/negative_adv/frac).
    One row per (run, step, name): where several ranks of a recorded run logged the same metric for a
    step, value is the mean of their values (as data-parallel frameworks average what their ranks log)."""
    if not table_columns(con, "train_metrics"):
        return empty(SERIES_COLUMNS)
    where, params = Filters.make(run_ids=run_id).where("NULL", "NULL", "run_id")
    sql = f"""SELECT run_id, step, name, avg(value) AS value FROM train_metrics WHERE {where}
              GROUP BY run_id, step, name ORDER BY run_id, name, step"""
    return query(con, sql, params)
