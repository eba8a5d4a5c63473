"""`mismatch-lab runs`: list a store's runs and drop one with all its rows, on a real DuckDB store."""

from __future__ import annotations

import subprocess
import sys

import duckdb
import pytest

from mismatch_lab.cli import main
from mismatch_lab.store.runs_command import RUN_TABLES
from mismatch_lab.store.synthetic import SyntheticSpec, synthetic_store


@pytest.fixture
def two_run_store(tmp_path):
    spec = SyntheticSpec(rollouts=("vllm:bf16", "vllm:fp32"), scorers=("hf:fp32", "hf:bf16"), n_sequences=6,
                         topk=3, exact_tv=True, train_steps=3)
    store = synthetic_store(tmp_path / "s.duckdb", spec)
    con = duckdb.connect(str(store.path))
    # the bookkeeping tables collect writes beside the data
    for run_id in store.frames["runs"]["run_id"]:
        con.execute("INSERT INTO chunks_done VALUES (?, 0, 6, 10, 1.0, now()::TIMESTAMP)", [run_id])
        con.execute("INSERT INTO skipped_prompts VALUES (?, 'p9', 'too long')", [run_id])
    con.close()
    return store


def _counts(db) -> dict[tuple[str, str], int]:
    con = duckdb.connect(str(db), read_only=True)
    try:
        return {(t, r): n for t in RUN_TABLES
                for r, n in con.execute(f"SELECT run_id, count(*) FROM {t} GROUP BY run_id").fetchall()}
    finally:
        con.close()


def test_listing_shows_each_runs_rows_and_scorers(two_run_store, capsys):
    assert main(["runs", "--db", str(two_run_store.path)]) == 0
    out = capsys.readouterr().out
    tokens = two_run_store.frames["tokens"]
    for run_id in ("synthetic-0-vllm-bf16", "synthetic-1-vllm-fp32"):
        line = next(ln for ln in out.splitlines() if ln.startswith(run_id))
        assert f" {int((tokens['run_id'] == run_id).sum())}  hf:bf16,hf:fp32" in line
        assert "complete" in line


def test_drop_removes_every_row_of_one_run_and_nothing_else(two_run_store, capsys):
    db = two_run_store.path
    before = _counts(db)
    gone, kept = "synthetic-1-vllm-fp32", "synthetic-0-vllm-bf16"
    for t in ("runs", "sequences", "tokens", "scores", "chunks_done", "skipped_prompts"):
        assert before[(t, gone)] > 0  # the run owns rows in each table, so the drop has something to remove
    assert main(["runs", "--db", str(db), "--drop", gone]) == 0
    out = capsys.readouterr().out
    assert f"dropped {gone}: runs 1, sequences " in out
    after = _counts(db)
    assert not [k for k in after if k[1] == gone]
    assert {k: v for k, v in before.items() if k[1] != gone} == after
    assert any(k[1] == kept for k in after)


def test_unknown_run_a_parquet_folder_or_a_busy_store_get_a_one_line_error(two_run_store, tmp_path, capsys):
    db = two_run_store.path
    assert main(["runs", "--db", str(db), "--drop", "nope"]) == 2
    err = capsys.readouterr().err
    assert "no run 'nope'" in err and "synthetic-0-vllm-bf16" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["runs", "--db", str(empty)]) == 2
    assert "not a .duckdb file" in capsys.readouterr().err
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time, duckdb; c = duckdb.connect(sys.argv[1]); print('ready', flush=True); time.sleep(60)",
         str(db)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        assert main(["runs", "--db", str(db), "--drop", "synthetic-0-vllm-bf16"]) == 2
        assert "another process" in capsys.readouterr().err
    finally:
        holder.kill()
        holder.wait()
    assert ("runs", "synthetic-0-vllm-bf16") in _counts(db)  # the refused drop removed nothing


def test_a_study_folder_holding_its_duckdb_lists_the_runs_of_that_file(two_run_store, capsys):
    folder = two_run_store.path.parent  # what `collect --study <folder>/study.toml` leaves: <folder>/<name>.duckdb
    (folder / "study.toml").write_text("")
    for db in (folder, folder / "study.toml"):
        assert main(["runs", "--db", str(db)]) == 0
        assert "synthetic-1-vllm-fp32" in capsys.readouterr().out
