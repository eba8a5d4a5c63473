"""Precision (the FP16 study): how far the rollout's mu and the scorer's pi disagree, per pair.

* `precision_table`: one row per (rollout, scorer) pair, token level and sequence level.
* `sequence_drift`: one row per sequence: sum of log-ratios against response length (FP16 paper, Fig. 2).
* `noise_floor`: the same metrics between two scorers on the same tokens (e.g. hf:bf16 against hf:fp32),
  the disagreement of one trainer dtype with the fp32 trainer, below which no rollout can be judged.

Definitions (probability vs log space, KL estimator and direction, denominators): `definitions` and
docs/analysis.md. Token-level means run over finite rows (`n_finite`); sequence-level means over
sequences without any non-finite row (`seq_n`).
"""

from __future__ import annotations

import duckdb
import numpy as np
import pandas as pd

from mismatch_lab.analysis import definitions as d
from mismatch_lab.analysis.relations import Filters, empty
from mismatch_lab.analysis.rows import Rows, Thresholds, rollup

TOKEN_COLUMNS = [
    "n_tokens", "n_nonfinite", "n_finite",
    "abs_dp_mean", "abs_dp_max", "dp_mean",
    "abs_dlogp_mean", "abs_dlogp_max", "dlogp_mean",
    "kl_k1", "kl_k2", "kl_k3", "chi2", "r_mean", "binary_kl_mean",
    "frac_ratio_outside_clip", "frac_abs_r_minus_1_gt_0_1", "frac_abs_dp_gt_0_5",
]  # fmt: skip
SEQUENCE_SUMMARY_COLUMNS = [
    "seq_n", "seq_n_nonfinite", "seq_len_mean", "seq_logratio_sum_mean",
    "seq_logratio_slope_per_1k", "seq_logratio_slope_ci_low_per_1k", "seq_logratio_slope_ci_high_per_1k",
    "seq_logratio_intercept",
    "seq_logratio_rate_per_1k", "seq_logratio_rate_ci_low_per_1k", "seq_logratio_rate_ci_high_per_1k",
    "seq_kl_k1_mean", "seq_kl_k3_mean",
]  # fmt: skip
PRECISION_COLUMNS = ["rollout", "scorer", *TOKEN_COLUMNS, *SEQUENCE_SUMMARY_COLUMNS]
NOISE_FLOOR_COLUMNS = ["rollout", "scorer", "reference", *TOKEN_COLUMNS, *SEQUENCE_SUMMARY_COLUMNS]
DRIFT_COLUMNS = [
    "rollout", "scorer", "run_id", "seq_id", "response_len", "n_nonfinite",
    "logratio_sum", "seq_kl_k1", "seq_kl_k3",
]  # fmt: skip


def token_metrics(s: pd.DataFrame) -> pd.DataFrame:
    """TOKEN_COLUMNS from rolled-up sums (rows.sums_sql); every mean over the n finite rows."""
    n = s["n"].astype(float)
    return pd.DataFrame(
        {
            "n_tokens": s["n"] + s["n_nonfinite"],
            "n_nonfinite": s["n_nonfinite"],
            "n_finite": s["n"],
            "abs_dp_mean": s["s_btv"] / n,
            "abs_dp_max": s["x_btv"],
            "dp_mean": s["s_dp"] / n,
            "abs_dlogp_mean": s["s_adlogp"] / n,
            "abs_dlogp_max": s["x_adlogp"],
            "dlogp_mean": s["s_dlogp"] / n,
            "kl_k1": -s["s_dlogp"] / n,  # k1 = log mu - log pi = -dlogp
            "kl_k2": s["s_k2"] / n,
            "kl_k3": s["s_k3"] / n,
            "chi2": s["s_r2"] / n - 1.0,
            "r_mean": 1.0 + s["s_r1"] / n,
            "binary_kl_mean": s["s_bkl"] / n,
            "frac_ratio_outside_clip": (s["c_hi"] + s["c_lo"]) / n,
            "frac_abs_r_minus_1_gt_0_1": s["c_dev"] / n,
            "frac_abs_dp_gt_0_5": s["c_bigdp"] / n,
        },
        index=s.index,
    )


def drift_summary(seqs: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """SEQUENCE_SUMMARY_COLUMNS per `keys` from per-sequence rows (rows.Rows.sequences). The slope is the
    least-squares fit of logratio_sum on response_len over sequences without a non-finite row, times
    1000 (per 1K tokens), with its 95 % t-interval (n − 2 degrees of freedom, analysis.stats.slope_ci);
    the slope is NaN with fewer than two distinct lengths, the interval with fewer than three sequences.
    The rate is the fit through the origin, logratio_sum = rate · response_len (a drift that starts at 0
    with the first token), times 1000, with its 95 % t-interval (n − 1 degrees of freedom,
    stats.origin_slope_ci); it needs two sequences. Where lengths hardly vary (a length cap most responses
    reach) the slope's interval is wide and the rate is the measurable quantity."""
    from mismatch_lab.analysis.stats import origin_slope_ci, slope_ci

    out = []
    for key, g in seqs.groupby(keys, sort=True, dropna=False):
        ok = g[g["logratio_sum"].notna()]
        x, y = ok["response_len"].to_numpy(float), ok["logratio_sum"].to_numpy(float)
        slope = intercept = lo = hi = np.nan
        if len(x) >= 3 and np.ptp(x) > 0:
            fit = slope_ci(x, y)
            slope, lo, hi = fit.slope, fit.ci_low, fit.ci_high
        elif len(x) == 2 and np.ptp(x) > 0:  # the line through both points, no interval
            slope = float((y[1] - y[0]) / (x[1] - x[0]))
        if not np.isnan(slope):
            intercept = float(y.mean() - slope * x.mean())
        rate = (np.nan,) * 3
        if len(x) >= 2:
            f0 = origin_slope_ci(x, y)
            rate = (f0.slope, f0.ci_low, f0.ci_high)
        out.append(
            dict(zip(keys, key if isinstance(key, tuple) else (key,)))
            | {
                "seq_n": len(ok),
                "seq_n_nonfinite": len(g) - len(ok),
                "seq_len_mean": x.mean() if len(x) else np.nan,
                "seq_logratio_sum_mean": y.mean() if len(y) else np.nan,
                "seq_logratio_slope_per_1k": 1000.0 * slope,
                "seq_logratio_slope_ci_low_per_1k": 1000.0 * lo,
                "seq_logratio_slope_ci_high_per_1k": 1000.0 * hi,
                "seq_logratio_intercept": intercept,
                **dict(zip(("seq_logratio_rate_per_1k", "seq_logratio_rate_ci_low_per_1k",
                            "seq_logratio_rate_ci_high_per_1k"), (1000.0 * v for v in rate))),
                "seq_kl_k1_mean": ok["seq_kl_k1"].mean(),
                "seq_kl_k3_mean": ok["seq_kl_k3"].mean(),
            }
        )
    return pd.DataFrame(out, columns=[*keys, *SEQUENCE_SUMMARY_COLUMNS])


def _table(sums: pd.DataFrame, seqs: pd.DataFrame, keys: list[str], columns: list[str]) -> pd.DataFrame:
    if sums.empty:
        return empty(columns)
    tokens = pd.concat([sums[keys], token_metrics(sums)], axis=1)
    out = tokens.merge(drift_summary(seqs, keys), on=keys, how="left")
    out[["seq_n", "seq_n_nonfinite"]] = out[["seq_n", "seq_n_nonfinite"]].fillna(0).astype("int64")
    return out.sort_values(keys).reset_index(drop=True)[columns]


def precision_table(
    con: duckdb.DuckDBPyConnection,
    *,
    rollout=None,
    scorer=None,
    run_ids=None,
    clip_low: float = d.CLIP_LOW,
    clip_high: float = d.CLIP_HIGH,
    _rows: Rows | None = None,
) -> pd.DataFrame:
    """One row per (rollout, scorer) pair: token-level |dp|, |dlogp|, KL k1/k2/k3 of KL(mu || pi), chi2,
    shares beyond thresholds (TOKEN_COLUMNS) and the sequence-level drift summary
    (SEQUENCE_SUMMARY_COLUMNS). `rollout`/`scorer` accept a label or a list; `run_ids` restricts runs."""
    # _rows: run_all's shared row set (its filters already applied); top-K is not needed here
    rows = _rows or Rows(con, Filters.make(rollout, scorer, run_ids), topk=False)
    if not rows.ok:
        return empty(PRECISION_COLUMNS)
    grid = rows.grid(Thresholds(clip_low=clip_low, clip_high=clip_high))
    keys = ["rollout", "scorer"]
    return _table(rollup(grid, keys), rows.sequences("rollout"), keys, PRECISION_COLUMNS)


def precision_from(sums: pd.DataFrame, seqs: pd.DataFrame) -> pd.DataFrame:
    """`precision_table` of every pair from PRECISION_SUMS per (rollout, scorer, ...) rows, summed here (maxima
    taken), and the rows of `Rows.sequences('rollout')` (a shard store's Overview keeps both per unit,
    `store.units_overview`)."""
    keys = ["rollout", "scorer"]
    return _table(rollup(sums, keys) if len(sums) else sums, seqs, keys, PRECISION_COLUMNS)


def sequence_drift(con: duckdb.DuckDBPyConnection, *, rollout=None, scorer=None, run_ids=None) -> pd.DataFrame:
    """One row per (rollout, scorer, sequence): response_len (tokens scored), n_nonfinite, logratio_sum =
    sum of (log pi - log mu), seq_kl_k1 = sum of (log mu - log pi) (the sequence-level KL(mu || pi) of the
    FP16 paper), seq_kl_k3 = sum of k3. Sums are NULL for sequences holding a non-finite row."""
    rows = Rows(con, Filters.make(rollout, scorer, run_ids), topk=False)
    if not rows.ok:
        return empty(DRIFT_COLUMNS)
    return rows.sequences("rollout")[DRIFT_COLUMNS]


def noise_floor(
    con: duckdb.DuckDBPyConnection,
    *,
    reference: str = d.REFERENCE_SCORER,
    rollout=None,
    scorer=None,
    run_ids=None,
    clip_low: float = d.CLIP_LOW,
    clip_high: float = d.CLIP_HIGH,
    _rows: Rows | None = None,
) -> pd.DataFrame:
    """The precision metrics of every scorer against `reference` on the same tokens (the reference's pi
    plays mu): one row per (rollout whose tokens were scored, scorer, reference). Empty when no token
    was scored by both."""
    rows = _rows or Rows(con, Filters.make(rollout, scorer, run_ids), reference, topk=False)
    if not rows.ok:
        return empty(NOISE_FLOOR_COLUMNS)
    sums = rows.scorer_sums(Thresholds(clip_low=clip_low, clip_high=clip_high))
    return _table(sums, rows.sequences("scorer"), ["rollout", "scorer", "reference"], NOISE_FLOOR_COLUMNS)
