"""`mismatch-lab export`: every contract table to zstd Parquet, row counts preserved, rows ordered."""

from __future__ import annotations

import duckdb
import pytest

from mismatch_lab.cli import main
from mismatch_lab.errors import UserError
from mismatch_lab.store.parquet import export
from mismatch_lab.store.reader import open_store
from mismatch_lab.store.schema import OPTIONAL_TABLES, TABLES


def _counts(con) -> dict[str, int]:
    return {t: con.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in TABLES}


def test_export_round_trip_keeps_every_row(figure_store, figure_study):
    db, frames = figure_store
    src, out = open_store(db), open_store(figure_study)
    expected = _counts(src)
    assert expected["tokens"] == len(frames["tokens"]) and expected["scores"] == len(frames["scores"])
    assert _counts(out) == expected
    for table in TABLES:  # an optional table without rows (routing of a dense model) is not written
        assert (figure_study / "results" / f"{table}.parquet").is_file() == (table not in OPTIONAL_TABLES
                                                                             or expected[table] > 0)
    # the same values come back, not only the same number of rows
    q = "SELECT sum(logp) FILTER (WHERE isfinite(logp)), count(*) FILTER (WHERE nonfinite) FROM scores"
    assert out.execute(q).fetchone() == pytest.approx(src.execute(q).fetchone())


def test_export_writes_zstd_ordered_by_run_seq_pos(figure_study):
    path = str(figure_study / "results" / "tokens.parquet")
    con = duckdb.connect()
    codecs = {r[0] for r in con.execute(f"SELECT DISTINCT compression FROM parquet_metadata('{path}')").fetchall()}
    assert codecs == {"ZSTD"}
    rows = con.execute(f"SELECT run_id, seq_id, pos FROM read_parquet('{path}')").fetchall()
    assert rows == sorted(rows)


def test_export_command_and_refusal(figure_store, tmp_path, capsys):
    out = tmp_path / "results"
    assert main(["export", "--db", str(figure_store[0]), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "tokens" in printed and "MB" in printed
    assert _counts(open_store(out)) == _counts(open_store(figure_store[0]))
    with pytest.raises(UserError, match="different folder"):
        export(tmp_path, out)  # tmp_path holds results/: the source would be overwritten while read


def test_export_while_a_writer_holds_the_store(figure_store, tmp_path):
    """A collect holding the file open for writing does not block the export: a snapshot is exported."""
    import shutil

    db = tmp_path / "live.duckdb"
    shutil.copyfile(figure_store[0], db)
    writer = duckdb.connect(str(db))  # read-write, as the collect holds it
    try:
        writer.execute("INSERT INTO meta VALUES ('writer', 'holds the lock')")
        counts = export(db, tmp_path / "results")
    finally:
        writer.close()
    assert counts == _counts(open_store(figure_store[0])) | {"meta": counts["meta"]}
    assert counts["meta"] >= 1 and counts["tokens"] > 0


def test_export_and_figures_refuse_an_out_that_is_a_file_or_a_shard_store(figure_store, figure_study, tmp_path, capsys):
    from mismatch_lab.store import shards

    afile = tmp_path / "afile"
    afile.write_text("x")
    shard_store = shards.init_store(tmp_path / "recorded")
    db = str(figure_store[0])
    assert main(["export", "--db", db, "--out", str(afile)]) == 2
    assert "--out" in capsys.readouterr().err and afile.read_text() == "x"
    assert main(["export", "--db", db, "--out", str(shard_store)]) == 2
    assert "is a shard store" in capsys.readouterr().err and not list(shard_store.glob("*.parquet"))
    assert main(["figures", str(figure_study), "--out", str(afile)]) == 2
    assert "exists and is not a directory" in capsys.readouterr().err
    assert main(["figures", str(figure_study), "--only", "3", "12"]) == 2
    assert "--only 12: no such figure; the figures are 1, 2, 3" in capsys.readouterr().err
