"""A recorded store's tokens and scores paired by position (store.aligned, relations.rollout_base with
`aligned`) against the key join: the same passes value for value, with and without filters, on shards of
different column sets; a shard whose rows are out of order falls back to the key join; footers that
disagree offer no slices. The stores here are small: MIN_SLICE_ROWS is set to 0 so that they get slices
(one test checks that the default offers small stores none)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mismatch_lab.analysis import rows as rows_module
from mismatch_lab.analysis.relations import Filters
from mismatch_lab.analysis.rows import Rows, Thresholds
from mismatch_lab.record import Recorder
from mismatch_lab.store import aligned
from mismatch_lab.store.reader import open_store

B, T = 6, 40


def _record(path: Path) -> None:
    """Two runs (one with two ranks), three steps, ragged responses, non-finite log-probs, top-K in one
    step of run 'a' only (its shards have columns the others lack)."""
    recs = [Recorder(path, "a", framework="trl", rollout_engine="vllm", trainer_dtype="fp32", rollout_dtype="bf16", rank=r)
            for r in (0, 1)] + [Recorder(path, "b", framework="trl", rollout_engine="sglang", trainer_dtype="fp32")]  # fmt: skip
    for step in range(3):
        for i, rec in enumerate(recs):
            rng = np.random.default_rng(10 * step + i)
            mask = np.arange(T)[None, :] < rng.integers(1, T + 1, (B, 1))
            lmu = -rng.exponential(1.0, (B, T))
            lpi = np.minimum(lmu + rng.normal(0.0, 0.2, (B, T)), 0.0)
            lpi[0, 0] = np.nan if step == 1 else lpi[0, 0]
            rewards = (rng.random(B) < 0.5).astype(float)
            topk = {}
            if step == 2 and i == 0:
                ids = rng.integers(0, 100, (B, T, 3))
                topk = {"rollout_topk_ids": ids, "rollout_topk_logps": np.log(np.full((B, T, 3), 0.2))}
            rec.log_step(step, rng.integers(0, 100, (B, T)), mask, lmu, lpi, advantages=rewards - rewards.mean(),
                         rewards=rewards, **topk)  # fmt: skip
    for rec in recs:
        rec.close()


@pytest.fixture(autouse=True)
def small_slices(monkeypatch):
    monkeypatch.setattr(aligned, "MIN_SLICE_ROWS", 0)


@pytest.fixture
def store(tmp_path) -> Path:
    path = tmp_path / "rec"
    _record(path)
    return path


def _sorted(frame: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    labels = [c for c in ("rollout", "scorer", "run_id", "adv_sign", "category") if c in frame.columns]
    frame[labels] = frame[labels].astype(object).where(frame[labels].notna(), None)
    return frame.sort_values(keys, na_position="first").reset_index(drop=True)


def _passes(rows: Rows) -> list[pd.DataFrame]:
    """The grid, the per-sequence sums, the quantiles of both scales and the token sums."""
    return [_sorted(rows.grid(Thresholds()), ["rollout", "scorer", "run_id", "step", "adv_sign", "category", "lb", "gb"]),
            _sorted(rows.sequences("rollout"), ["rollout", "scorer", "run_id", "seq_id"]),
            _sorted(rows.quantiles("linear", 10), ["rollout", "scorer", "bucket"]),
            _sorted(rows.quantiles("log", 13), ["rollout", "scorer", "bucket"]),
            _sorted(rows.token_sums(Thresholds()), ["rollout", "scorer", "token_text", "token_id", "category"])]  # fmt: skip


def _spy(monkeypatch) -> list[bool]:
    """Records, per rollout_base call of Rows, whether it was handed aligned slices."""
    calls: list[bool] = []
    real = rows_module.rollout_base

    def spy(*args, **kwargs):
        calls.append(bool(kwargs.get("aligned")))
        return real(*args, **kwargs)

    monkeypatch.setattr(rows_module, "rollout_base", spy)
    return calls


def _compare(path: Path, filters: Filters, monkeypatch) -> list[bool]:
    """Materialised passes through the slices equal those through the key join; returns the spy's calls."""
    con = open_store(path)
    calls = _spy(monkeypatch)
    with Rows(con, filters, materialize=True) as rows:
        mine = _passes(rows)
    with monkeypatch.context() as m:
        m.setattr(rows_module, "aligned_parts", lambda con: [])
        with Rows(con, filters, materialize=True) as rows:
            ref = _passes(rows)
    assert len(ref[0]) > 0 and len(ref[1]) > 0
    for a, b in zip(mine, ref, strict=True):  # counts exact; sums up to the order DuckDB adds rows in
        pd.testing.assert_frame_equal(a, b, check_exact=False, rtol=1e-12, atol=1e-12, check_dtype=False)
        counts = [c for c in a.columns if c[:2] in ("n_", "c_") or c in ("n", "response_len")]
        pd.testing.assert_frame_equal(a[counts], b[counts], check_exact=True, check_dtype=False)
    con.close()
    return calls


FILTERS = {
    "none": Filters(),
    "run": Filters.make(run_ids="a"),
    "rollout": Filters.make(rollout="sglang"),
    "scorer": Filters.make(scorer="trl:fp32"),
}


@pytest.mark.parametrize("name", FILTERS)
def test_slices_give_the_key_join(store, name, monkeypatch):
    calls = _compare(store, FILTERS[name], monkeypatch)
    assert calls[0] is True  # the slices were taken first


def test_slices_read_every_column_of_the_full_views(store):
    con = open_store(store)
    slices = aligned.parts(con)
    assert {run for run, _, _ in slices} == {"a", "b"} and len(slices) >= 2
    for table, i in (("tokens", 1), ("scores", 2)):
        full = con.execute(f"DESCRIBE {table}").fetchall()
        for s in slices:
            assert con.execute(f"DESCRIBE {s[i]}").fetchall() == full
        (n,) = con.execute(" UNION ALL ".join(f"SELECT count(*) FROM {s[i]}" for s in slices).join(
            ("SELECT sum(c) FROM (", ") t(c)"))).fetchone()  # fmt: skip
        assert n == con.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
    assert con.execute("SELECT count(topk_ids_rollout) FROM tokens").fetchone()[0] > 0
    con.close()


def _scores_shard(path: Path, run: str = "a") -> Path:
    return sorted((path / "scores" / run).glob("step-*/*.parquet"))[1]


def test_rows_out_of_order_fall_back_to_the_key_join(store, monkeypatch):
    shard = _scores_shard(store)
    table = pq.read_table(shard)
    pq.write_table(table.take(np.arange(table.num_rows)[::-1]), shard)  # same rows, same run, other order
    assert aligned.parts(open_store(store))  # the footers cannot tell
    calls = _compare(store, Filters(), monkeypatch)
    assert calls[:2] == [True, False]  # the slices raised MISALIGNED; the key join gave the rows


def test_footers_that_disagree_offer_no_slices(store, tmp_path):
    shard = _scores_shard(store)
    table = pq.read_table(shard)
    pq.write_table(table.slice(0, table.num_rows - 1), shard)  # a row fewer than its tokens shard
    assert aligned.parts(open_store(store)) == []

    other = tmp_path / "other"
    _record(other)
    shard = min((other / "tokens" / "a").glob("step-*/*.parquet"))
    table = pq.read_table(shard)
    run = table.schema.get_field_index("run_id")
    pq.write_table(table.set_column(run, "run_id", pq.read_table(_scores_shard(other, "b")).column("run_id")
                                    .slice(0, table.num_rows)), shard)  # fmt: skip
    assert aligned.parts(open_store(other)) == []  # a shard holding another run than its folder's


def test_a_store_of_several_scorers_is_joined_on_keys(tmp_path, monkeypatch):
    path = tmp_path / "two"
    for run, dtype in (("a", "fp32"), ("b", "bf16")):
        rec = Recorder(path, run, framework="trl", rollout_engine="vllm", trainer_dtype=dtype)
        rng = np.random.default_rng(1)
        lmu = -rng.exponential(1.0, (B, T))
        rec.log_step(0, rng.integers(0, 100, (B, T)), np.ones((B, T), bool), lmu, np.minimum(lmu + 0.1, 0.0))
        rec.close()
    assert aligned.parts(open_store(path))  # offered by the store ...
    calls = _compare(path, Filters(), monkeypatch)
    assert calls[0] is False  # ... but not taken: a scorer filter could hide a misaligned pair


def test_small_stores_are_offered_no_slices(store, monkeypatch):
    monkeypatch.setattr(aligned, "MIN_SLICE_ROWS", aligned.MIN_SLICE_ROWS.__class__(1 << 18))
    assert aligned.parts(open_store(store)) == []


def _rewrite(shard: Path, edit) -> None:
    pq.write_table(edit(pq.read_table(shard)), shard)


def test_null_run_ids_offer_no_slices(store):
    """Parquet's min and max skip NULLs: the null count must be 0 too (the key join drops such rows)."""
    shard = min((store / "tokens" / "a").glob("step-*/*.parquet"))
    _rewrite(shard, lambda t: t.set_column(0, "run_id", pa.array([None] + ["a"] * (t.num_rows - 1)).dictionary_encode()))
    assert aligned.parts(open_store(store)) == []


def test_an_empty_unit_keeps_the_slices(tmp_path, monkeypatch):
    path = tmp_path / "empty"
    rec = Recorder(path, "a", framework="trl", rollout_engine="vllm", trainer_dtype="fp32")
    rng = np.random.default_rng(2)
    lmu = -rng.exponential(1.0, (B, T))
    rec.log_step(0, rng.integers(0, 100, (B, T)), np.ones((B, T), bool), lmu, np.minimum(lmu + 0.1, 0.0))
    rec.log_step(1, rng.integers(0, 100, (B, T)), np.zeros((B, T), bool), lmu, np.minimum(lmu + 0.1, 0.0))  # no response token
    rec.log_step(2, rng.integers(0, 100, (B, T)), np.ones((B, T), bool), lmu, lmu - 0.1)
    rec.close()
    assert aligned.parts(open_store(path))
    assert _compare(path, Filters(), monkeypatch)[0] is True


def test_column_names_match_whatever_their_case(store, monkeypatch):
    """DuckDB reads `LOGP` of one shard as the column logp (union_by_name): so does its slice."""
    for shard in (store / "scores" / "b").glob("step-*/*.parquet"):  # every shard of b's slices
        _rewrite(shard, lambda t: t.rename_columns([("LOGP" if c == "logp" else c) for c in t.column_names]))
    calls = _compare(store, Filters(), monkeypatch)
    assert calls[0] is True


def test_a_store_reached_through_a_symlink_and_dotdot(store, tmp_path, monkeypatch):
    (tmp_path / "deep" / "er").mkdir(parents=True)
    (tmp_path / "deep" / "er" / "link").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (tmp_path / "elsewhere").mkdir()
    store.rename(tmp_path / "rec-moved")
    (tmp_path / "rec").symlink_to(tmp_path / "rec-moved")  # the fixture's path still leads to it
    # link/.. is elsewhere/.. = tmp_path for the OS; deep/er as text
    via = tmp_path / "deep" / "er" / "link" / ".." / "rec"
    assert aligned.parts(open_store(via))
    assert _compare(via, Filters(), monkeypatch)[0] is True


def test_slices_cut_short_are_not_kept(store, monkeypatch):
    con = open_store(store)
    real, made = aligned._slice, []

    def fail_second(*args):
        made.append(1)
        if len(made) == 3:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(aligned, "_slice", fail_second)
    with pytest.raises(KeyboardInterrupt):
        aligned.parts(con)
    monkeypatch.setattr(aligned, "_slice", real)
    again = aligned.parts(con)  # made whole now, not the first slice alone
    assert len(again) == len(aligned.parts(open_store(store))) >= 2


def test_the_write_settings_are_added_and_restored(store):
    con = open_store(store)
    con.execute("SET disabled_optimizers = 'compressed_materialization'")
    with pytest.raises(RuntimeError), rows_module._settings(con, **rows_module.WRITE_SETTINGS):
        (now,) = con.execute("SELECT current_setting('disabled_optimizers')").fetchone()
        assert "compressed_materialization" in now and "build_side_probe_side" in now
        raise RuntimeError
    assert con.execute("SELECT current_setting('disabled_optimizers')").fetchone()[0] == "compressed_materialization"
    assert con.execute("SELECT current_setting('preserve_insertion_order')").fetchone()[0] is True
