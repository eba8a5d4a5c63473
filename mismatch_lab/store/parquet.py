"""Export a store to compact Parquet: `<out>/<table>.parquet` (zstd) for every table of `schema.TABLES`
(an optional table of `schema.OPTIONAL_TABLES`, e.g. `routing`, only when it holds rows).

    mismatch-lab export --db studies/precision-sweep/precision-sweep.duckdb --out studies/precision-sweep/results

The source is read through `reader.open_store`, so exporting while a collect still writes the file reads a
consistent snapshot of what was committed (the collect never waits), and a Parquet directory or a study
directory can be re-exported too. Rows are written ordered by (run_id, seq_id, pos) where a table has those
columns: neighbouring rows then share run ids and positions, which zstd compresses far better. Every file
is written to a temporary name in `out` first and all are renamed only once every table is written, so an
export that stops (Ctrl-C, a full disk, a folder it may not write) leaves no half-written `<table>.parquet`
and no mix of new and old tables: `out` holds the previous export, or nothing, and no temporary file.
`open_store(out)` reads the result. An `out` holding Parquet files that are not an export of ours (no
`meta.parquet` recording the schema_version) is refused before anything is written.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from mismatch_lab.errors import UserError
from mismatch_lab.store import shards
from mismatch_lab.store.reader import STORE_HELP, open_store
from mismatch_lab.store.schema import OPTIONAL_TABLES, SCHEMA_VERSION, TABLES

ORDER_COLUMNS = ("run_id", "seq_id", "pos", "scorer", "side", "layer", "step", "name", "chunk", "key")
"""Sort keys, in this order, used where the table has them (scorer after pos: the rows of one token sit
together in `scores`)."""


def _columns(con, table: str) -> list[str]:
    rows = con.execute(
        "SELECT column_name FROM information_schema.columns WHERE table_name = ? AND table_schema = 'main' "
        "ORDER BY ordinal_position",
        [table],
    ).fetchall()
    return [r[0] for r in rows]


def export(db_path: str | Path, out_dir: str | Path, *, progress=None) -> dict[str, int]:
    """Write every table of the store at `db_path` (anything `open_store` accepts) to
    `out_dir/<table>.parquet` with zstd compression; returns table -> rows written. A table the source
    lacks is written empty with the contract's columns (the reader fills absent ones with NULL anyway).
    `progress(table, rows, seconds, bytes)` is called after each table is written (to its temporary name)."""
    out = Path(out_dir).expanduser()
    src = Path(db_path).expanduser()
    if src.is_dir() and out.resolve() in (src.resolve(), (src / "results").resolve()):
        raise UserError(f"--out {out} is where the source is read from; export into a different folder")
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a directory; pass a new or existing folder")
    if shards.is_shard_store(out):  # its readers take the shards, never <table>.parquet files beside them
        raise UserError(f"--out {out} is a shard store (recorded or imported runs); export into another folder")
    _refuse_foreign_out(out)
    con = open_store(src)
    counts: dict[str, int] = {}
    written: list[tuple[Path, Path]] = []  # (temporary, final) of every table written
    stale: list[Path] = []  # an optional table without rows: removed with the renames
    try:
        out.mkdir(parents=True, exist_ok=True)
        for table in TABLES:
            t0 = time.perf_counter()
            cols = _columns(con, table)
            if not cols:
                raise UserError(f"{src} has no table {table!r}; is it a mismatch-lab store?")
            final = out / f"{table}.parquet"
            if table in OPTIONAL_TABLES and not con.execute(f"SELECT count(*) FROM {table}").fetchone()[0]:
                stale.append(final)  # absent = none recorded (an earlier export's file would be stale)
                counts[table] = 0
                continue
            order = [c for c in ORDER_COLUMNS if c in cols]
            order_sql = f" ORDER BY {', '.join(order)}" if order else ""
            tmp = out / f".{table}.parquet.tmp-{os.getpid()}"
            path_sql = "'" + str(tmp).replace("'", "''") + "'"
            written.append((tmp, final))
            con.execute(
                f"COPY (SELECT * FROM {table}{order_sql}) TO {path_sql} "
                "(FORMAT parquet, COMPRESSION zstd, ROW_GROUP_SIZE 122880)"
            )
            counts[table] = int(con.execute(f"SELECT count(*) FROM {table}").fetchone()[0])
            if progress is not None:
                progress(table, counts[table], time.perf_counter() - t0, tmp.stat().st_size)
        for tmp, final in written:
            os.replace(tmp, final)
        for final in stale:
            final.unlink(missing_ok=True)
    finally:
        con.close()
        for tmp, _ in written:
            tmp.unlink(missing_ok=True)
    return counts


def _refuse_foreign_out(out: Path) -> None:
    """UserError when `out` holds Parquet files (<name>.parquet or a <table>/ folder) and is not an earlier
    export of ours: its meta.parquet records the schema_version. Nothing is written before this check."""
    import duckdb

    if not out.is_dir() or not (any(out.glob("*.parquet")) or any((out / t).is_dir() for t in TABLES)):
        return
    meta = out / "meta.parquet"
    version = None
    if meta.is_file():
        try:
            with duckdb.connect() as con:
                version = con.execute("SELECT max(value) FROM read_parquet(?) WHERE key = 'schema_version'",
                                      [str(meta)]).fetchone()[0]
        except duckdb.Error:
            version = None
    if version != SCHEMA_VERSION:
        raise UserError(f"--out {out} holds Parquet files that are not a mismatch-lab export (no meta.parquet with "
                        f"schema_version {SCHEMA_VERSION}); export into a new or empty folder, nothing was written")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", required=True, help=STORE_HELP)
    parser.add_argument("--out", required=True, help="output directory, e.g. studies/<name>/results")


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)

    def show(table: str, rows: int, seconds: float, size: int) -> None:
        print(f"  {table:<16} {rows:>11,} rows  {size / 1e6:8.2f} MB  {seconds:5.1f} s", flush=True)

    print(f"export {args.db} -> {out}/<table>.parquet (zstd)")
    counts = export(args.db, out, progress=show)
    files = [out / f"{t}.parquet" for t in counts if (out / f"{t}.parquet").is_file()]  # no empty optional table
    total = sum(f.stat().st_size for f in files)
    print(f"done: {len(files)} tables, {sum(counts.values()):,} rows, {total / 1e6:.2f} MB")
    return 0
