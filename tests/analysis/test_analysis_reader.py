"""open_store: DuckDB files (also while a writer holds them), Parquet directories, study directories."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import duckdb
import pytest

from mismatch_lab.errors import UserError
from mismatch_lab.store.reader import open_store
from mismatch_lab.store.schema import TABLES, create_schema


def _count(con, table: str) -> int:
    return con.execute(f"SELECT count(*) FROM {table}").fetchone()[0]


def test_a_duckdb_file_opens_read_only(full_store):
    con = open_store(full_store.path)
    assert _count(con, "tokens") == len(full_store.frames["tokens"])
    with pytest.raises(duckdb.Error, match="read-only"):
        con.execute("DELETE FROM tokens")
    con.close()


def test_a_file_locked_by_a_running_writer_is_read_from_a_snapshot(tmp_path):
    path = tmp_path / "busy.duckdb"
    writer = textwrap.dedent(
        f"""
        import sys, time, duckdb
        from mismatch_lab.store.schema import create_schema
        con = duckdb.connect({str(path)!r})
        create_schema(con)
        con.execute("INSERT INTO runs (run_id) VALUES ('checkpointed')")
        con.execute("CHECKPOINT")
        con.execute("INSERT INTO runs (run_id) VALUES ('in-the-wal')")
        print("ready", flush=True)
        sys.stdin.readline()
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", writer], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        with pytest.raises(duckdb.IOException, match="lock"):
            duckdb.connect(str(path), read_only=True)
        con = open_store(path)
        assert sorted(r[0] for r in con.execute("SELECT run_id FROM runs").fetchall()) == ["checkpointed", "in-the-wal"]
        con.close()
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
    assert proc.returncode == 0


def test_a_file_this_process_writes_is_read_from_a_snapshot(tmp_path):
    path = tmp_path / "mine.duckdb"
    writer = duckdb.connect(str(path))
    create_schema(writer)
    writer.execute("INSERT INTO runs (run_id) VALUES ('a')")
    writer.execute("CHECKPOINT")
    con = open_store(path)
    assert _count(con, "runs") == 1
    writer.execute("INSERT INTO runs (run_id) VALUES ('b')")  # the writer is not blocked by the reader
    assert _count(writer, "runs") == 2
    con.close()
    writer.close()


def _export(full_store, folder, tables=("runs", "tokens", "scores")):
    folder.mkdir(parents=True, exist_ok=True)
    src = duckdb.connect(str(full_store.path), read_only=True)
    for table in tables:
        src.execute(f"COPY {table} TO '{folder / (table + '.parquet')}' (FORMAT parquet)")
    src.close()


def test_a_parquet_directory_gets_views_and_missing_tables_come_empty(full_store, tmp_path):
    _export(full_store, tmp_path / "results")
    con = open_store(tmp_path / "results")
    assert _count(con, "tokens") == len(full_store.frames["tokens"])
    for table in TABLES:  # every contract table is there, the unexported ones empty
        con.execute(f"SELECT * FROM {table} LIMIT 0")
    assert _count(con, "sequences") == 0 and _count(con, "train_metrics") == 0
    con.close()


def test_a_contract_column_missing_from_a_parquet_file_reads_as_null(full_store, tmp_path):
    folder = tmp_path / "old"
    _export(full_store, folder, tables=("runs", "tokens"))
    src = duckdb.connect(str(full_store.path), read_only=True)
    src.execute(f"COPY (SELECT * EXCLUDE (logps_at_ref_topk, entropy) FROM scores) TO '{folder / 'scores.parquet'}' (FORMAT parquet)")
    src.close()
    con = open_store(folder)
    assert con.execute("SELECT count(*) FILTER (WHERE entropy IS NOT NULL) FROM scores").fetchone()[0] == 0
    assert _count(con, "scores") == len(full_store.frames["scores"])
    con.close()


def _export_partitioned(full_store, folder):
    """runs and tokens as files, scores as a folder partitioned by scorer (scores/scorer=hf%3Afp32/...)."""
    _export(full_store, folder, tables=("runs", "tokens"))
    src = duckdb.connect(str(full_store.path), read_only=True)
    src.execute(f"COPY scores TO '{folder / 'scores'}' (FORMAT parquet, PARTITION_BY (scorer))")
    src.close()


def test_a_partitioned_table_folder_is_read_with_its_hive_keys(full_store, tmp_path):
    folder = tmp_path / "parts"
    _export_partitioned(full_store, folder)
    con = open_store(folder)
    assert _count(con, "scores") == len(full_store.frames["scores"])
    assert {r[0] for r in con.execute("SELECT DISTINCT scorer FROM scores").fetchall()} == {"hf:fp32", "hf:bf16"}
    con.close()


def test_a_study_directory_or_its_toml_opens_its_results(full_store, tmp_path):
    study = tmp_path / "studies" / "demo"
    _export(full_store, study / "results")
    (study / "study.toml").write_text("name = 'demo'\n")
    for path in (study, study / "study.toml"):
        con = open_store(path)
        assert _count(con, "runs") == len(full_store.frames["runs"])
        con.close()


def test_bad_paths_raise_a_user_error_naming_the_fix(tmp_path):
    with pytest.raises(UserError, match="no such file or directory.*pass a .duckdb file"):
        open_store(tmp_path / "missing.duckdb")
    (tmp_path / "x" / "a.duckdb").parent.mkdir()
    (tmp_path / "x" / "a.duckdb").write_bytes(b"")
    with pytest.raises(UserError, match=r"cannot read \S*x/a\.duckdb as a DuckDB store"):  # the folder's only .duckdb
        open_store(tmp_path / "x")
    garbage = tmp_path / "garbage.duckdb"
    garbage.write_bytes(b"this is not a database" * 100)
    with pytest.raises(UserError, match="cannot read .* as a DuckDB store"):
        open_store(garbage)


def test_key_value_folders_above_a_store_are_not_read_as_columns(full_store, tmp_path):
    """DuckDB parses `key=value` from every folder of a Parquet file's absolute path; stores under such
    folders (Hydra-style run directories) must read as the files hold them: no `seed` column, no `step`
    overwritten, and a partitioned table's own keys read from below its folder only."""
    import numpy as np

    from mismatch_lab.record import Recorder

    base = tmp_path / "step=7" / "seed=3"
    _export(full_store, base / "results", tables=("runs", "tokens", "sequences"))
    con = open_store(base / "results")
    cols = [r[0] for r in con.execute("DESCRIBE sequences").fetchall()]
    assert "seed" not in cols
    src = duckdb.connect(str(full_store.path), read_only=True)
    want = src.execute("SELECT step, count(*) FROM sequences GROUP BY ALL ORDER BY ALL").fetchall()
    src.close()
    assert con.execute("SELECT step, count(*) FROM sequences GROUP BY ALL ORDER BY ALL").fetchall() == want
    con.close()

    with Recorder(base / "shards", "run-a", framework="trl", rollout_engine="vllm", trainer_dtype="fp32") as rec:
        rec.log_step(2, np.array([[5, 6]]), np.ones((1, 2), bool), np.full((1, 2), -0.5), np.full((1, 2), -0.4))
    con = open_store(base / "shards")
    assert con.execute("SELECT DISTINCT step FROM sequences").fetchall() == [(2,)]
    assert con.execute("SELECT DISTINCT run_id FROM tokens").fetchall() == [("run-a",)]
    assert "seed" not in [r[0] for r in con.execute("DESCRIBE tokens").fetchall()]
    con.close()

    folder = base / "parts"
    _export_partitioned(full_store, folder)
    con = open_store(folder)
    cols = [r[0] for r in con.execute("DESCRIBE scores").fetchall()]
    assert "seed" not in cols and "step" not in cols and cols.count("scorer") == 1
    assert {r[0] for r in con.execute("SELECT DISTINCT scorer FROM scores").fetchall()} == {"hf:fp32", "hf:bf16"}
    assert _count(con, "scores") == len(full_store.frames["scores"])
    con.close()


def test_a_file_that_is_not_parquet_is_a_one_line_error_naming_it(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "tokens.parquet").write_text("junk")
    (tmp_path / "b" / "scores" / "scorer=x").mkdir(parents=True)
    (tmp_path / "b" / "scores" / "scorer=x" / "p.parquet").write_text("junk")
    for folder, names in (("a", "the tokens table of"), ("b", "scores as Parquet")):
        with pytest.raises(UserError, match="cannot read") as exc:
            open_store(tmp_path / folder)
        message = str(exc.value)
        assert names in message and "too small to be a Parquet file" in message
        assert "\n" not in message and "LINE 1" not in message


def test_partition_keys_through_dotdot_paths_mixed_files_and_bad_values(full_store, tmp_path):
    folder = tmp_path / "parts"
    _export_partitioned(full_store, folder)
    want = {"hf:fp32", "hf:bf16"}
    con = open_store(tmp_path / "parts" / ".." / "parts")  # DuckDB reports the file names without '..'
    assert {r[0] for r in con.execute("SELECT DISTINCT scorer FROM scores").fetchall()} == want
    con.close()
    # a file outside any scorer= folder keeps its own scorer values
    src = duckdb.connect(str(full_store.path), read_only=True)
    src.execute(f"COPY (SELECT * FROM scores LIMIT 3) TO '{folder / 'scores' / 'loose.parquet'}' (FORMAT parquet)")
    (loose,) = src.execute("SELECT DISTINCT scorer FROM (SELECT * FROM scores LIMIT 3)").fetchall()
    src.close()
    con = open_store(folder)
    assert con.execute("SELECT count(*) FROM scores WHERE scorer IS NULL").fetchone() == (0,)
    assert con.execute("SELECT count(*) FROM scores WHERE scorer = ?", [loose[0]]).fetchone()[0] > 0
    con.close()
    # a partition value that is not of its contract column's type is an error naming the folder
    bad = tmp_path / "bad"
    _export(full_store, bad, tables=("runs", "tokens"))
    (bad / "sequences" / "step=abc").mkdir(parents=True)
    src = duckdb.connect(str(full_store.path), read_only=True)
    src.execute(f"COPY (SELECT * EXCLUDE (step) FROM sequences) TO '{bad / 'sequences' / 'step=abc' / 'p.parquet'}' (FORMAT parquet)")
    src.close()
    with pytest.raises(UserError, match=r"step=abc does not hold a INTEGER value"):
        open_store(bad)
