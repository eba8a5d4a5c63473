"""The Clipping page and the inspector's worst sequences of a shard store still being written, merged from per-unit
parts (mismatch_lab/store/units_clipping.py).

Real Recorders write the store, with a real tokenizer (texts and categories) and prompt groups (advantages of
both signs), a run without a tokenizer (tokens named by id) and another rollout; each look-up is compared with its
whole-store function as the runs go on and a resumed job logs a step again. A refresh of the page reads the new
step's files only and opens no connection on the whole store (counted by wrapping the reader, not timed)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from app_paths import open_page

from mismatch_lab.analysis import browse, clipping
from mismatch_lab.record import Recorder
from mismatch_lab.store import cache, units_clipping, units_merged
from mismatch_lab.store.reader import open_store

B, T = 8, 24
RTOL = 1e-12  # float64 sums of the same rows, added in another order


@pytest.fixture(scope="module")
def tokenizer(embedded_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_model)


def _log(rec: Recorder, step: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    ids = rng.integers(100, 400, (B, T))  # few distinct ids: the same token in several steps and sequences
    lmu = -rng.exponential(0.5, (B, T))
    lpi = np.minimum(lmu + rng.normal(0, 0.3, (B, T)), 0.0)  # many tokens leave the clip range
    rec.log_step(step, ids, np.ones((B, T), bool), lmu, lpi, rewards=rng.integers(0, 2, B).astype(float),
                 group_ids=[f"g{step}-{i // 4}" for i in range(B)])


def _live(path, tokenizer) -> Recorder:
    return Recorder(path, "live", framework="verl", rollout_engine="vllm", rollout_dtype="bf16", tokenizer=tokenizer)


def _whole_and_mine(path: Path, results: cache.ResultsCache) -> list[tuple[str, object, object]]:
    """(case, whole-store result, per-unit result) of every look-up of the Clipping page and of the worst sequences."""
    con = open_store(path)
    try:
        pairs = browse.list_pairs(con)
        scorers = sorted(set(pairs["scorer"]))
        source = units_clipping.ClippingUnits(path)
        out = [("list_pairs", pairs, units_clipping.list_pairs(source, results)),
               ("list_categories", browse.list_categories(con), units_clipping.list_categories(source, results))]
        for rollout, scorer in pairs[["rollout", "scorer"]].itertuples(index=False):
            kw = {"rollout": rollout, "scorer": scorer}
            out.append((f"by category {kw}", clipping.clipping_by_category(con, **kw),
                        units_clipping.clipping_by_category(source, results, **kw)))
            for n in (3, 100):
                out.append((f"top {n} {kw}", clipping.top_clipped_tokens(con, n, **kw),
                            units_clipping.top_clipped_tokens(source, results, n, **kw)))
        for scorer in (None, *scorers):
            for n in (5, units_clipping.WORST_N):
                out.append((f"worst {n} {scorer}", browse.worst_sequences(con, scorer=scorer, n=n),
                            units_clipping.worst_sequences(source, results, scorer=scorer, n=n)))
    finally:
        con.close()
    return out


def _assert_equal(path, results):
    found = _whole_and_mine(path, results)
    for case, whole, mine in found:
        if isinstance(whole, pd.DataFrame):
            pd.testing.assert_frame_equal(mine, whole, rtol=RTOL, obj=case)
        else:
            assert mine == whole, case
    return {case: mine for case, _, mine in found}


def test_every_clipping_look_up_per_unit_equals_the_whole_store_query_as_the_runs_go_on(tmp_path, tokenizer):
    path = tmp_path / "live"
    results = cache.ResultsCache(path)
    with Recorder(path, "ids", framework="verl", rollout_engine="sglang", rollout_dtype="fp16") as other:
        for step in range(2):  # no tokenizer: its tokens are ranked by id
            _log(other, step, 20 + step)
    with Recorder(path, "no-ids", framework="verl", rollout_engine="vllm", rollout_dtype="fp32") as loss:
        rng = np.random.default_rng(5)  # recorded from a loss function: no token ids, nothing to rank by
        lmu = -rng.exponential(0.5, (B, T))
        loss.log_step(0, None, np.ones((B, T), bool), lmu, np.minimum(lmu + rng.normal(0, 0.3, (B, T)), 0.0),
                      advantages=rng.normal(size=(B, T)))
    rec = _live(path, tokenizer)
    for step in range(3):
        _log(rec, step, step)
    first = _assert_equal(path, results)
    _log(rec, 3, 3)  # a new step: added to the kept sums
    _assert_equal(path, results)
    rec.close()
    with _live(path, tokenizer) as again:  # a resumed job logs step 1 again: its files are replaced
        _log(again, 1, 99)
    last = _assert_equal(path, results)
    pair = next(k for k in last if k.startswith("top 100") and "vllm" in k)
    named = last[pair]
    assert named["token_text"].notna().all() and named["token_id"].isna().all() and len(named) > 10
    ids = last[next(k for k in last if k.startswith("top 100") and "sglang" in k)]
    assert ids["token_text"].isna().all() and ids["token_id"].notna().all()
    assert last[next(k for k in last if k.startswith("top 100") and "fp32" in k)].empty  # (its tokens clipped)
    assert last[next(k for k in last if k.startswith("by category") and "fp32" in k)]["n_ratio_clip"].sum() > 0
    signs = last[next(k for k in last if k.startswith("by category") and "vllm" in k)]["adv_sign"]
    assert {"all", "positive", "negative"} <= set(signs)  # the prompt groups' advantages: both signs
    assert len(last["list_categories"]) > 1 and first["list_pairs"]["n_tokens"].sum() < last["list_pairs"]["n_tokens"].sum()


def test_the_page_computes_a_new_step_alone_and_a_step_written_again_with_the_new_ones(tmp_path, tokenizer,
                                                                                       monkeypatch):
    """The Clipping page's queries are computed over the units no kept part holds: at a refresh, the new step's
    (the parts kept in memory, or read back by a fresh process); a step written again drops the part holding it,
    whose units are computed again."""
    computed: list[set] = []
    real = units_merged._compute
    monkeypatch.setattr(units_merged, "_compute", lambda source, todo: (
        isinstance(source, units_clipping.ClippingUnits) and computed.append(set(todo))) or real(source, todo))
    path, results = tmp_path / "live", cache.ResultsCache(tmp_path / "live")
    pair = {"rollout": "vllm:bf16", "scorer": "trainer"}

    def page():
        source = units_clipping.ClippingUnits(path)
        return (units_clipping.list_pairs(source, results), units_clipping.list_categories(source, results),
                units_clipping.clipping_by_category(source, results, **pair),
                units_clipping.top_clipped_tokens(source, results, 10, **pair))

    with _live(path, tokenizer) as rec:
        for step in range(3):
            _log(rec, step, step)
        page()
        assert computed == [{("live", s) for s in range(3)}]  # every query of the units at once
        _log(rec, 3, 3)
        page()
        assert computed[1:] == [{("live", 3)}]
        monkeypatch.setattr(units_merged, "_KEPT", {})  # a fresh process: the parts are read back from disk
        _log(rec, 4, 4)
        page()
        assert computed[2:] == [{("live", 4)}]
    with _live(path, tokenizer) as again:  # a resumed job writes step 4 again
        _log(again, 4, 99)
    shown = page()
    assert computed[3:] == [{("live", 4)}]  # (step 4's part held it alone)
    with _live(path, tokenizer) as again:  # step 1 again: it was in the first part, computed again with it
        _log(again, 1, 98)
    shown = page()
    assert computed[4:] == [{("live", s) for s in range(3)}]
    con = open_store(path)
    try:
        pd.testing.assert_frame_equal(shown[2], clipping.clipping_by_category(con, **pair), rtol=RTOL)
        pd.testing.assert_frame_equal(shown[3], clipping.top_clipped_tokens(con, 10, **pair), rtol=RTOL)
    finally:
        con.close()


@pytest.fixture
def lab_cache(lab_ui):
    import lab_cache

    return lab_cache


@pytest.mark.parametrize("page", ["clipping", "inspector"])
def test_the_page_on_a_store_being_written_opens_no_connection_on_the_whole_store(tmp_path, monkeypatch, lab_cache,
                                                                                    tokenizer, page):
    """The Clipping page (pairs, categories, clipping by category, top clipped tokens) and the inspector's worst
    sequences read per unit: a refresh reads the new step's files alone (a whole-store connection opens every
    shard's footer at each change: ~0.13-0.24 CPU s on 200 steps), on one connection (kept from one look-up to
    the next: each opening costs ~12 ms of CPU)."""
    from mismatch_lab.store import reader

    path = tmp_path / "live"
    with _live(path, tokenizer) as rec:
        for step in range(3):
            _log(rec, step, step)
        opens = []
        opened = reader._open_parquet_dir
        monkeypatch.setattr(reader, "_open_parquet_dir", lambda d, files=None, *a, **k: opens.append(files)
                            or opened(d, files, *a, **k))
        at = open_page(path, monkeypatch, page)
        if page == "inspector":
            at.radio(key="insp_mode").set_value("Worst sequences by max |Δp|").run()
            assert not at.exception, at.exception
        assert opens and None not in opens  # every connection over some units' files
        del opens[:]
        _log(rec, 3, 3)
        monkeypatch.setattr(lab_cache, "FINGERPRINT_S", 0.0)  # the page takes the store's fingerprint on this run
        at.run()
        assert not at.exception, at.exception
    assert len(opens) == 1 and None not in opens
    read = {Path(f).parent.name for files in opens for table, fs in files.items() if table != "runs" for f in fs}
    assert read == {"step-00000003"}
    shown = pd.concat([d.value for d in at.dataframe], ignore_index=True)
    assert len(shown) and (page == "inspector" or shown["token_text"].notna().any())
