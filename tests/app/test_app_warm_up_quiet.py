"""The warm-up gives way to a page's script run, counted from the run's start and end (`lab_stores.page_run`).

Before the marks, a warm-up that a page run had just started saw no page query yet (a page reads its store
before it queries) and went straight through its list, the rules' torch import included, beside that page's
first load: ~0.4-0.7 server CPU s of each cached first load in Chromium (1 M-token study)."""

from __future__ import annotations

import sys
import threading
import time

from app_paths import APP

if str(APP.parent) not in sys.path:
    sys.path.insert(0, str(APP.parent))

import lab_stores

QUIET_S = 0.3


def _warm_up_timing_its_wait(done: threading.Event, when: list[float], quiet_s: float) -> lab_stores._WarmUp:
    def work(_path):
        lab_stores.yield_to_pages(quiet_s)
        when.append(time.monotonic())
        done.set()

    return lab_stores._WarmUp("test-store", work)


def test_a_warm_up_started_in_a_page_run_waits_for_quiet_after_that_run_ends():
    """As the rules' import does (a quiet span longer than a page run: lab_ui.IMPORT_QUIET_S)."""
    done, when, quiet_s = threading.Event(), [], 3 * QUIET_S
    with lab_stores.page_run():
        thread = _warm_up_timing_its_wait(done, when, quiet_s)
        thread.start()
        time.sleep(QUIET_S)  # the page draws without querying: the warm-up must not start meanwhile
        assert not done.is_set()
    ended = time.monotonic()
    thread.join(10)
    assert when and when[0] >= ended + quiet_s * 0.99  # monotonic clock; Condition.wait may wake a hair early
    # (it then waits again: wait_quiet loops until the quiet span has passed)


def test_a_page_run_waiting_on_the_warm_up_does_not_hold_it_back():
    """A page run may wait on a result the warm-up is computing (a cache's lock): the run's marks must not make
    the warm-up wait for the run's end, or both would wait for each other."""
    done, when = threading.Event(), []
    with lab_stores.page_run():
        thread = _warm_up_timing_its_wait(done, when, QUIET_S)
        start = time.monotonic()
        thread.start()
        assert done.wait(10), "the warm-up waited for the page run that waits for it"
        assert when[0] - start >= QUIET_S * 0.99
    thread.join(10)


def test_a_later_page_run_of_a_session_does_not_hold_the_warm_up_back():
    """Quick interactions, each a page run within the warm-up's quiet span, must not keep it from its
    remaining steps (the rules' import, each pair's sample at the defaults): only first loads mark."""
    done, when, quiet_s = threading.Event(), [], 3 * QUIET_S
    start = time.monotonic()
    thread = _warm_up_timing_its_wait(done, when, quiet_s)
    thread.start()
    for _ in range(9):  # 0.9 s of interactions: marked, they would push the wait to >= 1.8 s
        with lab_stores.page_run(first=False):
            time.sleep(QUIET_S / 3)
    thread.join(10)
    assert when and when[0] - start < 5 * QUIET_S  # at most quiet_s after an earlier test's last mark


def test_the_warm_up_reads_a_result_on_disk_without_waiting_for_pages(tmp_path, monkeypatch):
    """The warm-up's fetch runs inside the memory cache's lock of its result, where a page asking for the same
    one waits uncounted: a result already on disk is read at once, not after the pages' quiet span."""
    import lab_cache

    monkeypatch.setenv("MISMATCH_LAB_CACHE", str(tmp_path / "cache"))
    store = tmp_path / "store"
    store.mkdir()
    lab_cache.disk(str(store)).put(("q",), "fp", 42)
    found = []

    def work(_path):
        t = time.monotonic()
        found.append((lab_cache._fetch(str(store), ("q",), "fp", lambda: 0), time.monotonic() - t))

    with lab_stores._PAGE_QUERIES.running():  # a page query in flight for the whole test
        thread = lab_stores._WarmUp(str(store), work)
        thread.start()
        thread.join(2 * lab_stores._PageQueries.QUIET_S)
        assert found and found[0][0] == 42 and found[0][1] < lab_stores._PageQueries.QUIET_S


def test_the_warm_up_waits_for_pages_before_a_step_never_inside_one(tmp_path, monkeypatch, parquet_store):
    """A step computes inside the cache locks of its results, where a page asking for the same one waits (counted
    as a page query or not): a warm-up waiting there for the pages to be quiet held that page up, or both waited
    for ever. It waits before each step (`lab_ui._step`), and its fetches and queries inside a step go on while
    a page queries."""
    import lab_cache
    import lab_ui

    monkeypatch.setenv("MISMATCH_LAB_CACHE", str(tmp_path / "cache"))
    store = tmp_path / "store"
    store.mkdir()
    opened = lab_stores._Store(str(parquet_store))
    events = []

    def work(_path):
        computed = lab_cache._fetch(str(store), ("q",), "fp", lambda: 7)  # a miss: computed inside the step
        with opened.using() as cur:
            queried = cur.execute("SELECT 1").fetchone()[0]
        events.append(("inside", computed, queried, time.monotonic()))
        lab_ui._step(lambda: events.append(("next step", None, None, time.monotonic())))

    quiet = lab_stores._PageQueries.QUIET_S
    try:
        with lab_stores._PAGE_QUERIES.running():  # a page query in flight for 2 quiet spans
            start = time.monotonic()
            thread = lab_stores._WarmUp(str(store), work)
            thread.start()
            time.sleep(2 * quiet)
            assert events and events[0][:3] == ("inside", 7, 1) and events[0][3] - start < quiet
            assert len(events) == 1  # the next step waits for the page
        released = time.monotonic()
        thread.join(10)
    finally:
        opened.release()
    assert [e[0] for e in events] == ["inside", "next step"] and events[1][3] >= released + quiet * 0.99
