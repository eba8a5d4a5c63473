"""Stores that are not ours, data that breaks the contract, study folders holding their DuckDB file, and the
machine's own failures (a full disk, a read-only folder): each is one line and exit 2, and nothing foreign
is ever written into.

Disk-full and read-only cases use a real tmpfs mounted for the test (`mount -t tmpfs -o size=...` / `ro`),
which needs root; without it they are skipped with the reason.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import duckdb
import pytest

from mismatch_lab.cli import main
from mismatch_lab.errors import UserError
from mismatch_lab.store.reader import open_store
from mismatch_lab.store.synthetic import SyntheticSpec, synthetic_store
from mismatch_lab.store.writer import connect_writer

REPO = Path(__file__).resolve().parents[1]
SPEC = SyntheticSpec(rollouts=("vllm:bf16",), scorers=("hf:fp32", "hf:bf16"), n_sequences=12, max_len=12, seed=3)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tables(path: Path) -> list[str]:
    con = duckdb.connect(str(path), read_only=True)
    try:
        return [r[0] for r in con.execute("SELECT table_name FROM information_schema.tables ORDER BY 1").fetchall()]
    finally:
        con.close()


def _one_error_line(err: str, command: str) -> str:
    """The one error line of a command's stderr (progress lines may come before it; no traceback)."""
    lines = [x for x in err.strip().splitlines() if x.startswith("mismatch-lab ") or "Traceback" in x]
    assert len(lines) == 1 and lines[0].startswith(f"mismatch-lab {command}: error: "), err
    return lines[0]


@pytest.fixture
def store(tmp_path) -> Path:
    return synthetic_store(tmp_path / "ours.duckdb", SPEC).path


@pytest.fixture
def foreign(tmp_path) -> Path:
    """Another program's DuckDB file: two tables of its own, no `meta` table."""
    path = tmp_path / "other.duckdb"
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE customers(id INTEGER, name VARCHAR)")
    con.execute("INSERT INTO customers VALUES (1, 'ada'), (2, 'grace')")
    con.execute("CREATE TABLE orders(id INTEGER, customer INTEGER, total DOUBLE)")
    con.close()
    return path


# -- 1. a DuckDB file that is not ours -----------------------------------------------------------------------
def test_runs_refuses_another_programs_duckdb_file_and_leaves_it_byte_for_byte(foreign, capsys):
    before, tables = _digest(foreign), _tables(foreign)
    assert main(["runs", "--db", str(foreign)]) == 2
    line = _one_error_line(capsys.readouterr().err, "runs")
    assert "is not a mismatch-lab store" in line and "customers" in line and "new --db" in line
    assert _digest(foreign) == before and _tables(foreign) == tables == ["customers", "orders"]
    assert not foreign.with_name(foreign.name + ".wal").exists()


@pytest.mark.parametrize("command", ["analyze", "doctor", "corrections", "export", "figures"])
def test_every_reader_refuses_another_programs_duckdb_file_with_one_line(command, foreign, tmp_path, capsys):
    before = _digest(foreign)
    argv = {"export": ["export", "--db", str(foreign), "--out", str(tmp_path / "out")],
            "figures": ["figures", str(foreign), "--out", str(tmp_path / "figs")]}.get(command, [command, "--db", str(foreign)])
    assert main(argv) == 2
    line = _one_error_line(capsys.readouterr().err, command)
    assert f"{foreign} is not a mismatch-lab store" in line and "no mismatch-lab meta table" in line
    assert _digest(foreign) == before and not (tmp_path / "out").exists()


def test_collect_refuses_another_programs_file_before_it_loads_a_model_or_an_engine(foreign):
    """In a child process, so the modules it imported are its own: neither vLLM nor transformers was loaded."""
    before = _digest(foreign)
    probe = ("import sys; from mismatch_lab.cli import main; rc = main(sys.argv[1:]); "
             "print('loaded:', sorted(m for m in ('vllm', 'transformers', 'torch') if m in sys.modules)); sys.exit(rc)")
    argv = ["collect", "--model", "default", "--prompts", str(REPO / "data" / "default_prompts.jsonl"), "--db",
            str(foreign), "--no-progress"]
    r = subprocess.run([sys.executable, "-c", probe, *argv], check=False, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert "is not a mismatch-lab store" in _one_error_line(r.stderr, "collect")
    loaded = r.stdout.strip().splitlines()[-1]
    assert "vllm" not in loaded and "transformers" not in loaded, loaded
    assert _digest(foreign) == before


def test_a_file_that_is_not_duckdb_at_all_is_refused_by_the_writer_and_left_as_is(tmp_path, capsys):
    path = tmp_path / "notes.duckdb"
    path.write_text("id,name\n1,ada\n")
    assert main(["runs", "--db", str(path)]) == 2
    assert "is not a DuckDB file" in _one_error_line(capsys.readouterr().err, "runs")
    assert path.read_text() == "id,name\n1,ada\n"


def test_a_new_file_and_a_duckdb_file_without_tables_are_ours_to_write(tmp_path):
    empty = tmp_path / "empty.duckdb"
    duckdb.connect(str(empty)).close()
    for path in (empty, tmp_path / "new.duckdb"):
        con = connect_writer(path)
        assert con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == ("1",)
        con.close()
        assert open_store(path).execute("SELECT count(*) FROM runs").fetchone() == (0,)


def test_export_refuses_an_out_folder_holding_another_programs_parquet_files(store, tmp_path, capsys):
    out = tmp_path / "theirs"
    out.mkdir()
    duckdb.execute(f"COPY (SELECT 1 AS id, 'x' AS what) TO '{out / 'tokens.parquet'}' (FORMAT parquet)")
    before = _digest(out / "tokens.parquet")
    assert main(["export", "--db", str(store), "--out", str(out)]) == 2
    assert "not a mismatch-lab export" in _one_error_line(capsys.readouterr().err, "export")
    assert sorted(p.name for p in out.iterdir()) == ["tokens.parquet"] and _digest(out / "tokens.parquet") == before
    # an earlier export of ours is overwritten as before
    mine = tmp_path / "mine"
    assert main(["export", "--db", str(store), "--out", str(mine)]) == 0
    assert main(["export", "--db", str(store), "--out", str(mine)]) == 0


# -- 2. data that breaks the contract ------------------------------------------------------------------------
def _parquet_store(store: Path, out: Path, table: str, select: str) -> Path:
    """`store` exported to `out`, with `table` rewritten as `SELECT {select} FROM table`."""
    assert main(["export", "--db", str(store), "--out", str(out)]) == 0
    con = duckdb.connect(str(store), read_only=True)
    con.execute(f"COPY (SELECT {select} FROM {table}) TO '{out / (table + '.parquet')}' (FORMAT parquet)")
    con.close()
    return out


BROKEN = {
    "tokens without logp_rollout": ("tokens", "* EXCLUDE (logp_rollout)", "the tokens table has no column logp_rollout (DOUBLE)"),
    "scores without logp": ("scores", "* EXCLUDE (logp)", "the scores table has no column logp (DOUBLE)"),
    "logp as text": ("scores", "* REPLACE (CAST(logp AS VARCHAR) AS logp)", "column scores.logp is VARCHAR, the data contract needs DOUBLE"),
    "seq_id as a double": ("tokens", "* REPLACE (CAST(seq_id AS DOUBLE) AS seq_id)", "column tokens.seq_id is DOUBLE, the data contract needs BIGINT"),
}


@pytest.mark.parametrize("case", list(BROKEN))
@pytest.mark.parametrize("command", [["doctor", "--gate", "verl"], ["analyze"]], ids=["doctor-gate", "analyze"])
def test_a_store_breaking_the_contract_is_an_error_not_a_verdict(case, command, store, tmp_path, capsys):
    table, select, needle = BROKEN[case]
    capsys.readouterr()
    bad = _parquet_store(store, tmp_path / "bad", table, select)
    assert main([command[0], "--db", str(bad), *command[1:]]) == 2  # not 1, a failing gate
    line = _one_error_line(capsys.readouterr().err, command[0])
    assert needle in line and "The data contract" in line and str(bad) in line


def test_a_duckdb_store_of_ours_with_logp_as_text_is_refused_naming_the_column(store, capsys):
    con = duckdb.connect(str(store))
    con.execute("ALTER TABLE scores ALTER logp TYPE VARCHAR")
    con.close()
    assert main(["analyze", "--db", str(store)]) == 2
    assert "column scores.logp is VARCHAR, the data contract needs DOUBLE" in _one_error_line(capsys.readouterr().err, "analyze")


def test_float32_log_probs_and_int32_ids_fit_the_contract(store, tmp_path):
    """A framework's dump in narrower types is read as it is: the check refuses only what cannot be read."""
    out = _parquet_store(store, tmp_path / "narrow", "scores",
                         "* REPLACE (CAST(logp AS FLOAT) AS logp, CAST(seq_id AS INTEGER) AS seq_id)")
    con = open_store(out)
    src = open_store(store)
    q = "SELECT count(*), count(logp) FROM scores"
    assert con.execute(q).fetchone() == src.execute(q).fetchone()


# -- 3. the machine's failures: a full disk, a read-only folder --------------------------------------------
@contextmanager
def _tmpfs(path: Path, options: str):
    path.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs (disk full / read-only) needs root, and this test runs as a user")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=False, capture_output=True,
                       text=True)
    if r.returncode:
        pytest.skip(f"mount -t tmpfs is not permitted here ({r.stderr.strip()})")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*") if ".tmp-" in p.name or p.suffix == ".parquet")


def test_export_onto_a_full_disk_is_one_line_and_leaves_no_half_written_file(tmp_path, capsys):
    big = synthetic_store(tmp_path / "big.duckdb", SyntheticSpec(n_sequences=600, max_len=40, topk=8, seed=1)).path
    with _tmpfs(tmp_path / "disk", "size=256k") as disk:
        assert main(["export", "--db", str(big), "--out", str(disk / "results")]) == 2
        line = _one_error_line(capsys.readouterr().err, "export")
        assert f"{disk / 'results'}" in line and "No space left on device" in line and "free space" in line
        assert _leftovers(disk) == []


def test_a_failed_export_keeps_the_previous_export_whole(store, tmp_path, capsys):
    big = synthetic_store(tmp_path / "big.duckdb", SyntheticSpec(n_sequences=600, max_len=40, topk=8, seed=1)).path
    with _tmpfs(tmp_path / "disk", "size=1m") as disk:
        out = disk / "results"
        assert main(["export", "--db", str(store), "--out", str(out)]) == 0
        before = {p.name: _digest(p) for p in out.iterdir()}
        free = os.statvfs(disk)
        (disk / "filler").write_bytes(b"\0" * max(0, free.f_bavail * free.f_frsize - 64 * 1024))
        capsys.readouterr()
        assert main(["export", "--db", str(big), "--out", str(out)]) == 2
        assert "No space left on device" in _one_error_line(capsys.readouterr().err, "export")
        assert {p.name: _digest(p) for p in out.iterdir()} == before  # no table of the new export, no temporary file
        assert open_store(out).execute("SELECT count(*) FROM tokens").fetchone() == \
            open_store(store).execute("SELECT count(*) FROM tokens").fetchone()


@pytest.mark.parametrize("command", ["export", "analyze --json"])
def test_writing_into_a_read_only_folder_is_one_line_naming_the_path(command, store, tmp_path, capsys):
    with _tmpfs(tmp_path / "ro", "ro,size=64k") as ro:
        argv, target = {"export": (["export", "--db", str(store), "--out", str(ro / "results")], ro / "results"),
                        "analyze --json": (["analyze", "--db", str(store), "--json", str(ro / "a.json")], ro / "a.json"),
                        }[command]
        assert main(argv) == 2
        line = _one_error_line(capsys.readouterr().err, argv[0])
        assert f"{target}: Read-only file system" in line and "read-only" in line.split(";", 1)[1]
        assert list(ro.iterdir()) == []


@pytest.mark.parametrize("disk", ["size=64k", "ro,size=64k"], ids=["full", "read-only"])
def test_an_import_onto_a_full_or_read_only_disk_is_one_line(disk, tmp_path, capsys):
    import json
    import random

    rng = random.Random(0)
    dump = tmp_path / "dump.jsonl"
    with dump.open("w") as f:
        for i in range(400):
            n = 120
            f.write(json.dumps({"step": i // 100, "token_ids": [rng.randrange(50000) for _ in range(n)],
                                "logp_rollout": [-rng.random() * 5 for _ in range(n)],
                                "logp_trainer": [-rng.random() * 5 for _ in range(n)]}) + "\n")
    with _tmpfs(tmp_path / "disk", disk) as mount:
        assert main(["import", "jsonl", str(dump), "--out", str(mount / "store")]) == 2
        line = _one_error_line(capsys.readouterr().err, "import")
        assert str(mount) in line
        assert ("No space left on device" if disk.startswith("size") else "Read-only file system") in line


def test_a_denied_permission_is_one_line_naming_the_path(store, tmp_path, capsys):
    if os.geteuid() == 0:
        pytest.skip("root writes through chmod 0555; the read-only tmpfs tests cover this path as root")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    assert main(["export", "--db", str(store), "--out", str(locked / "results")]) == 2
    assert f"{locked / 'results'}: Permission denied" in _one_error_line(capsys.readouterr().err, "export")


@pytest.mark.slow
def test_collect_onto_a_full_disk_is_one_line_and_keeps_only_whole_chunks(tiny_model, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(f'{{"id": "p{i}", "prompt": "Count from {i} to {i + 9}."}}\n' for i in range(8)))
    with _tmpfs(tmp_path / "disk", "size=600k") as disk:
        db = disk / "c.duckdb"
        argv = ["collect", "--model", tiny_model, "--prompts", str(prompts), "--db", str(db), "--samples", "2",
                "--max-tokens", "16", "--engine", "hf", "--rollout-dtypes", "fp32", "--scorer-dtypes", "fp32",
                "--top-k", "20", "--max-model-len", "256", "--chunk-prompts", "1", "--no-progress"]
        r = subprocess.run([sys.executable, "-m", "mismatch_lab.cli", *argv], check=False, capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 2, r.stderr[-3000:]
        line = _one_error_line(r.stderr, "collect")
        assert f"{db}" in line and "No space left on device" in line
        con = open_store(db)  # what was committed reads back whole: every chunk's sequences and tokens
        done, seqs, toks = con.execute("SELECT count(*), sum(n_sequences), sum(n_tokens) FROM chunks_done").fetchone()
        assert (seqs or 0, toks or 0) == con.execute(
            "SELECT (SELECT count(*) FROM sequences), (SELECT count(*) FROM tokens)").fetchone()
        assert done < 8
        con.close()


# -- 4. a study folder holding its DuckDB file ---------------------------------------------------------------
@pytest.fixture
def study(tmp_path) -> Path:
    """What `collect --study studies/demo/study.toml` leaves: the study file and demo.duckdb, no results/."""
    folder = tmp_path / "studies" / "demo"
    folder.mkdir(parents=True)
    (folder / "study.toml").write_text('[collect]\nmodel = "default"\n')
    synthetic_store(folder / "demo.duckdb", SyntheticSpec(rollouts=("vllm:bf16", "vllm:fp16"), scorers=("hf:fp32",),
                                                          n_sequences=16, max_len=16, n_planted=2, seed=5))
    return folder


@pytest.mark.parametrize("argv", [["analyze", "--db", "{s}"], ["doctor", "--db", "{s}"], ["analyze", "--db", "{s}/study.toml"],
                                  ["corrections", "--db", "{s}"]], ids=["analyze", "doctor", "study.toml", "corrections"])
def test_commands_on_a_study_folder_read_its_duckdb_file(argv, study, capsys):
    assert main([a.format(s=study) for a in argv]) == 0, capsys.readouterr().err
    assert "2 run(s)" in capsys.readouterr().out or argv[0] in ("doctor", "corrections")


def test_figures_of_a_study_folder_are_drawn_from_its_duckdb_file(study, capsys):
    pytest.importorskip("matplotlib")
    assert main(["figures", str(study), "--only", "1", "--format", "png"]) == 0, capsys.readouterr().err
    assert list((study / "figures").glob("*.png"))


def test_the_app_opens_a_study_folder_holding_its_duckdb_file(study, monkeypatch):
    from streamlit.testing.v1 import AppTest

    from mismatch_lab.app_command import _check_study

    assert _check_study(study) == study.resolve()
    monkeypatch.setenv("MISMATCH_LAB_STUDY", str(study))
    monkeypatch.setenv("MISMATCH_LAB_APP_WARMUP", "0")
    at = AppTest.from_file(str(REPO / "apps" / "streamlit_app.py"), default_timeout=120)
    at.run()
    assert not at.exception, at.exception
    assert not [e.value for e in at.error], [e.value for e in at.error]


def test_results_win_over_the_duckdb_file_and_among_several_files_the_studys_own_is_read(study, tmp_path):
    con = open_store(study)
    assert con.execute("SELECT count(*) FROM runs").fetchone() == (2,)
    con.close()
    other = synthetic_store(study / "older.duckdb", SyntheticSpec(n_sequences=2, max_len=4, seed=9)).path
    con = open_store(study)  # two files: demo.duckdb, named after the folder, is the study's
    assert con.execute("SELECT count(*) FROM runs").fetchone() == (2,)
    con.close()
    (study / "demo.duckdb").rename(study / "newer.duckdb")
    with pytest.raises(UserError, match="several DuckDB files .*newer.duckdb.*pass one of them"):
        open_store(study)
    assert main(["export", "--db", str(other), "--out", str(study / "results")]) == 0
    con = open_store(study)  # results/ wins
    assert con.execute("SELECT count(*) FROM runs").fetchone() == (1,)
    con.close()
