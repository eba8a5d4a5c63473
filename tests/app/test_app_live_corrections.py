"""The Corrections comparison of a shard store still being written, merged from per-unit parts
(mismatch_lab/store/units_corrections.py).

Real Recorders write the store; the comparison of every token and the page's sample (1 in `every` prompt groups,
one pair at a time) are compared with the whole-store comparison on the same store as the runs go on: several
runs, non-finite tokens, a resumed step logged again: every table, and every method's dropped tokens of every
pair. A refresh of the page compares the new steps only and opens no connection on the whole store (counted by
wrapping the functions that open one, not timed).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from app_paths import open_page

from mismatch_lab.analysis.sample import group_key_sql, sample_size, sampled
from mismatch_lab.corrections.dropped import compare_with_drops
from mismatch_lab.corrections.layout import pair_info
from mismatch_lab.record import Recorder
from mismatch_lab.store import cache, reader, units_corrections
from mismatch_lab.store.reader import open_store
from mismatch_lab.store.units_overview import OverviewUnits

B, T = 8, 40
RTOL = 1e-12  # float64 sums of the same tokens, added in another order
EVERY = 2  # the sample's stride here (each recorded step is one prompt group: about 1 in 2 steps sampled)


def _log(rec: Recorder, step: int, seed: int, nonfinite: bool = False) -> None:
    rng = np.random.default_rng(seed)
    lmu = -rng.exponential(1.0, (B, T))
    lpi = np.minimum(lmu + rng.normal(0, 0.3, (B, T)), 0.0)
    if nonfinite:
        lpi[0, 3] = np.nan
    rec.log_step(step, rng.integers(0, 100, (B, T)), np.ones((B, T), bool), lmu, lpi, rewards=rng.normal(size=B))


def _live(path) -> Recorder:
    return Recorder(path, "live", framework="verl", rollout_engine="vllm", rollout_dtype="bf16")


def _whole(path, every: int | None = None, pair: tuple | None = None):
    """(compare_with_drops, pair_info, sample_size) of the whole store at `path`, or of its sample."""
    con = open_store(path)
    try:
        view = con if every is None else sampled(con.cursor(), every, pair)
        done = compare_with_drops(view)
        info = size = None
        if pair is None and every is not None:
            view = sampled(con.cursor(), every)
            info, size = pair_info(view), sample_size(view)
        return done, info, size
    finally:
        con.close()


def _assert_drops_equal(mine, whole) -> None:
    """The same PairDrops content: sequences, positions, log-ratios, offsets and every method's flags."""
    assert (mine.seqs is None) == (whole.seqs is None)
    if whole.seqs is None:
        return
    assert mine.seqs.to_pydict() == whole.seqs.to_pydict()
    for name in ("pos", "log_ratio", "seq_start"):
        np.testing.assert_array_equal(getattr(mine, name), getattr(whole, name))
        assert getattr(mine, name).dtype == getattr(whole, name).dtype
    assert list(mine.dropped) == list(whole.dropped)
    for method, bits in whole.dropped.items():
        np.testing.assert_array_equal(mine.dropped[method], bits)
    method = max(whole.dropped, key=lambda m: int(np.unpackbits(whole.dropped[m]).sum()))  # (drops the most)
    pd.testing.assert_frame_equal(mine.tokens(method), whole.tokens(method))


def _assert_equal(path, results: cache.ResultsCache, sample: bool = True) -> dict:
    """The comparison per unit of every token (and of the sample of each pair) equals the whole store's."""
    source = OverviewUnits(path)
    whole, _, _ = _whole(path)
    mine = units_corrections.comparison(source, results)
    for name, table in whole.tables.items():
        pd.testing.assert_frame_equal(mine[name], table, rtol=RTOL)
    for pair, drops in whole.drops.items():
        _assert_drops_equal(units_corrections.pair_drops(source, results, None, pair), drops)
    if not sample:
        return mine
    _, info, size = _whole(path, EVERY)
    pd.testing.assert_frame_equal(units_corrections.sample_info(source, results, EVERY), info)
    assert units_corrections.sample_size(source, results, EVERY) == size
    for pair in zip(info["rollout"], info["scorer"]):
        one, _, _ = _whole(path, EVERY, pair)
        for name, table in one.tables.items():
            pd.testing.assert_frame_equal(units_corrections.comparison(source, results, EVERY, pair)[name], table,
                                          rtol=RTOL)
        _assert_drops_equal(units_corrections.pair_drops(source, results, EVERY, pair), one.drops[pair])
    return mine


def test_the_comparison_per_unit_equals_the_whole_store_comparison_as_the_runs_go_on(tmp_path, monkeypatch):
    monkeypatch.setattr(units_corrections, "MAX_PARTS", 2)  # a third part merges them all into one
    path = tmp_path / "live"
    results = cache.ResultsCache(path)
    with Recorder(path, "other", framework="verl", rollout_engine="sglang", rollout_dtype="fp16") as other:
        _log(other, 0, 10)
    rec = _live(path)
    for step in range(3):
        _log(rec, step, step, nonfinite=step == 2)
    first = _assert_equal(path, results)
    assert len(first["corrections"][["rollout", "scorer"]].drop_duplicates()) == 2  # two runs, two rollouts
    _log(rec, 3, 3)  # a new step: a second part
    _assert_equal(path, results, sample=False)
    key = ("compare", None, None)
    before = [p.id for p in units_corrections.parts(OverviewUnits(path), results, key)]
    rec.close()  # the run's status moves, no unit changes: nothing compared again
    assert [p.id for p in units_corrections.parts(OverviewUnits(path), results, key)] == before
    with _live(path) as again:  # a resumed job logs step 1 again (its files replaced), then a new step
        _log(again, 1, 99)
        last = _assert_equal(path, results)
        assert [sorted(p.fps) for p in units_corrections.parts(OverviewUnits(path), results, key)] == [
            [("live", 3)], [*(("live", s) for s in (0, 1, 2)), ("other", 0)]]  # the first compared again
        _log(again, 4, 4)
        merged = _assert_equal(path, results, sample=False)
    assert len(units_corrections.parts(OverviewUnits(path), results, key)) == 1  # (past MAX_PARTS: merged)
    assert int(last["corrections"]["n_nonfinite"].max()) == 1
    assert (last["corrections"]["frac_tokens_masked"] > 0).any()  # some method drops tokens: the flags are read
    units_corrections._PARTS.clear()  # a fresh process: the parts come from the results cache
    units_corrections._MERGED.clear()
    monkeypatch.setattr(units_corrections, "_compute", lambda *a: pytest.fail("a unit compared again"))
    fresh = units_corrections.comparison(OverviewUnits(path), results)
    for name, table in merged.items():
        pd.testing.assert_frame_equal(fresh[name], table, rtol=0)  # the same parts: the same numbers


def _log_topk(rec: Recorder, step: int, lists: bool) -> None:
    """A step with the rollout's top-K lists; `lists`: the scorer's log-probs at them too (another writer's column,
    put into the step's scores shard): the top-K rules run on a pair only where every finite token has both."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng, k = np.random.default_rng(step), 3
    lmu = -rng.exponential(1.0, (B, T))
    lpi = np.minimum(lmu + rng.normal(0, 0.3, (B, T)), 0.0)
    rec.log_step(step, rng.integers(0, 100, (B, T)), np.ones((B, T), bool), lmu, lpi, None, rng.normal(size=B),
                 rng.integers(0, 100, (B, T, k)), -rng.exponential(1.0, (B, T, k)))
    if lists:
        shard = min(rec.root.glob(f"scores/live/step-{step:08d}/*.parquet"))
        table = pq.read_table(shard)
        values = pa.array((-rng.exponential(1.0, (table.num_rows, k))).tolist(), pa.list_(pa.float64()))
        pq.write_table(table.append_column("logps_at_rollout_topk", values), shard)


def test_units_are_compared_again_when_a_new_step_without_top_k_lists_turns_the_top_k_rules_off(tmp_path):
    path = tmp_path / "live"
    results, key = cache.ResultsCache(path), ("compare", None, None)
    with _live(path) as rec:
        for step in (0, 1):
            _log_topk(rec, step, lists=True)
        first = _assert_equal(path, results, sample=False)
        assert (first["corrections"]["note"] == "").all()  # the top-K rules ran
        _log_topk(rec, 2, lists=False)
        last = _assert_equal(path, results, sample=False)
    assert (last["corrections"]["note"] != "").any()  # ... and no longer do: steps 0 and 1 were compared again
    assert [sorted(p.fps) for p in units_corrections.parts(OverviewUnits(path), results, key)] == [
        [("live", 0), ("live", 1), ("live", 2)]]


@pytest.fixture
def computed(monkeypatch):
    """The units of each per-unit comparison, pair rows or sample size (`units_corrections._view`), one set per
    call, and the files of each connection opened (None: the whole store)."""
    calls: dict[str, list] = {"units": [], "opened": []}
    view, opened = units_corrections._view, reader._open_parquet_dir

    def counted_view(source, units, every, pair):
        calls["units"].append(({u[1] for u in units}, every))
        return view(source, units, every, pair)

    monkeypatch.setattr(units_corrections, "_view", counted_view)
    monkeypatch.setattr(reader, "_open_parquet_dir", lambda d, files=None, *a, **k: calls["opened"].append(files)
                        or opened(d, files, *a, **k))
    return calls


def _shown(at) -> pd.DataFrame:
    """The page's table of methods (method and numbers)."""
    return next(d.value for d in at.dataframe if "ess" in d.value.columns).reset_index(drop=True)


def _refresh(at, monkeypatch) -> None:
    import lab_cache

    monkeypatch.setattr(lab_cache, "FINGERPRINT_S", 0.0)  # the page takes the store's fingerprint on this run
    at.run()
    assert not at.exception, at.exception


def _assert_shown(at, path, every: int | None) -> None:
    """The page's table of methods and the tokens its chosen method drops are the whole store's comparison
    (of the sample of the pair shown, if `every`)."""
    con = open_store(path)
    try:
        pairs = pair_info(con if every is None else sampled(con.cursor(), every))[["rollout", "scorer"]]
    finally:
        con.close()
    pair = tuple(pairs.iloc[at.session_state["corr_pair"]])
    whole, _, _ = _whole(path, every, None if every is None else pair)
    main = whole.tables["corrections"]
    expected = main[(main["rollout"] == pair[0]) & (main["scorer"] == pair[1])].reset_index(drop=True)
    shown = _shown(at)
    columns = shown.columns.intersection(expected.columns)
    assert len(columns) >= 10
    pd.testing.assert_frame_equal(shown[columns], expected[columns], rtol=RTOL)
    method = at.session_state["corr_method"]
    tokens = whole.drops[pair].tokens(method)
    assert len(tokens) and f"{method} drops {len(tokens):,} of " in " ".join(c.value for c in at.caption)


def test_a_refresh_of_the_corrections_page_compares_only_the_new_step_and_opens_no_whole_store_connection(
        tmp_path, monkeypatch, lab_ui, computed):
    path = (tmp_path / "live").resolve()
    with _live(path) as rec:
        for step in range(4):
            _log(rec, step, step)
        at = open_page(path, monkeypatch, "corrections")
        assert computed["units"] == [({0, 1, 2, 3}, None)]  # every token (a small store)
        _log(rec, 4, 4)  # the writer goes on while the page is open
        del computed["units"][:], computed["opened"][:]
        _refresh(at, monkeypatch)
        assert computed["units"] == [({4}, None)]  # the finished steps came from the kept parts
        assert computed["opened"] and None not in computed["opened"]  # no connection on the whole store
    _assert_shown(at, path, None)


def test_a_refresh_of_the_page_on_a_sample_compares_the_new_sampled_step_only(tmp_path, monkeypatch, lab_ui,
                                                                              computed):
    path = (tmp_path / "live").resolve()
    import lab_corrections  # (beside lab_ui: the fixture puts apps/ on the path)
    monkeypatch.setattr(lab_corrections, "CORRECTIONS_SAMPLE_TOKENS", 4 * B * T)  # 5 to 8 steps of 320 tokens: 1 in 2
    steps = 5
    with _live(path) as rec:
        for step in range(steps):
            _log(rec, step, step)
        con = open_store(path)
        try:
            key = group_key_sql(con)
            hashes = dict(con.execute(f"SELECT DISTINCT q.step, {key} FROM sequences q").fetchall())
        finally:
            con.close()
        at = open_page(path, monkeypatch, "corrections")
        assert "Computed on a sample" in " ".join(i.value for i in at.info)
        first = {s for s, h in hashes.items() if h % EVERY == 0}
        assert first and {(frozenset(u), e) for u, e in computed["units"]} == {(frozenset(first), EVERY)}
        new = steps  # the next step whose prompt group the sample keeps (its hash: run, step, prompt)
        while True:
            _log(rec, new, new)
            con = open_store(path)
            try:
                h = con.execute(f"SELECT DISTINCT {key} FROM sequences q WHERE step = {new}").fetchone()[0]
            finally:
                con.close()
            if h % EVERY == 0 or new == 7:
                break
            new += 1
        assert h % EVERY == 0  # (the stride stays 2 up to 8 steps)
        del computed["units"][:], computed["opened"][:]
        _refresh(at, monkeypatch)
    assert "Computed on a sample" in " ".join(i.value for i in at.info)
    assert computed["units"] and all(u == {new} for u, _ in computed["units"])  # the info and the pair's sample
    assert None not in computed["opened"]
    _assert_shown(at, path, EVERY)
