"""What the warm-up and `mismatch-lab app --prepare` compute so that an interaction finds it cached.

benchmarks/bench_app_browser.py's interactions (real Chromium, 1 M-token study) found a pair change on the
Corrections page computing the tokens the pair's first dropping method drops (~4-6 CPU s: the method's rule over
the pair): the warm-up now computes them for every pair. Not timed: the computation is counted.
"""

from __future__ import annotations

import functools

from app_paths import open_page

from mismatch_lab.corrections import dropped


def test_after_the_warm_up_a_pair_change_on_the_corrections_page_computes_no_dropped_tokens(
        duckdb_store, tmp_path, monkeypatch, lab_ui):
    import streamlit as st

    db = tmp_path / "warmed.duckdb"
    db.write_bytes(duckdb_store.read_bytes())
    monkeypatch.setenv("MISMATCH_LAB_APP_WARMUP", "0")
    monkeypatch.setenv("MISMATCH_LAB_CACHE", str(tmp_path / "cache"))
    lab_ui._warm(str(db.resolve()))
    st.cache_data.clear()  # a new server: nothing in memory, the results cache on disk filled
    st.cache_resource.clear()
    lab_ui._DISK.clear()
    calls = []
    real = dropped.dropped_tokens
    monkeypatch.setattr(dropped, "dropped_tokens",
                        functools.wraps(real)(lambda con, *a, **kw: calls.append(a) or real(con, *a, **kw)))
    at = open_page(db, monkeypatch, "corrections")
    pairs = at.selectbox(key="corr_pair").options
    assert len(pairs) == 3
    for i in range(len(pairs)):
        at.selectbox(key="corr_pair").set_value(i).run()
        assert not at.exception, at.exception
        assert any("token inspector" in b.label for b in at.button)  # the pair's dropped sequences are listed
    assert not calls  # every pair's dropped tokens came from the cache the warm-up filled
