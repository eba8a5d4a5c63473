"""Shared plumbing of the app's pages: which store is open, the cached connection and queries, token colours.

Pages call `store()` for the open store's path (it stops the page with a plain message when there is
none) and `query(fn, ...)` to run a `mismatch_lab.analysis` function on it through the cache; they
never write SQL. The connection is a `st.cache_resource` (one per store path and fingerprint); query results
are `st.cache_data`, backed by the results cache on disk (`mismatch_lab.store.cache`); every cache is keyed by
the store's fingerprint (its files' sizes and times), so a store that a writer changes is re-read at the next
page run, and nothing computed is shown for data that changed. Each query runs on its own
cursor, because Streamlit serves every browser session from its own thread and one DuckDB connection
must not be shared across threads.

The heavy analyses (precision, volatility, clipping, worst sequences: ~1-3 s each on a 1M-token store
with 2 cores) are named once below (`precision_of`, `volatility_of`, ...) and computed for the pages'
default settings by a background warm-up thread as soon as a store is opened, so the first visit of
a page usually finds them cached. The warm-up gives way to the pages: it starts a query only once no page
has queried for `_PageQueries.QUIET_S`. MISMATCH_LAB_APP_WARMUP=0 turns the warm-up off (the benchmark's
cold measurements). The Corrections page of a large store opens on a sample of its prompt groups
(`corrections_view`) until the comparison of every token, the warm-up's last step, is cached.

Lifetimes. Every query runs on a cursor registered with the thread running it (`_Store.using`), so that
another thread can interrupt it: DuckDB's `interrupt()` acts on one connection, and a cursor is a
connection of its own. The warm-up thread stops on request (`_WarmUp.stop`: no further query, the one in
flight interrupted, the thread joined). A store the cache drops (its TTL, *Reload data*) is closed once
its queries in flight are done. At process exit `_shutdown` stops every warm-up, interrupts what still
runs and closes every store: a daemon thread left inside DuckDB at interpreter exit aborts the process
(`terminate called ...`, exit 134), and DuckDB objects alive then are reported as nanobind leaks.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import html
import importlib
import logging
import math
import os
import sys
import threading
import time
import weakref
from pathlib import Path

import duckdb
import pandas as pd
import streamlit as st

from mismatch_lab.analysis import (
    browse,
    clipping,
    definitions,
    precision,
    steps,
    volatility,
)
from mismatch_lab.analysis.sample import SAMPLE_TOKENS, sample_size, sampled, stride
from mismatch_lab.doctor.report import doctor_view
from mismatch_lab.errors import UserError
from mismatch_lab.store import cache
from mismatch_lab.store.reader import open_store
from mismatch_lab.store.shards import is_shard_store

APP_DIR = Path(__file__).resolve().parent
REPO = APP_DIR.parent
ENV_VAR = "MISMATCH_LAB_STUDY"  # set by `mismatch-lab app --study ...`; `-- --study ...` works too
TTL_S = 600  # what the memory caches keep at most this long (a changed store is re-read at once: `fingerprint`)
WORST_N = 50  # the inspector's list of worst sequences
TOP_CLIPPED_MAX = 100  # the Clipping page's longest list of token strings (one query serves every shorter one)
WARM_UP_THREAD = "mismatch-lab warm-up"  # the warm-up threads' name prefix
STOP_TIMEOUT_S = 30.0  # the longest wait for a stopped thread or an interrupted query (one fetch, in practice ms)

# The warm-up thread fills the caches outside any script run: Streamlit then warns "missing ScriptRunContext"
# on every cached call (its spinner has no page to draw on; the warning says it can be ignored). Raising that
# one logger's level (no filter object, nothing kept alive) keeps the warnings, and the logging errors they
# raise when a test's log stream has closed under a still-running warm-up, out of the output.
logging.getLogger("streamlit.runtime.scriptrunner_utils.script_run_context").setLevel(logging.ERROR)


def study_from_args(argv: list[str] | None = None) -> str | None:
    """The store named at start: `streamlit run apps/streamlit_app.py -- --study X`, or $MISMATCH_LAB_STUDY."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--study")
    args, _ = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    return args.study or os.environ.get(ENV_VAR) or None


def candidate_stores() -> list[str]:
    """The store given at start (first) and every study folder with data under ./studies and the repo's studies/."""
    found: list[str] = []
    given = study_from_args()
    if given:
        found.append(str(Path(given).resolve()))
    for root in dict.fromkeys([Path.cwd() / "studies", REPO / "studies"]):
        found += [str(p.resolve()) for p in browse.find_stores(root)]
    return list(dict.fromkeys(found))


def store_label(path: str) -> str:
    p = Path(path)
    try:
        return str(p.relative_to(Path.cwd()))
    except ValueError:
        return str(p)


def sidebar_store_picker() -> None:
    """The study selector and the reload button in the sidebar (rendered once, by the entry file)."""
    options = candidate_stores()
    if not options:
        st.session_state.pop("store_path", None)
        return
    if st.session_state.get("store_path") not in options:
        st.session_state["store_path"] = options[0]
    st.sidebar.selectbox(
        "Study",
        options,
        key="store_path",
        format_func=store_label,
        help="A study folder (its results/ Parquet), a .duckdb file, a Parquet folder, or the shard store of "
        "recorded / imported runs.",
    )
    if st.sidebar.button("Reload data", help="Data is re-read by itself as soon as a file of the store changes; "
                         "this empties the caches in memory (the results cache on disk is keyed by the data)."):
        st.cache_data.clear()
        st.cache_resource.clear()
        _DISK.clear()  # (the disk cache itself stays: it is keyed by the data, which is read again)


class StoreClosed(RuntimeError):
    """The store was closed (dropped from the cache, or the process is exiting) before a query could start."""


class _Stopped(Exception):
    """Raised in a warm-up thread that was asked to stop, before its next query."""


_STORES: weakref.WeakSet = weakref.WeakSet()  # every open store of this process
_WARM_UPS: weakref.WeakSet = weakref.WeakSet()  # every warm-up thread started


class _PageQueries:
    """The queries that pages run (not the warm-up's), so that the warm-up waits while a page queries: on 2
    cores a warm-up pass beside a page's first query doubled the page's wait. A warm-up query starts only
    once no page query has run for QUIET_S (the gap between two queries of one page run is shorter)."""

    QUIET_S = 0.75

    def __init__(self):
        self._cond = threading.Condition()
        self._running = 0
        self._last = -math.inf

    @contextlib.contextmanager
    def running(self):
        with self._cond:
            self._running += 1
        try:
            yield
        finally:
            with self._cond:
                self._running -= 1
                self._last = time.monotonic()
                self._cond.notify_all()

    def wake(self) -> None:
        """Wake the waiting warm-ups (one was asked to stop)."""
        with self._cond:
            self._cond.notify_all()

    def wait_quiet(self, warm_up: _WarmUp) -> None:
        """Block the warm-up until pages have been quiet for QUIET_S, or it is asked to stop."""
        with self._cond:
            while not warm_up.stopping:
                idle = time.monotonic() - self._last
                if not self._running and idle >= self.QUIET_S:
                    return
                self._cond.wait(self.QUIET_S if self._running else self.QUIET_S - idle)


_PAGE_QUERIES = _PageQueries()


class _Store:
    """One open store: its read-only connection and the cursors taken from it.

    `using()` lends a cursor to the calling thread and records which thread runs a query on it, so that
    `interrupt()` reaches queries in flight. `release()` (the cache dropped the store) closes the
    connection once no query runs on it; `shutdown()` (process exit) refuses new queries, interrupts the
    running ones, waits for them and closes.
    """

    def __init__(self, path: str):
        self.con = open_store(path, snapshot=True)  # a DuckDB file: a copy, so no writer is ever kept out
        self._lock = threading.Lock()
        self._held: dict[int, object] = {}  # long-lived cursors (a pair's joined rows), closed with the store
        self._busy: dict[int, tuple[object, threading.Thread]] = {}  # queries in flight: cursor, thread
        self._released = False
        self._closing = False
        _STORES.add(self)
        # open_store registered the removal of its temporary folders at exit; our shutdown must run first
        atexit.unregister(_shutdown)
        atexit.register(_shutdown)

    @property
    def usable(self) -> bool:
        return self.con is not None and not self._released and not self._closing

    @property
    def closing(self) -> bool:
        """The process is exiting: no new query."""
        return self._closing

    def held_cursor(self):
        """A cursor kept beyond one query (closed by `drop` or with the store)."""
        with self._lock:
            if self.con is None or self._closing:
                raise StoreClosed("the store was closed")
            cur = self.con.cursor()
            self._held[id(cur)] = cur
            return cur

    def drop(self, cur) -> None:
        """Close a cursor of `held_cursor` (no query may be running on it)."""
        with self._lock:
            if self._held.pop(id(cur), None) is not None:
                cur.close()

    @contextlib.contextmanager
    def using(self, cur=None):
        """A cursor for this thread's queries: `cur` (one of `held_cursor`) or a fresh one, closed after."""
        thread = threading.current_thread()
        warm_up = isinstance(thread, _WarmUp)
        if warm_up:
            _PAGE_QUERIES.wait_quiet(thread)
        with self._lock:
            if warm_up and thread.stopping:
                raise _Stopped
            if self.con is None or self._closing or (cur is not None and id(cur) not in self._held):
                raise StoreClosed("the store was closed")
            own = cur is None
            if own:
                cur = self.con.cursor()
            self._busy[id(cur)] = (cur, thread)
        try:
            with contextlib.nullcontext() if warm_up else _PAGE_QUERIES.running():
                yield cur
        finally:
            with self._lock:
                del self._busy[id(cur)]
                if own:
                    cur.close()
                idle = not self._busy
            if idle and self._released:
                self._close()

    def interrupt(self, thread: threading.Thread | None = None) -> int:
        """Interrupt the queries in flight (of `thread` only, if given); returns how many were running."""
        with self._lock:
            running = [cur for cur, t in self._busy.values() if thread is None or t is thread]
            for cur in running:
                cur.interrupt()
        return len(running)

    def release(self) -> None:
        """Dropped from the cache: close once the queries in flight are done (the cache's `on_release`)."""
        with self._lock:
            self._released = True
            idle = not self._busy
        if idle:
            self._close()

    def shutdown(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Refuse new queries, interrupt the running ones, wait for them, close."""
        with self._lock:
            self._closing = True
        deadline = time.monotonic() + timeout
        while self.interrupt() and time.monotonic() < deadline:
            time.sleep(0.02)
        if not self._busy:
            self._close()

    def _close(self) -> None:
        with self._lock:
            if self._busy or self.con is None:
                return
            con, self.con = self.con, None
            held, self._held = list(self._held.values()), {}
        for cur in held:
            with contextlib.suppress(duckdb.Error):
                cur.close()
        con.close()


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


def store() -> str:
    """Path of the open store; stops the page with a plain message when there is none or it cannot be read."""
    path = st.session_state.get("store_path")
    if not path:
        st.info(
            "No study to show. Start the app with `mismatch-lab app --study studies/<name>` "
            "(a study folder, a `.duckdb` file or a folder of Parquet files), "
            "or collect one first with `mismatch-lab collect`."
        )
        st.stop()
    try:
        _connection(path)
    except UserError as exc:
        st.error(f"Cannot open `{store_label(path)}`: {exc}")
        st.stop()
    if os.environ.get("MISMATCH_LAB_APP_WARMUP", "1") != "0":
        _warm_up(path)
    return path


def _fetch(path: str, query_: tuple, fp: str, compute):
    """A result the memory cache lacks: read from the disk cache, else computed and written there. A page's
    fetch counts as page work, so the warm-up waits for it (unpickling a large table takes a core too)."""
    thread = threading.current_thread()
    if not isinstance(thread, _WarmUp):
        with _PAGE_QUERIES.running():
            return disk(path).get_or_compute(query_, fp, compute)
    _PAGE_QUERIES.wait_quiet(thread)
    if thread.stopping:
        raise _Stopped
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


def query(fn, *args, **kwargs):
    """`fn(con, *args, **kwargs)` on the open store, cached by its arguments for TTL_S."""
    return _call(store(), fn, *args, **kwargs)


# --- the heavy analyses, named once so that the warm-up computes exactly what the pages ask for -----------


def precision_of(path: str | None = None):
    return _call(path or store(), precision.precision_table)


def corrections_of(path: str | None = None):
    """The Corrections page's tables: every method of the registry on every pair, published defaults."""
    from mismatch_lab.corrections.layout import pair_info

    if _call(path or store(), pair_info).empty:
        return None
    tables = _call_named(path or store(), COMPARE, "compare", overrides=None)
    _EXACT_DONE[(path or store(), fingerprint(path or store()), ())] = time.monotonic()  # the page shows it now on
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
    return _sample_at(path, fingerprint(path), every, pair, module, name, args, kwargs)


@st.cache_data(ttl=TTL_S, show_spinner="Querying a sample…", max_entries=512)
def _sample_at(path: str, fp: str, every: int, pair: tuple | None, module: str, name: str, args: tuple, kwargs: tuple):
    def compute():
        fn = getattr(importlib.import_module(module), name)
        return _on_store(path, lambda cur: fn(sampled(cur, every, pair), *args, **dict(kwargs)), fp)

    return _fetch(path, ("sample", every, pair, module, name, args, kwargs), fp, compute)


def corrections_sample_every(path: str | None = None) -> int:
    """1 for a store of at most CORRECTIONS_SAMPLE_TOKENS tokens, else the sampling stride of its prompt groups."""
    return stride(_call(path or store(), sample_size)["tokens"], CORRECTIONS_SAMPLE_TOKENS)


def _exact_tables(path: str, overrides):
    """Every method on every token of the store (cached), or None when it has no (rollout, scorer) pair."""
    from mismatch_lab.corrections.layout import pair_info

    if overrides and _call(path, pair_info).empty:
        return None
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

    return disk(store()).get_or_compute(("corrections.method_defaults",), cache.code_fingerprint(), compute)


def _exact_on_disk(path: str) -> bool:
    """Whether the comparison of every token at the published defaults is in the store's disk cache."""
    return disk(path).has((COMPARE, "compare", (), (("overrides", None),)), fingerprint(path))


def corrections_pairs(overrides=None, exact: bool = False):
    """(pairs, sample) for the Corrections page: the (rollout, scorer) rows it compares, in the comparison's
    order, and None when it compares every token (when `exact`, when the store is small, or when that
    comparison is already cached), else the sample it compares: {every, sequences, tokens, store_sequences,
    store_tokens, background}. A sample is compared one pair at a time (`corrections_tables`)."""
    from mismatch_lab.corrections.layout import pair_info

    path = store()
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
    whole = _call(path, sample_size)
    background = not overrides and os.environ.get("MISMATCH_LAB_APP_WARMUP", "1") != "0"  # the warm-up's last step
    return info[["rollout", "scorer"]], {"every": every, **sample, "store_sequences": whole["sequences"],
                                         "store_tokens": whole["tokens"], "background": background}


def corrections_tables(overrides, rollout: str, scorer: str, sample: dict | None):
    """The comparison's tables holding the pair (rollout, scorer): of every token (sample None: every pair),
    or of the sample (that pair only)."""
    if sample is None:
        return _exact_tables(store(), overrides)
    kwargs = (("overrides", overrides or None),)
    return _cached_sample(store(), sample["every"], (rollout, scorer), COMPARE, "compare", (), kwargs)


def dropped_tokens_of(method: str, rollout: str, scorer: str, overrides, sample: dict | None):
    """The tokens `method` drops on the pair, on the same tokens as the comparison shown (the sample's, if any).
    Named, not imported: the module imports torch, which a cached result does not need."""
    module = "mismatch_lab.corrections.dropped"
    if sample is None:
        return _call_named(store(), module, "dropped_tokens", method, rollout, scorer, overrides=overrides or None)
    kwargs = (("overrides", overrides or None),)
    return _cached_sample(store(), sample["every"], (rollout, scorer), module, "dropped_tokens",
                          (method, rollout, scorer), kwargs)


class _PairRows:
    """One pair's rollout rows joined once into a temporary table on a cursor of their own (the join of
    tokens and scores is most of a volatility pass), so that every bucketing of the pair -- a new bucket
    count, scale or ε -- is a GROUP BY over that table instead of a new join. A lock serialises the
    sessions that share it (a DuckDB cursor must not be used by two threads at once). The temporary table
    lives as long as its cursor: closed when the cache drops the pair, or with the store."""

    def __init__(self, store_: _Store, rollout: str, scorer: str):
        from mismatch_lab.analysis.relations import Filters
        from mismatch_lab.analysis.rows import Rows

        self.lock = threading.Lock()
        self.store = store_
        self.cursor = store_.held_cursor()
        try:
            with store_.using(self.cursor) as cur:  # the join: the long query, interruptible like any other
                self.rows = Rows(cur, Filters.make(rollout, scorer), materialize=True)
        except BaseException:
            store_.drop(self.cursor)
            raise

    def close(self) -> None:
        with self.lock:
            self.store.drop(self.cursor)
            self.rows = self.cursor = None  # no DuckDB object outlives the pair's release


@st.cache_resource(
    ttl=TTL_S,
    show_spinner="Joining the pair's tokens…",
    max_entries=64,
    validate=lambda pair: pair.store.usable,  # joined on a store the cache has dropped since: join again
    on_release=_PairRows.close,
)
def _pair_rows(path: str, rollout: str, scorer: str, fp: str | None = None) -> _PairRows:
    return _PairRows(_connection(path, fp), rollout, scorer)


@st.cache_data(ttl=TTL_S, show_spinner="Querying…", max_entries=512)
def _volatility(path: str, fp: str, rollout: str, scorer: str, buckets: str, n_buckets: int, eps_low: float,
                eps_high: float):
    query_ = ("volatility", rollout, scorer, buckets, n_buckets, eps_low, eps_high)
    return _fetch(path, query_, fp, lambda: _volatility_on_pair(
        path, fp, rollout, scorer, buckets, n_buckets, eps_low, eps_high))


def _volatility_on_pair(path, fp, rollout, scorer, buckets, n_buckets, eps_low, eps_high):
    for attempt in range(2):
        pair = _pair_rows(path, rollout, scorer, fp)
        try:
            with pair.lock:
                if pair.cursor is None:  # released between the look-up and the lock
                    raise StoreClosed("the pair was released")
                with pair.store.using(pair.cursor) as cur:
                    return volatility.volatility_table(cur, rollout=rollout, scorer=scorer, buckets=buckets,
                                                       n_buckets=n_buckets, eps_low=eps_low, eps_high=eps_high,
                                                       _rows=pair.rows)
        except StoreClosed:  # *Reload data* closed the pair's store between the look-up and the query
            if attempt or pair.store.closing:
                raise


def volatility_of(
    rollout: str,
    scorer: str,
    buckets: str = "linear",
    n_buckets: int | None = None,
    eps_low: float = definitions.EPS_LOW,
    eps_high: float = definitions.EPS_HIGH,
    path: str | None = None,
):
    """The volatility table of one pair, computed from the pair's joined rows (`_PairRows`)."""
    n = n_buckets or (definitions.N_LINEAR_BUCKETS if buckets == "linear" else definitions.N_LOG_BUCKETS)
    path = path or store()
    return _volatility(path, fingerprint(path), rollout, scorer, buckets, int(n), float(eps_low), float(eps_high))


def clipping_of(rollout: str, scorer: str, path: str | None = None):
    return _call(path or store(), clipping.clipping_by_category, rollout=rollout, scorer=scorer)


def top_clipped_of(rollout: str, scorer: str, path: str | None = None):
    """The TOP_CLIPPED_MAX most clipped token strings of a pair (ranked; the page shows the first n)."""
    return _call(path or store(), clipping.top_clipped_tokens, TOP_CLIPPED_MAX, rollout=rollout, scorer=scorer)


def worst_of(scorer: str | None = None, path: str | None = None):
    return _call(path or store(), browse.worst_sequences, scorer=scorer, n=WORST_N)


def step_series_of(path: str | None = None):
    """The Training page's mismatch per step (`analysis.steps.step_series`), per unit of (run, step): a refresh
    of a store being written computes only the new or changed steps (`store.units`). A shard store is read
    without a whole-store connection; a DuckDB store's units are checked on its snapshot (a checksum pass);
    any other store (a study's Parquet, written once) in one pass over the whole store."""
    path = path or live_store()
    if is_shard_store(path):
        return training("step_series", path=path)
    if not _is_duckdb(path):
        return _call(path, steps.step_series)
    return _steps_by_unit(path, fingerprint(path))


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


def live_store() -> str:
    """`store()` for the Training page: on a shard store without opening a connection on the whole store (its
    look-ups open one on the units they compute, `training`), so a refresh does no work per file of the store."""
    path = st.session_state.get("store_path")
    if not path or not is_shard_store(path):
        return store()
    if os.environ.get("MISMATCH_LAB_APP_WARMUP", "1") != "0":
        _warm_up(path)
    return path


def training(name: str, *args, path: str | None = None, **kwargs):
    """The Training page's look-up `name` (`store.units.TRAINING`): on a shard store per unit, else the
    whole-store function through `query`'s caches."""
    from mismatch_lab.store import units

    path = path or live_store()
    module, _ = units.TRAINING[name]
    if not is_shard_store(path):
        return _call_named(path, module, name, *args, **kwargs)
    try:
        return _training_by_unit(path, fingerprint(path), name, args, tuple(sorted(kwargs.items())))
    except UserError as exc:  # what `store()` says of a store it cannot open
        st.error(f"Cannot open `{store_label(path)}`: {exc}")
        st.stop()


@st.cache_data(ttl=TTL_S, show_spinner="Querying the new steps…", max_entries=256)
def _training_by_unit(path: str, fp: str, name: str, args: tuple, kwargs: tuple):
    from mismatch_lab.store import units

    with _PAGE_QUERIES.running():
        return units.TRAINING[name][1](units.ShardUnits(path, fp), disk(path), *args, **dict(kwargs))


def _warm(path: str) -> None:
    """Compute what the pages show first, most likely first: the overview, then each pair's pages."""
    _call(path, browse.list_runs)
    precision_of(path)
    _call(path, doctor_view)  # the Overview's verdicts and Doctor section (its own precision pass over the same rows)
    pairs = _call(path, browse.list_pairs)
    _call(path, browse.list_categories)
    for i, pair in enumerate(pairs.itertuples()):
        volatility_of(pair.rollout, pair.scorer, path=path)
        clipping_of(pair.rollout, pair.scorer, path=path)
        top_clipped_of(pair.rollout, pair.scorer, path=path)
        if i == 0:
            worst_of(path=path)
    for pair in pairs.itertuples():  # the other bucket scale, then the worst sequences under each scorer
        volatility_of(pair.rollout, pair.scorer, "log", path=path)
    for scorer in sorted(set(pairs["scorer"])):
        worst_of(scorer, path=path)
    corrections_of(path)


def prepare(path: str):
    """`mismatch-lab app --prepare`: into the store's results cache, in this process, what every page queries
    at its default settings (each page run once under Streamlit's AppTest, no server) and what the warm-up
    computes; returns the cache's folder (None: memory only, nothing kept)."""
    from streamlit.testing.v1 import AppTest

    _connection(path)  # opens (and checks) the store first: a UserError names the fix
    _warm(path)  # first: the pages then show what a server finds cached (the comparison of every token, ...)
    os.environ[ENV_VAR] = path
    os.environ["MISMATCH_LAB_APP_WARMUP"] = "0"  # (done above, in this thread)
    at = AppTest.from_file(str(APP_DIR / "streamlit_app.py"), default_timeout=24 * 3600)
    at.run()
    for page in sorted((APP_DIR / "app_pages").glob("*.py")):
        at.switch_page(f"app_pages/{page.name}").run()
        for exc in at.exception:
            print(f"warning: the {page.stem} page raised: {exc.message}", file=sys.stderr)
    return disk(path).folder


class _WarmUp(threading.Thread):
    """The warm-up of one store: a daemon thread that `stop()` ends within moments, even mid-query."""

    def __init__(self, path: str):
        super().__init__(target=_warm, args=(path,), name=f"{WARM_UP_THREAD} {path}", daemon=True)
        self.stopping = False
        _WARM_UPS.add(self)

    def run(self) -> None:
        try:
            super().run()
        except Exception:  # _Stopped, duckdb.InterruptException, StoreClosed: expected once stopping
            if not self.stopping:
                raise

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> bool:
        """No further query; the one in flight interrupted; joined. True when the thread has ended."""
        self.stopping = True
        _PAGE_QUERIES.wake()
        if threading.current_thread() is self:
            return False
        deadline = time.monotonic() + timeout
        while self.is_alive() and time.monotonic() < deadline:
            # again and again: DuckDB forgets an interrupt that lands before its query has started
            for store_ in list(_STORES):
                store_.interrupt(self)
            self.join(0.05)
        return not self.is_alive()


@st.cache_resource(ttl=TTL_S, show_spinner=False, on_release=_WarmUp.stop)
def _warm_up(path: str) -> _WarmUp:
    """Start the warm-up of one store once per TTL (the thread is the cached resource). Not again when a writer
    changes the store: on a run being recorded that would redo every whole-store analysis at each refresh; the
    pages compute what they show of the new data on demand."""
    thread = _WarmUp(path)
    thread.start()
    return thread


def _shutdown() -> None:
    """At process exit (atexit): stop and join the warm-ups, interrupt the queries still running, close
    every store. Registered again whenever a store opens, so that it runs before the removal of the
    store's temporary folders (atexit runs last-registered first)."""
    for thread in list(_WARM_UPS):
        thread.stop()
    for store_ in list(_STORES):
        store_.shutdown()
    # Drop what the caches hold, closed cursors included: the caches outlive this handler, and DuckDB
    # objects still alive when the interpreter finalises are reported as leaks ("nanobind: leaked ...").
    for cached in (_pair_rows, _warm_up, _store_at):
        cached.clear()


def shown(value) -> str:
    """A stored value as text; '—' where the store holds none (a recorded or imported run keeps only the
    required columns)."""
    return "—" if value is None or (not isinstance(value, str) and pd.isna(value)) else str(value)


token_label = browse.token_label  # a token for a picker or a table: its quoted string, else its id


def keep_valid(key: str, options: list) -> None:
    """Drop a remembered widget value that is no longer among its options (another run, study or step)."""
    if key in st.session_state and st.session_state[key] not in options:
        del st.session_state[key]


def studies_table() -> pd.DataFrame:
    """The study folders the app can open, with what each holds."""
    rows = []
    for path in candidate_stores():
        p = Path(path)
        d = browse.study_dir(p)
        rows.append(
            {
                "study": d.name,
                "path": store_label(path),
                "shard store": is_shard_store(p),  # recorded / imported runs: Parquet shards per run and step
                "parquet tables": len(list((d / "results").glob("*.parquet")))
                if (d / "results").is_dir()
                else len(list(p.glob("*.parquet")))
                if p.is_dir()
                else 0,
                "duckdb files": len(list(d.glob("*.duckdb"))),
                "figures": len(browse.study_figures(p)),
                "open": path == st.session_state.get("store_path"),
            }
        )
    return pd.DataFrame(rows)


def line_chart(data: pd.DataFrame, x: str, y: str, color: str, *, x_title: str, y_title: str, where=st) -> None:
    """A line chart of long-format data over an integer x (step, position), one line per value of `color`.

    Altair directly, not `st.line_chart`: labels such as 'hf:fp32' would be read as Altair shorthand
    once pivoted into column names. Altair is imported here: ~0.25 s of a fresh server's first page, which the
    pages without a chart do not need.
    """
    import altair as alt

    chart = (
        alt.Chart(data[[x, y, color]])
        .mark_line(point=len(data) <= 60)
        .encode(
            x=alt.X(f"{x}:Q", title=x_title, axis=alt.Axis(format="d", tickMinStep=1)),  # steps and positions
            y=alt.Y(f"{y}:Q", title=y_title),
            # past ten lines the default ten-colour scheme repeats: twenty colours (the stability study has 11 runs)
            color=alt.Color(f"{color}:N", title=color,
                            scale=alt.Scale(scheme="tableau20" if data[color].nunique() > 10 else "tableau10"),
                            legend=alt.Legend(labelLimit=0)),  # whole labels: pairs may differ only at the end
            tooltip=[alt.Tooltip(f"{x}:Q"), alt.Tooltip(f"{y}:Q", format=".4g"), alt.Tooltip(f"{color}:N")],
        )
    )
    where.altair_chart(chart, width="stretch")


# --- token colours for the inspector ------------------------------------------------------------------

COLOUR_MODES = ("|Δp|", "ratio", "mask decision")
MASK_COLOURS = {  # key -> (legend, colour name, rgb)
    "kept": ("kept by both", "no colour", None),
    "ppo": ("PPO clips only", "orange", (245, 158, 11)),
    "dppo": ("DPPO masks only", "purple", (139, 92, 246)),
    "both": ("PPO clips and DPPO masks", "red", (220, 38, 38)),
}


def _mask_key(row) -> str:
    ppo, dppo = bool(row.ppo_clipped), bool(row.dppo_masked)
    return "both" if ppo and dppo else "ppo" if ppo else "dppo" if dppo else "kept"


def _background(row, mode: str) -> str:
    if row.nonfinite or pd.isna(row.logp):
        return "background: repeating-linear-gradient(45deg,#ddd,#ddd 3px,#fff 3px,#fff 6px);"
    if mode == "|Δp|":
        # saturates at DPPO's δ so colours compare across sequences; sqrt makes small bf16 noise visible
        a = math.sqrt(min(row.abs_dp / browse.DELTA_TV, 1.0))
        return f"background: rgba(220,38,38,{a:.3f});"
    if mode == "ratio":
        lr = row.delta_logp
        a = min(abs(lr) / math.log(1 + browse.EPS_HIGH), 1.0)  # saturates at the clip-higher bound
        rgb = "220,38,38" if lr > 0 else "37,99,235"
        return f"background: rgba({rgb},{a:.3f});"
    rgb = MASK_COLOURS[_mask_key(row)][2]
    return f"background: rgb{rgb};color:white;" if rgb else ""


def token_html(tokens: pd.DataFrame, mode: str) -> str:
    """The response as HTML spans coloured by |Δp|, ratio or mask decision, each with a tooltip of its numbers."""
    spans = []
    for row in tokens.itertuples(index=False):
        if isinstance(row.token_text, str) and row.token_text:
            text = html.escape(row.token_text).replace("\n", "↵<br>")
        else:  # stored without text (no tokenizer): the id, in brackets
            text = html.escape(f"⟨{row.token_id}⟩" if pd.notna(row.token_id) else "∅")
        tip = f"pos {row.pos} · {token_label(row.token_text, row.token_id)} · μ={row.mu:.4g}" + (
            "  π=non-finite" if pd.isna(row.logp) else f" · π={row.pi:.4g} · r={row.ratio:.4g} · |Δp|={row.abs_dp:.3g}"
        )
        spans.append(
            f'<span title="{html.escape(tip)}" style="{_background(row, mode)}'
            f'border-radius:3px;padding:0 1px;">{text}</span>'
        )
    return (
        '<div style="font-family:ui-monospace,monospace;white-space:pre-wrap;line-height:1.9;'
        'border:1px solid #ddd;border-radius:6px;padding:10px;">' + "".join(spans) + "</div>"
    )


def colour_legend(mode: str) -> str:
    if mode == "|Δp|":
        return (
            f"Red intensity = √(|π − μ| / {browse.DELTA_TV}), saturating at DPPO's δ = {browse.DELTA_TV}. "
            "Hatched grey: non-finite π."
        )
    if mode == "ratio":
        return (
            f"Red: r = π/μ > 1, blue: r < 1; full colour at |log r| ≥ log(1 + {browse.EPS_HIGH}). "
            "Hatched grey: non-finite π."
        )
    parts = [f"{name} = {label}" for label, name, _ in MASK_COLOURS.values()]
    return (
        f"PPO clips r = π/μ outside [1 − {browse.EPS_LOW}, 1 + {browse.EPS_HIGH}], DPPO masks "
        f"|π − μ| > {browse.DELTA_TV}; both only in the advantage's direction when the sequence has one. "
        + "Colours: "
        + "; ".join(parts)
        + "; hatched grey = non-finite π."
    )
