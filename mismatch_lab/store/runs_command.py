"""List the runs of a store, or drop one with every row it owns.

    mismatch-lab runs --db studies/precision-sweep/precision-sweep.duckdb
    mismatch-lab runs --db studies/precision-sweep/precision-sweep.duckdb --drop <run_id>

The listing gives, per run: kind, rollout engine:dtype, status, committed chunks, sequences, response
tokens and the scorers present in `scores`. Dropping deletes the run's rows from every table of the
contract that has a `run_id` column (runs, sequences, tokens, scores, train_metrics, chunks_done,
skipped_prompts) in one transaction: either all of them go or none. Use it for a run that was stopped
and will not be resumed, or one superseded by a complete re-run, before `mismatch-lab export`.
A run still being written ('running' in a store another process holds) cannot be dropped: the writer
holds the file's lock, and the command says so.

A shard store (recorded and imported runs) is listed the same way; dropping a run there removes its
folders (`shards.drop_run`): its sequences shards first, the commit points, so a reader never sees half
a run. Stop the run's writers first: a Recorder still writing would add shards again. The listing also
names the runs whose shards have no run row (left by an import of an older version stopped just after
its commit: invisible to `runs` and `analyze` otherwise), which `--drop` removes too, and warns of each
damaged shard (a file cut short: its unit is left out of the tables, `shards.committed_files`).
`--check` reads every committed file's Parquet footer and lists the damaged ones, exit status 1 if any.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mismatch_lab.errors import UserError
from mismatch_lab.store.schema import TABLES, rollout_label_sql
from mismatch_lab.store.writer import connect_writer

RUN_TABLES = tuple(t for t in TABLES if t != "meta")
"""The contract tables keyed by run_id: a run's rows live in each of these."""


def list_runs(con) -> list[dict]:
    """One dict per run, oldest first: run_id, kind, rollout, status, chunks, sequences, tokens, scorers."""
    rows = con.execute(
        f"""
        SELECT r.run_id, r.kind, {rollout_label_sql("r")} AS rollout, r.status,
               (SELECT count(*) FROM chunks_done c WHERE c.run_id = r.run_id) AS chunks,
               (SELECT count(*) FROM sequences q WHERE q.run_id = r.run_id) AS sequences,
               (SELECT count(*) FROM tokens t WHERE t.run_id = r.run_id) AS tokens,
               (SELECT string_agg(DISTINCT s.scorer, ',' ORDER BY s.scorer) FROM scores s
                 WHERE s.run_id = r.run_id) AS scorers
        FROM runs r ORDER BY r.created_at, r.run_id
        """
    ).fetchall()
    keys = ("run_id", "kind", "rollout", "status", "chunks", "sequences", "tokens", "scorers")
    return [dict(zip(keys, r)) for r in rows]


def drop_run(con, run_id: str) -> dict[str, int]:
    """Delete every row of `run_id` from the run-keyed tables in one transaction; returns table -> rows
    deleted. UserError naming the runs present if the store has no such run."""
    if con.execute("SELECT count(*) FROM runs WHERE run_id = ?", [run_id]).fetchone()[0] == 0:
        present = [r[0] for r in con.execute("SELECT run_id FROM runs ORDER BY run_id").fetchall()]
        raise UserError(f"no run {run_id!r} in this store; its runs are: {', '.join(present) or '(none)'}")
    from mismatch_lab.store.writer import transaction

    deleted: dict[str, int] = {}
    with transaction(con):
        for table in RUN_TABLES:
            # DuckDB answers a DELETE with the number of rows it removed
            deleted[table] = con.execute(f"DELETE FROM {table} WHERE run_id = ?", [run_id]).fetchone()[0]
    return deleted


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", required=True, help="the study's .duckdb file or a recorded/imported shard store "
                        "(Parquet results are read-only: drop the run in the .duckdb and export again)")
    parser.add_argument("--drop", metavar="RUN_ID", action="append", default=[],
                        help="delete this run and all its rows (repeatable)")
    parser.add_argument("--check", action="store_true",
                        help="shard stores: read the Parquet footer of every committed file and list the damaged "
                        "ones (exit status 1 when there are any)")


def _print_runs(runs: list[dict]) -> None:
    if not runs:
        print("(no runs)")
        return
    print(f"{'run_id':<52} {'kind':<8} {'rollout':<10} {'status':<9} {'chunks':>6} {'seqs':>7} {'tokens':>9}  scorers")
    for r in runs:
        print(f"{r['run_id']:<52} {r['kind'] or '':<8} {r['rollout'] or '':<10} {r['status'] or '':<9} "
              f"{r['chunks']:>6} {r['sequences']:>7} {r['tokens']:>9}  {r['scorers'] or '-'}")


def _run_shards(path: Path, drops: list[str], check: bool = False) -> int:
    from mismatch_lab.store import shards
    from mismatch_lab.store.reader import open_store

    for run_id in drops:
        present = sorted({*shards.run_ids(path), *shards.orphan_runs(path)})
        if run_id not in present:
            raise UserError(f"no run {run_id!r} in this store; its runs are: {', '.join(present) or '(none)'}")
        files = shards.drop_run(path, run_id)
        print(f"dropped {run_id}: {files} files")
    if check:
        return _check_shards(path)
    con = open_store(path)
    try:
        _print_runs(list_runs(con))
    finally:
        con.close()
    for run_id, n in shards.orphan_runs(path).items():
        print(f"orphan rows of run {run_id}: {n} shards, no run row; drop with mismatch-lab runs --db {path} "
              f"--drop {run_id}")
    return 0


def _check_shards(path: Path) -> int:
    """`runs --check`: every committed file's footer read (`shards.damaged_files`); 1 when one is damaged."""
    from mismatch_lab.store import shards

    files = shards.committed_files(path, check=False)
    bad = shards.damaged_files(path, files, footer=True)
    for d in bad:
        print(d.line())
    n = sum(len(v) for v in files.values())
    print(f"{len(bad)} damaged of {n} committed files" if bad else f"no damaged file among {n} committed files")
    return 1 if bad else 0


def run(args: argparse.Namespace) -> int:
    path = Path(args.db).expanduser()
    from mismatch_lab.store.shards import is_shard_store

    if is_shard_store(path):
        return _run_shards(path, args.drop, args.check)
    if args.check:
        raise UserError("--check reads the shards of a recorded/imported run store; a DuckDB file checks itself "
                        "when it is opened")
    if path.is_file() and path.name == "study.toml":
        path = path.parent
    if path.is_dir() and not (path / "results").is_dir():
        from mismatch_lab.store.reader import study_duckdb

        path = study_duckdb(path) or path  # a study folder holding its <name>.duckdb, as every reader opens it
    if path.is_dir() or path.suffix != ".duckdb":
        raise UserError(f"--db {path} is not a .duckdb file; runs are listed and dropped in the study's DuckDB "
                        "store (Parquet results are an export of it)")
    if not path.exists():
        raise UserError(f"--db {path} does not exist; pass the .duckdb file `mismatch-lab collect` wrote")
    con = connect_writer(path)
    try:
        for run_id in args.drop:
            deleted = drop_run(con, run_id)
            parts = ", ".join(f"{t} {n:,}" for t, n in deleted.items() if n)
            print(f"dropped {run_id}: {parts} rows")
        _print_runs(list_runs(con))
    finally:
        con.close()
    return 0
