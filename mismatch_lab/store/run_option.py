"""`--run-id`: the one option by which `analyze`, `doctor` and `corrections` read only some runs of a store.

    mismatch-lab analyze --db STORE --run-id A --run-id B
    mismatch-lab doctor --db STORE --run-id A,B
    mismatch-lab corrections --db STORE --run-id A

Repeatable, each value one run id or a comma list of them (run ids hold no comma: `shards.check_name` refuses
one in a recorded or imported run's name, collect and train build theirs from labels and a hash). `open_runs`
opens the store knowing them (`reader.open_store(run_ids=...)`): a shard store where one of them lost a unit
to a damaged shard is refused with the file and the fix, since a result without the unit would pass for the
run's. A run id the store does not hold is a UserError naming `mismatch-lab runs`, which lists the runs.
`analyze` hands the ids to its analyses as a filter (`run_all(run_ids=...)`); `doctor` and `corrections`
read the store through `only_runs`: temporary views of every run-keyed table shadowing the store's, so each
of their measurements sees the named runs' rows alone.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from mismatch_lab.errors import UserError

if TYPE_CHECKING:
    import duckdb

HELP = "only this run (repeatable, or a comma list: --run-id A,B; default: every run; `mismatch-lab runs` lists them)"


def split_run_ids(value: str) -> list[str]:
    """'A,B' -> ['A', 'B'] (blanks around a comma dropped); argparse's error for a value naming no run."""
    ids = [v.strip() for v in value.split(",") if v.strip()]
    if not ids:
        raise argparse.ArgumentTypeError(f"{value!r} names no run; pass a run id, e.g. --run-id A")
    return ids


def add_run_id_argument(parser: argparse.ArgumentParser) -> None:
    """`--run-id` as every command taking it declares it: `args.run_ids`, a list of ids in the order given
    (each once), or None without the option."""
    parser.add_argument("--run-id", action="extend", type=split_run_ids, dest="run_ids", metavar="RUN_ID", help=HELP)


def asked_runs(args: argparse.Namespace) -> list[str] | None:
    """The run ids of `--run-id`, each once, in the order given; None without the option."""
    return list(dict.fromkeys(args.run_ids)) if args.run_ids else None


def check_run_ids(con: duckdb.DuckDBPyConnection, run_ids: list[str] | None, store) -> None:
    """UserError, one line, for a run id the store on `con` does not hold: the runs it holds (the first
    SHOWN) and the `mismatch-lab runs` command that lists them in full (`runs_command`)."""
    if not run_ids:
        return
    have = sorted(str(r[0]) for r in con.execute("SELECT DISTINCT run_id FROM runs").fetchall() if r[0] is not None)
    unknown = [r for r in run_ids if r not in have]
    if not unknown:
        return
    held = ", ".join(have[:SHOWN]) + (f" and {len(have) - SHOWN} more" if len(have) > SHOWN else "")
    raise UserError(f"--run-id {', '.join(unknown)}: no such run in {store} (it holds {held or 'no run'}); "
                    f"{runs_command(store)}")


SHOWN = 5
"""Run ids an unknown `--run-id`'s message names before it counts the rest."""


def runs_command(store) -> str:
    """The `mismatch-lab runs` command listing the runs of `store` (kind, rollout, scorers), as it reads
    them: the DuckDB file or shard store itself; a Parquet export's from the DuckDB store it was exported from."""
    from pathlib import Path

    from mismatch_lab.store.reader import study_duckdb
    from mismatch_lab.store.shards import is_shard_store

    p = Path(store).expanduser()
    p = p.parent if p.name == "study.toml" else p
    if p.is_dir() and not is_shard_store(p) and not (p / "results").is_dir():
        p = study_duckdb(p) or p
    if is_shard_store(p) or (p.is_file() and p.suffix == ".duckdb"):
        return f"`mismatch-lab runs --db {p}` lists them"
    return "`mismatch-lab runs --db <the .duckdb it was exported from>` lists them"


def only_runs(con: duckdb.DuckDBPyConnection, run_ids: list[str] | None) -> duckdb.DuckDBPyConnection:
    """`con` with a temporary view over each table of the contract keyed by run_id (store.schema), shadowing
    the store's own and keeping the rows of `run_ids` only (`con` unchanged for None). The views live with
    this connection; its cursors do not see them."""
    from mismatch_lab.analysis.relations import table_columns
    from mismatch_lab.store.schema import COLUMNS

    if not run_ids:
        return con
    db = con.execute("SELECT current_database()").fetchone()[0].replace('"', '""')
    listed = ", ".join("'" + r.replace("'", "''") + "'" for r in run_ids)  # SQL literals: a view takes no parameters
    for table, columns in COLUMNS.items():
        if any(name == "run_id" for name, _, _ in columns) and "run_id" in table_columns(con, table):
            con.execute(f'CREATE OR REPLACE TEMP VIEW {table} AS SELECT * FROM "{db}".main.{table} '
                        f"WHERE run_id::VARCHAR IN ({listed})")
    return con


def open_runs(store, run_ids: list[str] | None, *, restrict: bool = True) -> duckdb.DuckDBPyConnection:
    """The store at `store` opened for the runs `run_ids` (None: all): a damaged run among them refused
    (`reader.open_store`), an unknown one too (`check_run_ids`); with `restrict` read through `only_runs`."""
    from mismatch_lab.store.reader import open_store

    con = open_store(store, run_ids=run_ids)
    try:
        check_run_ids(con, run_ids, store)
    except UserError:
        con.close()
        raise
    return only_runs(con, run_ids) if restrict else con
