"""The materialised row set (rows.Rows(materialize=True)) against the live one: the same passes, the same
numbers, whichever labels it stores and which it adds as constants."""

from __future__ import annotations

import duckdb
import pandas as pd
import pytest

from mismatch_lab.analysis.relations import Filters
from mismatch_lab.analysis.rows import Rows, Thresholds
from mismatch_lab.store.reader import open_store
from mismatch_lab.store.synthetic import SyntheticSpec, synthetic_store

KEYS = ["rollout", "scorer", "run_id", "step", "adv_sign", "category", "lb", "gb"]


def _stored_columns(rows: Rows) -> set[str]:
    (table,) = rows._tables
    return {r[0] for r in rows.con.execute(f"DESCRIBE temp.{table}").fetchall()}


def _sorted(frame: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """`frame` with its label columns as str (ENUMs when stored, VARCHAR when live) or None, sorted by keys."""
    labels = [c for c in ("rollout", "scorer", "run_id", "adv_sign", "category") if c in frame.columns]
    frame[labels] = frame[labels].astype(object).where(frame[labels].notna(), None)
    return frame.sort_values(keys, na_position="first").reset_index(drop=True)


def _grid(rows: Rows) -> pd.DataFrame:
    return _sorted(rows.grid(Thresholds()), KEYS)


def _other_passes(rows: Rows) -> list[pd.DataFrame]:
    """The per-sequence sums, the linear-bucket quantiles and the token sums, in a fixed order."""
    return [_sorted(rows.sequences("rollout"), ["rollout", "scorer", "run_id", "seq_id"]),
            _sorted(rows.quantiles("linear", 10), ["rollout", "scorer", "bucket"]),
            _sorted(rows.token_sums(Thresholds()), ["rollout", "scorer", "token_text", "token_id", "category"])]  # fmt: skip


def _same_grid(con: duckdb.DuckDBPyConnection, filters: Filters | None = None) -> set[str]:
    """The materialised grid, per-sequence sums and quantiles equal the live ones value for value;
    returns the stored columns."""
    live = Rows(con, filters)
    with Rows(con, filters, materialize=True) as rows:
        stored = _stored_columns(rows)
        pd.testing.assert_frame_equal(_grid(rows), _grid(live), check_exact=True, check_dtype=False)
        for mine, ref in zip(_other_passes(rows), _other_passes(live), strict=True):
            assert len(ref) > 0
            pd.testing.assert_frame_equal(mine, ref, check_exact=True, check_dtype=False)
    return stored


def test_one_run_one_scorer_stores_no_label(tmp_path):
    """A store of one run, one rollout and one scorer (a recorded run's shape): those labels are constants,
    not columns of the temporary table, and every sum is what the live row set gives."""
    path = tmp_path / "one.duckdb"
    synthetic_store(path, SyntheticSpec(rollouts=("vllm:bf16",), scorers=("hf:fp32",), rewards="advantage", seed=3))
    con = open_store(path)
    stored = _same_grid(con)
    assert not {"rollout", "scorer", "run_id"} & stored
    with Rows(con, materialize=True) as rows:  # nor keys of its passes: added back to their results
        assert {"rollout", "scorer", "run_id"} <= set(rows._fixed)
        assert rows._free(KEYS) == [k for k in KEYS if k not in rows._fixed]
    assert {"lmu", "lpi", "seq_id", "token_id"} <= stored
    con.close()


def test_labels_with_several_values_or_a_null_are_stored(tmp_path):
    """Two runs and two scorers: every label is stored. One run's engine unknown (rollout label NULL)
    beside a single named rollout: the rollout label is stored too, not taken for a constant."""
    path = tmp_path / "two.duckdb"
    synthetic_store(path, SyntheticSpec(rollouts=("vllm:bf16", "vllm:fp16"), scorers=("hf:fp32", "hf:bf16"), seed=4))
    con = open_store(path)
    assert {"rollout", "scorer", "run_id"} <= _same_grid(con)
    run = con.execute("SELECT min(run_id) FROM runs").fetchone()[0]
    _same_grid(con, Filters.make(run_ids=run, scorer="hf:bf16"))  # one run of two, one scorer of two
    con.close()
    with duckdb.connect(str(path)) as w:
        w.execute("UPDATE runs SET engine = NULL WHERE engine_dtype = 'fp16'")
        w.execute("UPDATE runs SET engine_dtype = NULL WHERE engine IS NULL")
    con = open_store(path)
    assert con.execute("SELECT count(*) FROM runs WHERE engine IS NULL").fetchone()[0] == 1
    grid = _grid(Rows(con))
    assert grid["rollout"].isna().any() and grid["rollout"].dropna().nunique() == 1
    assert "rollout" in _same_grid(con)
    con.close()


@pytest.mark.parametrize("name", ["rollout", "scorer", "run_id"])
def test_a_single_label_quoted(tmp_path, name):
    """A constant label holding a quote is still one SQL literal."""
    path = tmp_path / "q.duckdb"
    synthetic_store(path, SyntheticSpec(rollouts=("vllm:bf16",), scorers=("hf:fp32",), seed=5))
    with duckdb.connect(str(path)) as w:
        column = {"rollout": ("runs", "engine"), "scorer": ("scores", "scorer"), "run_id": (None, "run_id")}[name]
        if column[0] is None:
            for table in ("runs", "sequences", "tokens", "scores"):
                w.execute(f"UPDATE {table} SET run_id = 'it''s'")
        else:
            w.execute(f"UPDATE {column[0]} SET {column[1]} = 'it''s'")
    con = open_store(path)
    _same_grid(con)
    with Rows(con, materialize=True) as rows:
        assert "it's" in set(_grid(rows)[name].astype(str).str.split(":").str[0])
    con.close()


def test_the_quantile_sample_keeps_its_share_of_the_stored_rows(tmp_path):
    """The materialised row set's sample (a hash of the row id against the share of the hash range) keeps
    about the share it is given: all rows at 1, about a tenth at 0.1, none at 0."""
    path = tmp_path / "s.duckdb"
    synthetic_store(path, SyntheticSpec(rollouts=("vllm:bf16",), scorers=("hf:fp32",), n_sequences=200, max_len=60, seed=6))
    con = open_store(path)
    with Rows(con, materialize=True) as rows:
        (n,) = con.execute(f"SELECT count(*) FROM ({rows.sql['rollout'][0]})").fetchone()
        kept = {share: con.execute(f"SELECT count(*) FROM ({rows._sample_rel.replace('{share}', repr(share))})").fetchone()[0]
                for share in (1.0, 0.1, 0.0)}  # fmt: skip
    assert n > 2000 and kept[1.0] == n and kept[0.0] == 0
    assert abs(kept[0.1] - 0.1 * n) < 5 * (n * 0.09) ** 0.5  # five binomial standard deviations
    con.close()
