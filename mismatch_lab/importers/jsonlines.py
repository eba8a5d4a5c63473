"""Fast reading of JSON-lines files into Arrow record batches, and the checks that name file:line.

The bulk path never parses a line in Python. Two readers, both against an explicit list of fields (the
other fields of a line are skipped, not converted):
* `read_batches_duckdb`: DuckDB's read_json (multi-threaded; the prime-rl importer, ~30 % less CPU
  than Arrow's reader on its exports);
* `read_batches`: `pyarrow.json.open_json` (strict about types, which the JSON-lines importer uses to
  tell the forms of its polymorphic fields apart).
The checks below then work on whole columns (list lengths, nulls) with numpy. A line-by-line Python
pass runs only to say where the input is wrong: when the reader rejects the file (bad JSON, a wrong
type), or when the number of records differs from the number of non-blank lines.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj

from mismatch_lab.errors import UserError
from mismatch_lab.importers.base import count_nonblank, line_of_row
from mismatch_lab.record.arrow import INT_RANGE, bad_token_ids
from mismatch_lab.record.flat import PROBABILITIES_FIX, describe_excess, logp_excess

BLOCK_SIZE = 64 << 20
"""Bytes of JSON per Arrow block. A line longer than a block is read again with larger blocks."""
MAX_BLOCK_SIZE = 1 << 30
DUCKDB_BATCH_ROWS = 512
"""Lines per record batch of the DuckDB reader."""


def _skip(batches: Iterator[tuple[int, pa.RecordBatch]], rows: int) -> Iterator[tuple[int, pa.RecordBatch]]:
    """The batches of a re-read after the first `rows` records, which the caller already has."""
    for row0, batch in batches:
        end = row0 + batch.num_rows
        if end <= rows:
            continue
        if row0 < rows:
            batch, row0 = batch.slice(rows - row0), rows
        yield row0, batch


def read_batches(path: Path, schema: pa.Schema, check_line: Callable[[dict], str | None] | None, n_lines: int | None,
                 block_size: int | None = None) -> Iterator[tuple[int, pa.RecordBatch]]:
    """(first row index, record batch) of `path` read against `schema`. Arrow errors become a UserError
    naming the first bad line (found by `check_line`, which returns a problem or None for a parsed object);
    with `check_line` None, a UserError without the line (the caller has a slower path that names it)."""
    if path.stat().st_size == 0:
        return
    block_size = block_size or BLOCK_SIZE
    rows = 0
    try:
        reader = pj.open_json(path, read_options=pj.ReadOptions(block_size=block_size, use_threads=True),
                              parse_options=pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore"))
        for batch in reader:
            yield rows, batch
            rows += batch.num_rows
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        if "straddl" in str(exc) and block_size < MAX_BLOCK_SIZE:  # a line longer than a block: larger blocks
            yield from _skip(read_batches(path, schema, check_line, n_lines, min(block_size * 4, MAX_BLOCK_SIZE)), rows)
            return
        if check_line is not None:
            locate_bad_line(path, check_line)
        raise UserError(f"{path}: cannot be read as JSON lines ({_first_line(exc)})") from exc
    if n_lines is not None and rows != n_lines and rows != count_nonblank(path):
        if check_line is not None:
            locate_bad_line(path, check_line)
        raise UserError(f"{path}: {rows} JSON records in {count_nonblank(path)} non-blank lines; "
                        "write one JSON object per line")


def _duckdb_type(t: pa.DataType, ints_as_double: bool) -> str:
    if pa.types.is_list(t):
        return _duckdb_type(t.value_type, ints_as_double) + "[]"
    if pa.types.is_struct(t):
        return "STRUCT(" + ", ".join(f"{f.name} {_duckdb_type(f.type, ints_as_double)}" for f in t) + ")"
    if pa.types.is_integer(t):
        return "DOUBLE" if ints_as_double else "BIGINT"
    return {pa.float64(): "DOUBLE", pa.bool_(): "BOOLEAN", pa.string(): "VARCHAR"}[t]


def read_batches_duckdb(path: Path, schema: pa.Schema, check_line: Callable[[dict], str | None], n_lines: int | None,
                        strict_ints: tuple[str, ...] = ()) -> Iterator[tuple[int, pa.RecordBatch]]:
    """As `read_batches`, parsed by DuckDB's read_json (yyjson; ~30 % less CPU than Arrow's reader on
    prime-rl exports). DuckDB converts leniently ("3" -> 3, 1.5 -> 2 for an integer), so the integer
    lists `strict_ints` are read as doubles and must hold whole numbers: a row where one does not is
    reported like any other bad row (`Problems`), through the `_ints_ok` column of the batch."""
    import duckdb

    if path.stat().st_size == 0:
        return
    cols = ", ".join(f"'{f.name}': '{_duckdb_type(f.type, f.name in strict_ints)}'" for f in schema)
    arg = str(path).replace("'", "''")
    query = (f"SELECT * FROM read_json('{arg}', format = 'newline_delimited', columns = {{{cols}}}, "
             f"maximum_object_size = {MAX_BLOCK_SIZE})")
    con = duckdb.connect()
    rows = 0
    try:
        con.execute("SET enable_progress_bar = false")
        reader = con.sql(query).to_arrow_reader(DUCKDB_BATCH_ROWS)
        for batch in reader:
            yield rows, _strict(batch, schema, strict_ints)
            rows += batch.num_rows
    except duckdb.Error as exc:
        locate_bad_line(path, check_line)
        raise UserError(f"{path}: cannot be read as JSON lines ({_first_line(exc)})") from exc
    finally:
        con.close()
    if n_lines is not None and rows != n_lines and rows != count_nonblank(path):
        locate_bad_line(path, check_line)
        raise UserError(f"{path}: {rows} JSON records in {count_nonblank(path)} non-blank lines; "
                        "write one JSON object per line")


def _strict(batch: pa.RecordBatch, schema: pa.Schema, strict_ints: tuple[str, ...]) -> pa.RecordBatch:
    """The batch in `schema`'s types: the `strict_ints` double lists back to integers, and a bool column
    `_ints_ok` saying per row whether they all held whole numbers."""
    ok = np.ones(batch.num_rows, dtype=bool)
    cols = {}
    for f in schema:
        col = batch.column(f.name)
        if f.name in strict_ints:
            flat = pc.list_flatten(col)
            values = flat.to_numpy(zero_copy_only=False)
            bad = ~np.isfinite(values) | (values != np.round(values)) | (np.abs(values) >= 2.0**62)
            if bad.any():
                ok[pc.list_parent_indices(col).to_numpy()[bad]] = False
                values = np.where(bad, 0, values)
            offsets = pc.fill_null(pc.list_value_length(col), 0).to_numpy(zero_copy_only=False).astype(np.int32).cumsum()
            col = pa.ListArray.from_arrays(pa.array(np.concatenate([[0], offsets]).astype(np.int32)),
                                           pa.array(values.astype(np.int64)), type=f.type,
                                           mask=col.is_null() if col.null_count else None)
        elif col.type != f.type:
            col = col.cast(f.type)
        cols[f.name] = col
    cols["_ints_ok"] = pa.array(ok)
    return pa.RecordBatch.from_pydict(cols)


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def locate_bad_line(path: Path, check_line: Callable[[dict], str | None]) -> None:
    """Raise UserError naming file:line of the first line that is not one valid JSON object for
    `check_line`; return when every line is fine."""
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise UserError(f"{path}:{lineno}: not valid JSON ({exc})") from None
            problem = "not a JSON object" if not isinstance(obj, dict) else check_line(obj)
            if problem:
                raise UserError(f"{path}:{lineno}: {problem}")


class Problems:
    """The first problem of a batch, by row: `add(rows_bad_mask, message)` then `raise_first()`."""

    def __init__(self, path: Path, row0: int):
        self.path, self.row0 = path, row0
        self.best: tuple[int, str] | None = None

    def add(self, bad: np.ndarray, message: str) -> None:
        bad = np.asarray(bad, dtype=bool)
        if bad.any():
            r = int(np.argmax(bad))
            if self.best is None or r < self.best[0]:
                self.best = (r, message)

    def raise_first(self) -> None:
        if self.best is not None:
            r, message = self.best
            raise UserError(f"{self.path}:{line_of_row(self.path, self.row0 + r)}: {message}")


def logp_problem(problems: Problems, values: np.ndarray, stored: np.ndarray, row_len: np.ndarray, field: str) -> None:
    """Add the rows where the log-prob field `field` ([N] `values`, `row_len` [R] per row) holds a value above
    `flat.LOGP_TOLERANCE` at a `stored` position; the message counts them over the batch."""
    bad = logp_excess(values, stored)
    if bad.any():
        rows = np.zeros(len(row_len), dtype=bool)
        rows[np.repeat(np.arange(len(row_len)), row_len)[bad]] = True
        problems.add(rows, f"field {field!r} has {describe_excess(values, bad)} in this line and the "
                           f"{len(row_len) - 1 - int(np.argmax(rows)):,} read after it: {PROBABILITIES_FIX}")


def lengths(col: pa.Array) -> np.ndarray:
    """[R] list lengths, -1 where the list is null (missing)."""
    return pc.fill_null(pc.list_value_length(col), -1).to_numpy(zero_copy_only=False).astype(np.int64)


def has_null_items(col: pa.Array) -> np.ndarray:
    """[R] whether a row's list has a null element."""
    flat = pc.list_flatten(col)
    if flat.null_count == 0:
        return np.zeros(len(col), dtype=bool)
    parents = pc.list_parent_indices(col).to_numpy()
    out = np.zeros(len(col), dtype=bool)
    out[parents[flat.is_null().to_numpy(zero_copy_only=False)]] = True
    return out


def bad_id_rows(col: pa.Array) -> np.ndarray:
    """[R] rows of a list<integer> column holding an id that is not a whole number in INT_RANGE
    (`record.arrow.bad_token_ids`; null items are reported by `has_null_items`)."""
    values = pc.list_flatten(col)
    bad = np.zeros(len(col), dtype=bool)
    if len(values) == 0:
        return bad
    flags = bad_token_ids(pc.fill_null(values, 0).to_numpy(zero_copy_only=False))
    bad[pc.list_parent_indices(col).to_numpy()[flags]] = True
    return bad


ID_TEXT = f"token ids (integers in {INT_RANGE})"
"""How errors name what a token-id field must hold."""



def check_aligned(problems: Problems, batch: pa.RecordBatch, base_len: np.ndarray, fields: dict[str, bool],
                  source_names: dict[str, str] | None = None) -> None:
    """Each list field of `fields` (name -> required) must have the length of the base field; messages name
    a column by its field in the file (`source_names`: column -> file field, where they differ)."""
    for name, required in fields.items():
        n = lengths(batch.column(name))
        field = (source_names or {}).get(name, name)
        if required:
            problems.add(n < 0, f"field {field!r} is missing (or null)")
        problems.add((n >= 0) & (n != base_len), f"field {field!r} has a different length than token_ids (misaligned)")


def flat_values(col: pa.Array, row_len: np.ndarray, dtype=np.float64) -> np.ndarray:
    """[N] the concatenated lists of `col` where each row holds `row_len` items; a null row (missing
    field) becomes NaN items (floats) - the caller has checked that non-null rows have `row_len` items."""
    flat = pc.list_flatten(col)
    values = flat.to_numpy(zero_copy_only=False)
    if values.dtype != dtype and dtype is not None:
        values = values.astype(dtype)
    if col.null_count == 0:
        return values
    valid = ~col.is_null().to_numpy(zero_copy_only=False)
    out = np.full(int(row_len.sum()), np.nan, dtype=dtype)
    out[np.repeat(valid, row_len)] = values
    return out


def is_all_null(col: pa.Array) -> bool:
    return col.null_count == len(col)


def number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_list(obj: dict, name: str, item: Callable[[object], bool], what: str, required: bool, n: int | None) -> str | None:
    """Line-level check of one list field (for `locate_bad_line`)."""
    v = obj.get(name)
    if v is None:
        return f"field {name!r} is missing (or null)" if required else None
    if not isinstance(v, list):
        return f"field {name!r} must be a list of {what}"
    if not all(item(x) for x in v):
        return f"field {name!r} must be a list of {what}"
    if n is not None and len(v) != n:
        return f"field {name!r} has a different length than token_ids (misaligned)"
    return None
