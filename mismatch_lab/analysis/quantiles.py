"""Exact quantiles of a large row set per group, without holding every value: bracketing.

A quantile here is numpy's default and DuckDB's `quantile_cont`: over the n non-NULL values of a group,
sorted x_0 <= ... <= x_{n-1}, and h = (n - 1) q, the value x_lo (1 - d) + x_hi d with lo = floor(h),
hi = ceil(h), d = h - lo. An exact aggregate keeps all n values of every group until it is done; on
10^7 rows and two bucket scales that pass costs more than reading the rows (docs/benchmarks.md). Here:

1. a Bernoulli sample of the rows (about SAMPLE_ROWS of them) gives, per group and wanted quantile, a
   bracket [a, b] of values that holds x_lo and x_hi with a wide margin (Z standard deviations of the
   sampled rank, plus two ranks, each side);
2. one pass over all rows sorts each row's value into the regions its cell's brackets cut the line
   into (below, inside, between, above them), counts the rows per cell and region, and keeps the
   values inside a bracket;
3. per group, `below` = its rows below the bracket, and x_lo, x_hi are picked from the sorted values
   inside the bracket at ranks lo - below and hi - below.

Step 3 checks that the bracket held both ranks (below <= lo and hi - below < values inside); where the
sample misled (or a NaN sits among the wanted ranks: no bracket holds NaN), that group is computed again
with quantile_cont. The result is therefore exact whatever the sample: the sample only decides how few
values are kept. A group with fewer than MIN_SAMPLE sampled values keeps all its values (no bracket).

Several key sets (e.g. one per mu-bucket scale) share the pass: rows are counted per cell of all their
keys, each key set is a rollup of the cells (counts add, kept values concatenate), and a cell's regions
come from the union ("hull") of the brackets of every group it belongs to.
"""

from __future__ import annotations

import math
import uuid
import warnings
from dataclasses import dataclass
from fractions import Fraction

import duckdb
import numpy as np
import pandas as pd

from mismatch_lab.analysis.relations import _used

SAMPLE_ROWS = 200_000
"""Rows sampled to place the brackets (all rows below this many): more narrows the brackets (fewer
values kept) at the price of a larger sample."""
MIN_SAMPLE = 400
"""A group with fewer sampled values than this keeps all its values instead of a bracket."""
Z = 5.0
"""Bracket half-width in standard deviations of the sampled rank, (m q (1 - q)) ** 0.5, plus two ranks."""
SEED = 20251125


@dataclass(frozen=True)
class Wanted:
    """Quantiles `levels` of the SQL expression `value` over the rows where `where` holds, as columns
    `{name}_{i}` (one per level)."""

    name: str
    value: str
    levels: tuple[float, ...]
    where: str = "true"

    def sql(self) -> str:
        return self.value if self.where == "true" else f"CASE WHEN {self.where} THEN {self.value} END"

    def columns(self) -> list[str]:
        return [f"{self.name}_{i}" for i in range(len(self.levels))]


def interpolate(lo: float, hi: float, d: float) -> float:
    """lo (1 - d) + hi d rounded once, as DuckDB's quantile_cont computes it (bit for bit on x86-64 builds,
    where the product lo (1 - d) is fused into the addition)."""
    if d == 0.0 or not (math.isfinite(lo) and math.isfinite(hi)):
        return lo * (1.0 - d) + hi * d
    return float(Fraction(lo) * Fraction(1.0 - d) + Fraction(hi * d))


def select(inside: np.ndarray, below: int, n: int, q: float) -> float | None:
    """Quantile q of a group of n values from the sorted values of a bracket and the group's count of
    values below it: NaN for an empty group, None where the bracket does not hold both ranks."""
    if n == 0:
        return math.nan
    h = float(n - 1) * q
    lo, hi = math.floor(h), math.ceil(h)
    if lo < below or hi - below >= len(inside):
        return None
    return interpolate(float(inside[lo - below]), float(inside[hi - below]), h - lo)


def exact_quantiles(
    con: duckdb.DuckDBPyConnection,
    rel: str,
    params: dict,
    sets: dict[str, list[str]],
    wanted: list[Wanted],
    *,
    sample_rel: str | None = None,
    row_bound: int | None = None,
    sample_rows: int | None = None,
) -> dict[str, pd.DataFrame]:
    """Per key set (name -> key columns of `rel`): a frame of its keys and every Wanted's columns, one row
    per group of rel's rows. `sample_rel`: rel as read from a sample, '{sample}' standing where the
    sample clause goes (default: rel sampled); `row_bound`: at least rel's row count (sets the sample
    rate; None: counted); `sample_rows`: the sample's expected size (default SAMPLE_ROWS)."""
    cells = list(dict.fromkeys(k for keys in sets.values() for k in keys))
    head = f"SELECT {', '.join(cells)}, {', '.join(f'{w.sql()} AS v_{w.name}' for w in wanted)} FROM "
    full = f"{head}({rel})"
    if row_bound is None:
        row_bound = con.execute(f"SELECT count(*) FROM ({rel})", _used(rel, params)).fetchone()[0]
    pct = 100.0 * min(1.0, (sample_rows or SAMPLE_ROWS) / max(row_bound, 1))
    clause = f"USING SAMPLE {pct!r} PERCENT (bernoulli, {SEED})"
    sampled = (sample_rel or f"SELECT * FROM ({rel}) {{sample}}").replace("{sample}", clause)
    sample = f"temp._ml_sample_{uuid.uuid4().hex[:10]}"
    con.execute(f"CREATE TEMP TABLE {sample.split('.')[1]} AS {head}({sampled})", _used(sampled, params))
    try:
        brackets = _brackets(con, sample, sets, wanted)
        hulls = _hulls(_fetch(con, f"SELECT DISTINCT {', '.join(cells)} FROM {sample}", {}), sets, brackets, wanted)
    finally:
        con.execute(f"DROP TABLE IF EXISTS {sample}")
    counted = _pass(con, full, params, cells, wanted, hulls)
    per_cell = {w.name: _cell_regions(counted, cells, w).merge(hulls, on=cells, how="left") for w in wanted}
    return {s: _finish(con, full, params, keys, wanted, counted[keys].drop_duplicates(), per_cell, brackets[s])
            for s, keys in sets.items()}  # fmt: skip


def _brackets(con, sample: str, sets: dict[str, list[str]], wanted: list[Wanted]) -> dict[str, pd.DataFrame]:
    """Per key set, per group of its keys in the sample table: a_{name}_{i}, b_{name}_{i}, NaN where the
    group keeps every value (fewer than MIN_SAMPLE sampled values)."""
    out = {}
    for s, keys in sets.items():
        lists = ", ".join(f"list_sort(list(v_{w.name}) FILTER (WHERE NOT isnan(v_{w.name}))) AS s_{w.name}" for w in wanted)
        frame = _fetch(con, f"SELECT {', '.join(keys)}, {lists} FROM {sample} GROUP BY ALL", {})
        for w in wanted:
            for i, q in enumerate(w.levels):
                ab = [_bracket(np.asarray(v if v is not None else [], dtype=np.float64), q) for v in frame[f"s_{w.name}"]]
                frame[f"a_{w.name}_{i}"] = [x[0] for x in ab]
                frame[f"b_{w.name}_{i}"] = [x[1] for x in ab]
        out[s] = frame.drop(columns=[f"s_{w.name}" for w in wanted])
    return out


def _bracket(sorted_sample: np.ndarray, q: float) -> tuple[float, float]:
    """[a, b] around the sample's quantile q, Z standard deviations of its rank and two ranks wide each
    side (-inf / inf past the ends); NaN, NaN where the sample is too small to bracket."""
    m = len(sorted_sample)
    if m < MIN_SAMPLE:
        return math.nan, math.nan
    h, spread = (m - 1) * q, Z * math.sqrt(m * q * (1.0 - q)) + 2.0
    lo, hi = math.floor(h - spread), math.ceil(h + spread)
    return (float(sorted_sample[lo]) if lo >= 0 else -math.inf, float(sorted_sample[hi]) if hi < m else math.inf)


def _hulls(cells: pd.DataFrame, sets: dict[str, list[str]], brackets: dict, wanted: list[Wanted]) -> pd.DataFrame:
    """Per sampled cell and Wanted: the disjoint sorted intervals lo_{name}_{j}, hi_{name}_{j} (j from 1,
    NaN-padded to the number of levels) covering every bracket of the groups the cell belongs to; a
    group without a bracket makes it (-inf, inf)."""
    frame = cells.reset_index(drop=True)
    for s, keys in sets.items():
        frame = frame.merge(brackets[s].add_suffix(f"@{s}").rename(columns={f"{k}@{s}": k for k in keys}),
                            on=keys, how="left")  # fmt: skip
    for w in wanted:
        merged = []
        for _, row in frame.iterrows():
            spans = []
            for i in range(len(w.levels)):
                a = [row[f"a_{w.name}_{i}@{s}"] for s in sets]
                b = [row[f"b_{w.name}_{i}@{s}"] for s in sets]
                spans.append((-math.inf, math.inf) if any(pd.isna(x) for x in a) else (min(a), max(b)))
            merged.append(_merge(spans))
        for j in range(len(w.levels)):
            frame[f"lo_{w.name}_{j + 1}"] = [m[j][0] if j < len(m) else np.nan for m in merged]
            frame[f"hi_{w.name}_{j + 1}"] = [m[j][1] if j < len(m) else np.nan for m in merged]
    return frame[[*cells.columns, *(c for c in frame.columns if c.startswith(("lo_", "hi_")))]]


def _merge(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _region(w: Wanted, n: int) -> str:
    """SQL: the region of v_{name} among its cell's intervals: 2j - 1 inside interval j, 2j - 2 below it
    (above the one before), 2n above all; 1 (keep) where the cell has no intervals; NULL for NULL."""
    v = f"v_{w.name}"
    whens = [f"WHEN h.lo_{w.name}_1 IS NULL THEN 1"]
    for j in range(1, n + 1):
        whens += [f"WHEN {v} < h.lo_{w.name}_{j} THEN {2 * j - 2}", f"WHEN {v} <= h.hi_{w.name}_{j} THEN {2 * j - 1}"]
    return f"CASE WHEN {v} IS NULL THEN NULL {' '.join(whens)} ELSE {2 * n} END"


def _pass(con, full: str, params: dict, cells: list[str], wanted: list[Wanted], hulls: pd.DataFrame) -> pd.DataFrame:
    """One GROUP BY (cell, region of each Wanted): the row count n and, per Wanted, the values kept."""
    table = f"_ml_hulls_{uuid.uuid4().hex[:10]}"
    con.register(table, hulls)
    try:
        desc = con.execute(f"DESCRIBE SELECT {', '.join(cells)} FROM ({full})", _used(full, params)).fetchall()
        # cast to the row set's key types, so that ENUM labels compare as integers
        cast = ", ".join([f"CAST({r[0]} AS {r[1]}) AS {r[0]}" for r in desc] + [f"* EXCLUDE ({', '.join(cells)})"])
        regions = ", ".join(f"{_region(w, len(w.levels))} AS g_{w.name}" for w in wanted)
        kept = ", ".join(f"list(v_{w.name}) FILTER (WHERE g_{w.name} % 2 = 1) AS kept_{w.name}" for w in wanted)
        sql = f"""SELECT {', '.join(cells)}, {', '.join(f'g_{w.name}' for w in wanted)}, count(*) AS n, {kept}
                  FROM (SELECT x.*, {regions} FROM ({full}) x
                        LEFT JOIN (SELECT {cast} FROM {table}) h USING ({', '.join(cells)}))
                  GROUP BY ALL"""
        return _fetch(con, sql, params)
    finally:
        con.unregister(table)


def _finish(con, full: str, params: dict, keys: list[str], wanted: list[Wanted], groups_present: pd.DataFrame,
            per_cell: dict[str, pd.DataFrame], brackets: pd.DataFrame) -> pd.DataFrame:  # fmt: skip
    """The quantiles of one key set (its groups: `groups_present`) from the pass (module docstring, step 3);
    per_cell: per Wanted, _cell_regions joined with the hulls."""
    out = groups_present.reset_index(drop=True).merge(brackets, on=keys, how="left")
    redo = []
    for w in wanted:
        groups = {_tuple(k): g for k, g in per_cell[w.name].groupby(keys, dropna=False, sort=False)}
        for c in w.columns():
            out[c] = np.nan
        for idx, row in out.iterrows():
            key = tuple(row[k] for k in keys)
            part = groups.get(key)
            if part is None:
                continue
            n = int(part["n"].sum())
            for i, q in enumerate(w.levels):
                a, b = row[f"a_{w.name}_{i}"], row[f"b_{w.name}_{i}"]
                a, b = (-math.inf, math.inf) if pd.isna(a) else (a, b)
                below, inside = _below_inside(part, w, a, b)
                got = select(inside, below, n, q)
                if got is None:
                    redo.append((idx, key, w))
                out.loc[idx, f"{w.name}_{i}"] = got
    for idx, key, w in dict.fromkeys(redo):
        _recompute(con, full, params, keys, key, w, out, idx)
    return out[[*keys, *(c for w in wanted for c in w.columns())]]


def _cell_regions(counted: pd.DataFrame, cells: list[str], w: Wanted) -> pd.DataFrame:
    """Per cell: n (rows with a value), counts (region -> rows) and kept (the kept values), for one Wanted."""
    rows = counted[counted[f"g_{w.name}"].notna()]
    out = []
    for key, part in rows.groupby(cells, dropna=False, sort=False):
        counts = part.groupby(f"g_{w.name}")["n"].sum().to_dict()
        lists = [np.asarray(x, dtype=np.float64) for x in part[f"kept_{w.name}"] if x is not None and len(x)]
        kept = np.sort(np.concatenate(lists)) if lists else np.empty(0)
        out.append({**dict(zip(cells, _tuple(key), strict=True)), "n": sum(counts.values()), "counts": counts, "kept": kept})
    return pd.DataFrame(out, columns=[*cells, "n", "counts", "kept"])


def _below_inside(part: pd.DataFrame, w: Wanted, a: float, b: float) -> tuple[int, np.ndarray]:
    """Over the cells of one group: the values below a, and the sorted kept values in [a, b]."""
    below, inside = 0, []
    for _, cell in part.iterrows():
        j = 1  # the cell's interval holding [a, b] (a cell without intervals keeps all: interval 1)
        while not pd.isna(cell.get(f"lo_{w.name}_{j + 1}", np.nan)) and cell[f"lo_{w.name}_{j + 1}"] <= a:
            j += 1
        lo = cell.get(f"lo_{w.name}_{j}", np.nan)
        kept, start = cell["kept"], np.searchsorted(cell["kept"], -math.inf if pd.isna(lo) else lo, side="left")
        # rows of the regions below interval j, then the kept values of interval j below a
        below += sum(c for g, c in cell["counts"].items() if g <= 2 * j - 2)
        below += int(np.searchsorted(kept, a, side="left") - start)
        inside.append(kept[np.searchsorted(kept, a, side="left"):np.searchsorted(kept, b, side="right")])
    return below, np.sort(np.concatenate(inside)) if inside else np.empty(0)


def _recompute(con, full: str, params: dict, keys: list[str], key: tuple, w: Wanted, out: pd.DataFrame, idx) -> None:
    """quantile_cont for one group whose bracket missed (rare), written into out's row idx."""
    cond = " AND ".join(f"{k} IS NOT DISTINCT FROM $k{j}" for j, k in enumerate(keys))
    sql = f"SELECT quantile_cont(v_{w.name}, {list(w.levels)}) FROM ({full}) WHERE {cond}"
    args = params | {f"k{j}": (None if pd.isna(v) else v) for j, v in enumerate(key)}
    (qs,) = con.execute(sql, _used(sql, args)).fetchone()
    for col, v in zip(w.columns(), qs or [None] * len(w.levels), strict=True):
        out.loc[idx, col] = math.nan if v is None else v


def _tuple(key) -> tuple:
    return key if isinstance(key, tuple) else (key,)


def _fetch(con, sql: str, params: dict) -> pd.DataFrame:
    """Run SQL into pandas through Arrow (lists of values ~5x faster than .df()), ENUM labels as str."""
    result = con.execute(sql, _used(sql, params))
    with warnings.catch_warnings():  # the copy Arrow makes of a DB-API result costs less than .df()
        warnings.filterwarnings("ignore", "Arrow output on a DB-API result", UserWarning)
        df = result.to_arrow_table().to_pandas()
    for c in df.select_dtypes("category").columns:
        df[c] = df[c].astype(object)
    return df


__all__ = ["Wanted", "exact_quantiles", "interpolate", "select"]
