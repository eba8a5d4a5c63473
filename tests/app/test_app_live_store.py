"""The app on a store that is still being written, and its results cache on disk (mismatch_lab/store/cache.py).

A real Recorder writes steps into a shard store between two runs of the Training page (AppTest): the refresh
shows the new steps, and the per-step analysis runs on the new steps only (counted by wrapping the analysis
function, not timed); the same on a DuckDB store written by the `train` writer. A rewritten step shows its new numbers. Cached results are reused by a fresh process's
caches, never shown for changed data, never read unless signed with the user's key; a read-only store still
opens (its cache goes elsewhere) and a store that is not ours gets nothing written into it.
"""

from __future__ import annotations

import functools
import os
import pickle
import subprocess
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from app_paths import open_page

from mismatch_lab.analysis import precision, steps
from mismatch_lab.record import Recorder
from mismatch_lab.store import cache, units, units_pages
from mismatch_lab.store.reader import open_store

B, T = 4, 12
RTOL = 1e-12  # float64 sums of one step's rows, added in another order


def _log(rec: Recorder, step: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    lmu = -rng.exponential(1.0, (B, T))
    lpi = np.minimum(lmu + rng.normal(0, 0.2, (B, T)), 0.0)
    rec.log_step(step, rng.integers(0, 100, (B, T)), np.ones((B, T), bool), lmu, lpi, rewards=rng.normal(size=B))


def _recorder(path: Path) -> Recorder:
    return Recorder(path, "live", framework="verl", rollout_engine="vllm", rollout_dtype="bf16")


@pytest.fixture
def counted(monkeypatch):
    """Wrap `units._compute`, through which the Training page computes its per-step results (the mismatch per
    step among them) of the steps it has not cached: the steps of each such computation, one set per call."""
    calls: list[set[int]] = []
    real = units._compute

    @functools.wraps(real)
    def compute(source, results, fps, todo, name):
        assert "step_series" in source.queries
        calls.append({step for _, step in todo})
        return real(source, results, fps, todo, name)

    monkeypatch.setattr(units, "_compute", compute)
    return calls


def _per_step(at) -> pd.DataFrame:
    return next(d.value for d in at.dataframe if {"step", "kl_k3", "abs_dp_mean"} <= set(d.value.columns))


@pytest.fixture
def lab_cache(lab_ui):
    """The app's caches module (apps/lab_cache.py): where the fingerprint's hold times are read."""
    import lab_cache

    return lab_cache


def _refresh(at, lab_cache, monkeypatch):
    monkeypatch.setattr(lab_cache, "FINGERPRINT_S", 0.0)  # the page takes the store's fingerprint on this run
    at.run()
    assert not at.exception, at.exception
    return at


def test_a_refresh_shows_new_steps_and_computes_only_those(tmp_path, monkeypatch, lab_cache, counted):
    path = tmp_path / "live"
    with _recorder(path) as rec:
        for step in range(3):
            _log(rec, step, step)
        at = open_page(path, monkeypatch, "training")
        assert _per_step(at)["step"].tolist() == [0, 1, 2] and counted == [{0, 1, 2}]
        for step in (3, 4):  # the writer goes on while the page is open
            _log(rec, step, step)
        _refresh(at, lab_cache, monkeypatch)
        shown = _per_step(at)
        assert shown["step"].tolist() == [0, 1, 2, 3, 4]
        assert counted == [{0, 1, 2}, {3, 4}]  # the finished steps came from the cache
        whole = steps.step_series(open_store(path))
        pd.testing.assert_frame_equal(shown.reset_index(drop=True), whole, rtol=RTOL)


def test_a_rewritten_step_shows_its_new_numbers(tmp_path, monkeypatch, lab_cache, counted):
    path = tmp_path / "live"
    with _recorder(path) as rec:
        for step in range(3):
            _log(rec, step, step)
    at = open_page(path, monkeypatch, "training")
    before = _per_step(at).set_index("step")
    with _recorder(path) as rec:  # a resumed job logs step 1 again: its files are replaced
        _log(rec, 1, 99)
    _refresh(at, lab_cache, monkeypatch)
    after = _per_step(at).set_index("step")
    assert counted[-1] == {1}
    assert after.loc[1, "abs_dp_mean"] != before.loc[1, "abs_dp_mean"]
    pd.testing.assert_frame_equal(after.loc[[0, 2]], before.loc[[0, 2]])
    whole = steps.step_series(open_store(path)).set_index("step")
    pd.testing.assert_frame_equal(after, whole, rtol=RTOL)


def test_a_fresh_process_reads_cached_results_and_recomputes_them_once_the_store_changes(
        tmp_path, monkeypatch, lab_ui, lab_cache):
    import streamlit as st

    path = tmp_path / "live"
    calls = []
    real = precision.precision_table
    monkeypatch.setattr(precision, "precision_table",
                        functools.wraps(real)(lambda con, **kw: calls.append(1) or real(con, **kw)))
    with _recorder(path) as rec:
        _log(rec, 0, 0)
        first = lab_ui.precision_of(str(path))
        st.cache_data.clear()  # what a new server starts with: nothing in memory
        st.cache_resource.clear()
        again = lab_ui.precision_of(str(path))
        assert len(calls) == 1
        pd.testing.assert_frame_equal(again, first)
        _log(rec, 1, 1)
        monkeypatch.setattr(lab_cache, "FINGERPRINT_S", 0.0)
        changed = lab_ui.precision_of(str(path))
    assert len(calls) == 2
    assert int(changed["n_tokens"].sum()) == 2 * B * T == 2 * int(first["n_tokens"].sum())


def _one_entry(tmp_path, value):
    """A one-step shard store whose results cache holds `value` under the query ('q',): (store, cache,
    fingerprint, the entry's file)."""
    path = tmp_path / "live"
    with _recorder(path) as rec:
        _log(rec, 0, 0)
    results = cache.ResultsCache(path)
    fp = cache.fingerprint(path)
    results.put(("q",), fp, value)
    return path, results, fp, results._file(("q",), fp)


def test_an_entry_not_signed_with_the_users_key_is_never_unpickled(tmp_path):
    _, results, fp, entry = _one_entry(tmp_path, "ours")
    assert results.get(("q",), fp) == "ours"

    class Boom:
        def __reduce__(self):
            return (os._exit, (3,))  # would end this process if it were ever unpickled

    body = pickle.dumps(Boom())
    entry.write_bytes(b"\0" * 32 + body)  # a store from elsewhere, with a forged entry
    assert results.get(("q",), fp) is cache.MISSING
    assert results.get_or_compute(("q",), fp, lambda: "recomputed") == "recomputed"


@contextmanager
def _read_only(folder: Path):
    """`folder` as a real read-only mount (a bind mount remounted ro; needs root, skipped otherwise)."""
    if os.geteuid() != 0:
        pytest.skip("a read-only bind mount needs root, and this test runs as a user")
    for args in (["mount", "--bind", str(folder), str(folder)], ["mount", "-o", "remount,bind,ro", str(folder)]):
        r = subprocess.run(args, check=False, capture_output=True, text=True)
        if r.returncode:
            subprocess.run(["umount", "-l", str(folder)], check=False, capture_output=True)
            pytest.skip(f"a read-only bind mount is not permitted here ({r.stderr.strip()})")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


def test_a_read_only_store_opens_and_its_cache_goes_to_the_users_cache_folder(tmp_path, monkeypatch, counted):
    folder = tmp_path / "mounted"
    folder.mkdir()
    path = folder / "live"
    with _recorder(path) as rec:
        _log(rec, 0, 0)
    monkeypatch.delenv(cache.ENV_VAR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user-cache"))
    assert cache.location(path) == path / cache.DIR_NAME  # writable: inside our shard store
    files = sorted(folder.rglob("*"))
    with _read_only(folder):
        assert cache.location(path).is_relative_to(tmp_path / "user-cache" / "mismatch-lab" / "app")
        at = open_page(path, monkeypatch, "training")
        assert _per_step(at)["step"].tolist() == [0] and counted == [{0}]
    assert sorted(folder.rglob("*")) == files


def test_a_store_that_is_not_ours_gets_no_cache_written_into_it(parquet_store, tmp_path, monkeypatch, lab_ui):
    import streamlit as st

    st.cache_data.clear()  # this session's other tests may have computed the shared store's pages in memory
    st.cache_resource.clear()
    lab_ui._DISK.clear()
    monkeypatch.delenv(cache.ENV_VAR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user-cache"))
    study = parquet_store.parent
    before = sorted((p, p.stat().st_mtime_ns) for p in study.rglob("*"))
    open_page(parquet_store, monkeypatch, "overview")
    assert sorted((p, p.stat().st_mtime_ns) for p in study.rglob("*")) == before
    assert list((tmp_path / "user-cache" / "mismatch-lab" / "app").glob("*/*/*.pkl"))  # cached there instead


def test_app_prepare_fills_the_cache_that_the_pages_then_read(duckdb_store, tmp_path, monkeypatch, capsys, lab_ui):
    import streamlit as st

    from mismatch_lab.cli import main

    db = tmp_path / "prepared.duckdb"
    db.write_bytes(duckdb_store.read_bytes())
    # in this process: the cache is keyed by the package's sources, which a second process could read after an
    # edit of the working tree; prepare sets these two for its own AppTest run
    monkeypatch.setenv("MISMATCH_LAB_STUDY", str(db))
    monkeypatch.setenv("MISMATCH_LAB_APP_WARMUP", "0")
    assert main(["app", "--prepare", "--study", str(db)]) == 0
    assert f"cached every page's default analyses of {db}" in capsys.readouterr().out
    st.cache_data.clear()  # what a new server starts with: nothing in memory
    st.cache_resource.clear()
    lab_ui._DISK.clear()
    calls = []
    real = precision.precision_table
    monkeypatch.setattr(precision, "precision_table",
                        functools.wraps(real)(lambda con, **kw: calls.append(1) or real(con, **kw)))
    at = open_page(db, monkeypatch, "overview")
    assert not calls  # the page's precision table (and the doctor's) came from the prepared cache
    assert any("Precision table" in s.value for s in at.subheader)


def test_the_training_page_leaves_a_damaged_shard_out_as_a_whole_store_read_does(tmp_path, monkeypatch, lab_ui):
    path = tmp_path / "live"
    with _recorder(path) as rec:
        for step in range(3):
            _log(rec, step, step)
    shard = min(path.glob("scores/*/step-00000001/*.parquet"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # a node died mid-write
    at = open_page(path, monkeypatch, "training")
    assert not at.exception, at.exception
    assert _per_step(at)["step"].tolist() == [0, 2]


def test_a_duckdb_store_open_in_the_app_can_still_be_opened_for_writing(tmp_path, monkeypatch, duckdb_store):
    import shutil

    from mismatch_lab.store.writer import StoreWriter

    db = tmp_path / "open.duckdb"
    shutil.copyfile(duckdb_store, db)
    at = open_page(db, monkeypatch, "overview")  # the page's store connection stays open for the session
    writer = StoreWriter(db)  # what collect, train and `runs --drop` do: refused while a reader held the file
    writer.close()
    assert not at.exception


def _train_step(writer, run_id: str, step: int, seed: int) -> None:
    """One training step as `mismatch-lab train` writes it (rl.step.write_step): the Recorder's row builder and
    one `write_chunk` with chunk = step."""
    from mismatch_lab.record.tables import StepArrays, step_tables

    rng = np.random.default_rng(seed)
    lmu = -rng.exponential(1.0, (B, T))
    arrays = StepArrays(rng.integers(0, 100, (B, T)), np.ones((B, T), bool), lmu,
                        np.minimum(lmu + rng.normal(0, 0.2, (B, T)), 0.0), rewards=rng.normal(size=B))
    tables = step_tables(run_id, step, np.arange(B, dtype=np.int64) + step * B, arrays, "hf:fp32")
    writer.write_chunk(run_id, step, sequences=tables["sequences"], tokens=tables["tokens"], scores=tables["scores"],
                       seconds=0.0, metrics=[(step, "reward/mean", float(rng.normal()))])


@pytest.fixture
def step_passes(monkeypatch):
    """Wrap `steps.step_series`: the steps on the connection of each call (what it computed), one set a call."""
    calls: list[set[int]] = []
    real = steps.step_series

    @functools.wraps(real)
    def step_series(con, **kwargs):
        calls.append({s for (s,) in con.execute("SELECT DISTINCT step FROM sequences").fetchall()})
        return real(con, **kwargs)

    monkeypatch.setattr(steps, "step_series", step_series)
    return calls


def test_a_duckdb_store_being_trained_reuses_the_steps_it_computed_and_recomputes_a_redone_one(
        tmp_path, monkeypatch, lab_cache, step_passes):
    from mismatch_lab.rl.loop import _delete_steps_after
    from mismatch_lab.store.schema import create_schema
    from mismatch_lab.store.writer import StoreWriter

    db = tmp_path / "train.duckdb"
    writer = StoreWriter(db)
    create_schema(writer.con)
    writer.start_run("train-live", study="t", kind="train", model="m", weights_sha256="0", engine="vllm",
                     engine_dtype="bf16", device="cpu", versions={}, config={"loss": "grpo"})
    try:
        for step in range(3):
            _train_step(writer, "train-live", step, step)
        at = open_page(db, monkeypatch, "training")
        assert _per_step(at)["step"].tolist() == [0, 1, 2]
        monkeypatch.setattr(lab_cache, "DUCKDB_FINGERPRINT_S", 0.0)
        for step in (3, 4):  # train goes on while the page is open
            _train_step(writer, "train-live", step, step)
        step_passes.clear()
        shown = _per_step(_refresh(at, lab_cache, monkeypatch))
        assert shown["step"].tolist() == [0, 1, 2, 3, 4]
        assert step_passes == [{3, 4}]  # steps 0-2 were not computed again
        before = shown.set_index("step")
        _delete_steps_after(writer.con, "train-live", 3)  # a resumed run redoes step 4: same counts, new values
        _train_step(writer, "train-live", 4, 99)
        step_passes.clear()
        after = _per_step(_refresh(at, lab_cache, monkeypatch)).set_index("step")
        assert step_passes == [{4}]
        assert after.loc[4, "abs_dp_mean"] != before.loc[4, "abs_dp_mean"]
        pd.testing.assert_frame_equal(after.loc[[0, 1, 2, 3]], before.loc[[0, 1, 2, 3]])
    finally:
        writer.close()
    whole = steps.step_series(open_store(db)).set_index("step")
    pd.testing.assert_frame_equal(after, whole, rtol=RTOL)


def _log_metrics(rec: Recorder, step: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    lmu = -rng.exponential(1.0, (B, T))
    rec.log_step(step, rng.integers(0, 100, (B, T)), np.ones((B, T), bool), lmu,
                 np.minimum(lmu + rng.normal(0, 0.2, (B, T)), 0.0), rewards=rng.normal(size=B),
                 metrics={"reward/mean": float(rng.normal()), "mismatch/abs_dp/mean": float(rng.uniform())})


def _whole_and_by_unit(path: Path, results: cache.ResultsCache) -> list[tuple[object, object, tuple]]:
    """(whole-store result, per-unit result, (name, arguments)) of every per-unit look-up of `units_pages.PAGES` (the Training page's,
    the token inspector's, the Clipping page's) on the store, every pair's where a look-up takes one."""
    import importlib

    from mismatch_lab.analysis import browse

    con = open_store(path)
    seq_id = con.execute("SELECT max(seq_id) FROM sequences WHERE run_id = 'live' AND step = 1").fetchone()[0]
    pairs = [{"rollout": r, "scorer": s} for r, s in browse.list_pairs(con)[["rollout", "scorer"]].itertuples(index=False)]
    scorers = sorted({p["scorer"] for p in pairs})
    cases = {"list_sequences": [{"run_id": "live", "step": 1}, {"run_id": "live", "step": None}],
             "training_steps": [{"run_id": "live"}],
             "sequence_tokens": [{"run_id": "live", "seq_id": seq_id}, {"run_id": "live", "seq_id": -1}],
             "token_topk": [{"run_id": "live", "seq_id": seq_id, "pos": 3}],
             "clipping_by_category": pairs, "top_clipped_tokens": [{"n": 5, **p} for p in pairs],
             "worst_sequences": [{"n": 7}, {"scorer": "nobody", "n": 7}, *({"scorer": s, "n": 3} for s in scorers)]}
    out = []
    for source, look_ups in units_pages.PAGES.values():
        for name, (module, per_unit) in look_ups.items():
            fn = getattr(importlib.import_module(module), name)
            for args in cases.get(name, [{}]):
                out.append((fn(con, **args), per_unit(source(path), results, **args), (name, args)))
    con.close()
    return out


def _assert_same(per_unit, whole, case) -> None:
    if isinstance(whole, pd.DataFrame) and whole.empty:  # (DuckDB types an empty result's text columns object)
        assert per_unit.empty and list(per_unit.columns) == list(whole.columns), case
    elif isinstance(whole, pd.DataFrame):
        pd.testing.assert_frame_equal(per_unit, whole, rtol=RTOL, obj=str(case))
    else:  # (the categories: a list)
        assert per_unit == whole, case


def test_every_training_look_up_per_unit_equals_the_whole_store_query_as_a_run_goes_on_and_closes(tmp_path):
    path = tmp_path / "live"
    results = cache.ResultsCache(path)
    rec = Recorder(path, "live", framework="verl", rollout_engine="vllm", rollout_dtype="bf16")
    with Recorder(path, "other", framework="verl", rollout_engine="sglang", rollout_dtype="fp16") as other:
        _log_metrics(other, 0, 10)
    for step in range(2):
        _log_metrics(rec, step, step)
    states = [_whole_and_by_unit(path, results)]
    _log_metrics(rec, 2, 2)  # a new step
    states.append(_whole_and_by_unit(path, results))
    rec.close()  # the run's status moves, no unit changes
    states.append(_whole_and_by_unit(path, results))
    for state in states:
        for whole, per_unit, case in state:
            _assert_same(per_unit, whole, case)
    runs = states[-1][0][0].set_index("run_id")
    assert runs.loc["live", "status"] == "complete" and runs.loc["live", "steps"] == 3
    assert states[0][0][0].set_index("run_id").loc["live", "status"] == "running"


def test_a_refresh_of_a_few_new_steps_opens_no_database_and_looks_up_the_columns_once(tmp_path, monkeypatch):
    import duckdb

    from mismatch_lab.analysis import relations

    path, results = tmp_path / "live", cache.ResultsCache(tmp_path / "live")
    with _recorder(path) as rec:
        for step in range(3):
            _log(rec, step, step)
        units.step_series(units.ShardUnits(path), results)  # the first load (may make the process's database)
        for step in (3, 4):
            _log(rec, step, step)
        opened, looked_up = [], []
        connect, columns = duckdb.connect, relations._columns
        monkeypatch.setattr(duckdb, "connect", lambda *a, **k: opened.append(a) or connect(*a, **k))
        monkeypatch.setattr(relations, "_columns", lambda con, table=None: looked_up.append(table) or columns(con, table))
        shown = units.step_series(units.ShardUnits(path), results)  # every per-step query of the new steps
    assert shown["step"].unique().tolist() == [0, 1, 2, 3, 4]
    assert opened == []  # a cursor of the process's one-thread database (~20 ms of CPU a new one)
    assert looked_up == [None]  # every table's columns at once, for the refresh's 4 queries (were 16 look-ups)


def test_a_kept_connection_serves_the_same_files_alone_and_none_is_kept_once_the_process_exits(tmp_path, monkeypatch):
    """A small connection over some units is kept after its block for the next block over the same files (the
    look-ups of one refresh), with its column look-ups; a unit written again, or the run rows changed, open
    another on the new files; a block raising closes its connection; after the exit's clean-up none is kept."""
    from mismatch_lab.analysis import relations

    def rows(con) -> int:
        return con.execute("SELECT count(*) FROM tokens").fetchone()[0]

    path = tmp_path / "live"
    with _recorder(path) as rec:
        for step in range(3):
            _log(rec, step, step)
    one = [("live", 2)]
    with units.ShardUnits(path).connection(one) as first:
        assert relations.table_columns(first, "tokens") and rows(first) == B * T
        memo = relations._FIXED.get()[1]
    with units.ShardUnits(path).like(units.InspectorUnits).connection(one) as again:
        assert again is first and relations._FIXED.get()[1] is memo  # the same files: kept, with its look-ups
    with Recorder(path, "live", framework="verl", rollout_engine="vllm", rollout_dtype="bf16") as resumed:
        resumed.log_step(2, np.zeros((B, 2 * T), int), np.ones((B, 2 * T), bool), -np.ones((B, 2 * T)),
                         -np.ones((B, 2 * T)), rewards=np.zeros(B))  # step 2 written again, twice the tokens
    with units.ShardUnits(path).connection(one) as other:
        assert other is not first and rows(other) == 2 * B * T
    with pytest.raises(ZeroDivisionError), units.ShardUnits(path).connection(one) as failing:
        assert failing is other
        raise ZeroDivisionError
    with units.ShardUnits(path).connection(one) as fresh:
        assert fresh is not failing  # (closed, not kept)
    monkeypatch.setattr(units, "_SHUT", [])
    with units.ShardUnits(path).connection(one) as last:
        assert last is fresh
        units._close_small()  # the exit's clean-up while a block runs (another thread's)
    assert not units._HELD and units._SHUT  # that block's connection closed, not kept


def test_a_scan_lists_again_only_the_folders_a_writer_changed(tmp_path, monkeypatch):
    path = tmp_path / "live"
    with _recorder(path) as rec:
        for step in range(3):
            _log(rec, step, step)
        monkeypatch.setattr(units, "RACY_NS", 0)  # trust every folder's mtime at once (no coarse clock here)
        scan = units.Scan(path)
        first = scan.snapshot()
        listed: list[str] = []
        real = units._listing
        monkeypatch.setattr(units, "_listing", lambda folder: listed.append(folder) or real(folder))
        assert scan.snapshot() == first and not listed  # nothing changed: no folder listed
        _log(rec, 3, 3)
        now = scan.snapshot()
    relative = {str(Path(f).relative_to(path)) for f in listed}
    assert all("step-00000003" in f or f.count("/") <= 1 for f in relative), relative  # the new step, its parents
    assert {"sequences/live/step-00000003", "tokens/live/step-00000003"} <= relative
    assert set(now.fingerprints) == set(first.fingerprints) | {("live", 3)}
    assert all(now.fingerprints[u] == fp for u, fp in first.fingerprints.items())


@pytest.mark.parametrize("racy_ns, seen", [(units.RACY_NS, True), (0, False)])
def test_a_folder_changed_within_its_clock_tick_is_listed_again(tmp_path, monkeypatch, racy_ns, seen):
    path = tmp_path / "live"
    with _recorder(path) as rec:
        _log(rec, 0, 0)
    folder = path / "sequences" / "live" / "step-00000000"
    real = units._folder_key
    tick = real(str(folder))
    # a file system whose clock ticks coarsely: a change within the tick leaves the folder's times as they were
    monkeypatch.setattr(units, "_folder_key", lambda f: tick if f == str(folder) else real(f))
    monkeypatch.setattr(units, "RACY_NS", racy_ns)
    scan = units.Scan(path)
    before = scan.snapshot()
    extra = folder / "rank-00009-part-0000.parquet"
    extra.write_bytes(next(folder.glob("*.parquet")).read_bytes())  # a second writer's shard, in the same tick
    changed = scan.snapshot().fingerprints[("live", 0)] != before.fingerprints[("live", 0)]
    assert changed is seen  # listed again because it changed less than RACY_NS before its listing (0: missed)


def test_a_rewrite_that_keeps_size_and_mtime_changes_the_fingerprint(tmp_path):
    store = tmp_path / "results"
    store.mkdir()
    f = store / "tokens.parquet"
    f.write_bytes(b"a" * 100)
    before = cache.fingerprint(store)
    s = f.stat()
    f.write_bytes(b"b" * 100)  # in place, same size, mtime set back: only the change time tells
    os.utime(f, ns=(s.st_atime_ns, s.st_mtime_ns))
    assert cache.fingerprint(store) != before


def test_a_killed_cache_write_leaves_a_temporary_that_the_next_open_removes_once_stale(tmp_path):
    import time

    path, _, fp, entry = _one_entry(tmp_path, "value")
    stale, live = (entry.with_name(f".{entry.name}.{pid}.1") for pid in (111, 222))
    for tmp, age in ((stale, cache.STALE_TMP_S + 60), (live, 1)):  # as a write killed before its rename leaves
        tmp.write_bytes(b"half an entry")
        os.utime(tmp, (time.time() - age, time.time() - age))
    again = cache.ResultsCache(path)
    assert not stale.exists() and live.exists()  # a young one may be a write in progress
    assert again.get(("q",), fp) == "value"


def test_the_inspectors_token_look_ups_per_unit_equal_the_whole_store_with_and_without_top_k(tmp_path):
    """`units.sequence_tokens` and `units.token_topk` read the sequence's unit alone; a token's top-K lists lie in
    its unit, and where they are there the top-K is read over every unit (it names tokens by any unit's text)."""
    from mismatch_lab.analysis import browse

    path, results = tmp_path / "live", cache.ResultsCache(tmp_path / "live")
    rng = np.random.default_rng(7)
    with _recorder(path) as rec:
        for step in range(3):
            lmu = -rng.exponential(1.0, (B, T))
            ids = rng.integers(0, 100, (B, T, 3))
            with_topk = {} if step == 1 else {"rollout_topk_ids": ids, "rollout_topk_logps": np.sort(
                -rng.exponential(1.0, (B, T, 3)), axis=-1)[..., ::-1]}
            rec.log_step(step, ids[..., 0], np.ones((B, T), bool), lmu, np.minimum(lmu + rng.normal(0, 0.2, (B, T)), 0.0),
                         rewards=rng.normal(size=B), **with_topk)
    con = open_store(path)
    try:
        found = con.execute("SELECT step, max(seq_id) FROM sequences GROUP BY step ORDER BY step").fetchall()
        for step, seq_id in found:
            tokens = units.sequence_tokens(units.InspectorUnits(path), results, "live", seq_id)
            pd.testing.assert_frame_equal(tokens, browse.sequence_tokens(con, "live", seq_id))
            topk = units.token_topk(units.InspectorUnits(path), results, "live", seq_id, 2)
            pd.testing.assert_frame_equal(topk, browse.token_topk(con, "live", seq_id, 2))
            assert len(tokens) == T and topk.empty == (step == 1)
    finally:
        con.close()


def test_the_inspector_on_a_store_being_written_opens_no_connection_on_the_whole_store(tmp_path, monkeypatch, lab_cache):
    """Its run list, steps, sequences, a sequence's tokens and a token's top-K are read per unit (a whole-store
    connection opens every shard's footer at each change: ~0.13-0.24 CPU s on 200 steps)."""
    from mismatch_lab.store import reader

    path = tmp_path / "live"
    with _recorder(path) as rec:
        for step in range(3):
            _log(rec, step, step)
        opens = []
        opened = reader._open_parquet_dir
        monkeypatch.setattr(reader, "_open_parquet_dir", lambda d, files=None, *a, **k: opens.append(files)
                            or opened(d, files, *a, **k))
        at = open_page(path, monkeypatch, "inspector")
        assert opens and None not in opens  # every connection over some units' files
        del opens[:]
        _log(rec, 3, 3)
        _refresh(at, lab_cache, monkeypatch)
    assert opens and None not in opens
    read = {Path(f).parent.name for files in opens for table, fs in files.items() if table != "runs" for f in fs}
    assert read == {"step-00000003"}  # the new step only: the sequence shown was kept under its unit's fingerprint
    shown = {m.label: m.value for m in at.metric}
    assert "Prompt" in shown and not any("No top-K" in str(i.value) for i in at.exception)
    assert any("No top-K stored for this token" in str(i.value) for i in at.info)  # (a recorded run without lists)
