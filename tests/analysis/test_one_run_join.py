"""Rows of one run join on (seq_id, pos) with both sides restricted to that run (relations._one_run): the
same rows, value for value, as the three-column join, also where the store holds rows of a run id that
`runs` does not list (they must join nothing) and where the filters pick one run of several."""

from __future__ import annotations

import duckdb
import pandas as pd
import pytest

from mismatch_lab.analysis import relations
from mismatch_lab.analysis.relations import Filters, rollout_base, scorer_base
from mismatch_lab.store.reader import open_store
from mismatch_lab.store.synthetic import SyntheticSpec, synthetic_store


def _rows(con, base_of, filters: Filters) -> pd.DataFrame:
    sql, params = base_of(con, filters)
    cols = "rollout, scorer, run_id, seq_id, lmu, lpi, finite" + (", adv_sign, step" if base_of is rollout_base else "")
    frame = con.execute(f"SELECT {cols} FROM ({sql})", relations._used(sql, params)).df()
    return relations.labels_as_str(frame).sort_values(["scorer", "run_id", "seq_id", "lmu", "lpi"]).reset_index(drop=True)


def _both(con, base_of, filters: Filters, monkeypatch) -> tuple[pd.DataFrame, pd.DataFrame, str]:
    """(rows through the one-run join, rows through the three-column join, the one-run condition)."""
    one = relations._one_run(con, filters, {})
    fast = _rows(con, base_of, filters)
    with monkeypatch.context() as m:
        m.setattr(relations, "_one_run", lambda *a: "")
        full = _rows(con, base_of, filters)
    return fast, full, one


@pytest.fixture
def one_run(tmp_path):
    """One run (scored by the reference and one more scorer) plus sequence, token and score rows of a run
    id that `runs` does not list, at the same (seq_id, pos) and with other log-probs and advantages."""
    path = tmp_path / "one.duckdb"
    spec = SyntheticSpec(rollouts=("vllm:bf16",), scorers=("hf:fp32", "hf:bf16"), rewards="advantage", seed=7)
    synthetic_store(path, spec)
    with duckdb.connect(str(path)) as w:
        w.execute("INSERT INTO sequences SELECT * REPLACE ('ghost' AS run_id, -advantage AS advantage) FROM sequences")
        w.execute("INSERT INTO tokens SELECT * REPLACE ('ghost' AS run_id, logp_rollout - 1.0 AS logp_rollout) FROM tokens")
        w.execute("INSERT INTO scores SELECT * REPLACE ('ghost' AS run_id, logp - 1.0 AS logp) FROM scores")
    con = open_store(path)
    yield con
    con.close()


@pytest.mark.parametrize("base_of", [rollout_base, scorer_base], ids=["rollout", "scorer"])
def test_one_run_joins_the_same_rows(one_run, base_of, monkeypatch):
    fast, full, one = _both(one_run, base_of, Filters(), monkeypatch)
    assert one  # the one-run join was taken
    assert len(fast) > 0 and set(fast["run_id"]) == {one_run.execute("SELECT run_id FROM runs").fetchone()[0]}
    if base_of is rollout_base:
        assert fast["adv_sign"].notna().any()
    pd.testing.assert_frame_equal(fast, full, check_exact=True)


def test_a_filter_naming_one_run_of_several(tmp_path, monkeypatch):
    path = tmp_path / "two.duckdb"
    spec = SyntheticSpec(rollouts=("vllm:bf16", "vllm:fp16"), scorers=("hf:fp32", "hf:bf16"), rewards="advantage", seed=8)
    synthetic_store(path, spec)
    con = open_store(path)
    runs = sorted(r[0] for r in con.execute("SELECT run_id FROM runs").fetchall())
    assert len(runs) == 2
    assert relations._one_run(con, Filters(), {}) == ""  # two runs, no filter: the three-column join
    for base_of in (rollout_base, scorer_base):
        fast, full, one = _both(con, base_of, Filters.make(run_ids=runs[1]), monkeypatch)
        assert one and len(fast) > 0 and set(fast["run_id"]) == {runs[1]}
        pd.testing.assert_frame_equal(fast, full, check_exact=True)
    con.close()
