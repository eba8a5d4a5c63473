"""The Volatility page of a shard store still being written, per unit (mismatch_lab/store/units_volatility.py).

Real Recorders write the store; each pair's table per unit is compared with the whole-store
`volatility.volatility_table` at several bucketings as the runs go on (counts, labels and quantiles bit for bit,
the means and std to RTOL): several runs of one pair and a run of another, non-finite rows (log μ: the 'μ
non-finite' row; log π), a unit whose scores carry the scorer's log-probs at the rollout's top-K and a stored
exact TV (another writer's columns: the Recorder stores neither), a step logged again by a resumed job. A refresh
of the page's look-ups computes the new step only (counted by wrapping the functions that compute, not timed)
and opens no connection on the whole store.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import pandas as pd
import pytest
from app_paths import REPO, open_page

from mismatch_lab.analysis import browse, volatility
from mismatch_lab.record import Recorder
from mismatch_lab.store import cache, reader, units_volatility
from mismatch_lab.store.reader import open_store
from mismatch_lab.store.units import ShardUnits

B, T = 6, 30
RTOL = 1e-12  # float64 sums of the same rows, added in another order
MEANS = ["mu_mean", "r_mean", "r_std", "binary_tv_mean", "topk_tv_mean", "tv_exact_vs_ref_mean"]
BUCKETINGS = [("linear", None, 0.2, 0.28), ("log", None, 0.2, 0.28), ("log", 5, 0.1, 0.3)]


def _log(rec: Recorder, step: int, seed: int, *, nonfinite: bool = False, topk: bool = False) -> None:
    rng = np.random.default_rng(seed)
    lmu = -rng.exponential(1.0, (B, T))
    lmu[0, :4] = -rng.exponential(20.0, 4)  # μ below the log scale's floor
    lpi = np.minimum(lmu + rng.normal(0, 0.3, (B, T)), 0.0)
    if nonfinite:
        lmu[0, 5], lpi[1, 3] = np.nan, np.nan
    ids = rng.integers(0, 100, (B, T))
    extra = {}
    if topk:
        extra = {"rollout_topk_ids": np.stack([ids, ids + 1, ids + 2], axis=-1),
                 "rollout_topk_logps": np.stack([lmu, lmu - 1.0, lmu - 2.0], axis=-1)}
    rec.log_step(step, ids, np.ones((B, T), bool), lmu, lpi, rewards=rng.normal(size=B), **extra)


def _recorder(path, run: str = "live", engine: str = "vllm") -> Recorder:
    return Recorder(path, run, framework="verl", rollout_engine=engine, rollout_dtype="bf16")


def _add_scorer_columns(path, run: str, step: int) -> None:
    """Another writer's columns in the unit's scores: the scorer's log-probs at the rollout's top-K and a stored
    exact TV (one NaN: not read), written beside the shard and renamed onto it."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    for shard in path.glob(f"scores/{run}/step-{step:08d}/*.parquet"):
        table = pq.read_table(shard)
        logp = table["logp"].to_numpy(zero_copy_only=False)
        lists = pa.array([[x - 0.1, x - 1.2, x - 1.9] for x in logp], pa.list_(pa.float64()))
        exact = pc.abs(table["logp"]).to_numpy(zero_copy_only=False).copy()
        exact[7] = np.nan
        table = table.append_column("logps_at_rollout_topk", lists).append_column("tv_exact_vs_ref", pa.array(exact))
        tmp = shard.with_name(f".{shard.name}.tmp")
        pq.write_table(table, tmp)
        os.replace(tmp, shard)


@pytest.fixture(autouse=True)
def fresh_memory(monkeypatch):
    """The module's memory as a new process has it; room for every bucketing of these tests."""
    monkeypatch.setattr(units_volatility, "_TOKENS", type(units_volatility._TOKENS)())
    monkeypatch.setattr(units_volatility, "_GROUPS", type(units_volatility._GROUPS)())
    monkeypatch.setattr(units_volatility, "MAX_GROUPS", 64)


@pytest.fixture
def counted(monkeypatch):
    """The units of each computation of tokens (`_compute`), the row count of each groups' pass (`_groups_of`)
    and the number of merges (`_merged`)."""
    calls: dict[str, list] = {"units": [], "rows": [], "merges": []}
    compute, groups_of, merged = units_volatility._compute, units_volatility._groups_of, units_volatility._merged

    @functools.wraps(compute)
    def counted_compute(source, rollout, scorer, todo):
        calls["units"].append(set(todo))
        return compute(source, rollout, scorer, todo)

    @functools.wraps(groups_of)
    def counted_groups_of(parts, bucketing, fps):
        calls["rows"].append(sum(p.num_rows for p in parts))
        return groups_of(parts, bucketing, fps)

    @functools.wraps(merged)
    def counted_merged(kept, new):
        calls["merges"].append(1)
        return merged(kept, new)

    monkeypatch.setattr(units_volatility, "_compute", counted_compute)
    monkeypatch.setattr(units_volatility, "_groups_of", counted_groups_of)
    monkeypatch.setattr(units_volatility, "_merged", counted_merged)
    return calls


def assert_same(got: pd.DataFrame, want: pd.DataFrame) -> None:
    """The tables equal: every column bit for bit but the means and std, to RTOL (and within the rounding bound
    of the analysis tests' assert_same_table)."""
    import sys

    sys.path.insert(0, str(REPO / "tests" / "analysis"))
    from test_analysis_volatility import assert_same_table

    assert_same_table(got, want)
    pd.testing.assert_frame_equal(got[MEANS], want[MEANS], rtol=RTOL)


def _rows(tokens) -> pd.DataFrame:
    """A pair's tokens as rows in one order (for comparing the multisets of rows)."""
    frame = tokens.table.to_pandas()
    return frame.sort_values(list(frame.columns), kind="stable").reset_index(drop=True)


def _assert_equal(path, results: cache.ResultsCache, rollouts=("sglang:bf16", "vllm:bf16")) -> pd.DataFrame:
    """Each pair of `rollouts`: its table per unit, at each bucketing, equals the whole store's: `volatility_table`
    for the live run's pair at the page's default bucketings, else (for time: ~0.2 s a table) the whole store's pair
    tokens' `volatility_of_pair` (equal to it: tests/analysis/test_analysis_volatility.py); so do the pair's tokens.
    Returns the store's pairs."""
    con = open_store(path)
    try:
        pairs = browse.list_pairs(con)
        source = ShardUnits(path)
        for pair in pairs[pairs["rollout"].isin(rollouts)].itertuples():
            whole = volatility.pair_tokens(con, pair.rollout, pair.scorer)
            mine = units_volatility.pair_tokens(source, results, pair.rollout, pair.scorer)
            pd.testing.assert_frame_equal(_rows(mine), _rows(whole))
            for buckets, n, eps_low, eps_high in BUCKETINGS:
                got = units_volatility.volatility_of(source, results, pair.rollout, pair.scorer, buckets, n, eps_low,
                                                     eps_high)
                if pair.rollout == "vllm:bf16" and n is None:
                    want = volatility.volatility_table(con, rollout=pair.rollout, scorer=pair.scorer, buckets=buckets)
                else:
                    want = volatility.volatility_of_pair(whole, buckets, n, eps_low, eps_high)
                assert_same(got, want)
    finally:
        con.close()
    return pairs


def test_each_pairs_table_per_unit_equals_the_whole_store_table_as_the_runs_go_on(tmp_path, monkeypatch, counted):
    monkeypatch.setattr(units_volatility, "COMPACT", 0)  # new values never merged into the kept ones: their ranks
    path = tmp_path / "live"
    results = cache.ResultsCache(path)
    with _recorder(path, "other", "sglang") as other:  # another pair
        for step in range(2):
            _log(other, step, 10 + step)
    with _recorder(path, "second") as second:  # a second run of the live run's pair
        _log(second, 0, 20, nonfinite=True)
    rec = _recorder(path)
    for step in range(3):
        _log(rec, step, step, nonfinite=step == 1, topk=step == 2)
    _add_scorer_columns(path, "live", 2)
    pairs = _assert_equal(path, results)
    assert sorted(pairs["rollout"]) == ["sglang:bf16", "vllm:bf16"]
    table = units_volatility.volatility_of(ShardUnits(path), results, "vllm:bf16", "verl:trainer", "log")
    assert table.loc[table["bucket"] == -1, ["n_tokens", "n_nonfinite"]].values.tolist() == [[0, 2]]  # μ NaN: 1 a run
    assert table["n_topk"].sum() == B * T and table["n_exact"].sum() == B * T - 1
    assert table["n_nonfinite"].sum() == 4

    merges = len(counted["merges"])
    for step in (3, 4):  # new steps: merged into the kept groups
        _log(rec, step, step, topk=step == 4)
        if step == 4:
            _add_scorer_columns(path, "live", 4)
        _assert_equal(path, results, ["vllm:bf16"])  # (the other pair's: at the end)
    assert len(counted["merges"]) == merges + 2 * len(BUCKETINGS)  # the live pair's, each step
    rec.close()  # the run's status moves, no unit changes: nothing computed
    done = {key: len(v) for key, v in counted.items()}
    for buckets, n, eps_low, eps_high in BUCKETINGS:
        units_volatility.volatility_of(ShardUnits(path), results, "vllm:bf16", "verl:trainer", buckets, n, eps_low,
                                       eps_high)
    assert {key: len(v) for key, v in counted.items()} == done
    with _recorder(path) as again:  # a resumed job logs step 2 again: its files are replaced
        _log(again, 2, 99)
    counted["units"].clear()
    _assert_equal(path, results)
    # the live pair's: that unit alone; the other pair's: also the units added since it was last asked for
    assert counted["units"] == [{("live", 2), ("live", 3), ("live", 4)}, {("live", 2)}]
    table = units_volatility.volatility_of(ShardUnits(path), results, "vllm:bf16", "verl:trainer", "log")
    assert table["n_topk"].sum() == B * T and table["n_exact"].sum() == B * T - 1  # step 4's: step 2's went


@pytest.mark.parametrize("compact", [0, 2, 8])
def test_values_merged_in_as_runs_go_on_give_the_quantiles_of_all_of_them_sorted(monkeypatch, compact):
    """A bucket's values, new ones merged in many times (their ranks among the kept ones, or all merged): each
    quantile is quantiles.select's on every value sorted (NaN last, ties, infinities)."""
    from mismatch_lab.analysis.quantiles import select

    monkeypatch.setattr(units_volatility, "COMPACT", compact)
    rng = np.random.default_rng(compact)
    pool = np.concatenate([rng.normal(size=400), rng.integers(0, 5, 200).astype(float), [np.nan, np.inf, -np.inf]])
    values = rng.permutation(pool)
    merged, seen = units_volatility._Sorted.of(np.sort(values[:50])), list(values[:50])
    for start in range(50, len(values), 37):
        new = values[start:start + 37]
        merged, seen = merged.with_new(np.sort(new)), seen + list(new)
        every = np.sort(np.array(seen))
        assert len(merged) == len(every)
        for q in (0.0, 0.01, 0.05, 0.5, 0.95, 0.99, 1.0):
            want, got = select(every, 0, len(every), q), merged.quantile(q)
            assert (np.isnan(want) and np.isnan(got)) or got == want, (q, got, want)
    assert compact != 0 or len(merged.added) == len(values) - 50  # (0: never merged into the kept ones)


def test_a_new_process_reads_the_units_tokens_from_the_results_cache(tmp_path, counted):
    path = tmp_path / "live"
    results = cache.ResultsCache(path)
    with _recorder(path) as rec:
        for step in range(3):
            _log(rec, step, step)
    first = units_volatility.volatility_of(ShardUnits(path), results, "vllm:bf16", "verl:trainer")
    units_volatility._TOKENS.clear()  # what a new process starts with
    units_volatility._GROUPS.clear()
    again = units_volatility.volatility_of(ShardUnits(path), cache.ResultsCache(path), "vllm:bf16", "verl:trainer")
    assert len(counted["units"]) == 1  # the first look-up's
    pd.testing.assert_frame_equal(again, first)


def test_a_refresh_of_the_volatility_look_ups_computes_the_new_step_only_and_opens_no_whole_store_connection(
        tmp_path, monkeypatch, lab_ui, counted):
    import lab_cache

    path = (tmp_path / "live").resolve()
    pair = ("vllm:bf16", "verl:trainer")
    with _recorder(path) as rec:
        for step in range(6):
            _log(rec, step, step)
        for buckets in ("linear", "log"):  # the page's first load (the warm-up's steps of a pair)
            lab_ui.volatility_of(*pair, buckets, path=str(path))
        lab_cache._keep_pair_tokens(str(path), *pair)
        _log(rec, 6, 6)  # the writer goes on while the page is open
        opened = []
        real = reader._open_parquet_dir
        monkeypatch.setattr(reader, "_open_parquet_dir", lambda d, files=None, *a, **k: opened.append(files)
                            or real(d, files, *a, **k))
        monkeypatch.setattr(lab_cache, "FINGERPRINT_S", 0.0)  # the store's fingerprint taken again
        for key in ("units", "rows", "merges"):
            counted[key].clear()
        shown = {buckets: lab_ui.volatility_of(*pair, buckets, path=str(path)) for buckets in ("linear", "log")}
        lab_cache._keep_pair_tokens(str(path), *pair)
        tokens = lab_cache._pair_tokens(str(path), lab_ui.fingerprint(str(path)), *pair)
    assert None not in opened, "a connection on the whole store"
    assert opened and all("step-00000006" in f for files in opened for t, fs in files.items() if t != "runs"
                          for f in fs)
    assert counted["units"] == [{("live", 6)}]  # the new step's tokens, once
    assert counted["rows"] == [B * T, B * T] and len(counted["merges"]) == 2  # each table: the new step's rows
    assert tokens.table.num_rows == 7 * B * T
    con = open_store(path)
    try:
        for buckets, table in shown.items():
            assert_same(table, volatility.volatility_table(con, rollout=pair[0], scorer=pair[1], buckets=buckets))
    finally:
        con.close()


def test_the_page_on_a_store_being_written_shows_the_whole_stores_table_after_a_refresh(tmp_path, monkeypatch, lab_ui):
    import lab_cache

    path = (tmp_path / "live").resolve()
    with _recorder(path) as rec:
        for step in range(2):
            _log(rec, step, step, nonfinite=step == 1)
        at = open_page(path, monkeypatch, "volatility")
        _log(rec, 2, 2)
        opened = []
        real = reader._open_parquet_dir
        monkeypatch.setattr(reader, "_open_parquet_dir", lambda d, files=None, *a, **k: opened.append(files)
                            or real(d, files, *a, **k))
        monkeypatch.setattr(lab_cache, "FINGERPRINT_S", 0.0)
        at.radio(key="vol_scale").set_value("log")
        next(b for b in at.button if b.label == "Apply").click().run()
        assert not at.exception, at.exception
    assert opened and None not in opened, "a connection on the whole store"
    con = open_store(path)
    try:
        want = volatility.volatility_table(con, rollout="vllm:bf16", scorer="verl:trainer", buckets="log")
    finally:
        con.close()
    shown = at.dataframe[0].value
    want = want[want["bucket"] >= 0].drop(columns=["rollout", "scorer", "scale"]).reset_index(drop=True)
    assert shown["n_tokens"].sum() == 3 * B * T - 2  # the new step's tokens, less the 2 with a non-finite log π
    pd.testing.assert_frame_equal(shown.reset_index(drop=True), want, rtol=RTOL)
