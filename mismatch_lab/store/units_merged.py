"""Results of a shard store still being written that combine over disjoint sets of units (run_id, step): kept as
parts, one a set of units computed together, and combined, so that a refresh computes its new units only.

A `Merged` query's rows, computed on a connection over any set of units, are grouped by its keys; the rows of two
disjoint sets combine by grouping their union by the same keys, each other column added up (counts, sums),
maximised (`x_` maxima) or minimised (`agg`): equal to the query on the union, up to the order floating-point sums
are added in. This holds where every row the query reads lies in one unit (a shard store's token and score rows
lie in their sequence's unit) and each column is such an aggregate of those rows.

`merged(source, results, name)`: the query `name` of `source.merged` (every query of that mapping computed together
on one connection over the units no kept part holds: the first load, all of them; a refresh, its new ones). A part
is kept under its units' fingerprints, in memory and in the store's results cache (one entry a part, and an index
of the parts), and dropped when one of its units changed (a resumed job's step written again): its units are then
computed again, with the new ones. Past MAX_PARTS parts they are combined into one. Each query's combined rows are kept
in memory with the fingerprints they were built from, combined when first asked for.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import pandas as pd

from mismatch_lab.store import cache

MAX_PARTS = 16
"""Parts kept before they are combined into one (a refresh then combines few frames)."""


@dataclass(frozen=True)
class Merged:
    """A query `fn(con) -> rows` grouped by `keys`; its other columns combined by `agg` (column -> 'sum', 'max', or
    'least': the least non-NULL value; {}: the keys alone; None: every sums column of `rows.sums_sql` present, `x_`
    maxima by max, as `rows.rollup`)."""

    fn: Callable
    keys: tuple[str, ...]
    agg: dict[str, str] | None = None

    def combine(self, frames: list[pd.DataFrame]) -> pd.DataFrame:
        """The rows of the union of the sets of units whose rows `frames` are (at least one frame)."""
        from mismatch_lab.analysis.rows import rollup

        rows = pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0]
        keys = list(self.keys)
        if self.agg is None:
            return rollup(rows, keys)
        rest = {c: how for c, how in self.agg.items() if how != "least"}
        out = (rows.groupby(keys, dropna=False, sort=False).agg(rest).reset_index() if rest
               else rows[keys].drop_duplicates(ignore_index=True))
        for c in (c for c, how in self.agg.items() if how == "least"):  # by a sort: a text's min per group in
            least = rows.sort_values(c, na_position="last", kind="stable").drop_duplicates(keys)  # pandas is a loop
            out = out.merge(least[[*keys, c]], on=keys, how="left")
        return out


@dataclass
class _Kept:
    """A store's parts (each: its units' fingerprints, its disk entry's key) and their combined rows as of `fps`."""

    parts: list[tuple[dict, str]]
    frames: dict[str, dict[str, pd.DataFrame]]  # part key -> query -> its rows
    fps: dict | None = None
    combined: dict[str, pd.DataFrame] = field(default_factory=dict)


_KEPT: dict[tuple, _Kept] = {}  # (store, source class) -> its parts
_LOCK = threading.Lock()


def merged(source, results: cache.ResultsCache, name: str) -> pd.DataFrame:
    """The query `name` of `source.merged` over every unit of the store of `source` (module doc): its parts
    combined, once per set of fingerprints."""
    kept = _kept(source, results)
    with _LOCK:
        found = kept.combined.get(name)
    if found is None:
        found = source.merged[name].combine(merged_parts(source, results, name, kept))
        with _LOCK:
            found = kept.combined.setdefault(name, found)
    return found


def merged_parts(source, results: cache.ResultsCache, name: str, kept: _Kept | None = None) -> list[pd.DataFrame]:
    """The rows of the query `name` of each kept part (their union: every unit), not combined: for a look-up that
    combines a few of their columns, or a few of their rows."""
    kept = kept or _kept(source, results)
    return [kept.frames[key][name] for _, key in kept.parts]


def _kept(source, results: cache.ResultsCache) -> _Kept:
    """The parts of the store of `source` as of its fingerprints, the units no part holds computed (module doc)."""
    fps = source.fingerprints()
    group = type(source).__name__
    with _LOCK:
        kept = _KEPT.get((source.key, group))
        if kept is not None and kept.fps == fps:
            return kept
    kept = kept or _from_disk(results, group)
    parts = [(units, key) for units, key in kept.parts if all(fps.get(u) == fp for u, fp in units.items())]
    todo = sorted(set(fps) - {u for units, _ in parts for u in units})
    frames = {key: kept.frames[key] for _, key in parts}
    if todo or not parts:
        units = {u: fps[u] for u in todo}
        key = cache._digest((group, sorted(units.items())))
        frames[key] = _compute(source, todo)
        results.put(("merged", group, key), "part", frames[key])
        parts.append((units, key))
        if len(parts) > MAX_PARTS:
            parts, frames = _one(source, parts, frames, results, group)
        results.put(("merged", group), "parts", parts)
    kept = _Kept(parts, frames, fps)
    with _LOCK:
        _KEPT[(source.key, group)] = kept
    return kept


def _from_disk(results: cache.ResultsCache, group: str) -> _Kept:
    """The parts the results cache holds for `group` (a fresh process), those whose entry is there."""
    parts = results.get(("merged", group), "parts")
    found = _Kept([], {})
    for units, key in [] if parts is cache.MISSING else parts:
        frames = results.get(("merged", group, key), "part")
        if frames is not cache.MISSING:
            found.parts.append((units, key))
            found.frames[key] = frames
    return found


def _one(source, parts, frames, results: cache.ResultsCache, group: str):
    """Every part combined into one (its units: all of theirs)."""
    units = {u: fp for us, _ in parts for u, fp in us.items()}
    key = cache._digest((group, sorted(units.items())))
    one = {q: m.combine([frames[k][q] for _, k in parts]) for q, m in source.merged.items()}
    results.put(("merged", group, key), "part", one)
    return [(units, key)], {key: one}


def _compute(source, todo: list) -> dict[str, pd.DataFrame]:
    """query -> its rows over the units `todo`, every query of `source.merged` on one connection over them."""
    from mismatch_lab.analysis.relations import fixed_store

    with source.connection(todo) as con, fixed_store(con):
        source.prime(con)
        return {q: m.fn(con) for q, m in source.merged.items()}  # (combined with the other parts when read)
