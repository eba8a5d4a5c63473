"""Read-only access to a store, whatever form it takes. Readers never block a running collect.

`open_store(path)` accepts
  (a) a DuckDB file: opened read_only. If a running writer holds the lock, the file (and its .wal) is
      copied to a temporary directory and the copy is opened instead: a consistent snapshot of what was
      committed, while the writer goes on. The copy is removed when the process exits.
  (b) a directory of Parquet results, `<dir>/<table>.parquet` (or `<dir>/<table>/*.parquet`, e.g. hive
      partitions) for the tables of `schema.TABLES`: an in-memory DuckDB with one VIEW per table.
      A missing file gives an empty table; a contract column a file lacks reads as NULL. `key=value`
      folders count only below `<dir>/<table>/` (a store under `runs/seed=3/` gains no column `seed`).
  (c) a study directory `studies/<name>/` (or its study.toml): its `results/` directory, as in (b); a study
      without `results/` but holding the DuckDB file `collect --study` writes there: that file, as in (a)
      (the only `*.duckdb` of the folder, or `<name>.duckdb` among several). `results/` wins when both exist.
  (d) a shard store (recorded and imported runs, `store.shards`): read as (b), its `runs` folded to one
      row per run from the per-rank rows (`shards.RUNS_VIEW`); its tokens and scores are also offered
      in row-aligned slices of units (`store.aligned`), which `analyze` joins by position.
Anything else raises `UserError` naming the fix, and so does a store that is not ours or breaks the data
contract, checked once here from the schema alone (no data is scanned): a DuckDB file must hold our `meta`
table (`schema.not_ours`; a file with no table yet passes), and every table present must hold the required
columns of `schema.REQUIRED_COLUMNS` with types that fit the contract's (`schema.type_fits`).
"""

from __future__ import annotations

import atexit
import functools
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import unquote

import duckdb

from mismatch_lab.errors import UserError
from mismatch_lab.store import aligned
from mismatch_lab.store.schema import (
    DDL,
    REQUIRED_COLUMNS,
    TABLES,
    contract_type,
    not_ours,
    type_fits,
)
from mismatch_lab.store.shards import (
    RUNS_VIEW,
    Damaged,
    committed_files,
    is_shard_store,
)

STORE_HELP = ("the store: a .duckdb file (a running collect is fine), a directory of <table>.parquet files, a "
              "study directory or a recorded/imported run store")
"""The --db help of every command that reads a store (what `open_store` accepts)."""
ACCEPTED = (
    "pass a .duckdb file, a directory holding <table>.parquet files, a study directory "
    "(studies/<name>/ with a results/ folder or its <name>.duckdb) or a recorded/imported run store"
)
READER_MEMORY_LIMIT = "3GB"
"""DuckDB's own default is 80 % of RAM, which a reader could take from a collect running beside it. At
3 GB `analyze` of 10^7 tokens still runs in memory (peak RSS ~3.3 GB, docs/analysis.md); larger stores
spill to a private temporary directory instead of failing."""
DAMAGED = "_ml_damaged_units"
"""Table of (run_id, path, line): the damaged files of a shard store whose units its reader left out."""
FILLED_COLUMNS = "_ml_filled_columns"
"""Table of (table_name, column_name): the contract columns a Parquet store lacks, which its views fill
with typed NULLs. `analysis.relations.table_columns` reports them absent, so the analyses neither read
nor materialise columns that hold nothing."""
SNAPSHOT_TRIES = 3  # a copy taken while the writer checkpoints can be torn; a retry a moment later is not


def open_store(path: str | Path, run_ids: list[str] | None = None, *, snapshot: bool = False
               ) -> duckdb.DuckDBPyConnection:
    """A read-only DuckDB connection on the store at `path` (module docstring). `run_ids`: the runs a command
    was asked for by name; a shard store where one of them lost a damaged unit is refused (UserError naming
    the file and the fix) instead of read without it (`damaged_units`). `snapshot`: a DuckDB file is always
    read from a snapshot copy, so the connection holds no lock on it (the app keeps its connection open for
    a session: a read-only connection on the file itself would keep `collect`, `train` or `runs --drop`
    from opening it for writing)."""
    con = _open(Path(path).expanduser(), run_ids, snapshot)
    con.execute("SET enable_progress_bar = false")  # DuckDB's bar would garble CLI tables and app logs
    con.execute(f"SET memory_limit = '{READER_MEMORY_LIMIT}'")
    # spill files go to a private folder, not beside the store (a study folder may be read-only)
    spill = tempfile.mkdtemp(prefix="mismatch-lab-spill-")
    atexit.register(shutil.rmtree, spill, True)
    con.execute("SET temp_directory = ?", [spill])
    return con


def _open(p: Path, run_ids: list[str] | None = None, snapshot: bool = False) -> duckdb.DuckDBPyConnection:
    if p.is_file() and p.name == "study.toml":
        p = p.parent
    if p.is_file():
        return _open_file(p, snapshot)
    if p.is_dir():
        if (p / "results").is_dir():
            return _open_parquet_dir(p / "results")
        if is_shard_store(p) or _parquet_sources(p):  # (a shard store's files are listed and checked once)
            return _open_parquet_dir(p, run_ids=run_ids)
        db = study_duckdb(p)
        if db is not None:
            return _open_file(db, snapshot)
        raise UserError(f"{p} holds neither <table>.parquet files, a results/ folder nor a .duckdb file; {ACCEPTED}")
    raise UserError(f"no such file or directory: {p}; {ACCEPTED}")


def study_duckdb(d: Path) -> Path | None:
    """The DuckDB store of a study folder `d` (what `collect --study d/study.toml` writes by default): its only
    `*.duckdb` file, or `<folder name>.duckdb` among several; None where it holds none. Several others:
    UserError naming them."""
    dbs = sorted(x for x in d.glob("*.duckdb") if x.is_file())
    if len(dbs) <= 1:
        return dbs[0] if dbs else None
    named = d / f"{d.resolve().name}.duckdb"
    if named in dbs:
        return named
    raise UserError(f"{d} holds several DuckDB files ({', '.join(x.name for x in dbs)}); pass one of them as the store")


def _open_file(p: Path, snapshot: bool = False) -> duckdb.DuckDBPyConnection:
    con = _open_snapshot(p) if snapshot else _connect_file(p)
    try:
        why = not_ours(con)
        if why is not None:
            raise UserError(f"{p} is not a mismatch-lab store: {why}; pass a store that mismatch-lab wrote "
                            "(collect, train, export, import); the file was not changed")
        rows = con.execute("SELECT table_name, column_name, data_type FROM information_schema.columns "
                           "WHERE table_schema = 'main' AND table_catalog = current_database()").fetchall()
        described: dict[str, dict[str, str]] = {}
        for table, column, typ in rows:
            described.setdefault(table, {})[column] = typ
        for table, columns in described.items():
            check_columns(p, table, columns)
    except BaseException:
        con.close()
        raise
    return con


def check_columns(where: Path, table: str, columns: dict[str, str]) -> None:
    """UserError unless the `table` of the store at `where`, holding `columns` (name -> DuckDB type), has every
    required column of the contract (`schema.REQUIRED_COLUMNS`) with a type that fits (`schema.type_fits`)."""
    for column in REQUIRED_COLUMNS.get(table, ()):
        expected = contract_type(table, column)
        fix = (f"write {table}.{column} as {expected} (docs/design.md, \"The data contract\") and open the store "
               "again")
        if column not in columns:
            raise UserError(f"{where}: the {table} table has no column {column} ({expected}), which the data "
                            f"contract requires; {fix}")
        found = columns[column].strip('"')
        if not type_fits(found, expected):
            raise UserError(f"{where}: column {table}.{column} is {found}, the data contract needs {expected}; {fix}")


def _connect_file(p: Path) -> duckdb.DuckDBPyConnection:
    try:
        return duckdb.connect(str(p), read_only=True)
    except duckdb.IOException as exc:
        if "lock" not in str(exc).lower():
            raise UserError(f"cannot read {p} as a DuckDB store ({_last_line(exc)}); {ACCEPTED}") from exc
    except duckdb.ConnectionException:
        pass  # this process already holds it open for writing: read a snapshot, as from another process
    except duckdb.Error as exc:
        raise UserError(f"cannot read {p} as a DuckDB store ({_last_line(exc)}); {ACCEPTED}") from exc
    return _open_snapshot(p)


def _open_snapshot(p: Path) -> duckdb.DuckDBPyConnection:
    last: Exception | None = None
    for attempt in range(SNAPSHOT_TRIES):
        tmp = Path(tempfile.mkdtemp(prefix="mismatch-lab-snapshot-"))
        atexit.register(shutil.rmtree, tmp, True)
        copy = tmp / p.name
        shutil.copyfile(p, copy)
        wal = p.with_name(p.name + ".wal")
        if wal.exists():
            shutil.copyfile(wal, tmp / wal.name)
        try:
            return duckdb.connect(str(copy), read_only=True)
        except duckdb.Error as exc:
            last = exc
            time.sleep(0.5 * (attempt + 1))
    raise UserError(
        f"{p} is being written and a snapshot of it could not be read ({_last_line(last)}); "
        "retry in a moment, or analyse an exported results/ directory"
    )


def _unreadable(d: Path, table: str, files: dict[str, list[str]] | None, exc: Exception) -> str:
    """The message for a table DuckDB cannot read: in a shard store, the first of its files that DuckDB cannot
    read on its own, named with its run and the fix (a file whose ends are intact but whose inside is not, which
    the open-time check does not see); in an exported store, the re-export."""
    for path in (files or {}).get(table, []):
        try:
            duckdb.sql(f"DESCRIBE SELECT * FROM read_parquet({_quote(path)})").fetchall()
        except duckdb.Error as one:
            return Damaged(d, table, path, _last_line(one)).line() + f"; `mismatch-lab runs --db {d} --check` lists every one"
    return f"cannot read the {table} table of {d} as Parquet ({_last_line(exc)}); re-export the store"


def _quote(path: str) -> str:
    return "'" + path.replace("'", "''") + "'"


def read_files(files: list[str]) -> str:
    """SQL reading the Parquet `files` in order as one relation (their columns by name, no hive keys)."""
    return f"read_parquet([{', '.join(_quote(f) for f in files)}], union_by_name = true, hive_partitioning = false)"


def _parquet_sources(
    d: Path, contract: dict[str, list[tuple[str, str]]] | None = None, shard_files: dict[str, list[str]] | None = None
) -> dict[str, str]:
    """table -> a relation (SQL) reading the table's Parquet files in directory d. A shard store is read
    from its committed shards only (`shards.committed_files`): a unit whose commit a crash cut short is
    invisible until it is written again. DuckDB's own hive parsing is off everywhere: it reads `key=value`
    from every folder of the absolute path, so a store under `.../seed=3/` would gain a column `seed` (or
    have `step` overwritten); a partitioned table folder gets its keys from below the folder only."""
    out = {}
    if is_shard_store(d):
        files = committed_files(d) if shard_files is None else shard_files
        return {table: read_files(paths) for table, paths in files.items()}
    for table in TABLES:
        if (d / f"{table}.parquet").is_file():
            out[table] = f"read_parquet({_quote(str(d / f'{table}.parquet'))}, hive_partitioning = false)"
        elif (d / table).is_dir() and any((d / table).rglob("*.parquet")):
            out[table] = _hive_folder(d / table, dict((contract or _contract_columns())[table]))
    return out


def _hive_folder(folder: Path, types: dict[str, str]) -> str:
    """A relation over every Parquet file below `folder` plus one column per `key=value` folder name
    below it (table/scorer=hf:fp32/...), URL-decoded and typed as the contract column of that name (else
    VARCHAR); as in hive partitioning, a key replaces a file column of the same name (in the files below
    such a folder; files elsewhere keep their own values). A value that is not of its column's type is a
    UserError naming the folder."""
    folder = Path(os.path.abspath(folder))  # DuckDB reports file names normalised ('..' resolved)
    values: dict[str, set[str]] = {}
    for f in folder.rglob("*.parquet"):
        for part in f.relative_to(folder).parent.parts:
            if "=" in part:
                key, value = part.split("=", 1)
                values.setdefault(key, set()).add(unquote(value))
    reader = (f"read_parquet({_quote(str(folder / '**' / '*.parquet'))}, union_by_name = true, "
              "hive_partitioning = false, filename = '_ml_file')")
    scratch = duckdb.connect()
    try:
        present = {r[0] for r in scratch.execute(f"DESCRIBE SELECT * FROM {reader}").fetchall()}
        for key, vals in values.items():
            typ = types.get(key, "VARCHAR")
            vals = sorted(v for v in vals if v not in ("", "__HIVE_DEFAULT_PARTITION__"))
            bad = scratch.execute(f"SELECT v FROM unnest(?::VARCHAR[]) t(v) WHERE TRY_CAST(v AS {typ}) IS NULL",
                                  [vals]).fetchall()
            if bad:
                raise UserError(f"{folder}: the folder {key}={bad[0][0]} does not hold a {typ} value ({key} is a {typ} "
                                "column of the contract); rename the partition folder")
    except duckdb.Error as exc:
        raise UserError(f"cannot read {folder} as Parquet ({_last_line(exc)}); re-export the store") from exc
    finally:
        scratch.close()
    below = f"replace(substr(_ml_file, {len(str(folder)) + 2}), '\\', '/')"  # the path below the folder

    def pattern(key: str) -> str:
        return _quote(f"(^|/){re.escape(key)}=([^/]*)/")

    def value(key: str) -> str:
        raw = f"url_decode(regexp_extract({below}, {pattern(key)}, 2))"
        return f"TRY_CAST(nullif(nullif({raw}, ''), '__HIVE_DEFAULT_PARTITION__') AS {types.get(key, 'VARCHAR')})"

    def name(key: str) -> str:
        return '"' + key.replace('"', '""') + '"'

    replaced = [f"CASE WHEN regexp_matches({below}, {pattern(k)}) THEN {value(k)} ELSE {name(k)} END AS {name(k)}"
                for k in values if k in present]
    added = "".join(f", {value(k)} AS {name(k)}" for k in values if k not in present)
    star = "* EXCLUDE (_ml_file)" + (f" REPLACE ({', '.join(replaced)})" if replaced else "")
    return f"(SELECT {star}{added} FROM {reader})"


@functools.cache
def _contract_columns() -> dict[str, list[tuple[str, str]]]:
    """table -> [(column, type)] of the DDL, read from a scratch in-memory database (once per process: 30 ms a
    time, and the app opens a connection per refresh of a store being written; callers only read it)."""
    scratch = duckdb.connect()
    try:
        for stmt in DDL:
            scratch.execute(stmt)
        rows = scratch.execute(
            "SELECT table_name, column_name, data_type FROM information_schema.columns "
            "WHERE table_schema = 'main' ORDER BY table_name, ordinal_position"
        ).fetchall()
    finally:
        scratch.close()
    out: dict[str, list[tuple[str, str]]] = {}
    for table, column, typ in rows:
        out.setdefault(table, []).append((column, typ))
    return out


def _open_parquet_dir(d: Path, files: dict[str, list[str]] | None = None,
                      run_ids: list[str] | None = None, on: duckdb.DuckDBPyConnection | None = None
                      ) -> duckdb.DuckDBPyConnection:
    """`files` (a shard store only): read these committed files instead of all (the app's cache, store/cache.py).
    `run_ids`: refuse the store when a damaged unit of one of these runs was left out (`open_store`). `on`: a
    fresh cursor of a database that such calls share (`store.units`: a new connection costs ~20 ms of CPU),
    returned with the store's tables and views as its temporary ones (closing it drops them), without the
    row-aligned slices (`aligned`: for large stores, which get a connection of their own)."""
    contract = _contract_columns()
    shards = is_shard_store(d)
    damaged: list[Damaged] = []
    files = (committed_files(d, damaged=damaged) if files is None else files) if shards else None
    _damage_notice(damaged, run_ids)
    sources = _parquet_sources(d, contract, files)
    con, temp = (duckdb.connect(), "") if on is None else (on, "TEMP ")
    script = [f"CREATE {temp}TABLE {FILLED_COLUMNS}(table_name VARCHAR, column_name VARCHAR)",
              f"CREATE {temp}TABLE {DAMAGED}(run_id VARCHAR, path VARCHAR, line VARCHAR)"]
    script += [f"INSERT INTO {DAMAGED} VALUES ({_quote(x.run_id)}, {_quote(x.path)}, {_quote(x.line())})"
               for x in damaged]
    for table in TABLES:
        src = sources.get(table)
        if src is None:
            script.append(next(s for s in DDL if _ddl_table(s) == table).replace("CREATE TABLE", f"CREATE {temp}TABLE", 1))
            continue
        reader = src
        try:
            present = {r[0]: r[1] for r in con.execute(f"DESCRIBE SELECT * FROM {reader}").fetchall()}
            check_columns(d, table, present)
        except duckdb.Error as exc:
            con.close()
            raise UserError(_unreadable(d, table, files, exc)) from exc
        except UserError:
            con.close()
            raise
        absent = [(name, typ) for name, typ in contract[table] if name not in present]
        if absent:  # (a recorded run lacks ~20 columns)
            script.append(f"INSERT INTO {FILLED_COLUMNS} VALUES "
                          + ", ".join(f"({_quote(table)}, {_quote(name)})" for name, _ in absent))
        select = f"SELECT *{''.join(f', NULL::{typ} AS {name}' for name, typ in absent)} FROM {reader}"
        if table == "runs" and shards:
            firsts = ", ".join(f"arg_min_null({name}, rank) AS {name}" for name, _ in contract["runs"]
                               if name not in ("run_id", "status"))
            select = RUNS_VIEW.format(firsts=firsts, source=f"({select})")
        script.append(f"CREATE {temp}VIEW {table} AS {select}")
    con.execute(";\n".join(script))  # one call: ~15 statements cost ~0.2 ms each when sent one by one
    if shards and on is None:
        aligned.declare(con, d, files)
    return con


def _damage_notice(damaged: list[Damaged], run_ids: list[str] | None) -> None:
    """UserError for the first damaged file of a run asked for by name (a result without its unit would be
    taken for the run's); else one warning a file (the unit is read without)."""
    for x in damaged:
        if run_ids and x.run_id in run_ids:
            raise UserError(f"run {x.run_id!r} is incomplete: {x.line()}; then ask for it again")
    for x in damaged:
        print(f"warning: {x.line()}; read without it", file=sys.stderr)


def damaged_units(con: duckdb.DuckDBPyConnection) -> list[tuple[str, str, str]]:
    """(run_id, path, line naming the fix) of each damaged shard whose unit the reader left out of the store
    on `con`, by run; [] for a store without (and for every store that is not a shard store)."""
    if not con.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name = ?", [DAMAGED]).fetchone()[0]:
        return []
    return con.execute(f"SELECT run_id, path, line FROM {DAMAGED} ORDER BY run_id, path").fetchall()


def _ddl_table(stmt: str) -> str:
    return stmt.split("EXISTS", 1)[1].split("(", 1)[0].strip()


def _last_line(exc: BaseException | None) -> str:
    """The message's last line, without DuckDB's 'LINE n:' excerpt of the query (and its caret line)."""
    return str(exc).strip().split("\n\nLINE ")[0].splitlines()[-1] if exc else "unknown error"
