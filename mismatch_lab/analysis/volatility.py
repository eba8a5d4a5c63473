"""Volatility (DPPO Fig. 2): how the ratio r = pi/mu spreads against the binary TV |pi - mu|, by mu.

At identical parameters r should be 1. As mu -> 0 a tiny move in mass is a large move in r, so ratio
clipping sees noise there; TV does not. One row per (rollout, scorer, mu bucket); every bucket of the
grid is present, empty ones with n_tokens = 0 and empty statistics. Rows whose log mu is not finite
cannot be bucketed: they appear in one extra row `bucket = -1` (label 'mu non-finite') when any exist.

`volatility_table` joins the store's tokens and scores. The app's Volatility page, whose controls ask for
one pair's table at any bucketing, reads the pair's few per-token inputs once (`pair_tokens`: log mu, log
pi, finite, top-K TV, exact TV; ~17-33 bytes a token, kept in the app's results cache) and computes each
table from them (`volatility_of_pair`): the same SQL of the metrics, buckets, sums and quantiles over an
Arrow table in memory instead of the join, so the same table (counts, labels and quantiles bit for bit;
the means up to the order in which floating-point sums are added).
"""

from __future__ import annotations

from dataclasses import dataclass

import duckdb
import numpy as np
import pandas as pd

from mismatch_lab.analysis import definitions as d
from mismatch_lab.analysis.relations import (
    STORED_METRICS,
    Filters,
    _used,
    empty,
    typed_null,
    with_metrics,
)
from mismatch_lab.analysis.rows import (
    R_QUANTILE_COLUMNS,
    Rows,
    Thresholds,
    rollup,
    sums_sql,
)

STAT_COLUMNS = [
    "n_tokens", "n_nonfinite", "mu_mean", "r_mean", "r_std", *R_QUANTILE_COLUMNS, "frac_r_outside_eps",
    "binary_tv_mean", "binary_tv_p99", "n_topk", "topk_tv_mean", "topk_tv_p99",
    "n_exact", "tv_exact_vs_ref_mean", "tv_exact_vs_ref_p99",
]  # fmt: skip
VOLATILITY_COLUMNS = ["rollout", "scorer", "scale", "bucket", "mu_lo", "mu_hi", "bucket_label", *STAT_COLUMNS]
NONFINITE_BUCKET = -1
COUNTS = ("n_tokens", "n_nonfinite", "n_topk", "n_exact")
VOLATILITY_SUMS = ("n", "n_nonfinite", "s_mu", "s_r1", "s_r1sq", "c_hi", "c_lo", "s_btv", "n_topk", "s_ktv", "n_exact",
                   "s_exact")  # fmt: skip
"""The sums (rows.sums_sql's names) a volatility table reads."""
EXACT_OK = "finite AND isfinite(tv_exact)"
"""The rows whose stored exact TV the table reads (its mean, as sums_sql's n_exact / s_exact, and its p99)."""
PAIR_OPTIONAL = {"topk_tv": "topk", "tv_exact": "tv_exact"}
"""pair_tokens' optional columns -> the rows.ABSENT_READS key of what reads them: a pair with no value of
one (no top-K recorded, no exact TV stored) keeps no column of it."""
PAIR_SELECT = f"lmu, lpi, finite, topk_tv, CASE WHEN {EXACT_OK} THEN tv_exact END AS tv_exact"
"""pair_tokens' columns, selected from the rollout row set (`rows.Rows.sql['rollout']`)."""
QUANTILED = {  # the value a quantile column is taken of (SQL over with_metrics' columns) -> (levels, its columns)
    "r": (d.RATIO_QUANTILES, tuple(R_QUANTILE_COLUMNS)),
    "btv": ((0.99,), ("binary_tv_p99",)),
    "topk_tv": ((0.99,), ("topk_tv_p99",)),
    f"CASE WHEN {EXACT_OK} THEN tv_exact END": ((0.99,), ("tv_exact_vs_ref_p99",)),
}
"""The quantile columns of a volatility table (quantile_cont of each value over a bucket's non-NULL values)."""


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
    q = rows.quantiles(buckets, n)
    q["bucket"] = q["bucket"].astype("int64")
    return _table(s, q, buckets, edges)


def _table(s: pd.DataFrame, q: pd.DataFrame, buckets: str, edges) -> pd.DataFrame:
    """The volatility table from the sums per (rollout, scorer, bucket) `s` (VOLATILITY_SUMS, sums_sql's
    names) and the quantiles per (rollout, scorer, bucket) `q` (rows.QUANTILE_COLUMNS)."""
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


@dataclass(frozen=True)
class PairTokens:
    """One pair's per-token inputs of its volatility tables (`pair_tokens`), as an Arrow table."""

    rollout: str
    scorer: str
    table: object  # pyarrow.Table: lmu, lpi, finite and PAIR_OPTIONAL's columns the pair has values of


def pair_tokens(con: duckdb.DuckDBPyConnection, rollout: str, scorer: str) -> PairTokens | None:
    """The rows `volatility_table(con, rollout=rollout, scorer=scorer)` reads, in one pass over the join of
    the pair's tokens and scores, reduced to what its statistics are computed from: log mu, log pi, finite,
    the top-K TV (computed from the lists) and the stored exact TV on the rows the table reads it from.
    None when the store holds no scored tokens."""
    rows = Rows(con, Filters.make(rollout, scorer))
    if not rows.ok:
        return None
    rel, params = rows.sql["rollout"]
    sql = f"SELECT {PAIR_SELECT} FROM ({rel})"
    table = con.sql(sql, params=_used(sql, params)).to_arrow_table()
    unused = [c for c in PAIR_OPTIONAL if table[c].null_count == table.num_rows]
    return PairTokens(rollout, scorer, table.drop_columns(unused))


def volatility_of_pair(
    tokens: PairTokens | None,
    buckets: str = "linear",
    n_buckets: int | None = None,
    eps_low: float = d.EPS_LOW,
    eps_high: float = d.EPS_HIGH,
) -> pd.DataFrame:
    """`volatility_table(con, rollout=..., scorer=..., buckets=..., ...)` of the pair whose `pair_tokens`
    these are, without the store: one GROUP BY over them in an in-memory DuckDB, with the same SQL of the
    metrics (relations.with_metrics), the buckets (definitions.bucket_sql), the sums (rows.sums_sql) and
    the quantiles (quantile_cont, which analysis.quantiles reproduces bit for bit)."""
    edges = d.bucket_edges(buckets, n_buckets)  # validates `buckets`
    n = len(edges) - (1 if buckets == "log" else 0)
    if tokens is None or tokens.table.num_rows == 0:
        return empty(VOLATILITY_COLUMNS)
    t = Thresholds(clip_low=1.0 - eps_low, clip_high=1.0 + eps_high)
    quantiles, picks = [], []
    for i, (value, (levels, columns)) in enumerate(QUANTILED.items()):
        one = len(levels) == 1
        quantiles.append(f"quantile_cont({value}, {levels[0] if one else list(levels)}) AS _q{i}")
        picks += [f"_q{i} AS {columns[0]}"] if one else [f"_q{i}[{j + 1}] AS {c}" for j, c in enumerate(columns)]
    sql = f"""SELECT * EXCLUDE ({', '.join(f'_q{i}' for i in range(len(QUANTILED)))}), {', '.join(picks)}
              FROM ({bucket_groups_sql(set(tokens.table.column_names), buckets, n, t, quantiles)})"""
    got = on_pair(tokens.table, sql, arrow=False)
    for i, (name, label) in enumerate((("rollout", tokens.rollout), ("scorer", tokens.scorer))):
        got.insert(i, name, pd.Series(label, index=got.index, dtype=object))  # as volatility_table's labels
    got["bucket"] = got["bucket"].astype("int64")
    return _table(got, got.drop(columns=list(VOLATILITY_SUMS)), buckets, edges)


def bucket_groups_sql(has: set[str], buckets: str, n: int, t: Thresholds, aggregates: list[str]) -> str:
    """SQL over pair tokens registered as `_ml_pair` (`on_pair`; `has`: their columns): per mu bucket (`bucket`,
    NONFINITE_BUCKET where log mu is not finite) the VOLATILITY_SUMS (rows.sums_sql) and `aggregates`
    ('<SQL> AS <name>' over the per-token metrics of relations.with_metrics: r, btv, topk_tv, tv_exact, ...)."""
    topk = "{'tv': topk_tv, 'kl': CAST(NULL AS DOUBLE)}" if "topk_tv" in has else typed_null("STRUCT(tv DOUBLE, kl DOUBLE)")
    base = f"SELECT lmu, lpi, finite, {'tv_exact' if 'tv_exact' in has else typed_null('DOUBLE')} AS tv_exact, " \
           f"{topk} AS topk FROM _ml_pair"  # fmt: skip
    absent = ["entropy", *(key for c, key in PAIR_OPTIONAL.items() if c not in has)]
    return f"""SELECT coalesce({d.bucket_sql(buckets, n)}, {NONFINITE_BUCKET}) AS bucket,
                      {sums_sql(t, VOLATILITY_SUMS, absent)}, {', '.join(aggregates)}
               FROM ({with_metrics(base, STORED_METRICS)}) GROUP BY ALL"""


def on_pair(table, sql: str, *, arrow: bool = True, cursor: duckdb.DuckDBPyConnection | None = None):
    """The result of `sql` (an Arrow table, else a pandas frame) run on an in-memory DuckDB where the Arrow table
    `table` is `_ml_pair`: a new one, or `cursor` (a fresh cursor of a database kept elsewhere; closed here)."""
    mem = cursor or duckdb.connect()
    try:
        mem.register("_ml_pair", table)
        return mem.sql(sql).to_arrow_table() if arrow else mem.execute(sql).df()
    finally:
        mem.close()
