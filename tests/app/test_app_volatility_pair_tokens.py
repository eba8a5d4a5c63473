"""The Volatility page's bucketings that the warm-up did not compute: from the pair's tokens, not the store.

benchmarks/bench_app_browser.py's Volatility interactions (1 M-token study, Chromium) found a bucketing the
warm-up had not computed (10 log buckets; then the first pair at ε 0.1) joining the pair's tokens and scores
first (~1.5 server CPU s a pair). The warm-up now keeps each pair's tokens (`volatility.pair_tokens`) in the
results cache, and every table of the pair is computed from them. Not timed: the store's joins are counted
(`rows.Rows`, from which every join of tokens and scores is built).
"""

from __future__ import annotations

import functools
import shutil

from app_paths import REPO, open_page

from mismatch_lab.analysis import browse, rows, volatility
from mismatch_lab.store.reader import open_store

# the benchmark's Volatility interactions, in its order: (pair, scale, buckets, ε low)
STEPS = [(1, "linear", "default", 0.2), (1, "log", "default", 0.2), (1, "log", 10, 0.2), (1, "log", 10, 0.1),
         (0, "log", 10, 0.1)]  # fmt: skip


def count_joins(monkeypatch) -> list:
    """The joins of a pair's tokens and scores started from now on (each builds a rows.Rows)."""
    started = []
    real = rows.Rows.__init__
    monkeypatch.setattr(rows.Rows, "__init__",
                        functools.wraps(real)(lambda self, *a, **kw: started.append(a[1:2]) or real(self, *a, **kw)))
    return started


def warm_volatility(lab_ui, path: str) -> None:
    """The warm-up's steps for the Volatility page (`lab_ui._warm` runs them among the others)."""
    pairs = lab_ui._call(path, browse.list_pairs)
    for pair in pairs.itertuples():
        for scale in ("linear", "log"):
            lab_ui.volatility_of(pair.rollout, pair.scorer, scale, path=path)
        lab_ui._keep_pair_tokens(path, pair.rollout, pair.scorer)


def test_after_the_warm_up_every_bucketing_of_the_page_is_computed_without_joining_the_store(
        duckdb_store, tmp_path, monkeypatch, lab_ui):
    import streamlit as st

    db = tmp_path / "warmed.duckdb"
    shutil.copyfile(duckdb_store, db)
    path = str(db.resolve())
    monkeypatch.setenv("MISMATCH_LAB_CACHE", str(tmp_path / "cache"))
    warm_volatility(lab_ui, path)
    st.cache_data.clear()  # a new server: nothing in memory, the results cache filled
    st.cache_resource.clear()
    lab_ui._DISK.clear()
    at = open_page(path, monkeypatch, "volatility")
    started = count_joins(monkeypatch)
    pairs = at.selectbox(key="vol_pair").options
    for pick, scale, n, eps_low in STEPS:
        at.selectbox(key="vol_pair").set_value(pick)
        at.radio(key="vol_scale").set_value(scale)
        at.select_slider(key="vol_n").set_value(n)
        at.number_input(key="vol_eps_low").set_value(eps_low)
        next(b for b in at.button if b.label == "Apply").click().run()
        assert not at.exception, at.exception
        shown = at.dataframe[0].value
        assert len(shown) == (10 if n == "default" and scale == "linear" else 13 if n == "default" else n + (scale == "log"))
        assert f"[1 − {eps_low:g}, 1 +" in " ".join(c.value for c in at.caption)
    assert not started, f"the store was joined again: {started}"
    # what the page showed is the volatility table of the whole store (bit for bit but the means' last bits)
    monkeypatch.syspath_prepend(str(REPO / "tests" / "analysis"))
    from test_analysis_volatility import assert_same_table

    con = open_store(path)
    try:
        for pick, scale, n, eps_low in STEPS[2:]:
            rollout, scorer = pairs[pick].split(" → ")
            shown = lab_ui.volatility_of(rollout, scorer, scale, n, eps_low, path=path)  # (the page's cache entry)
            assert_same_table(shown, volatility.volatility_table(con, rollout=rollout, scorer=scorer, buckets=scale,
                                                                 n_buckets=n, eps_low=eps_low))
    finally:
        con.close()


def test_a_page_asking_for_the_pair_tokens_the_warm_up_is_reading_waits_but_never_hangs(parquet_store, lab_ui):
    """The warm-up reads a pair's tokens inside their cache lock; a page's bucketing that needs the same tokens,
    counted as a page query, waits on that lock. When the warm-up waited there for the pages to be quiet, the
    page kept it waiting and both hung; it now waits only before a step (`lab_ui._step`), never inside one."""
    import threading
    import time

    import lab_cache
    import lab_stores

    path = str(parquet_store)
    fp = lab_ui.fingerprint(path)
    pair = lab_ui._call(path, browse.list_pairs).iloc[0]
    shown = []
    with lab_stores._PAGE_QUERIES.running():  # another page query in flight while the warm-up reads the tokens
        warm = lab_stores._WarmUp(path, lambda p: lab_cache._pair_tokens(p, fp, pair.rollout, pair.scorer))
        warm.start()
        time.sleep(0.3)  # the warm-up is inside _pair_tokens (formerly waiting there for quiet)
        page = threading.Thread(target=lambda: shown.append(lab_cache._volatility(
            path, fp, pair.rollout, pair.scorer, "log", 7, 0.2, 0.28)), daemon=True)
        page.start()
        time.sleep(0.3)  # the page asks for the same tokens
    page.join(3 * lab_stores._PageQueries.QUIET_S + 10)
    warm.join(10)
    assert shown and not shown[0].empty, "the page and the warm-up waited for each other"
