"""The app's caches: the store's fingerprint, the connection and query results keyed by it, and the per-unit
look-ups of a store being written.

The connection is a `st.cache_resource` (one per store path and fingerprint); query results are
`st.cache_data`, backed by the results cache on disk (`mismatch_lab.store.cache`); every cache is keyed by
the store's fingerprint (its files' sizes and times), so a store that a writer changes is re-read at the
next page run, and nothing computed is shown for data that changed. A pair's per-token inputs of the
Volatility page (`_pair_tokens`: `volatility.pair_tokens`, one join, kept in the disk cache and in memory)
serve every bucketing of the pair as a GROUP BY over them, without the store. The Training page of a store being written reads it per unit of (run, step) (`_page_by_unit`,
`_steps_by_unit`; `mismatch_lab.store.units`).
"""

from __future__ import annotations

import importlib
import os
import time

import streamlit as st
from lab_stores import (
    StoreClosed,
    _Store,
    clear_at_exit,
    page_work,
)

from mismatch_lab.analysis import volatility
from mismatch_lab.store import cache

TTL_S = 600  # what the memory caches keep at most this long (a changed store is re-read at once: `fingerprint`)
FINGERPRINT_S = 0.5  # a store's fingerprint is taken again after this long (one stat of its files per page run)
DUCKDB_FINGERPRINT_S = 5.0  # ... a DuckDB file's: a change seen while a writer holds it means a snapshot copy
_FINGERPRINTS: dict[str, tuple[float, str]] = {}
_DISK: dict[str, cache.ResultsCache] = {}


def fingerprint(path: str) -> str:
    """The fingerprint of the store's data (`store.cache`): another one as soon as a writer adds or changes a
    file, so every cache below (connection, queries, disk) is keyed by it and a refresh shows new data."""
    now = time.monotonic()
    taken = _FINGERPRINTS.get(path)
    hold = DUCKDB_FINGERPRINT_S if path.endswith(".duckdb") else FINGERPRINT_S
    if taken is None or now - taken[0] > hold:
        taken = _FINGERPRINTS[path] = (now, cache.fingerprint(path))
    return taken[1]


def disk(path: str) -> cache.ResultsCache:
    """The results cache on disk of the store at `path` (`store.cache`: beside the store, or elsewhere)."""
    key = f"{path}\0{os.environ.get(cache.ENV_VAR, '')}"
    if key not in _DISK:
        _DISK[key] = cache.ResultsCache(path)
    return _DISK[key]


@st.cache_resource(ttl=TTL_S, show_spinner="Opening the store…", on_release=_Store.release, max_entries=8)
def _store_at(path: str, fp: str) -> _Store:
    return _Store(path)


def _connection(path: str, fp: str | None = None) -> _Store:
    """The open store of `path` as of fingerprint `fp` (default: now); the fingerprint is taken before it opens."""
    return _store_at(path, fp or fingerprint(path))


def _on_store(path: str, work, fp: str | None = None):
    """`work(cursor)` on the open store of `path`; again on a fresh store if *Reload data* closed it meanwhile."""
    for attempt in range(2):
        store_ = _connection(path, fp)
        try:
            with store_.using() as cur:
                return work(cur)
        except StoreClosed:
            if attempt or store_.closing:
                raise


def _fetch(path: str, query_: tuple, fp: str, compute):
    """A result the memory cache lacks: read from the disk cache, else computed and written there. A page's
    fetch counts as page work, so the warm-up waits for it before its next step (unpickling a large table takes
    a core too); the warm-up's does not wait here (it waited before its step: `lab_stores` module doc)."""
    with page_work():
        return disk(path).get_or_compute(query_, fp, compute)


@st.cache_data(ttl=TTL_S, show_spinner="Querying…", max_entries=512)
def _cached(path: str, fp: str, module: str, name: str, args: tuple, kwargs: tuple):
    """`module.name(cursor, *args, **kwargs)` on the store as of `fp`: from the disk cache, else computed and
    kept there. The function is imported only when computed (the Corrections rules import torch)."""
    def compute():
        fn = getattr(importlib.import_module(module), name)
        return _on_store(path, lambda cur: fn(cur, *args, **dict(kwargs)), fp)

    return _fetch(path, (module, name, args, kwargs), fp, compute)


def _call(path: str, fn, *args, **kwargs):
    return _call_named(path, fn.__module__, fn.__name__, *args, **kwargs)


def _call_named(path: str, module: str, name: str, *args, **kwargs):
    return _cached(path, fingerprint(path), module, name, args, tuple(sorted(kwargs.items())))


def _pair_tokens_query(rollout: str, scorer: str) -> tuple:
    return ("volatility.pair_tokens", rollout, scorer)


def _volatility_by_unit(path: str, fp: str, name: str, *args):
    """On a shard store, `store.units_volatility.<name>(its units as of fp, disk(path), *args)`: the pair's tokens
    kept per unit (run, step), so that a refresh reads and computes the new steps only; None on another store."""
    from mismatch_lab.store import units_volatility
    from mismatch_lab.store.shards import is_shard_store

    if not is_shard_store(path):
        return None
    with page_work():
        return getattr(units_volatility, name)(units_volatility.ShardUnits(path, fp), disk(path), *args)


@st.cache_resource(ttl=TTL_S, show_spinner="Reading the pair's tokens…", max_entries=16)
def _pair_tokens(path: str, fp: str, rollout: str, scorer: str) -> volatility.PairTokens | None:
    """The per-token inputs of one pair's volatility tables (`volatility.pair_tokens`: 17-33 bytes a token)
    as of `fp`: from the disk cache (~0.05 s for 500,000 tokens), else one join of the pair's tokens and
    scores, kept there. A resource: shared by the sessions, never copied; the tables computed from it are
    read-only in DuckDB."""
    def compute():
        return _on_store(path, lambda cur: volatility.pair_tokens(cur, rollout, scorer), fp)

    by_unit = _volatility_by_unit(path, fp, "pair_tokens", rollout, scorer)
    return by_unit if by_unit is not None else _fetch(path, _pair_tokens_query(rollout, scorer), fp, compute)


def _keep_pair_tokens(path: str, rollout: str, scorer: str) -> None:
    """The warm-up's step for a pair: its tokens in the disk cache (one join when missing), so that a
    bucketing no one computed yet reads them from there; without a disk cache, in memory."""
    fp = fingerprint(path)
    if _volatility_by_unit(path, fp, "unit_pair_tokens", rollout, scorer) is not None:  # a shard store: per unit
        return
    if not disk(path).has(_pair_tokens_query(rollout, scorer), fp):
        _pair_tokens(path, fp, rollout, scorer)


@st.cache_data(ttl=TTL_S, show_spinner="Querying…", max_entries=512)
def _volatility(path: str, fp: str, rollout: str, scorer: str, buckets: str, n_buckets: int, eps_low: float,
                eps_high: float):
    """A pair's volatility table as of `fp`, computed from the pair's tokens (`_pair_tokens`) when not cached."""
    query_ = ("volatility", rollout, scorer, buckets, n_buckets, eps_low, eps_high)

    def compute():
        by_unit = _volatility_by_unit(path, fp, "volatility_of", *query_[1:])  # a shard store: per unit
        return by_unit if by_unit is not None else volatility.volatility_of_pair(
            _pair_tokens(path, fp, rollout, scorer), buckets, n_buckets, eps_low, eps_high)

    return _fetch(path, query_, fp, compute)


@st.cache_data(ttl=TTL_S, show_spinner="Querying the new steps…", max_entries=64)
def _steps_by_unit(path: str, fp: str):
    """The per-unit step series of a DuckDB store as of `fp` (`store.units.DuckUnits` on the snapshot)."""
    from mismatch_lab.store import units

    return _on_store(path, lambda cur: units.by_unit(units.DuckUnits(cur, path), disk(path), "step_series"), fp)


_DUCKDB: dict[str, bool] = {}


def _is_duckdb(path: str) -> bool:
    """Whether the store at `path` is read from a DuckDB file (a `.duckdb`, or a study folder holding one)."""
    if path not in _DUCKDB:
        files = cache.data_files(path)[1]
        _DUCKDB[path] = bool(files) and files[0].suffix == ".duckdb"
    return _DUCKDB[path]


@st.cache_data(ttl=TTL_S, show_spinner="Querying the new steps…", max_entries=256)
def _page_by_unit(path: str, fp: str, page: str, name: str, args: tuple, kwargs: tuple):
    """The look-up `name` of `page` (`store.units_pages.PAGES`) per unit."""
    from mismatch_lab.store import units_pages

    source, look_ups = units_pages.PAGES[page]
    with page_work():
        return look_ups[name][1](source(path, fp), disk(path), *args, **dict(kwargs))


for _cached_resource in (_store_at, _pair_tokens):
    clear_at_exit(_cached_resource)
