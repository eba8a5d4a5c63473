"""The token inspector's look-ups, named once: the inspector page runs them, and a page whose button opens the
inspector on a sequence prefetches them for that sequence in the background (`prefetch`), so that the page run
the button causes finds them cached.

Which sequence, scorer and token the inspector opens on is decided here too (`listed`, `scorer_of`,
`start_pos`), so the prefetch asks for exactly what the page will show: the same functions with the same
arguments hit the same caches (`lab_ui.query`'s, and on a shard store the inspector's per-unit look-ups,
`lab_ui.per_unit`, `store.units_pages.INSPECTOR`: no connection on the whole store). The click opens the inspector without running
the page that holds the button again (`open_on`, `switch_if_asked`).
"""

from __future__ import annotations

import os
import threading

import duckdb
import lab_ui
import pandas as pd
import streamlit as st
from lab_stores import (
    _PAGE_QUERIES,
    _WARM_UPS,
    WARM_UP_THREAD,
    StoreClosed,
    _WarmUp,
    clear_at_exit,
)

from mismatch_lab.errors import UserError

PAGE = "app_pages/inspector.py"
BY_RUN = "By run and sequence"  # the inspector's radio option for a picked run and sequence
ALL_STEPS = "all steps"
OPEN_KEY = "insp_open"  # set by a button's callback: the entry script switches to the inspector before any page runs


def open_on(state: dict, drop: tuple = ()) -> None:
    """A button's `on_click` that opens the inspector on `state` (its widgets' keys: run, step, sequence, ...),
    forgetting the keys `drop`. The entry script switches page before the page holding the button runs again
    (`switch_if_asked`): a click costs the inspector's run only, not the other page's as well."""
    st.session_state.update(state)
    for key in drop:
        st.session_state.pop(key, None)
    st.session_state[OPEN_KEY] = True


def switch_if_asked() -> None:
    """In the entry script, right after `st.navigation`: switch to the inspector when a button asked for it."""
    if st.session_state.pop(OPEN_KEY, False):
        st.switch_page(PAGE)


def runs_of(path: str) -> pd.DataFrame:
    """Every run (`browse.list_runs`; per unit on a shard store, `store.units_pages.INSPECTOR`)."""
    return lab_ui.per_unit("inspector", "list_runs", path=path)


def steps_of(path: str, run_id: str) -> pd.DataFrame:
    """The run's training steps (`browse.training_steps`; per unit on a shard store, `store.units_pages.INSPECTOR`)."""
    return lab_ui.per_unit("inspector", "training_steps", run_id, path=path)


def sequences_of(path: str, run_id: str, step: int | None) -> pd.DataFrame:
    """The run's sequences (`browse.list_sequences`), of one step when `step` is given (per unit on a shard store,
    as the Training page)."""
    return lab_ui.per_unit("inspector", "list_sequences", run_id, step=None if step is None else int(step), path=path)


def tokens_of(path: str, run_id: str, seq_id: int) -> pd.DataFrame:
    """`browse.sequence_tokens` (on a shard store over the sequence's unit alone, `store.units`)."""
    return lab_ui.per_unit("inspector", "sequence_tokens", run_id, int(seq_id), path=path)


def topk_of(path: str, run_id: str, seq_id: int, pos: int) -> pd.DataFrame:
    """`browse.token_topk` (on a shard store over the sequence's unit where it holds no top-K, `store.units`)."""
    return lab_ui.per_unit("inspector", "token_topk", run_id, int(seq_id), int(pos), path=path)


def listed(seqs: pd.DataFrame) -> pd.DataFrame:
    """The sequences the inspector lists: those with a stored token (a Recorder keeps sequences without a
    loss-mask token)."""
    return seqs[seqs["response_len"] != 0]


def scorers_of(tokens: pd.DataFrame) -> list[str]:
    return sorted(tokens["scorer"].dropna().unique())


def scorer_of(tokens: pd.DataFrame, remembered: str | None) -> str | None:
    """The scorer the inspector shows: the remembered one where it scored the sequence, else the first."""
    scorers = scorers_of(tokens)
    return remembered if remembered in scorers else (scorers[0] if scorers else None)


def start_pos(view: pd.DataFrame, focus) -> int:
    """The token the detail opens on: `focus` (a token another page opens) where the sequence holds it, else
    the largest |Δp| under the scorer shown (`view`: its rows), else the first."""
    positions = view["pos"].tolist()
    if focus in positions:
        return focus
    return int(view.loc[view["abs_dp"].idxmax(), "pos"]) if view["abs_dp"].notna().any() else positions[0]


def look_ups(path: str, run_id: str, step: int | None, seq_id: int | None, scorer: str | None, focus,
             go_on=lambda: True) -> None:
    """What the inspector queries when a button opens it on (run, step, sequence; None: the first listed),
    with the remembered scorer and the token to focus; each look-up only while `go_on()`."""
    runs_of(path)
    if not go_on():
        return
    steps_of(path, run_id)
    seqs = listed(sequences_of(path, run_id, step)) if go_on() else None
    if seqs is None or seq_id is None and seqs.empty:
        return
    seq_id = int(seqs["seq_id"].iloc[0]) if seq_id is None else seq_id
    tokens = tokens_of(path, run_id, seq_id) if go_on() else None
    scorer = None if tokens is None else scorer_of(tokens, scorer)
    if scorer is not None and go_on():
        topk_of(path, run_id, seq_id, start_pos(tokens[tokens["scorer"] == scorer], focus))


_FIRST_SEEN: dict[str, str] = {}  # store path -> its fingerprint at the first prefetch of this process


def prefetch(run_id: str, *, step: int | None = None, seq_id: int | None = None, scorer: str | None = None,
             focus=None) -> None:
    """In the page run that draws a button opening the inspector on (run, step, sequence) with `scorer` (None:
    the one the inspector remembers) and the token `focus`: compute the inspector's look-ups for that
    target in a background thread (part of the warm-up: off with it, MISMATCH_LAB_APP_WARMUP=0). The thread
    waits until no page has queried for a moment (`_Prefetch.QUIET_S`), so it does not slow the page that drew
    the button; once per target, and only while the store is as the first prefetch saw it (a store
    being written changes at every refresh)."""
    path = st.session_state.get("store_path")
    if not path or not background():
        return
    fp = lab_ui.fingerprint(path)
    if _FIRST_SEEN.setdefault(path, fp) != fp:  # a store being written: not at each refresh (a whole-store
        return  # connection per version), the inspector computes on demand, as the warm-up's analyses
    target = (str(run_id), None if step is None else int(step), None if seq_id is None else int(seq_id),
              scorer or st.session_state.get("insp_scorer"), None if focus is None else int(focus))
    _prefetch_at(path, fp, target)


def background() -> bool:
    """Whether the app computes in the background (the warm-up and the prefetch): MISMATCH_LAB_APP_WARMUP=0
    turns both off."""
    return os.environ.get("MISMATCH_LAB_APP_WARMUP", "1") != "0"


def _prefetch(path: str, target: tuple, go_on) -> None:
    try:
        look_ups(path, *target, go_on=go_on)
    except (UserError, StoreClosed, duckdb.InterruptException):  # the store changed, closed or is closing (its
        return  # queries interrupted at exit): the page computes on demand


class _Prefetch(threading.Thread):
    """The prefetch of one target: it starts once pages have been quiet for QUIET_S, shorter than the warm-up's
    wait (the button is the last thing its page draws, so the page's queries are done), then queries as a page
    does (the warm-up waits for it). Stopped at process exit with the warm-ups (`lab_stores._shutdown`)."""

    QUIET_S = 0.5  # at 0.25 its queries overlapped the end of the interaction that drew the button
    stop = _WarmUp.stop  # (no further query, the one in flight interrupted, joined)

    def __init__(self, path: str, target: tuple):
        super().__init__(name=f"{WARM_UP_THREAD} prefetch {path}", daemon=True)
        self.path, self.target, self.stopping = path, target, False
        _WARM_UPS.add(self)

    def run(self) -> None:
        _PAGE_QUERIES.wait_quiet(self, self.QUIET_S)
        if self.going_on():
            _prefetch(self.path, self.target, self.going_on)

    def going_on(self) -> bool:
        """Not stopped, and the process is not exiting (its main thread has ended: the exit handlers that close
        the stores may have run, and a thread inside DuckDB then aborts the process)."""
        return not self.stopping and threading.main_thread().is_alive()


@st.cache_resource(ttl=lab_ui.TTL_S, show_spinner=False, max_entries=32, on_release=_Prefetch.stop)
def _prefetch_at(path: str, fp: str, target: tuple) -> _Prefetch:
    thread = _Prefetch(path, target)
    thread.start()
    return thread


clear_at_exit(_prefetch_at)
