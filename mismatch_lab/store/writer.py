"""The one writer of a study's DuckDB file: Arrow bulk inserts, one transaction per unit of work.

Resume protocol: a run is cut into chunks (a fixed slice of prompts x samples). A chunk's sequences,
tokens and scores are inserted together with its `chunks_done` row in a single transaction, so after a
crash (Ctrl-C, kill -9) the file holds every committed chunk exactly once and nothing of the chunk in
flight. Re-running the same command asks `done_chunks(run_id)` and skips those.

DuckDB allows one writing process per file; a second writer gets `StoreBusyError` at once, not a hang.
A writer writes only into a file of ours (`schema.not_ours`: our `meta` table, or no table yet); any other
DuckDB file, or a file that is not DuckDB at all, is refused with `UserError` before a byte is written
(`check_ours`, which `collect` also calls before it loads a model).
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import pyarrow as pa

from mismatch_lab.errors import StoreBusyError, UserError
from mismatch_lab.store.schema import COLUMNS, create_schema, not_ours

# Arrow types of the DuckDB types of `schema.COLUMNS`, so DuckDB inserts without casting surprises (lists stay lists).
ARROW_OF_SQL = {
    "VARCHAR": pa.string(), "JSON": pa.string(), "BIGINT": pa.int64(), "INTEGER": pa.int32(), "DOUBLE": pa.float64(),
    "BOOLEAN": pa.bool_(), "TIMESTAMP": pa.timestamp("us"), "INTEGER[]": pa.list_(pa.int32()),
    "DOUBLE[]": pa.list_(pa.float64()), "SMALLINT": pa.int16(), "SMALLINT[]": pa.list_(pa.int16()),
    "FLOAT": pa.float32(), "FLOAT[]": pa.list_(pa.float32()),
}


def arrow_types(table: str) -> dict[str, pa.DataType]:
    """column -> Arrow type of a contract table, in contract order (from `schema.COLUMNS`)."""
    return {name: ARROW_OF_SQL[typ] for name, typ, _ in COLUMNS[table]}


RUN_TYPES = arrow_types("runs")
SEQUENCE_TYPES = arrow_types("sequences")
TOKEN_TYPES = arrow_types("tokens")
SCORE_TYPES = arrow_types("scores")
METRIC_TYPES = arrow_types("train_metrics")
ROUTING_TYPES = arrow_types("routing")
TABLE_TYPES = {"sequences": SEQUENCE_TYPES, "tokens": TOKEN_TYPES, "scores": SCORE_TYPES, "routing": ROUTING_TYPES}


@contextmanager
def transaction(con):
    """`with transaction(con):` BEGIN ... COMMIT, or ROLLBACK when the block raises (also on Ctrl-C)."""
    con.execute("BEGIN TRANSACTION")
    try:
        yield con
    except BaseException:
        con.execute("ROLLBACK")
        raise
    con.execute("COMMIT")


def to_arrow(table: str, columns: dict[str, list]) -> pa.Table:
    """Build an Arrow table for `table` from column lists; missing contract columns become NULL."""
    types = TABLE_TYPES[table]
    n = len(next(iter(columns.values()))) if columns else 0
    arrays = {}
    for name, typ in types.items():
        vals = columns.get(name)
        arrays[name] = pa.array(vals if vals is not None else [None] * n, type=typ)
    unknown = set(columns) - set(types)
    assert not unknown, f"columns outside the contract: {sorted(unknown)}"
    return pa.table(arrays)


def check_ours(path: str | Path) -> None:
    """UserError unless `path` is absent or a DuckDB file that mismatch-lab may write into (`schema.not_ours`).
    The file is opened read-only, so a file that is refused is left exactly as it was. A file another process
    holds open for writing is left to `connect_writer` (StoreBusyError)."""
    import duckdb

    path = Path(path)
    if not path.exists():
        return
    if path.is_dir():
        raise UserError(f"--db {path} is a folder; pass a .duckdb file path (a new one, or one mismatch-lab wrote)")
    try:
        con = duckdb.connect(str(path), read_only=True)
    except duckdb.ConnectionException:
        return  # this process holds it open already (a writer of ours)
    except duckdb.IOException as exc:
        if "lock" in str(exc).lower():
            return
        raise UserError(f"{path} is not a DuckDB file ({_last_line(exc)}); pass a new --db path, the file was not "
                        "changed") from exc
    try:
        why = not_ours(con)
    finally:
        con.close()
    if why is not None:
        raise UserError(f"{path} is not a mismatch-lab store: {why}; pass a new --db path (or one mismatch-lab "
                        "wrote), the file was not changed")


def _last_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[-1]


def connect_writer(path: str | Path):
    """Open (or create) the study database for writing; StoreBusyError if another process writes it,
    UserError if the file is not ours (`check_ours`)."""
    import duckdb

    path = Path(path)
    check_ours(path)
    if path.parent and not path.parent.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
    try:
        con = duckdb.connect(str(path))
    except duckdb.IOException as exc:
        if "lock" in str(exc).lower():
            raise StoreBusyError(
                f"{path} is being written by another process ({str(exc).splitlines()[-1].strip()}); "
                "wait for it to finish or pass a different --db"
            ) from exc
        raise UserError(f"cannot open {path}: {exc}; pass a writable --db path") from exc
    why = not_ours(con)  # again: a file another process held during check_ours, changed since
    if why is not None:
        con.close()
        raise UserError(f"{path} is not a mismatch-lab store: {why}; pass a new --db path (or one mismatch-lab wrote)")
    create_schema(con)
    return con


class StoreWriter:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.con = connect_writer(self.path)

    # -- runs -----------------------------------------------------------------------------------------
    def run_status(self, run_id: str) -> str | None:
        row = self.con.execute("SELECT status FROM runs WHERE run_id = ?", [run_id]).fetchone()
        return row[0] if row else None

    def start_run(self, run_id: str, *, study: str, kind: str, model: str, weights_sha256: str, engine: str,
                  engine_dtype: str, device: str, versions: dict, config: dict) -> None:
        """Insert the run as 'running', or mark an existing (interrupted/failed) run 'running' again."""
        if self.run_status(run_id) is None:
            self.con.execute(
                "INSERT INTO runs VALUES (?, ?, ?, ?, 'running', ?, ?, ?, ?, ?, ?, ?)",
                [run_id, study, kind, datetime.now(timezone.utc).replace(tzinfo=None), model, weights_sha256,
                 engine, engine_dtype, device, json.dumps(versions), json.dumps(config, default=str)],
            )
        else:
            self.set_status(run_id, "running")

    def set_status(self, run_id: str, status: str) -> None:
        self.con.execute("UPDATE runs SET status = ? WHERE run_id = ?", [status, run_id])

    def done_chunks(self, run_id: str) -> set[int]:
        return {r[0] for r in self.con.execute("SELECT chunk FROM chunks_done WHERE run_id = ?", [run_id]).fetchall()}

    # -- data -----------------------------------------------------------------------------------------
    def write_chunk(self, run_id: str, chunk: int, *, sequences: pa.Table, tokens: pa.Table, scores: pa.Table,
                    seconds: float, skipped: list[tuple[str, str]] = (), metrics: list[tuple] = (),
                    routing: pa.Table | None = None) -> None:
        """Insert one unit of work atomically; `metrics` are (step, name, value) rows for train_metrics, `routing`
        the unit's MoE routing rows (None: none recorded)."""
        con = self.con
        with transaction(con):
            for name, tbl in (("sequences", sequences), ("tokens", tokens), ("scores", scores), ("routing", routing)):
                if tbl is not None and tbl.num_rows:
                    con.register("_chunk_tbl", tbl)
                    cols = ", ".join(tbl.column_names)
                    con.execute(f"INSERT INTO {name} ({cols}) SELECT {cols} FROM _chunk_tbl")
                    con.unregister("_chunk_tbl")
            if skipped:
                con.executemany("INSERT INTO skipped_prompts VALUES (?, ?, ?)", [(run_id, p, r) for p, r in skipped])
            if metrics:
                con.executemany("INSERT INTO train_metrics VALUES (?, ?, ?, ?)", [(run_id, *m) for m in metrics])
            con.execute(
                "INSERT INTO chunks_done VALUES (?, ?, ?, ?, ?, ?)",
                [run_id, chunk, sequences.num_rows, tokens.num_rows, seconds,
                 datetime.now(timezone.utc).replace(tzinfo=None)],
            )

    def close(self) -> None:
        self.con.close()
