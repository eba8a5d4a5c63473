"""Row-aligned slices of a shard store's tokens and scores: the token join without a hash table.

The Recorder and the importers write a unit's tokens and scores shards from the same flat arrays: one
scores row per tokens row, in the same order. `declare` (at open_store) lists a shard store's units;
`parts` (when an analysis asks) checks from the Parquet footers that every unit's two shards hold the same
number of rows and only the run of their folder (the run_id statistics: min = max = the run, no NULL),
then offers each run's units in slices, for each slice a pair of views reading the same units' files in
the same order (`_ml_tokens_part_<k>`, `_ml_scores_part_<k>`, with every column and type of the full
`tokens` / `scores` views). A POSITIONAL JOIN of a slice's two views pairs row i with row i: where every
pair's (seq_id, pos) agree, that is the key join of the slice's rows (the run is the slice's; keys are
unique per table and scorer, as the contract has them: duplicated keys would be multiplied by the key join
and paired once here). Whoever reads the parts checks that on every row (`analysis.relations.rollout_base`
raises MISALIGNED otherwise) and then joins on keys after all. The slices let DuckDB's threads join in
parallel (one positional scan runs on one thread). On 10^7 tokens the positional join alone costs about a
third of DuckDB's hash join on 2 cores (0.5 s against 1.4-1.6 s, measured 2026-11-27 on a 2-core AMD EPYC). A store of small
slices (MIN_SLICE_ROWS) is offered none, and one unit failing the footer check turns the slices off for
the whole store. A unit with a shard cut short is not listed at all: `shards.committed_files` leaves it
out of every table when the store is opened (with a warning naming the file); a footer that cannot be
read here is a UserError pointing to `mismatch-lab runs --check`.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import duckdb

UNITS = "_ml_shard_units"
"""Table of (run_id, tokens, scores): each unit's two shard files, in the order the tables read them."""
ALIGNED_PARTS = "_ml_aligned_parts"
"""Table of (part, run_id, tokens, scores): the view names of each slice, made whole by the first `parts`
call (empty where the store offers none)."""
MISALIGNED = "mismatch-lab: the tokens and scores shards of a unit are not row-aligned"
"""The error a reader of the parts raises on a pair of rows whose keys differ (then it joins on keys)."""
PARTS_PER_THREAD = 4
"""Slices per DuckDB thread: enough for the threads to share the work when units differ in size."""
MIN_SLICE_ROWS = 1 << 18
"""Fewer rows a slice on average and no slices are offered: each slice is a branch of the query (its plan,
its scans) and a small store joins on keys in well under a second anyway (500 runs of 100 tokens took
10 s by slices against 3.5 s on keys, measured 2026-11-27 on a 2-core AMD EPYC)."""


def declare(con: duckdb.DuckDBPyConnection, root: Path, files: dict[str, list[str]]) -> None:
    """List the units of a shard store at `root` with committed `files` (shards.committed_files) in UNITS
    on `con`, where every unit has both a tokens and a scores shard (nothing is listed otherwise). Reads
    no file: `parts` checks them when first asked."""
    toks, scs = files.get("tokens", []), files.get("scores", [])
    units = [Path(f).relative_to(root / "tokens") for f in toks]
    if not toks or units != [Path(f).relative_to(root / "scores") for f in scs]:
        return
    # real paths: how parquet_metadata names the files it reads, a symlink followed by '..' included
    columns = [[u.parts[0] for u in units], [os.path.realpath(t) for t in toks], [os.path.realpath(s) for s in scs]]
    con.execute(f"CREATE TABLE {UNITS} AS SELECT unnest(?::VARCHAR[]) AS run_id, unnest(?::VARCHAR[]) AS tokens, "
                "unnest(?::VARCHAR[]) AS scores", columns)


def parts(con: duckdb.DuckDBPyConnection) -> list[tuple[str, str, str]]:
    """(run_id, tokens view, scores view) of each slice, in order; [] where the store lists no units, a
    unit's shards fail the footer check (the module docstring) or the slices would be small
    (MIN_SLICE_ROWS). Made on the first call and kept (ALIGNED_PARTS is written last, in one statement:
    a call stopped half way leaves nothing that a later call would take for the whole)."""
    try:
        return _made(con)
    except duckdb.CatalogException:
        pass
    try:
        units = con.execute(f"SELECT run_id, tokens, scores FROM {UNITS} ORDER BY rowid").fetchall()
    except duckdb.CatalogException:
        return []
    rows = _unit_rows(con)
    (threads,) = con.execute("SELECT current_setting('threads')").fetchone()
    slices = _plan(units, rows, PARTS_PER_THREAD * max(1, int(threads)))
    made = []
    if rows and sum(rows.values()) >= MIN_SLICE_ROWS * len(slices):
        full = {t: con.execute(f"DESCRIBE {t}").fetchall() for t in ("tokens", "scores")}
        for k, (run, chunk) in enumerate(slices):
            for i, table in ((1, "tokens"), (2, "scores")):
                con.execute(f"CREATE OR REPLACE VIEW _ml_{table}_part_{k} AS {_slice(con, [u[i] for u in chunk], full[table])}")
            made.append((k, run, f"_ml_tokens_part_{k}", f"_ml_scores_part_{k}"))
    if made:  # one statement: the table exists whole or not at all
        values = ", ".join(["(?::INTEGER, ?, ?, ?)"] * len(made))
        con.execute(f"CREATE TABLE {ALIGNED_PARTS} AS SELECT * FROM (VALUES {values}) v(part, run_id, tokens, scores)",
                    [x for m in made for x in m])  # fmt: skip
    else:
        con.execute(f"CREATE TABLE {ALIGNED_PARTS}(part INTEGER, run_id VARCHAR, tokens VARCHAR, scores VARCHAR)")
    return _made(con)


def _made(con: duckdb.DuckDBPyConnection) -> list[tuple[str, str, str]]:
    return [tuple(r) for r in con.execute(f"SELECT run_id, tokens, scores FROM {ALIGNED_PARTS} ORDER BY part").fetchall()]


def _unit_rows(con: duckdb.DuckDBPyConnection) -> dict[str, int]:
    """tokens file -> its rows, for every unit of UNITS, where each unit's tokens and scores shards hold
    as many rows as each other and each shard's run_id column holds its unit's run and no NULL (every row
    group's statistics: min = max = the folder's run, null count 0; a shard without them fails, but for
    row groups of no rows); {} where a unit fails. A file without row groups holds no rows. Reads the
    Parquet footers only."""
    files = [f for (f,) in con.execute(f"SELECT tokens FROM {UNITS} UNION ALL SELECT scores FROM {UNITS}").fetchall()]
    footers = """
        SELECT file_name, sum(row_group_num_rows) FILTER (WHERE column_id = 0) AS n,
               count(*) FILTER (WHERE path_in_schema = 'run_id' AND (row_group_num_rows = 0 OR
                                  stats_null_count = 0 AND stats_min_value = stats_max_value)) AS ok,
               min(stats_min_value) FILTER (WHERE path_in_schema = 'run_id' AND row_group_num_rows > 0) AS run,
               count(*) FILTER (WHERE column_id = 0) AS groups
        FROM parquet_metadata(?) GROUP BY file_name"""
    try:
        got = con.execute(f"""
            WITH f AS ({footers})
            SELECT u.tokens, coalesce(t.n, 0), coalesce(t.n, 0) = coalesce(s.n, 0)
                   AND coalesce(t.ok = t.groups AND (t.n = 0 OR t.run = u.run_id), t.n IS NULL)
                   AND coalesce(s.ok = s.groups AND (s.n = 0 OR s.run = u.run_id), s.n IS NULL)
            FROM {UNITS} u LEFT JOIN f t ON t.file_name = u.tokens LEFT JOIN f s ON s.file_name = u.scores""",
            [files]).fetchall()  # fmt: skip
    except (duckdb.IOException, duckdb.InvalidInputException) as exc:  # a footer damaged since the store was opened
        from mismatch_lab.errors import UserError

        raise UserError(f"a shard's Parquet footer cannot be read ({str(exc).strip().splitlines()[-1]}); "
                        "`mismatch-lab runs --db STORE --check` lists the damaged files and how to fix each") from exc
    return {f: int(n) for f, n, _ in got} if all(ok for _, _, ok in got) else {}


def _plan(units: list[tuple[str, str, str]], rows: dict[str, int], want: int) -> list[tuple[str, list]]:
    """(run, its units) of each slice: each run's units (UNITS rows, in order) cut into its share of `want`
    slices by rows (at least one a run)."""
    total, out = max(sum(rows.values()), 1), []
    for run, grouped in itertools.groupby(units, key=lambda u: u[0]):
        group = list(grouped)
        n = [rows.get(u[1], 0) for u in group]
        out += [(run, chunk) for chunk in _chunks(group, n, want * sum(n) / total)]
    return out


def _chunks(units: list, rows: list[int], n: float) -> list[list]:
    """`units` cut into about `n` (at least 1, at most one a unit) contiguous chunks of similar row counts."""
    n = min(len(units), max(1, round(n)))
    cum, total, out, start = 0, sum(rows), [], 0
    for i, r in enumerate(rows):
        cum += r
        if len(out) < n - 1 and cum * n >= total * (len(out) + 1) and i + 1 < len(units):
            out.append(units[start : i + 1])
            start = i + 1
    return [*out, units[start:]]


def _slice(con: duckdb.DuckDBPyConnection, paths: list[str], full: list[tuple]) -> str:
    """SQL reading `paths` in order with the columns of the full view (DESCRIBE rows `full`): a column
    these files lack is a typed NULL, one of another type is cast to the full view's."""
    from mismatch_lab.store.reader import read_files

    reader = read_files(paths)
    # names match as DuckDB matches them (union_by_name, identifiers): whatever their case
    have = {r[0].lower(): r[1] for r in con.execute(f"DESCRIBE SELECT * FROM {reader}").fetchall()}
    cols = []
    for name, typ, *_ in full:
        ident = '"' + name.replace('"', '""') + '"'
        if have.get(name.lower()) == typ:
            cols.append(ident)
        else:
            cols.append(f"CAST({ident if name.lower() in have else 'NULL'} AS {typ}) AS {ident}")
    return f"SELECT {', '.join(cols)} FROM {reader}"
