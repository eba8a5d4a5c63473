"""The app's Volatility page on a shard store still being written, per unit (run_id, step) as the Training page
(`store.units`): a pair's volatility table equal to the whole-store `volatility.volatility_table` (counts, bucket
labels and quantiles bit for bit, means and std up to the order floating-point sums are added in), so that a
refresh computes in proportion to the new steps.

Per unit: the pair's tokens (`unit_pair_tokens`: `volatility.pair_tokens`' columns of the unit's rows; every
token of a shard store lies in the unit of its sequence's step), computed for the units that lack them on one
connection over those units alone (`units.ShardUnits.connection`), split by (run_id, step) and kept in the
results cache one entry a (pair, unit) under the unit's fingerprint. The pair's tokens (`pair_tokens`) are their
concatenation, kept in memory per store and pair with the fingerprints they were built from: a refresh reads
the new units' parts only.

Per bucketing (scale, buckets, ε): the table's groups (`_Groups`), kept in memory per store, pair and bucketing
(the last MAX_GROUPS of them) with the fingerprints they were built from: per μ bucket its sums (rows.sums_sql's
VOLATILITY_SUMS, added) and, per quantile value (`volatility.QUANTILED`: r, binary TV, top-K TV, exact TV), its
non-NULL values in order (`_Sorted`). A refresh whose units only grew computes the new units' groups (one GROUP
BY over their tokens in an in-memory DuckDB, on the process's one-thread database: `volatility.bucket_groups_sql`,
the same SQL of metrics, buckets and sums), adds their sums and merges their values into the kept ones
(`_merged`): a new value's rank among the kept ones is a binary search, and the kept sorted array is built
again (a linear merge, no full sort) only once the values added since outgrow 1/COMPACT of it, so that a
refresh costs in proportion to its new tokens (amortized), not to the pair's. The quantiles are read from the
values in order as quantile_cont interpolates them (`quantiles.interpolate`, bit for bit). Where a kept unit
changed or went (a resumed job logged a step again), the groups are built again from every unit's tokens in
memory (no store read but the changed units'). Memory: ~8 bytes a token and quantile value (r and binary TV
always; top-K and exact TV where the pair has them) for each bucketing kept, beside the tokens' 17-33.
"""

from __future__ import annotations

import collections
import math
import threading
from dataclasses import dataclass

import numpy as np
import pandas as pd

from mismatch_lab.store import cache
from mismatch_lab.store.units import ONE_THREAD_BYTES, ShardUnits, Unit, _small

QUERY = "units_volatility.pair_tokens"
"""The results cache's query of one (pair, unit)'s tokens: (QUERY, rollout, scorer, unit)."""
MAX_PAIRS = 16
"""Pairs (of any store) whose tokens per unit are kept in memory (the last used; as lab_cache._pair_tokens')."""
COMPACT = 8
"""A bucket's added values are merged into its kept ones once they are more than 1/COMPACT of them (`_Sorted`)."""
MAX_GROUPS = 8
"""Bucketings whose groups are kept in memory (the last used): the page's linear and log tables of 4 pairs."""
UNIT_COLUMNS = ("run_id", "step")


@dataclass(frozen=True)
class _Tokens:
    """One pair's tokens of every unit as of `fps`: unit -> its Arrow table (`volatility.PAIR_SELECT`'s columns
    the unit has values of), None for a unit without rows of the pair."""

    fps: dict[Unit, str]
    parts: dict[Unit, object]


@dataclass(frozen=True)
class _Groups:
    """One pair's volatility groups at one bucketing as of `fps`: `sums` per bucket (index: bucket; columns:
    VOLATILITY_SUMS) and `values`: bucket -> per QUANTILED value, its non-NULL values sorted (NaN last, as DuckDB
    orders them)."""

    fps: dict[Unit, str]
    sums: pd.DataFrame
    values: dict[int, tuple[_Sorted, ...]]


_NO_VALUES, _NO_RANKS = np.empty(0), np.empty(0, np.int64)  # (never written to)


@dataclass(frozen=True)
class _Sorted:
    """One bucket's values of one quantile value in order without one sorted array of them all: `kept` (sorted)
    and `added` (sorted: the values merged in since `kept` was built), `at` each added value's index in the merge
    of both (the count of kept values <= it, plus its own index). A merge of new values costs their count times
    log(kept) plus the added ones (`with_new`); `kept` is built again, the O(n) part, once `added` outgrows
    1/COMPACT of it: amortized, a refresh costs in proportion to its new values."""

    kept: np.ndarray
    added: np.ndarray
    at: np.ndarray

    @classmethod
    def of(cls, values: np.ndarray) -> _Sorted:
        """Sorted values, all kept."""
        return cls(values, _NO_VALUES, _NO_RANKS)

    def __len__(self) -> int:
        return len(self.kept) + len(self.added)

    def __getitem__(self, k: int) -> float:
        """The value of rank k (0-based) among both, in numpy's order (NaN last, as DuckDB orders them)."""
        j = int(np.searchsorted(self.at, k))  # the added values before rank k
        return float(self.added[j]) if j < len(self.at) and self.at[j] == k else float(self.kept[k - j])

    def quantile(self, q: float) -> float:
        """quantile_cont(q) of the values (`quantiles.select` on them sorted): NaN for none."""
        from mismatch_lab.analysis.quantiles import interpolate

        n = len(self)
        if n == 0:
            return math.nan
        h = float(n - 1) * q
        lo, hi = math.floor(h), math.ceil(h)
        return interpolate(self[lo], self[hi], h - lo)

    def with_new(self, new: np.ndarray) -> _Sorted:
        """These values and the sorted values `new`."""
        if not len(new):
            return self
        if (len(self.added) + len(new)) * COMPACT > len(self.kept):
            return _Sorted.of(_merge(_merge(self.kept, self.added), new))
        values = np.concatenate([self.added, new])
        below = np.concatenate([self.at - np.arange(len(self.at)), np.searchsorted(self.kept, new, side="right")])
        order = np.argsort(values, kind="stable")  # two sorted runs: merged in linear time
        return _Sorted(self.kept, values[order], below[order] + np.arange(len(order)))


_TOKENS: collections.OrderedDict[tuple, _Tokens] = collections.OrderedDict()  # (store, pair) -> tokens per unit
_GROUPS: collections.OrderedDict[tuple, _Groups] = collections.OrderedDict()  # (store, pair, bucketing) -> groups
_LOCK = threading.Lock()


# --- the pair's tokens per unit -------------------------------------------------------------------------------


def unit_pair_tokens(source: ShardUnits, results: cache.ResultsCache, rollout: str, scorer: str) -> _Tokens:
    """The pair's tokens of every unit of `source` (module doc): kept parts of unchanged units, else the results
    cache's, else computed together on one connection over the units lacking them."""
    fps = source.fingerprints()
    with _LOCK:
        kept = _TOKENS.get((source.key, rollout, scorer))
    if kept is not None and kept.fps == fps:
        return kept
    parts = {u: kept.parts[u] for u, fp in fps.items() if kept is not None and kept.fps.get(u) == fp}
    for unit in sorted(set(fps) - set(parts)):
        found = results.get((QUERY, rollout, scorer, unit), fps[unit])
        if found is not cache.MISSING:
            parts[unit] = found
    todo = sorted(set(fps) - set(parts))
    if todo:
        computed = _compute(source, rollout, scorer, todo)
        for unit, part in computed.items():
            results.put((QUERY, rollout, scorer, unit), fps[unit], part)
        parts |= computed
    out = _Tokens(fps, parts)
    _keep(_TOKENS, (source.key, rollout, scorer), out, MAX_PAIRS)
    return out


def _keep(kept: collections.OrderedDict, key: tuple, value, limit: int) -> None:
    """`kept[key] = value`, the least recently kept entries dropped past `limit`."""
    with _LOCK:
        kept[key] = value
        kept.move_to_end(key)
        while len(kept) > limit:
            kept.popitem(last=False)


def _compute(source: ShardUnits, rollout: str, scorer: str, todo: list[Unit]) -> dict[Unit, object]:
    """unit -> its tokens of the pair (`_Tokens.parts`) for the units `todo`, from one pass over the join of their
    tokens and scores (the rows `volatility.pair_tokens` reads, with their run_id and step)."""
    from mismatch_lab.analysis.relations import Filters, _used, fixed_store
    from mismatch_lab.analysis.rows import Rows
    from mismatch_lab.analysis.volatility import PAIR_SELECT

    with source.connection(todo) as con, fixed_store(con):
        source.prime(con)
        rows = Rows(con, Filters.make(rollout, scorer))
        if not rows.ok:
            return dict.fromkeys(todo)
        rel, params = rows.sql["rollout"]
        sql = f"SELECT {', '.join(UNIT_COLUMNS)}, {PAIR_SELECT} FROM ({rel})"
        table = con.sql(sql, params=_used(sql, params)).to_arrow_table()
    parts = _split(table) if table["step"].null_count == 0 else None
    if parts is not None and set(parts) <= set(todo):
        return dict.fromkeys(todo) | parts
    # a row not labelled by its unit's (run_id, step) (every writer of ours labels it so): one unit at a time
    if len(todo) == 1:
        return {todo[0]: _part(table.combine_chunks())}
    return {u: _compute(source, rollout, scorer, [u])[u] for u in todo}


def _split(table) -> dict[Unit, object]:
    """unit -> its rows of `table` (UNIT_COLUMNS and pair_tokens' columns), without UNIT_COLUMNS and without the
    optional columns it has no value of; each an Arrow table of its own (taken, not sliced: cached alone)."""
    import pyarrow.compute as pc

    if table.num_rows == 0:
        return {}
    runs = pc.dictionary_encode(table["run_id"]).combine_chunks()
    steps = table["step"].to_numpy().astype(np.int64)
    span = int(steps.max()) + 1
    key = runs.indices.to_numpy().astype(np.int64) * span + steps
    order = np.argsort(key, kind="stable")
    ordered = key[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    body = table.drop_columns(list(UNIT_COLUMNS)).combine_chunks()  # (a take from chunks joins them each time)
    names = runs.dictionary.to_pylist()
    out = {}
    for start, end in zip(starts, [*starts[1:], len(order)], strict=True):
        out[(names[ordered[start] // span], int(ordered[start] % span))] = _part(body.take(order[start:end]))
    return out


def _part(table):
    """A unit's tokens: `table` without UNIT_COLUMNS and without the optional columns it has no value of."""
    from mismatch_lab.analysis.volatility import PAIR_OPTIONAL

    unused = [c for c in (*UNIT_COLUMNS, *PAIR_OPTIONAL) if c in table.column_names and (
        c in UNIT_COLUMNS or table[c].null_count == table.num_rows)]
    return table.drop_columns(unused)


def _concat(parts: list):
    """One Arrow table of the parts (a column some part lacks: NULL there), pair_tokens' columns in its order,
    without the optional columns no part has a value of; None for no part."""
    import pyarrow as pa

    from mismatch_lab.analysis.volatility import PAIR_OPTIONAL

    if not parts:
        return None
    whole = parts[0] if len(parts) == 1 else pa.concat_tables(parts, promote_options="default")
    order = ["lmu", "lpi", "finite", *(c for c in PAIR_OPTIONAL if c in whole.column_names)]
    return whole.select(order)


def pair_tokens(source: ShardUnits, results: cache.ResultsCache, rollout: str, scorer: str):
    """`volatility.pair_tokens` of the store of `source` (its rows in another order): the concatenation of
    every unit's part; None where the store holds no scored tokens."""
    from mismatch_lab.analysis.volatility import PairTokens

    tokens = unit_pair_tokens(source, results, rollout, scorer)
    table = _concat([p for _, p in sorted(tokens.parts.items()) if p is not None])
    if table is None:
        return None if not tokens.parts else PairTokens(rollout, scorer, _empty_tokens())
    return PairTokens(rollout, scorer, table)


def _empty_tokens():
    import pyarrow as pa

    return pa.table({"lmu": pa.array([], pa.float64()), "lpi": pa.array([], pa.float64()),
                     "finite": pa.array([], pa.bool_())})


# --- the volatility table from groups kept per bucketing ------------------------------------------------------


def volatility_of(source: ShardUnits, results: cache.ResultsCache, rollout: str, scorer: str, buckets: str = "linear",
                  n_buckets: int | None = None, eps_low: float | None = None, eps_high: float | None = None
                  ) -> pd.DataFrame:
    """`volatility.volatility_table(con, rollout=rollout, scorer=scorer, buckets=..., n_buckets=..., eps_low=...,
    eps_high=...)` of the store of `source` (module doc): from the groups kept for this bucketing and the new
    units' tokens."""
    from mismatch_lab.analysis import definitions as d
    from mismatch_lab.analysis.relations import empty
    from mismatch_lab.analysis.volatility import VOLATILITY_COLUMNS

    eps_low, eps_high = d.EPS_LOW if eps_low is None else eps_low, d.EPS_HIGH if eps_high is None else eps_high
    edges = d.bucket_edges(buckets, n_buckets)  # validates `buckets`
    n = len(edges) - (1 if buckets == "log" else 0)
    tokens = unit_pair_tokens(source, results, rollout, scorer)
    bucketing = (buckets, n, float(eps_low), float(eps_high))
    groups = _groups(source.key, rollout, scorer, bucketing, tokens)
    if groups.sums.empty:
        return empty(VOLATILITY_COLUMNS)
    return _table(groups, rollout, scorer, buckets, edges)


def _groups(store: str, rollout: str, scorer: str, bucketing: tuple, tokens: _Tokens) -> _Groups:
    """The groups of `bucketing` as of `tokens`: kept, or the kept ones with the new units' merged in, or built
    from every unit's tokens."""
    key = (store, rollout, scorer, bucketing)
    with _LOCK:
        kept = _GROUPS.get(key)
    if kept is not None and kept.fps == tokens.fps:
        out = kept
    elif kept is not None and all(tokens.fps.get(u) == fp for u, fp in kept.fps.items()):  # only new units
        new = [tokens.parts[u] for u in sorted(set(tokens.fps) - set(kept.fps)) if tokens.parts[u] is not None]
        out = _merged(kept, _groups_of(new, bucketing, tokens.fps)) if new else _Groups(tokens.fps, kept.sums,
                                                                                         kept.values)
    else:
        out = _groups_of([p for _, p in sorted(tokens.parts.items()) if p is not None], bucketing, tokens.fps)
    _keep(_GROUPS, key, out, MAX_GROUPS)
    return out


def _groups_of(parts: list, bucketing: tuple, fps: dict[Unit, str]) -> _Groups:
    """The groups of the tokens `parts` (Arrow tables): one GROUP BY over them per μ bucket, with the sums and,
    per QUANTILED value, the list of its non-NULL values (sorted here)."""
    import pyarrow as pa

    from mismatch_lab.analysis.rows import Thresholds
    from mismatch_lab.analysis.volatility import (
        QUANTILED,
        VOLATILITY_SUMS,
        bucket_groups_sql,
        on_pair,
    )

    table = _concat(parts)
    if table is None:
        return _Groups(fps, pd.DataFrame(columns=list(VOLATILITY_SUMS), index=pd.Index([], name="bucket")), {})
    buckets, n, eps_low, eps_high = bucketing
    t = Thresholds(clip_low=1.0 - eps_low, clip_high=1.0 + eps_high)
    lists = [f"list({v}) FILTER (WHERE ({v}) IS NOT NULL) AS _v{i}" for i, v in enumerate(QUANTILED)]
    small = _small() if table.nbytes < ONE_THREAD_BYTES else None  # a refresh's few new steps (as units.open_units)
    got = on_pair(table, bucket_groups_sql(set(table.column_names), buckets, n, t, lists), cursor=small)
    sums = pa.table({c: got[c].cast(pa.int64()) if pa.types.is_decimal(got[c].type) else got[c]  # (HUGEINT counts)
                     for c in ["bucket", *VOLATILITY_SUMS]}).to_pandas().set_index("bucket")
    values = {}
    for row, bucket in enumerate(got["bucket"].to_pylist()):
        values[int(bucket)] = tuple(_Sorted.of(_sorted(got[f"_v{i}"][row])) for i in range(len(QUANTILED)))
    return _Groups(fps, sums, values)


def _sorted(values) -> np.ndarray:
    """The float64 values of one Arrow list scalar, sorted (NULL: none)."""
    if not values.is_valid:
        return np.empty(0)
    return np.sort(values.values.to_numpy(zero_copy_only=False).astype(np.float64, copy=False))


def _merge(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """Two sorted arrays as one sorted array: concatenated, then numpy's stable sort (timsort on floats) merges
    the two runs in linear time."""
    if not len(new):
        return old
    out = np.concatenate([old, new])
    out.sort(kind="stable")
    return out


def _merged(kept: _Groups, new: _Groups) -> _Groups:
    """`kept` with the groups of disjoint new rows added: sums added (NULL + NULL stays NULL, as SQL's sum over
    both), each bucket's sorted values merged."""
    if kept.sums.empty:  # (no rows of the pair before: its sums have no dtypes to keep)
        return new
    sums = kept.sums.add(new.sums, fill_value=0)
    for c, dtype in kept.sums.dtypes.items():  # counts: integers again where a bucket of one side only made floats
        if pd.api.types.is_integer_dtype(dtype) and sums[c].notna().all():
            sums[c] = sums[c].astype(dtype)
    values = dict(kept.values)
    for bucket, added in new.values.items():
        old = values.get(bucket)
        values[bucket] = added if old is None else tuple(
            a.with_new(b.kept) for a, b in zip(old, added, strict=True))  # (a new groups' values are all kept)
    return _Groups(new.fps, sums, values)


def _table(groups: _Groups, rollout: str, scorer: str, buckets: str, edges) -> pd.DataFrame:
    """The volatility table of the pair from its groups (`volatility._table`), the quantiles read from the sorted
    values as quantile_cont interpolates them."""
    from mismatch_lab.analysis.volatility import QUANTILED, _table

    order = sorted(groups.values)
    labels = {"rollout": pd.Series(rollout, index=range(len(order)), dtype=object),
              "scorer": pd.Series(scorer, index=range(len(order)), dtype=object),
              "bucket": pd.Series(order, dtype="int64")}
    s = pd.DataFrame(labels).join(groups.sums.loc[order].reset_index(drop=True))
    q = pd.DataFrame(labels)
    for i, (levels, columns) in enumerate(QUANTILED.values()):
        for level, column in zip(levels, columns, strict=True):
            q[column] = pd.Series([groups.values[b][i].quantile(level) for b in order],
                                  dtype="float64")
    return _table(s, q, buckets, edges)
