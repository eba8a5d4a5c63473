"""Row-aligned slices of a shard store's tokens and scores: the token join without a hash table.

The Recorder and the importers write a unit's tokens and scores shards from the same flat arrays: one
scores row per tokens row, in the same order. `declare` (at open_store) lists a shard store's units;
`parts` (when an analysis asks) checks from the Parquet footers that every unit's two shards hold the same
number of rows and only the run of their folder (the run_id statistics), then offers each run's units in
slices, for each slice a pair of views reading the same units' files in the same order
(`_ml_tokens_part_<k>`, `_ml_scores_part_<k>`, with every column and type of the full `tokens` / `scores`
views). A POSITIONAL JOIN of a slice's two views pairs row i with row i: where every pair's (seq_id, pos)
agree, that is the key join of the slice's rows (the run is the slice's; keys are unique per table and
scorer, as the contract has them). Whoever reads the parts checks that on every row
(`analysis.relations.rollout_base` raises MISALIGNED otherwise) and then joins on keys after all. The
slices let DuckDB's threads join in parallel (one positional scan runs on one thread). On 10^7 tokens the
positional join costs about half of DuckDB's hash join on 2 cores (docs/benchmarks.md).
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import duckdb

UNITS = "_ml_shard_units"
"""Table of (run_id, tokens, scores): each unit's two shard files, in the order the tables read them."""
ALIGNED_PARTS = "_ml_aligned_parts"
"""Table of (part, run_id, tokens, scores): the view names of each slice, made by the first `parts` call."""
MISALIGNED = "mismatch-lab: the tokens and scores shards of a unit are not row-aligned"
"""The error a reader of the parts raises on a pair of rows whose keys differ (then it joins on keys)."""
PARTS_PER_THREAD = 4
"""Slices per DuckDB thread: enough for the threads to share the work when units differ in size."""


def declare(con: duckdb.DuckDBPyConnection, root: Path, files: dict[str, list[str]]) -> None:
    """List the units of a shard store at `root` with committed `files` (shards.committed_files) in UNITS
    on `con`, where every unit has both a tokens and a scores shard (nothing is listed otherwise). Reads
    no file: `parts` checks them when first asked."""
    toks, scs = files.get("tokens", []), files.get("scores", [])
    units = [Path(f).relative_to(root / "tokens") for f in toks]
    if not toks or units != [Path(f).relative_to(root / "scores") for f in scs]:
        return
    con.execute(f"CREATE TABLE {UNITS}(run_id VARCHAR, tokens VARCHAR, scores VARCHAR)")
    rows = [[u.parts[0], os.path.abspath(t), os.path.abspath(s)] for u, t, s in zip(units, toks, scs, strict=True)]
    con.executemany(f"INSERT INTO {UNITS} VALUES (?, ?, ?)", rows)  # absolute: as parquet_metadata names them


def parts(con: duckdb.DuckDBPyConnection) -> list[tuple[str, str, str]]:
    """(run_id, tokens view, scores view) of each slice, in order; [] where the store lists no units or a
    unit's shards fail the footer check (the module docstring). The views are made on the first call."""
    try:
        return _made(con)
    except duckdb.CatalogException:
        pass
    try:
        units = con.execute(f"SELECT run_id, tokens, scores FROM {UNITS} ORDER BY rowid").fetchall()
    except duckdb.CatalogException:
        return []
    if not _footers_agree(con):
        return []
    (threads,) = con.execute("SELECT current_setting('threads')").fetchone()
    want = PARTS_PER_THREAD * max(1, int(threads))
    full = {t: con.execute(f"DESCRIBE {t}").fetchall() for t in ("tokens", "scores")}
    con.execute(f"CREATE TABLE {ALIGNED_PARTS}(part INTEGER, run_id VARCHAR, tokens VARCHAR, scores VARCHAR)")
    k = 0
    for run, group in itertools.groupby(units, key=lambda u: u[0]):
        group = list(group)
        n = min(len(group), max(1, round(want * len(group) / len(units))))
        bounds = [round(i * len(group) / n) for i in range(n + 1)]
        for a, b in itertools.pairwise(bounds):
            for i, table in ((1, "tokens"), (2, "scores")):
                con.execute(f"CREATE VIEW _ml_{table}_part_{k} AS {_slice(con, [u[i] for u in group[a:b]], full[table])}")
            con.execute(f"INSERT INTO {ALIGNED_PARTS} VALUES (?, ?, ?, ?)", [k, run, f"_ml_tokens_part_{k}", f"_ml_scores_part_{k}"])
            k += 1
    return _made(con)


def _made(con: duckdb.DuckDBPyConnection) -> list[tuple[str, str, str]]:
    return [tuple(r) for r in con.execute(f"SELECT run_id, tokens, scores FROM {ALIGNED_PARTS} ORDER BY part").fetchall()]


def _footers_agree(con: duckdb.DuckDBPyConnection) -> bool:
    """Every unit's tokens and scores shards hold as many rows as each other, and each shard's run_id
    column holds only its unit's run (min = max = the folder's run in every row group's statistics; a
    shard without statistics fails). Reads the Parquet footers only."""
    files = [f for (f,) in con.execute(f"SELECT tokens FROM {UNITS} UNION ALL SELECT scores FROM {UNITS}").fetchall()]
    footers = """
        SELECT file_name, sum(row_group_num_rows) AS n,
               bool_and(coalesce(stats_min_value = stats_max_value, false)) AS one, min(stats_min_value) AS run
        FROM parquet_metadata(?) WHERE path_in_schema = 'run_id' GROUP BY file_name"""
    (bad,) = con.execute(f"""
        WITH f AS ({footers})
        SELECT count(*) FROM {UNITS} u LEFT JOIN f t ON t.file_name = u.tokens LEFT JOIN f s ON s.file_name = u.scores
        WHERE t.n IS NULL OR s.n IS NULL OR t.n <> s.n OR NOT (t.one AND s.one AND t.run = u.run_id AND s.run = u.run_id)""",
        [files]).fetchone()  # fmt: skip
    return bad == 0


def _slice(con: duckdb.DuckDBPyConnection, paths: list[str], full: list[tuple]) -> str:
    """SQL reading `paths` in order with the columns of the full view (DESCRIBE rows `full`): a column
    these files lack is a typed NULL, one of another type is cast to the full view's."""
    from mismatch_lab.store.reader import read_files

    reader = read_files(paths)
    have = {r[0]: r[1] for r in con.execute(f"DESCRIBE SELECT * FROM {reader}").fetchall()}
    cols = []
    for name, typ, *_ in full:
        ident = '"' + name.replace('"', '""') + '"'
        if have.get(name) == typ:
            cols.append(ident)
        else:
            cols.append(f"CAST({ident if name in have else 'NULL'} AS {typ}) AS {ident}")
    return f"SELECT {', '.join(cols)} FROM {reader}"
