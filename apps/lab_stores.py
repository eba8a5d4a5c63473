"""The app's open stores and their lifetimes: the read-only connection of each store, the cursors lent to the
threads that query it, and the warm-up threads that query in the background.

Every query runs on a cursor registered with the thread running it (`_Store.using`), so that
another thread can interrupt it: DuckDB's `interrupt()` acts on one connection, and a cursor is a
connection of its own. Streamlit serves every browser session from its own thread and one DuckDB
connection must not be shared across threads, so each query has its own cursor. A warm-up thread
(`_WarmUp`) stops on request (`_WarmUp.stop`: no further query, the one in flight interrupted, the
thread joined); while a page queries, the warm-up waits (`_PageQueries`), before each of its steps and never
inside one: a step runs inside Streamlit's cache locks of what it computes, and a page asking for the same
result waits on such a lock (counted as a page query or not), so a warm-up waiting there for the pages to be
quiet held that page up, or waited for it for ever. A store the cache drops (its
TTL, *Reload data*) is closed once its queries in flight are done. At process exit `_shutdown` stops
every warm-up, interrupts what still runs and closes every store: a daemon thread left inside DuckDB at
interpreter exit aborts the process (`terminate called ...`, exit 134), and DuckDB objects alive then
are reported as nanobind leaks.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import threading
import time
import weakref

from mismatch_lab.store.reader import open_store

WARM_UP_THREAD = "mismatch-lab warm-up"  # the warm-up threads' name prefix
STOP_TIMEOUT_S = 30.0  # the longest wait for a stopped thread or an interrupted query (one fetch, in practice ms)

# The warm-up thread fills the caches outside any script run: Streamlit then warns "missing ScriptRunContext"
# on every cached call (its spinner has no page to draw on; the warning says it can be ignored). Raising that
# one logger's level (no filter object, nothing kept alive) keeps the warnings, and the logging errors they
# raise when a test's log stream has closed under a still-running warm-up, out of the output.
logging.getLogger("streamlit.runtime.scriptrunner_utils.script_run_context").setLevel(logging.ERROR)


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

    def mark(self) -> None:
        """A page run starts or ends: the warm-up's quiet wait counts from now. Without the start's mark a
        warm-up that a page run just started saw no page query yet and went through its whole list (the
        rules' torch import included) beside that page's first load; without the end's, the import waited
        only from the page's last query, while the page still drew."""
        with self._cond:
            self._last = time.monotonic()
            self._cond.notify_all()

    def wake(self) -> None:
        """Wake the waiting warm-ups (one was asked to stop)."""
        with self._cond:
            self._cond.notify_all()

    def wait_quiet(self, warm_up: _WarmUp, quiet_s: float = QUIET_S) -> None:
        """Block the warm-up until pages have been quiet for `quiet_s`, or it is asked to stop."""
        with self._cond:
            while not warm_up.stopping:
                idle = time.monotonic() - self._last
                if not self._running and idle >= quiet_s:
                    return
                self._cond.wait(quiet_s if self._running else quiet_s - idle)


_PAGE_QUERIES = _PageQueries()


@contextlib.contextmanager
def page_run(first: bool = True):
    """Around a page's script run (apps/streamlit_app.py): marks the start and end of a session's `first` run
    (its first page load) for the warm-up (`_PageQueries.mark`). Only marks, no count held over the run: a
    page run may wait on a result the warm-up is computing (a cache's lock), so the warm-up must not wait for
    the run to end. Not a later run's: those of quick interactions, each within the rules' import's quiet
    span (lab_ui.IMPORT_QUIET_S), kept the import and what follows it (each pair's sample at the defaults,
    which an override reads) from ever starting (an override: 0.30 -> 1.44 server CPU s in Chromium)."""
    if first:
        _PAGE_QUERIES.mark()
    try:
        yield
    finally:
        if first:
            _PAGE_QUERIES.mark()


def page_work():
    """The context of a thread's query work: counted as a page query (`_PAGE_QUERIES.running`, which the warm-up
    waits for) in a page's thread, not in a warm-up's (it waited before its step: module doc)."""
    return contextlib.nullcontext() if isinstance(threading.current_thread(), _WarmUp) else _PAGE_QUERIES.running()


def yield_to_pages(quiet_s: float = _PageQueries.QUIET_S) -> None:
    """In a warm-up thread: wait until pages have been quiet for `quiet_s` (`_PageQueries.wait_quiet`), then
    raise `_Stopped` if it was asked to stop. Elsewhere: nothing."""
    thread = threading.current_thread()
    if isinstance(thread, _WarmUp):
        _PAGE_QUERIES.wait_quiet(thread, quiet_s)
        if thread.stopping:
            raise _Stopped


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

    @contextlib.contextmanager
    def using(self):
        """A fresh cursor for this thread's queries, closed after."""
        thread = threading.current_thread()
        with self._lock:
            if isinstance(thread, _WarmUp) and thread.stopping:
                raise _Stopped
            if self.con is None or self._closing:
                raise StoreClosed("the store was closed")
            cur = self.con.cursor()
            self._busy[id(cur)] = (cur, thread)
        try:
            with page_work():
                yield cur
        finally:
            with self._lock:
                del self._busy[id(cur)]
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
        con.close()


class _WarmUp(threading.Thread):
    """The warm-up of one store: a daemon thread that `stop()` ends within moments, even mid-query."""

    def __init__(self, path: str, work):
        """`work(path)` in the thread (the app's `_warm`)."""
        super().__init__(target=work, args=(path,), name=f"{WARM_UP_THREAD} {path}", daemon=True)
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


_AT_EXIT: list = []  # the Streamlit caches that hold stores, pairs or warm-ups, emptied by `_shutdown`


def clear_at_exit(cached):
    """Register a cached function (`st.cache_resource`) whose entries `_shutdown` drops; returns it."""
    _AT_EXIT.append(cached)
    return cached


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
    for cached in _AT_EXIT:
        cached.clear()
