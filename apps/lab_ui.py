"""What the app's pages call: which store is open, the queries on it through the caches, the named analyses.

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
(`corrections_pairs`) until the comparison of every token, the warm-up's last step, is cached.

The plumbing lives beside this module, which re-exports what the pages use: `lab_stores` (the open
stores, their cursors and lifetimes, the warm-up thread), `lab_cache` (fingerprints, the cached connection
and results, the per-unit look-ups of a store being written) and `lab_draw` (tables, charts, token colours).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

import pandas as pd
import streamlit as st
from lab_cache import (  # (names the pages and tests use as lab_ui.X are re-exported: marked F401)
    _DISK,
    TTL_S,
    _call,
    _call_named,
    _connection,
    _is_duckdb,
    _keep_pair_tokens,
    _page_by_unit,
    _steps_by_unit,
    _store_at,  # noqa: F401
    _volatility,
    disk,
    fingerprint,
)
from lab_draw import (  # noqa: F401
    COLOUR_MODES,
    colour_legend,
    keep_valid,
    line_chart,
    shown,
    token_html,
    token_label,
)
from lab_stores import StoreClosed, _WarmUp, clear_at_exit, page_run, yield_to_pages  # noqa: F401

from mismatch_lab.analysis import (
    browse,
    definitions,
    precision,
    steps,
)
from mismatch_lab.analysis.sample import sample_size
from mismatch_lab.errors import UserError
from mismatch_lab.store import units_clipping
from mismatch_lab.store.shards import is_shard_store

APP_DIR = Path(__file__).resolve().parent
REPO = APP_DIR.parent
ENV_VAR = "MISMATCH_LAB_STUDY"  # set by `mismatch-lab app --study ...`; `-- --study ...` works too
WORST_N = units_clipping.WORST_N  # the inspector's list of worst sequences (as many as are kept per unit)
TOP_CLIPPED_MAX = 100  # the Clipping page's longest list of token strings (one query serves every shorter one)
IMPORT_QUIET_S = 5.0  # the warm-up imports the Corrections rules (torch) once pages have not queried this long


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


def query(fn, *args, **kwargs):
    """`fn(con, *args, **kwargs)` on the open store, cached by its arguments for TTL_S."""
    return _call(store(), fn, *args, **kwargs)


# --- the heavy analyses, named once so that the warm-up computes exactly what the pages ask for -----------


def precision_of(path: str | None = None):
    return _call(path or store(), precision.precision_table)


def volatility_of(
    rollout: str,
    scorer: str,
    buckets: str = "linear",
    n_buckets: int | None = None,
    eps_low: float = definitions.EPS_LOW,
    eps_high: float = definitions.EPS_HIGH,
    path: str | None = None,
):
    """The volatility table of one pair, computed from the pair's tokens (`lab_cache._pair_tokens`; on a shard store
    per unit, with no connection on the whole store)."""
    n = n_buckets or (definitions.N_LINEAR_BUCKETS if buckets == "linear" else definitions.N_LOG_BUCKETS)
    path = path or live_store()
    return _volatility(path, fingerprint(path), rollout, scorer, buckets, int(n), float(eps_low), float(eps_high))


def pairs_of(path: str | None = None):
    """The store's (rollout, scorer) pairs (`browse.list_pairs`; per unit on a shard store)."""
    return per_unit("clipping", "list_pairs", path=path)


def categories_of(path: str | None = None) -> list[str]:
    """The store's token categories (`browse.list_categories`; per unit on a shard store)."""
    return per_unit("clipping", "list_categories", path=path)


def clipping_of(rollout: str, scorer: str, path: str | None = None):
    """A pair's clipping by token category (`clipping.clipping_by_category`; per unit on a shard store)."""
    return per_unit("clipping", "clipping_by_category", rollout=rollout, scorer=scorer, path=path)


def top_clipped_of(rollout: str, scorer: str, path: str | None = None):
    """The TOP_CLIPPED_MAX most clipped token strings of a pair (ranked; the page shows the first n)."""
    return per_unit("clipping", "top_clipped_tokens", TOP_CLIPPED_MAX, rollout=rollout, scorer=scorer, path=path)


def worst_of(scorer: str | None = None, path: str | None = None):
    """The inspector's WORST_N worst sequences (`browse.worst_sequences`; per unit on a shard store)."""
    return per_unit("inspector", "worst_sequences", scorer=scorer, n=WORST_N, path=path)


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
    """The Training page's look-up `name` (`store.units_pages.TRAINING`): on a shard store per unit, else the
    whole-store function through `query`'s caches."""
    return per_unit("training", name, *args, path=path, **kwargs)


def per_unit(page: str, name: str, *args, path: str | None = None, **kwargs):
    """The look-up `name` of `page` (`store.units_pages.PAGES`: "training", "inspector", "clipping") on a shard
    store per unit, else the whole-store function through `query`'s caches."""
    from mismatch_lab.store import units_pages

    path = path or live_store()
    module, _ = units_pages.PAGES[page][1][name]
    if not is_shard_store(path):
        return _call_named(path, module, name, *args, **kwargs)
    try:
        return _page_by_unit(path, fingerprint(path), page, name, args, tuple(sorted(kwargs.items())))
    except UserError as exc:  # what `store()` says of a store it cannot open
        st.error(f"Cannot open `{store_label(path)}`: {exc}")
        st.stop()


def overview(name: str, path: str | None = None):
    """The Overview's look-up `name` (`store.units_overview.OVERVIEW`: list_runs, precision_table, doctor_view):
    on a shard store merged from per-unit parts (a refresh of a store being written computes its new steps
    only), else, and where the doctor's parts are not kept per unit, the whole-store function through `query`'s
    caches (the same entries as `precision_of` and the warm-up's)."""
    from mismatch_lab.store import units_overview

    path = path or live_store()
    module, _ = units_overview.OVERVIEW[name]
    if is_shard_store(path):
        try:
            found = _overview_by_unit(path, fingerprint(path), name)
        except UserError as exc:  # what `store()` says of a store it cannot open
            st.error(f"Cannot open `{store_label(path)}`: {exc}")
            st.stop()
        if found is not None:
            return found
    return _call_named(path, module, name)


@st.cache_data(ttl=TTL_S, show_spinner="Querying the new steps…", max_entries=64)
def _overview_by_unit(path: str, fp: str, name: str):
    from lab_stores import page_work

    from mismatch_lab.store import units_overview

    with page_work():
        return units_overview.OVERVIEW[name][1](units_overview.OverviewUnits(path, fp), disk(path))


def _step(fn, *args, **kwargs):
    """One step of the warm-up (`_warm`): `fn(*args, **kwargs)` once the pages have been quiet
    (`yield_to_pages`). The only place it waits: a step runs inside the cache locks of what it computes, where
    a page asking for the same result waits (`lab_stores` module doc)."""
    yield_to_pages()
    return fn(*args, **kwargs)


def _warm(path: str) -> None:
    """Compute what the pages show first, most likely first: the overview, then each pair's pages."""
    if not is_shard_store(path):  # the inspector's run list (the inspector's and the Overview's on a shard store
        _step(_call, path, browse.list_runs)  # are per unit)
    _step(overview, "list_runs", path)
    _step(overview, "precision_table", path)
    _step(overview, "doctor_view", path)  # the Overview's verdicts and Doctor section (its own precision pass)
    pairs = _step(pairs_of, path)
    _step(categories_of, path)
    for i, pair in enumerate(pairs.itertuples()):
        _step(volatility_of, pair.rollout, pair.scorer, path=path)
        _step(clipping_of, pair.rollout, pair.scorer, path=path)
        _step(top_clipped_of, pair.rollout, pair.scorer, path=path)
        if i == 0:
            _step(worst_of, path=path)
    for pair in pairs.itertuples():  # the other bucket scale and the pair's tokens (any other bucketing reads
        _step(volatility_of, pair.rollout, pair.scorer, "log", path=path)  # them), then the worst sequences
        _step(_keep_pair_tokens, path, pair.rollout, pair.scorer)  # per scorer
    for scorer in sorted(set(pairs["scorer"])):
        _step(worst_of, scorer, path=path)
    _warm_corrections(path)


def _warm_corrections(path: str) -> None:
    """The warm-up's last steps: the Corrections page's comparison (`lab_corrections`)."""
    from lab_corrections import (
        _cached_sample,
        _compare_keeping_drops,
        corrections_of,
        corrections_sample_every,
    )

    if _step(corrections_of, path) is None:  # (with every method's dropped tokens of every pair: one pass)
        return
    every = _step(corrections_sample_every, path)
    pairs = None
    if every > 1:  # what an override opens on (the sample: corrections_pairs), the same for any override
        pairs = _step(_cached_sample, path, every, None, "mismatch_lab.corrections.layout", "pair_info", (), ())
        _step(_cached_sample, path, every, None, sample_size.__module__, "sample_size", (), ())
    # the rules' modules (torch: ~1.5 CPU s), which a cached result does not import: an override, computed on
    # demand, then costs only its rule. Only once no page has queried for IMPORT_QUIET_S: the page's rendering
    # goes on after its last query, and beside a page's first load on 2 cores the import took ~0.5 CPU s of it
    # (Inspector 2.1-2.6 -> 3.0-3.9 s in Chromium)
    yield_to_pages(IMPORT_QUIET_S)
    importlib.import_module("mismatch_lab.corrections.compare")
    for pair in [] if pairs is None else pairs.itertuples():  # last, each pair's sample at the defaults (~0.5
        # CPU s a pair on 1 M tokens): an override there then runs only the methods it changes (_at_defaults)
        _step(_compare_keeping_drops, path, every, (pair.rollout, pair.scorer), None)


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


@st.cache_resource(ttl=TTL_S, show_spinner=False, on_release=_WarmUp.stop)
def _warm_up(path: str) -> _WarmUp:
    """Start the warm-up of one store once per TTL (the thread is the cached resource). Not again when a writer
    changes the store: on a run being recorded that would redo every whole-store analysis at each refresh; the
    pages compute what they show of the new data on demand."""
    thread = _WarmUp(path, _warm)
    thread.start()
    return thread


clear_at_exit(_warm_up)
