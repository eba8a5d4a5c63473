"""Volatility (DPPO Fig. 2): how the ratio r = pi/mu spreads against the binary TV |pi - mu|, by mu.

At identical parameters r should be 1. As mu -> 0 a tiny move in mass is a large move in r, so ratio
clipping sees noise there; TV does not. One row per (rollout, scorer, mu bucket); every bucket of the
grid is present, empty ones with n_tokens = 0 and empty statistics. Rows whose log mu is not finite
cannot be bucketed: they appear in one extra row `bucket = -1` (label 'mu non-finite') when any exist.
"""

from __future__ import annotations

import duckdb
import numpy as np
import pandas as pd

from mismatch_lab.analysis import definitions as d
from mismatch_lab.analysis.relations import Filters, empty
from mismatch_lab.analysis.rows import R_QUANTILE_COLUMNS, Rows, Thresholds, rollup

STAT_COLUMNS = [
    "n_tokens", "n_nonfinite", "mu_mean", "r_mean", "r_std", *R_QUANTILE_COLUMNS, "frac_r_outside_eps",
    "binary_tv_mean", "binary_tv_p99", "n_topk", "topk_tv_mean", "topk_tv_p99",
    "n_exact", "tv_exact_vs_ref_mean", "tv_exact_vs_ref_p99",
]  # fmt: skip
VOLATILITY_COLUMNS = ["rollout", "scorer", "scale", "bucket", "mu_lo", "mu_hi", "bucket_label", *STAT_COLUMNS]
NONFINITE_BUCKET = -1
COUNTS = ("n_tokens", "n_nonfinite", "n_topk", "n_exact")


def bucket_grid(scale: str, edges: list[tuple[float, float]], with_nonfinite: bool) -> pd.DataFrame:
    """bucket, mu_lo, mu_hi, bucket_label for every bucket (+ the 'mu non-finite' row on request)."""
    last = len(edges) - 1
    grid = pd.DataFrame(
        {
            "bucket": range(len(edges)),
            "mu_lo": [lo for lo, _ in edges],
            "mu_hi": [hi for _, hi in edges],
            "bucket_label": [d.bucket_label(lo, hi, i == last) for i, (lo, hi) in enumerate(edges)],
        }
    )
    if with_nonfinite:
        bad = pd.DataFrame({"bucket": [NONFINITE_BUCKET], "mu_lo": [np.nan], "mu_hi": [np.nan],
                            "bucket_label": ["mu non-finite"]})  # fmt: skip
        grid = pd.concat([bad, grid], ignore_index=True)
    return grid


def volatility_table(
    con: duckdb.DuckDBPyConnection,
    *,
    rollout=None,
    scorer=None,
    run_ids=None,
    buckets: str = "linear",
    n_buckets: int | None = None,
    eps_low: float = d.EPS_LOW,
    eps_high: float = d.EPS_HIGH,
    _rows: Rows | None = None,
) -> pd.DataFrame:
    """Per (rollout, scorer, mu bucket): count, mean and sample std (n - 1) and quantiles of r, share of r
    outside [1 - eps_low, 1 + eps_high], binary TV mean and p99, top-K TV (where top-K was recorded;
    denominator n_topk) and the stored exact TV of the scorer against the fp32 reference scorer
    (denominator n_exact). `buckets`: 'linear' (n_buckets equal widths on [0, 1], default 10) or 'log'
    (one bucket below 1e-6, then n_buckets log-spaced up to 1, default 12)."""
    edges = d.bucket_edges(buckets, n_buckets)  # validates `buckets`
    n = len(edges) - (1 if buckets == "log" else 0)
    rows = _rows or Rows(con, Filters.make(rollout, scorer, run_ids))  # _rows: run_all's shared row set
    if not rows.ok:
        return empty(VOLATILITY_COLUMNS)
    t = Thresholds(clip_low=1.0 - eps_low, clip_high=1.0 + eps_high)
    linear = buckets == "linear"
    grid = rows.grid(t, **({"n_linear": n} if linear else {"n_log": n}))
    if grid.empty:
        return empty(VOLATILITY_COLUMNS)
    s = rollup(grid, ["rollout", "scorer", "lb" if linear else "gb"]).rename(columns={"lb": "bucket", "gb": "bucket"})
    nf = s["n"].astype(float)
    stats = pd.DataFrame(
        {
            "rollout": s["rollout"], "scorer": s["scorer"], "bucket": s["bucket"].astype("int64"),
            "n_tokens": s["n"], "n_nonfinite": s["n_nonfinite"],
            "mu_mean": s["s_mu"] / nf,
            "r_mean": 1.0 + s["s_r1"] / nf,
            # sample variance from sums of (r - 1), shifted so the subtraction does not cancel
            "r_std": np.sqrt(((s["s_r1sq"] - s["s_r1"] ** 2 / nf) / (nf - 1)).clip(lower=0).where(nf > 1)),
            "frac_r_outside_eps": (s["c_hi"] + s["c_lo"]) / nf,
            "binary_tv_mean": s["s_btv"] / nf,
            "n_topk": s["n_topk"], "topk_tv_mean": s["s_ktv"] / s["n_topk"].astype(float),
            "n_exact": s["n_exact"], "tv_exact_vs_ref_mean": s["s_exact"] / s["n_exact"].astype(float),
        }
    )  # fmt: skip
    q = rows.quantiles(buckets, n)
    q["bucket"] = q["bucket"].astype("int64")
    stats = stats.merge(q, on=["rollout", "scorer", "bucket"], how="left")
    return complete_buckets(stats, buckets, edges, ["rollout", "scorer"], COUNTS)[VOLATILITY_COLUMNS]


def complete_buckets(stats: pd.DataFrame, scale: str, edges, keys: list[str], counts) -> pd.DataFrame:
    """Every bucket for every `keys` group of stats (empty ones with zero counts); the 'mu non-finite'
    row (bucket -1) only for the groups that have one. Sorted by keys then bucket."""
    grid = bucket_grid(scale, edges, with_nonfinite=True)
    groups = stats[keys].drop_duplicates()
    full = pd.concat(
        [groups.merge(grid[grid["bucket"] != NONFINITE_BUCKET], how="cross"),
         stats.loc[stats["bucket"] == NONFINITE_BUCKET, keys].merge(grid[grid["bucket"] == NONFINITE_BUCKET], how="cross")],
        ignore_index=True,
    )  # fmt: skip
    full = full.merge(stats, on=[*keys, "bucket"], how="left")
    full[list(counts)] = full[list(counts)].fillna(0).astype("int64")
    full["scale"] = scale
    return full.sort_values([*keys, "bucket"], kind="stable").reset_index(drop=True)
