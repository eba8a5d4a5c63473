"""The Corrections page's data (apps/app_pages/corrections.py): every method of the registry on every (rollout,
scorer) pair, of every token or, on a store over CORRECTIONS_SAMPLE_TOKENS tokens, first of a stated sample of its
prompt groups, one pair at a time; each method's dropped tokens from the same pass; threshold overrides on the
comparison at the published defaults (only the methods they change run again). On a shard store still being
written, at the published defaults, per unit (`mismatch_lab/store/units_corrections.py`): a refresh compares its
new steps only and opens no connection on the whole store. The warm-up's last steps compute it (`lab_ui._warm`)."""

from __future__ import annotations

import importlib
import math
import os
import time

import pandas as pd
import streamlit as st
from lab_cache import TTL_S, _call, _call_named, _fetch, _on_store, disk, fingerprint
from lab_ui import live_store, store_label

from mismatch_lab.analysis.sample import SAMPLE_TOKENS, sample_size, sampled, stride
from mismatch_lab.errors import UserError
from mismatch_lab.store import cache
from mismatch_lab.store.shards import is_shard_store


def corrections_of(path: str | None = None):
    """The Corrections page's tables: every method of the registry on every pair, published defaults."""
    from mismatch_lab.corrections.layout import pair_info

    path = path or live_store()
    if is_shard_store(path):  # merged from per-unit parts (a refresh compares the new steps only)
        tables = _corrections_units(path, "comparison", ())
        tables = None if tables["corrections"].empty else tables
    elif _call(path, pair_info).empty:
        return None
    else:
        _compare_keeping_drops(path, None, None, None)
        tables = _call_named(path, COMPARE, "compare", overrides=None)
    _EXACT_DONE[(path, fingerprint(path), ())] = time.monotonic()  # the page shows it now on
    return tables


# --- the Corrections page on a sample of a large store ---------------------------------------------------

COMPARE = "mismatch_lab.corrections.compare"
"""The comparison's module, named rather than imported where a cached result may serve: it imports torch."""
CORRECTIONS_SAMPLE_TOKENS = SAMPLE_TOKENS
"""A store with more tokens than this opens the Corrections page on a sample of its prompt groups (about
this many tokens, analysis/sample.py) until the comparison of every token is cached (the warm-up's last step,
or on demand)."""
_EXACT_DONE: dict[tuple, float] = {}  # (path, fingerprint, overrides) -> when the comparison of every token was
# last returned


def _frozen(overrides) -> tuple:
    return tuple(sorted((m, tuple(sorted(p.items()))) for m, p in (overrides or {}).items()))


def _cached_sample(path: str, every: int, pair: tuple | None, module: str, name: str, args: tuple, kwargs: tuple):
    by_unit = _SAMPLE_BY_UNIT.get((module, name))
    if by_unit and is_shard_store(path) and not args and kwargs in ((), (("overrides", None),)) and (
            pair is None or by_unit == "comparison"):
        return _corrections_units(path, by_unit, (every, pair) if pair else (every,))
    return _sample_at(path, fingerprint(path), every, pair, module, name, args, kwargs)


_SAMPLE_BY_UNIT = {  # a sample's look-up (module, name) -> its per-unit form on a shard store (units_corrections)
    ("mismatch_lab.corrections.layout", "pair_info"): "sample_info",
    ("mismatch_lab.analysis.sample", "sample_size"): "sample_size",
    (COMPARE, "compare"): "comparison",  # (at the published defaults)
}


def _corrections_units(path: str, name: str, args: tuple):
    """`_corrections_by_unit` as of the store's fingerprint now; a store it cannot open stops the page with what
    `store()` says."""
    try:
        return _corrections_by_unit(path, fingerprint(path), name, args)
    except UserError as exc:
        st.error(f"Cannot open `{store_label(path)}`: {exc}")
        st.stop()


@st.cache_data(ttl=TTL_S, show_spinner="Comparing the new steps…", max_entries=256)
def _corrections_by_unit(path: str, fp: str, name: str, args: tuple):
    """`units_corrections.<name>(source, results, *args)` of a shard store as of `fp`, merged from per-unit parts
    (a refresh compares the new or changed steps only, and opens no connection on the whole store)."""
    from lab_stores import page_work

    from mismatch_lab.store import units_corrections

    with page_work():
        return getattr(units_corrections, name)(units_corrections.OverviewUnits(path, fp), disk(path), *args)


@st.cache_resource(ttl=TTL_S, show_spinner=False, max_entries=8)
def _dropped_by_unit(path: str, fp: str, every: int | None, pair: tuple, method: str) -> pd.DataFrame:
    """`method`'s rows of the pair's PairDrops merged from per-unit parts (`units_corrections.pair_drops`); shared
    and never copied: read only."""
    from lab_stores import page_work

    from mismatch_lab.store import units_corrections

    with page_work():
        source = units_corrections.OverviewUnits(path, fp)
        return units_corrections.pair_drops(source, disk(path), every, pair).tokens(method)


def _store_size(path: str) -> dict:
    """`sample_size` of the whole store (per unit on a shard store)."""
    if is_shard_store(path):
        return _corrections_units(path, "sample_size", ())
    return _call(path, sample_size)


@st.cache_data(ttl=TTL_S, show_spinner="Querying a sample…", max_entries=512)
def _sample_at(path: str, fp: str, every: int, pair: tuple | None, module: str, name: str, args: tuple, kwargs: tuple):
    def compute():
        fn = getattr(importlib.import_module(module), name)
        return _on_store(path, lambda cur: fn(sampled(cur, every, pair), *args, **dict(kwargs)), fp)

    return _fetch(path, ("sample", every, pair, module, name, args, kwargs), fp, compute)


def corrections_sample_every(path: str | None = None) -> int:
    """1 for a store of at most CORRECTIONS_SAMPLE_TOKENS tokens, else the sampling stride of its prompt groups;
    on a shard store rounded up to a power of two (`measure.sample_every`), so that a store being written keeps
    its sample, and the parts compared of it, until it doubles."""
    from mismatch_lab.doctor.measure import sample_every

    path = path or live_store()
    return (sample_every if is_shard_store(path) else stride)(_store_size(path)["tokens"], CORRECTIONS_SAMPLE_TOKENS)


def _compare_keeping_drops(path: str, every: int | None, pair: tuple | None, overrides) -> None:
    """Into the results cache, when it lacks them: the comparison (of every token: every None; else of the
    sample's `pair`), under the key its cached call reads, and from the same pass each pair's dropped tokens
    (`dropped.PairDrops`, for `dropped_tokens_of`): the rules then run once for both. With overrides, on the
    comparison at the defaults (computed first when missing): only the methods the overrides change are run."""
    if is_shard_store(path) and not overrides:  # per unit: the parts keep the drops (units_corrections)
        _corrections_units(path, "comparison", (every, pair) if every else ())
        return
    fp = fingerprint(path)
    query = _compare_query(every, pair, overrides)
    if disk(path).has(query, fp):
        return

    def compute():
        from mismatch_lab.corrections.dropped import compare_with_drops

        base = _at_defaults(path, fp, every, pair) if overrides else None

        def work(cur):
            return compare_with_drops(cur if every is None else sampled(cur, every, pair), overrides=overrides or None,
                                      base=base)

        done = _on_store(path, work, fp)
        for p, d in done.drops.items():
            disk(path).put(_drops_query(every, p, overrides), fp, d)
        if not overrides:  # (the base of any override)
            disk(path).put(_sums_query(every, pair), fp, (done.sums, done.info))
        return done.tables

    _fetch(path, query, fp, compute)


def _at_defaults(path: str, fp: str, every: int | None, pair: tuple | None):
    """The comparison at the published defaults (`dropped.Compared`) from the results cache (computed first when
    missing); None if it is not all there after all (an entry not ours, or of an earlier version)."""
    from mismatch_lab.corrections.dropped import Compared

    if is_shard_store(path):  # (kept per unit, not as one pass's sums to splice into: the overrides run every method)
        return None
    _compare_keeping_drops(path, every, pair, None)
    tables, sums = (disk(path).get(q, fp) for q in (_compare_query(every, pair, None), _sums_query(every, pair)))
    if tables is cache.MISSING or sums is cache.MISSING:
        return None
    pairs = tables["corrections"][["rollout", "scorer"]].drop_duplicates().itertuples(index=False)
    drops = {(r, s): disk(path).get(_drops_query(every, (r, s), None), fp) for r, s in pairs}
    return None if any(d is cache.MISSING for d in drops.values()) else Compared(tables, drops, *sums)


def _compare_query(every: int | None, pair: tuple | None, overrides) -> tuple:
    """The results-cache key of the comparison `_call_named` (every None) or `_cached_sample` reads."""
    if every is None:
        return (COMPARE, "compare", (), (("overrides", overrides),))
    return ("sample", every, pair, COMPARE, "compare", (), (("overrides", overrides or None),))


def _drops_query(every: int | None, pair: tuple, overrides) -> tuple:
    return ("corrections.drops", every, tuple(pair), _frozen(overrides))


def _sums_query(every: int | None, pair: tuple | None) -> tuple:
    return ("corrections.sums", every, pair)


@st.cache_resource(ttl=TTL_S, show_spinner=False, max_entries=8)  # (~13 MB each on 500,000 tokens)
def _drops_at(path: str, fp: str, query: tuple):
    """A pair's PairDrops from the results cache (~12 bytes a token), shared by the sessions
    and never copied (read only); None when it is not there."""
    value = disk(path).get(query, fp)
    return None if value is cache.MISSING else value


@st.cache_resource(ttl=TTL_S, show_spinner=False, max_entries=8)  # (up to ~15 MB each)
def _dropped_at(path: str, fp: str, query: tuple, method: str) -> pd.DataFrame:
    """`method`'s rows of a pair's PairDrops (~0.06 s for 400,000 tokens), kept for the page's next runs; shared
    and never copied: read only."""
    return _drops_at(path, fp, query).tokens(method)


def _exact_tables(path: str, overrides):
    """Every method on every token of the store (cached), or None when it has no (rollout, scorer) pair."""
    from mismatch_lab.corrections.layout import pair_info

    if overrides and _call(path, pair_info).empty:
        return None
    if overrides:
        _compare_keeping_drops(path, None, None, overrides)
    tables = _call_named(path, COMPARE, "compare", overrides=overrides) if overrides else corrections_of(path)
    if tables is not None:
        _EXACT_DONE[(path, fingerprint(path), _frozen(overrides))] = time.monotonic()
    return tables


def method_defaults() -> pd.DataFrame:
    """(method, parameter, default) of every compared method at its published defaults, from the results cache
    keyed by the package's sources: the registry imports torch (its rules), which a page showing cached tables
    does not otherwise need (~1.5 s of a first load)."""
    def compute():
        from mismatch_lab.corrections.compare import variants

        return pd.DataFrame([{"method": v.label, "parameter": k, "default": x}
                             for v in variants() for k, x in v.params.items()])

    return disk(live_store()).get_or_compute(("corrections.method_defaults",), cache.code_fingerprint(), compute)


def _exact_on_disk(path: str) -> bool:
    """Whether the comparison of every token at the published defaults is in the store's disk cache (a shard
    store's: kept per unit but for at most a sample's tokens, `units_corrections.exact_kept`)."""
    if is_shard_store(path):
        return _corrections_units(path, "exact_kept", (CORRECTIONS_SAMPLE_TOKENS,))
    return disk(path).has(_compare_query(None, None, None), fingerprint(path))


def corrections_pairs(overrides=None, exact: bool = False):
    """(pairs, sample) for the Corrections page: the (rollout, scorer) rows it compares, in the comparison's
    order, and None when it compares every token (when `exact`, when the store is small, or when that
    comparison is already cached), else the sample it compares: {every, sequences, tokens, store_sequences,
    store_tokens, background}. A sample is compared one pair at a time (`corrections_tables`)."""
    from mismatch_lab.corrections.layout import pair_info

    path = live_store()
    every = corrections_sample_every(path)
    done = (_EXACT_DONE.get((path, fingerprint(path), _frozen(overrides)), -math.inf) > time.monotonic() - TTL_S
            or not overrides and _exact_on_disk(path))
    info = None if exact or every == 1 or done else _cached_sample(path, every, None, pair_info.__module__,
                                                                    "pair_info", (), ())
    if info is None or info.empty:  # (a sample that missed every pair: the whole store)
        tables = _exact_tables(path, overrides)
        pairs = tables["corrections"] if tables is not None else pd.DataFrame(columns=["rollout", "scorer"])
        return pairs[["rollout", "scorer"]].drop_duplicates().reset_index(drop=True), None
    sample = _cached_sample(path, every, None, sample_size.__module__, "sample_size", (), ())
    whole = _store_size(path)
    background = not overrides and os.environ.get("MISMATCH_LAB_APP_WARMUP", "1") != "0"  # the warm-up's last step
    return info[["rollout", "scorer"]], {"every": every, **sample, "store_sequences": whole["sequences"],
                                         "store_tokens": whole["tokens"], "background": background}


def corrections_tables(overrides, rollout: str, scorer: str, sample: dict | None):
    """The comparison's tables holding the pair (rollout, scorer): of every token (sample None: every pair),
    or of the sample (that pair only)."""
    path = live_store()
    if sample is None:
        return _exact_tables(path, overrides)
    _compare_keeping_drops(path, sample["every"], (rollout, scorer), overrides)
    kwargs = (("overrides", overrides or None),)
    return _cached_sample(path, sample["every"], (rollout, scorer), COMPARE, "compare", (), kwargs)


def dropped_tokens_of(method: str, rollout: str, scorer: str, overrides, sample: dict | None):
    """The tokens `method` drops on the pair, on the same tokens as the comparison shown (the sample's, if any):
    read off the decisions the comparison kept (`_compare_keeping_drops`), else computed (its rule on the pair).
    Named, not imported: the module imports torch, which a cached result does not need."""
    path = live_store()
    fp = fingerprint(path)
    if is_shard_store(path) and not overrides:  # merged from per-unit parts
        return _dropped_by_unit(path, fp, None if sample is None else sample["every"], (rollout, scorer), method)
    query = _drops_query(None if sample is None else sample["every"], (rollout, scorer), overrides)
    if disk(path).has(query, fp) and _drops_at(path, fp, query) is not None:
        return _dropped_at(path, fp, query, method)
    module = "mismatch_lab.corrections.dropped"
    if sample is None:
        return _call_named(path, module, "dropped_tokens", method, rollout, scorer, overrides=overrides or None)
    kwargs = (("overrides", overrides or None),)
    return _cached_sample(path, sample["every"], (rollout, scorer), module, "dropped_tokens",
                          (method, rollout, scorer), kwargs)
