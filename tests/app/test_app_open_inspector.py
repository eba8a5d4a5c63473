"""A button that opens the token inspector on a sequence (Training's step, Corrections' dropped sequence): the
page that draws it prefetches the inspector's look-ups for that target (apps/lab_inspect.py), so the page run the
click causes computes nothing; and on a shard store the inspector reads its runs, a run's steps and sequences and a
sequence's tokens per unit (`store.units_pages.INSPECTOR`), which hold the whole-store look-ups' rows.

Computations are counted by wrapping the `browse` look-ups (a cache miss imports them by name) and
`units._compute` (the per-unit ones); nothing is timed.
"""

from __future__ import annotations

import functools
import threading

import numpy as np
import pandas as pd
import pytest
from app_paths import open_page
from streamlit import config as st_config

from mismatch_lab.analysis import browse
from mismatch_lab.record import Recorder
from mismatch_lab.store import units
from mismatch_lab.store.reader import open_store

B, T, STEPS = 4, 10, 3


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A Recorder's run of STEPS steps in a shard store, with token ids, rewards and one empty loss mask."""
    path = tmp_path_factory.mktemp("open-inspector") / "store"
    rng = np.random.default_rng(7)
    with Recorder(path, "steps", framework="verl", rollout_engine="vllm", rollout_dtype="bf16") as rec:
        for step in range(STEPS):
            mask = np.ones((B, T), bool)
            mask[0] = False  # the step's first sequence has no stored token: the inspector lists it not
            lmu = -rng.exponential(1.0, (B, T))
            lpi = np.minimum(lmu + rng.normal(0, 0.3, (B, T)), 0.0)
            rec.log_step(step, rng.integers(0, 100, (B, T)), mask, lmu, lpi, rewards=rng.normal(size=B))
    return path


LOOK_UPS = ("list_runs", "training_steps", "list_sequences", "sequence_tokens", "token_topk", "worst_sequences")


@pytest.fixture
def computed(monkeypatch, lab_ui):
    """The look-ups computed (not read from a cache) from now on: ('browse', name) of the whole-store ones (a
    cache miss imports the function by name and calls it), ('units', name) of the per-unit ones."""
    calls: list[tuple[str, str]] = []

    def counted(kind, fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            calls.append((kind, fn.__name__ if kind == "browse" else args[4]))
            return fn(*args, **kwargs)

        return call

    for name in LOOK_UPS:
        monkeypatch.setattr(browse, name, counted("browse", getattr(browse, name)))
    monkeypatch.setattr(units, "_compute", counted("units", units._compute))
    return calls


def _prefetch_on(monkeypatch, on: bool) -> None:
    import lab_inspect

    monkeypatch.setattr(lab_inspect, "background", lambda: on)  # the prefetch only: the warm-up stays off


def _join_prefetches() -> None:
    from lab_stores import WARM_UP_THREAD

    for thread in threading.enumerate():
        if thread.name.startswith(WARM_UP_THREAD):
            thread.join(60)


def _click(at, label: str) -> None:
    next(b for b in at.button if label in b.label).click().run()
    assert not at.exception, at.exception
    assert [t.value for t in at.title] == ["Token inspector"]


def test_the_step_button_opens_the_inspector_on_look_ups_its_prefetch_computed(recorded, monkeypatch, lab_ui,
                                                                                computed):
    at = open_page(recorded, monkeypatch, "training")
    computed.clear()
    _click(at, f"Open step {STEPS - 1} in the token inspector")  # no prefetch: the click computes the sequence
    assert ("browse", "sequence_tokens") in computed and ("browse", "token_topk") in computed
    shown = next(s for s in at.selectbox if s.label == "Sequence").value

    _prefetch_on(monkeypatch, True)
    at.switch_page("app_pages/training.py").run()
    at.select_slider(key="train_step:steps").set_value(0).run()  # draws the button of step 0: its prefetch
    _join_prefetches()
    computed.clear()
    looked_up = []
    per_unit = lab_ui.per_unit
    monkeypatch.setattr(lab_ui, "per_unit", lambda page, name, *a, **k: looked_up.append((page, name))
                        or per_unit(page, name, *a, **k))
    _click(at, "Open step 0 in the token inspector")
    assert computed == []
    assert ("training", "train_runs") not in looked_up  # the Training page did not run again
    assert ("inspector", "training_steps") in looked_up and ("inspector", "sequence_tokens") in looked_up
    # nor does a server's script run end in a full garbage collection (~0.24 CPU s each; AppTest's runner has none)
    assert st_config.get_option("runner.postScriptGC") is False
    picker = next(s for s in at.selectbox if s.label == "Sequence")
    first = browse.list_sequences(open_store(recorded), "steps", step=0).query("response_len > 0")["seq_id"].iloc[0]
    assert picker.value == first != shown and at.selectbox(key="insp_step").value == 0


def test_a_sequence_opened_at_a_token_under_a_scorer_finds_every_look_up_prefetched(duckdb_store, monkeypatch, lab_ui,
                                                                                    computed):
    import lab_inspect

    con = open_store(duckdb_store)
    run_id = next(r.run_id for r in browse.list_runs(con).itertuples() if ", " in r.scorers)  # two scorers
    seq_id = int(browse.list_sequences(con, run_id)["seq_id"].iloc[1])
    tokens = browse.sequence_tokens(con, run_id, seq_id)
    scorer = sorted(tokens["scorer"].dropna().unique())[1]  # not the inspector's default
    view = tokens[tokens["scorer"] == scorer]
    focus = int(view.loc[view["abs_dp"].idxmin(), "pos"])  # not the default token either
    at = open_page(duckdb_store, monkeypatch, "overview")
    lab_inspect.look_ups(at.session_state["store_path"], run_id, None, seq_id, scorer, focus)  # the prefetch's work
    computed.clear()
    for key, value in {"insp_mode": lab_inspect.BY_RUN, "insp_run": run_id, "insp_step": lab_inspect.ALL_STEPS,
                           "insp_seq": seq_id, "insp_scorer": scorer, "insp_focus_pos": focus}.items():
        at.session_state[key] = value  # what the Corrections page's button sets
    at.switch_page("app_pages/inspector.py").run()
    assert not at.exception, at.exception
    assert computed == []
    assert at.selectbox(key="insp_scorer").value == scorer
    assert at.selectbox(key=f"insp_pos:{run_id}:{seq_id}:{scorer}").value == focus


def test_a_shard_stores_steps_and_sequences_in_the_inspector_are_the_whole_store_rows(recorded, monkeypatch, lab_ui):
    import lab_inspect

    path, con = str(recorded), open_store(recorded)
    pd.testing.assert_frame_equal(lab_inspect.steps_of(path, "steps"), browse.training_steps(con, "steps"))
    for step in range(STEPS):
        pd.testing.assert_frame_equal(lab_inspect.sequences_of(path, "steps", step),
                                      browse.list_sequences(con, "steps", step=step))
    pd.testing.assert_frame_equal(lab_inspect.sequences_of(path, "steps", None), browse.list_sequences(con, "steps"))


def test_a_store_being_written_is_not_prefetched_again_at_each_refresh(tmp_path, monkeypatch, lab_ui):
    import lab_cache
    import lab_inspect

    _prefetch_on(monkeypatch, True)
    targets: list[tuple] = []
    monkeypatch.setattr(lab_inspect, "_prefetch", lambda path, target, go_on: targets.append(target))
    rng = np.random.default_rng(3)
    with Recorder(tmp_path / "live", "live", framework="verl", rollout_engine="vllm", rollout_dtype="bf16") as rec:
        lmu = -rng.exponential(1.0, (B, T))
        rec.log_step(0, None, np.ones((B, T), bool), lmu, lmu)
        at = open_page(tmp_path / "live", monkeypatch, "training")
        _join_prefetches()
        assert targets == [("live", 0, None, None, None)]
        rec.log_step(1, None, np.ones((B, T), bool), lmu, lmu)  # the writer goes on while the page is open
        monkeypatch.setattr(lab_cache, "FINGERPRINT_S", 0.0)  # the page takes the store's new fingerprint
        at.run()
        _join_prefetches()
    assert not at.exception, at.exception
    assert any(b.label == "Open step 1 in the token inspector" for b in at.button)
    assert targets == [("live", 0, None, None, None)]  # the store changed since: no prefetch at its refreshes
