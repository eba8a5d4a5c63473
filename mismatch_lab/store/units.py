"""Per-step results of a store still being written: the app's Training page (TRAINING), token inspector
(INSPECTOR) and Overview (`units_overview`) computed per unit (run_id, step) and reused for every unit that did
not change, so that a refresh costs in proportion to the new steps.

Shard stores (`store.shards`: a Recorder's or an importer's runs). A unit is one step folder of a run in every
step table; its fingerprint (`Scan.snapshot`) is the stats (size, mtime, ctime, inode) of its files and a
digest of its run's rows without RUN_STATE (the status moves when a writer closes; what the rows label the
steps by does not). The files are known from the folders' own stats, kept for the process (`Scan`): a folder
is listed again, and its files stat'ed, only when its stat changed or when it changed less than RACY_NS
before its last listing (a file system's clock is coarse: a second change within the same tick would keep
the folder's mtime). A refresh therefore stats the store's folders (one per table, run and step) and lists
only the folders a writer touched. Missed by design: a committed file rewritten in place, without a rename
and without a change of the folder (no writer of ours does that: they write a temporary and rename it).

DuckDB stores (`collect` / `train` write one file; the app reads a snapshot copy). A unit is a (run_id, step)
of the sequences with a step; its fingerprint (`duck_fingerprints`) is, per unit, the count and the sum of
a 64-bit hash of its rows in each table, over CHECKSUM's columns (what the per-step analysis reads: the
sequences' whole rows, the tokens' μ, the scores' π), and its run's row without its status. DuckDB writers
change a step's rows by inserting or deleting them (a resumed `train` deletes and redoes its last steps, with
the same counts and other values; `score` adds a scorer's rows) or, for a sequence's reward, updating it
(`collect`; hashed with the sequence's whole row): each changes a count or a hash sum, so a cached unit is
reused exactly when the rows it reads are the same (up to a collision of the 64-bit sums). One pass of hashing over the store (0.19 CPU s on 1 M tokens and 1.5 M scores, 2-core EPYC)
against ~1 CPU s for the per-step analysis of every step.

`by_unit(source, results, name)`: the query `name` (`_queries`) on the units whose fingerprint has no cached
part (computed together, on a connection over those units alone), split by (run_id, step) and cached one entry a
unit holding every query's part (`cache.ResultsCache`); the whole table is kept in memory per store and query with the fingerprints it was
built from, so a refresh with k new units reads and concatenates k parts, not all of them. Equal to the query
on the whole store: each row of these queries is computed from the rows of one (run, step) alone.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import itertools
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from mismatch_lab.store import cache
from mismatch_lab.store.shards import MARKER, STEP_TABLES, parquet_damage

RACY_NS = 2_000_000_000
"""A folder changed less than this before it was listed is listed again at the next scan (see module doc)."""
RUN_STATE = ("status", "created_at", "updated_at")
"""Columns of a shard store's run rows that change as the run goes on (a rank closes, a job resumes) without
changing what its steps are labelled by: left out of the units' fingerprints."""
CHECKSUM = {  # table -> the columns hashed per unit of a DuckDB store (module doc); None: the whole row
    "sequences": None,
    "tokens": ("seq_id", "pos", "logp_rollout"),
    "scores": ("seq_id", "pos", "scorer", "logp", "nonfinite"),
}

ONE_THREAD_BYTES = 32 << 20
"""Units of fewer bytes than this (their shards) are read on one DuckDB thread, on a cursor of a database kept
for the process (`open_units`): 5 new steps of 5,000 tokens, 0.14 CPU s for the page's per-step queries against
0.16 s on 2 threads of a new connection."""
Unit = tuple[str, int]


# --- shard stores: the files per unit, from the folders' stats ------------------------------------------------


def _listing(folder: str) -> tuple[tuple[str, ...], tuple[tuple, ...]]:
    """(sub-folders, Parquet files with their stats) of a folder, without hidden names (temporaries, our cache)."""
    dirs, files = [], []
    with os.scandir(folder) as entries:
        for e in entries:
            if e.name.startswith("."):
                continue
            if e.is_dir():
                dirs.append(e.name)
            elif e.name.endswith(".parquet"):
                try:
                    s = e.stat()
                except FileNotFoundError:  # replaced between the listing and the stat
                    continue
                files.append((e.name, s.st_size, s.st_mtime_ns, s.st_ctime_ns, s.st_ino))
    return tuple(sorted(dirs)), tuple(sorted(files))


def _folder_key(folder: str) -> tuple[int, int, int]:
    """(mtime, ctime, inode) of a folder: adding, renaming or removing a file in it moves both times."""
    s = os.stat(folder)
    return s.st_mtime_ns, s.st_ctime_ns, s.st_ino


@dataclass(frozen=True)
class Snapshot:
    """A shard store's files as of one scan: run -> its run-row files, unit -> table -> files (name and stats)."""

    runs: dict[str, tuple]
    units: dict[Unit, dict[str, tuple]]
    fingerprints: dict[Unit, str]  # committed units only (a sequences shard: the commit point)
    store: str  # every file of the store (cache.fingerprint)


class Scan:
    """The files of one shard store, kept for the process and brought up to date from the folders' stats."""

    def __init__(self, root: Path):
        self.root = root
        self._seen: dict[str, tuple[tuple, int, tuple]] = {}  # folder -> (stat key, listed at, listing)
        self._described: dict[tuple, str] = {}  # a run's row files -> their description
        self._digests: dict[Unit, tuple[tuple, str]] = {}  # unit -> (its files, their digest)
        self._lock = threading.Lock()
        self.latest: Snapshot | None = None

    def _folder(self, folder: str) -> tuple[tuple[str, ...], tuple[tuple, ...]]:
        try:
            key = _folder_key(folder)
        except (FileNotFoundError, NotADirectoryError):
            self._seen.pop(folder, None)
            return (), ()
        old = self._seen.get(folder)
        if old is not None and old[0] == key and old[1] - key[0] > RACY_NS:
            return old[2]
        listed_at = time.time_ns()
        try:
            listing = _listing(folder)
        except (FileNotFoundError, NotADirectoryError):
            listing = ((), ())
        self._seen[folder] = (key, listed_at, listing)
        return listing

    def snapshot(self) -> Snapshot:
        with self._lock:
            root = str(self.root)
            runs = {run: self._folder(f"{root}/runs/{run}")[1] for run in self._folder(f"{root}/runs")[0]}
            units: dict[Unit, dict[str, tuple]] = {}
            for table in STEP_TABLES:
                for run in self._folder(f"{root}/{table}")[0]:
                    for step in self._folder(f"{root}/{table}/{run}")[0]:
                        files = self._folder(f"{root}/{table}/{run}/{step}")[1] if step.startswith("step-") else ()
                        if files:
                            units.setdefault((run, int(step[5:])), {})[table] = files
            digests = {unit: self._digest(unit, files) for unit, files in units.items()}
            described = {run: self._description(run, files) for run, files in runs.items()}
            fps = {unit: cache._digest((cache.code_fingerprint(), described.get(unit[0]), digests[unit]))
                   for unit, files in units.items() if "sequences" in files}
            marker = os.stat(f"{root}/{MARKER}")
            store = cache._digest((cache.code_fingerprint(), marker.st_mtime_ns, marker.st_ino, sorted(runs.items()),
                                   sorted(digests.items())))
            self.latest = Snapshot(runs, units, fps, store)
            return self.latest

    def _digest(self, unit: Unit, files: dict[str, tuple]) -> str:
        old = self._digests.get(unit)
        if old is None or old[0] != files:
            old = self._digests[unit] = (files, cache._digest(sorted(files.items())))
        return old[1]

    def _description(self, run: str, files: tuple) -> str:
        """A digest of the run's rows without RUN_STATE (engine, dtype, kind, config: what they label it by)."""
        import pyarrow.parquet as pq

        if files not in self._described:
            rows = []
            for name, *_ in files:
                with contextlib.suppress(FileNotFoundError):  # replaced since the listing: the next scan has it
                    table = pq.read_table(self.root / "runs" / run / name)
                    rows += table.drop_columns([c for c in RUN_STATE if c in table.column_names]).to_pylist()
            self._described[files] = cache._digest(rows)
        return self._described[files]

    def files(self, snap: Snapshot, units) -> dict[str, list[str]]:
        """table -> the committed files of `units` and every run-row file: what `open_units` reads. As
        `shards.committed_files`: a shard counts once its unit's sequences shard of the same name exists, and
        a damaged shard's unit (every table's shard of that name) is left out, as a whole-store read leaves it
        out."""
        out: dict[str, list[str]] = {"runs": [str(self.root / "runs" / run / f[0]) for run in sorted(snap.runs)
                                              for f in snap.runs[run]]}
        for unit in sorted(units):
            paths = self.committed(snap, unit)
            names = {p.name for ps in paths.values() for p in ps}
            names -= {p.name for ps in paths.values() for p in ps if parquet_damage(p) is not None}
            for table, ps in paths.items():
                out.setdefault(table, []).extend(str(p) for p in ps if p.name in names)
        return {t: sorted(fs) for t, fs in out.items() if fs}

    def committed(self, snap: Snapshot, unit: Unit) -> dict[str, list[Path]]:
        """table -> the committed shards of `unit` (those whose sequences shard of the same name exists)."""
        run, step = unit
        tables = snap.units.get(unit, {})
        names = {f[0] for f in tables.get("sequences", ())}
        return {t: [self.root / t / run / f"step-{step:08d}" / f[0] for f in files if f[0] in names]
                for t, files in tables.items()}


_SCANS: dict[str, Scan] = {}
_SCANS_LOCK = threading.Lock()


def scan(root: str | Path) -> Scan:
    """The process's `Scan` of the shard store at `root`."""
    root = Path(root).expanduser().resolve()
    with _SCANS_LOCK:
        return _SCANS.setdefault(str(root), Scan(root))


def _units_bytes(snap: Snapshot, units) -> int:
    return sum(f[1] for u in units for files in snap.units.get(tuple(u), {}).values() for f in files)


def open_units(root: str | Path, units, snap: Snapshot | None = None):
    """A read-only connection on the units (run_id, step) of a shard store only (and its run rows): for units
    of fewer than ONE_THREAD_BYTES a cursor of the process's one-thread database (`_small`), else a connection
    of its own."""
    from mismatch_lab.store import reader

    s = scan(root)
    snap = snap or s.snapshot()
    on = _small() if _units_bytes(snap, units) < ONE_THREAD_BYTES else None  # a refresh's few new steps
    con = reader._open_parquet_dir(s.root, s.files(snap, units), on=on)
    con.execute("SET enable_progress_bar = false")
    return con


_SMALL: list = []  # the process's one-thread database for small units (`_small`), made on first use
_SMALL_LOCK = threading.Lock()


def _small():
    """A fresh cursor of the process's in-memory database for small units: one DuckDB thread (on a few new
    steps the worker threads cost more CPU than they save), and no new database a refresh (~20 ms of CPU to
    open and close). Closed at exit (a DuckDB object alive at interpreter exit is reported as a leak)."""
    import duckdb

    with _SMALL_LOCK:
        if not _SMALL:
            _SMALL.append(duckdb.connect(config={"threads": 1}))
            atexit.register(_close_small)
        return _SMALL[0].cursor()


def _close_small() -> None:
    with _SMALL_LOCK:
        _SHUT.append(True)  # (a block still running gives its connection back: closed, not kept)
        while _HELD:
            _HELD.popitem()[1][0].close()
        while _SMALL:
            _SMALL.pop().close()


MAX_HELD = 4
"""Small connections kept after use (`ShardUnits.connection`), the last used: one a store being refreshed."""
_HELD: collections.OrderedDict = collections.OrderedDict()  # (store, units, their fps, run rows) -> (con, memo)
_SHUT: list = []  # set at exit (`_close_small`): nothing kept after it


def _take_held(key: tuple):
    """The kept connection (and its look-ups) over the files `key` names, taken out (one user at a time); None."""
    with _SMALL_LOCK:
        return _HELD.pop(key, None)


def _hold(key: tuple, con, memo: dict) -> None:
    """Keep `con` for the next block over the same files: the store's connection kept before over other files
    is closed (those units are computed), and the least recently kept past MAX_HELD."""
    with _SMALL_LOCK:
        gone = [k for k in _HELD if k[0] == key[0]]
        closing = [_HELD.pop(k)[0] for k in gone]
        if _SHUT:
            closing.append(con)
        else:
            _HELD[key] = (con, memo)
        while len(_HELD) > MAX_HELD:
            closing.append(_HELD.popitem(last=False)[1][0])
    for old in closing:
        old.close()


# --- sources of units: a shard store, a DuckDB store's open connection ----------------------------------------


class ShardUnits:
    """The units of a shard store: fingerprints from its `Scan` (the latest snapshot when it has the store
    fingerprint `fp`: the one the caller's caches are keyed by), a connection over the units asked for (their
    files as of that snapshot: nothing written after it is read)."""

    def __init__(self, root: str | Path, fp: str | None = None):
        self.scan = scan(root)
        self.key = str(self.scan.root)
        latest = self.scan.latest
        self.snap = latest if fp is not None and latest is not None and latest.store == fp else self.scan.snapshot()

    queries = ("step_series", "step_counts", "train_series", "sequences")  # what the Training page shows of a unit

    def fingerprints(self) -> dict[Unit, str]:
        return self.snap.fingerprints

    @contextlib.contextmanager
    def connection(self, units):
        """A connection over `units` as of the snapshot, inside `relations.fixed_store`. A small one (`open_units`:
        a refresh's few new steps) is kept after the block for the next block over the same files (a page's
        look-ups of one refresh each compute the same new units: one connection, not one each)."""
        from mismatch_lab.analysis.relations import fixed_store

        units = sorted(units)
        key = (self.key, tuple(units), tuple(self.snap.fingerprints.get(u) for u in units),
               tuple(sorted(self.snap.runs.items())))
        con, memo = _take_held(key) or (open_units(self.scan.root, units, self.snap), {})
        try:
            with fixed_store(con, memo):
                yield con
        except BaseException:
            con.close()
            raise
        if units and _units_bytes(self.snap, units) < ONE_THREAD_BYTES:  # (no units: the run rows alone)
            _hold(key, con, memo)
        else:
            con.close()

    def runs_described(self) -> str:
        """A digest of the store's run rows without RUN_STATE (engine, dtype, kind, config: what labels a run) as of
        the snapshot: it moves when a run is added or relabelled, not when a writer's status does."""
        return cache._digest(sorted((run, self.scan._description(run, files)) for run, files in self.snap.runs.items()))

    def like(self, cls: type[ShardUnits]) -> ShardUnits:
        """The same store as of the same snapshot, as the source `cls` reads it (another set of queries)."""
        out = cls.__new__(cls)
        out.scan, out.key, out.snap = self.scan, self.key, self.snap
        return out

    def prime(self, con) -> None:
        """Inside `relations.fixed_store(con)`: the run ids of the run rows as read from the same run-row files
        before (every connection over units reads all of them; a query of the runs view costs ~5 ms of CPU)."""
        from mismatch_lab.analysis.relations import prime, run_ids

        key = (self.key, tuple(sorted(self.snap.runs.items())))
        with _RUN_IDS_LOCK:
            found = _RUN_IDS.get(key)
        if found is not None:
            prime(con, "runs", found)
            return
        found = run_ids(con)
        with _RUN_IDS_LOCK:
            if len(_RUN_IDS) >= 64:
                _RUN_IDS.clear()
            _RUN_IDS[key] = found


_RUN_IDS: dict[tuple, list] = {}  # (store, its run-row files with their stats) -> the run ids they hold
_RUN_IDS_LOCK = threading.Lock()


class InspectorUnits(ShardUnits):
    """The units of a shard store as the token inspector reads them (`INSPECTOR`): the run list's counts, a run's
    steps and sequences; none of the per-token analyses the Training page and the Overview compute per unit."""

    queries = ("unit_counts", "scorer_counts", "step_counts", "sequences")


def duck_fingerprints(cur) -> dict[Unit, str]:
    """(run_id, step) -> the unit's checksum (module doc) on a DuckDB store's connection `cur`."""
    from mismatch_lab.analysis.relations import table_columns

    def summed(table: str, alias: str) -> str:
        have = table_columns(cur, table)
        cols = CHECKSUM[table] and [c for c in CHECKSUM[table] if c in have]  # (a column an older file lacks)
        hashed = f"hash({', '.join(f'{alias}.{c}' for c in cols)})" if cols else f"hash({alias})"
        join = "" if table == "sequences" else "JOIN q USING (run_id, seq_id)"
        source = "q" if table == "sequences" else f"{table} {alias}"
        return (f"(SELECT q.run_id, q.step, count(*) AS n, sum({hashed}) AS h FROM {source} {join} "
                f"GROUP BY ALL) {alias}")

    sql = f"""WITH q AS (SELECT * FROM sequences WHERE step IS NOT NULL),
                   r AS (SELECT run_id, hash(x) AS h FROM (SELECT * EXCLUDE (status) FROM runs) x)
              SELECT q.run_id, q.step, q.n, q.h, t.n, t.h, s.n, s.h, r.h
              FROM {summed('sequences', 'q')} LEFT JOIN {summed('tokens', 't')} USING (run_id, step)
                   LEFT JOIN {summed('scores', 's')} USING (run_id, step) LEFT JOIN r USING (run_id)"""
    code = cache.code_fingerprint()
    return {(run, int(step)): cache._digest((code, rest)) for run, step, *rest in cur.execute(sql).fetchall()}


class DuckUnits:
    """The units of a DuckDB store, on a fresh cursor `cur` of its (snapshot) connection: the units asked for
    through temporary views on that cursor (it must not serve another query meanwhile)."""

    queries = ("step_series",)  # on a DuckDB store the page's other look-ups are whole-store queries

    def __init__(self, cur, key: str):
        self.cur, self.key = cur, key

    def fingerprints(self) -> dict[Unit, str]:
        return duck_fingerprints(self.cur)

    def prime(self, con) -> None:
        """(Nothing known beforehand: `ShardUnits.prime`.)"""

    @contextlib.contextmanager
    def connection(self, units):
        cur = self.cur
        db = cur.execute("SELECT current_database()").fetchall()[0][0].replace('"', '""')
        cur.register("_ml_units", pd.DataFrame(sorted(units), columns=["run_id", "step"]).astype({"step": "int64"}))
        cur.execute(f'CREATE OR REPLACE TEMP VIEW sequences AS SELECT q.* FROM "{db}".main.sequences q '
                    "SEMI JOIN _ml_units u ON u.run_id = q.run_id AND u.step = q.step")
        for table in ("tokens", "scores"):
            cur.execute(f'CREATE OR REPLACE TEMP VIEW {table} AS SELECT x.* FROM "{db}".main.{table} x '
                        "SEMI JOIN sequences q ON q.run_id = x.run_id AND q.seq_id = x.seq_id")
        try:
            yield cur
        finally:
            for view in ("sequences", "tokens", "scores"):
                cur.execute(f"DROP VIEW IF EXISTS temp.main.{view}")
            cur.unregister("_ml_units")


# --- the per-unit queries --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class UnitQuery:
    """A query whose rows each come from one (run_id, step) and carry both columns: `fn(con)`, rows in `order`."""

    fn: Callable
    order: tuple[str, ...]


def _queries() -> dict[str, UnitQuery]:
    """The per-unit queries by name (a function: the analyses are imported when first used): the Training page's,
    the Overview's (`units_overview.QUERIES`) and the Clipping page's and inspector's (`units_clipping.QUERIES`)."""
    from mismatch_lab.analysis import steps, violations
    from mismatch_lab.store import units_clipping, units_overview

    return units_overview.QUERIES | units_clipping.QUERIES | {
        "step_series": UnitQuery(steps.step_series, ("run_id", "rollout", "scorer", "step")),
        "step_counts": UnitQuery(steps.step_counts, ("run_id", "step")),
        "train_series": UnitQuery(violations.train_series, ("run_id", "name", "step")),
        "sequences": UnitQuery(steps.step_sequences, ("run_id", "step", "seq_id")),
    }


_BUILT: dict[tuple[str, str], tuple[dict[Unit, str], pd.DataFrame]] = {}  # (store, query) -> (fingerprints, table)
_FRESH: dict[str, dict[tuple, dict]] = {}  # store -> (unit, fingerprint) -> query -> its part: the last computed
_BUILT_LOCK = threading.Lock()


def _unit_keys(frame: pd.DataFrame) -> pd.MultiIndex:
    return pd.MultiIndex.from_arrays([frame["run_id"], frame["step"].astype("int64")])


def by_unit(source, results: cache.ResultsCache, name: str) -> pd.DataFrame:
    """The query `name` (`_queries`) of the store of `source` (module doc): parts of unchanged units from memory or the results
    cache, the others computed on a connection over those units alone and cached one entry a unit. Where units
    are computed, every query of `source.queries` is, on the same connection (the Training page asks for
    each: one connection per refresh, not one per query)."""
    fps = source.fingerprints()
    with _BUILT_LOCK:
        built = _BUILT.get((source.key, name))
    if built is not None and built[0] == fps:
        return built[1]
    kept = {u for u, fp in fps.items() if built is not None and built[0].get(u) == fp}
    parts = {u: _part(source, results, name, u, fps[u]) for u in fps if u not in kept}
    todo = sorted(u for u, part in parts.items() if part is cache.MISSING)
    empty = next((p.iloc[:0] for p in [*([built[1]] if built else []), *parts.values()] if p is not cache.MISSING),
                 None)
    if todo or empty is None:
        fresh = _compute(source, results, fps, todo, name)
        parts.update(fresh[name][0])
        empty = fresh[name][1]
    old = (empty if not kept else built[1] if len(kept) == len(built[0])  # only new units: keep the whole table
           else built[1][_unit_keys(built[1]).isin(list(kept))])
    order = list(_queries()[name].order)
    found = [old, *(parts[u] for u in sorted(parts) if len(parts[u]))]
    out = pd.concat(found, ignore_index=True) if len(found) > 1 else found[0].reset_index(drop=True)
    if not _in_order(found, order):
        out = out.sort_values(order, kind="stable").reset_index(drop=True)
    with _BUILT_LOCK:
        _BUILT[(source.key, name)] = (fps, out)
    return out


def _in_order(frames: list[pd.DataFrame], order: list[str]) -> bool:
    """Whether `frames` one after the other are sorted by `order` (a stable sort would keep them as they are):
    the first is the kept table (sorted), the others a refresh's new parts, which usually come after it.
    Sorting the whole table instead took ~3 ms a look-up on 205 steps."""
    kept, *parts = frames
    last = tuple(kept[order].iloc[-1]) if len(kept) else None
    try:
        for part in (p for p in parts if len(p)):
            keys = list(zip(*(part[c].tolist() for c in order)))
            if last is not None and keys[0] < last or any(b < a for a, b in itertools.pairwise(keys)):
                return False
            last = keys[-1]
    except TypeError:  # a NULL key (None against a str): let the sort place it
        return False
    return True


def _compute(source, results: cache.ResultsCache, fps: dict[Unit, str], todo: list[Unit], name: str) -> dict:
    """query -> ({unit: its rows}, an empty frame of its columns) for the units `todo`, computed on one
    connection over them: `name`, and every other query of `source.queries` (cached one entry a unit)."""
    from mismatch_lab.analysis.relations import fixed_store

    out = {}
    with source.connection(todo) as con, fixed_store(con):
        source.prime(con)
        for q in dict.fromkeys([name, *source.queries]):
            fresh = _queries()[q].fn(con)
            split = _split(fresh, todo) if len(fresh) else {}
            empty = fresh.iloc[:0]
            out[q] = ({u: split.get(u, empty) for u in todo}, empty)
    entries = {u: {q: rows[u] for q, (rows, _) in out.items()} for u in todo}
    for unit, entry in entries.items():
        results.put(_entry(source, unit), fps[unit], entry)
    with _BUILT_LOCK:  # for the other queries' `by_unit` of the same refresh: not read back from disk
        _FRESH[source.key] = {(u, fps[u]): entry for u, entry in entries.items()}
    return out


def _split(fresh: pd.DataFrame, todo: list[Unit]) -> dict[Unit, pd.DataFrame]:
    """unit -> its rows of `fresh` (in their order, index from 0): one new unit's rows are the whole result (a
    refresh's usual); else the rows' positions per (run_id, step) taken at once (a pandas groupby over a few
    new steps cost ~3 ms a query, most of a 5-step refresh's splitting)."""
    if len(todo) == 1:
        return {todo[0]: fresh.reset_index(drop=True)}
    rows: dict[Unit, list[int]] = {}
    for i, unit in enumerate(zip(fresh["run_id"].tolist(), fresh["step"].tolist())):
        rows.setdefault((unit[0], int(unit[1])), []).append(i)
    return {u: fresh.take(ix).reset_index(drop=True) for u, ix in rows.items()}


def _entry(source, unit: Unit) -> tuple:
    """The results cache's query of one unit's entry: every query of `source.queries` on it (query -> rows)."""
    return ("units", tuple(source.queries), unit)


def _part(source, results: cache.ResultsCache, name: str, unit: Unit, fp: str):
    """The rows of the query `name` on one unit as of `fp`: just computed, else from the results cache, else
    MISSING."""
    with _BUILT_LOCK:
        entry = _FRESH.get(source.key, {}).get((unit, fp))
    if entry is None:
        entry = results.get(_entry(source, unit), fp)
    return cache.MISSING if entry is cache.MISSING or name not in entry else entry[name]


# --- the Training page of a shard store ------------------------------------------------------------------------


def train_runs(source: ShardUnits, results: cache.ResultsCache) -> pd.DataFrame:
    """`browse.train_runs` of a shard store: each run's columns from its rows (on a connection over the run rows
    and one unit of each run with steps, so that a recorded run qualifies as on the whole store), its `steps`
    and `n_sequences` from the per-unit `step_counts` (every sequence of a shard unit carries the unit's step)."""
    from mismatch_lab.analysis import browse

    counts = by_unit(source, results, "step_counts")
    by_run = counts.groupby("run_id", sort=True)
    per_run = {"steps": by_run.size(), "n_sequences": by_run["n_sequences"].sum()}
    some = [(run, int(step)) for run, step in by_run["step"].first().items()]
    key = cache._digest((sorted(source.snap.runs.items()), [source.snap.fingerprints[u] for u in some]))
    runs = results.get_or_compute(("train_runs.runs", tuple(some)), key,
                                  lambda: _on(source, some, browse.train_runs))
    out = runs.copy()
    for column in ("steps", "n_sequences"):
        out[column] = out["run_id"].map(per_run[column]).fillna(0).astype(runs[column].dtype)
    return out


def _on(source: ShardUnits, units, fn, *args, **kwargs):
    from mismatch_lab.analysis.relations import fixed_store

    with source.connection(units) as con, fixed_store(con):
        source.prime(con)
        return fn(con, *args, **kwargs)


def training_steps(source: ShardUnits, results: cache.ResultsCache, run_id: str) -> pd.DataFrame:
    """`browse.training_steps(run_id)` of a shard store, from the per-unit `step_counts`."""
    counts = by_unit(source, results, "step_counts")
    return counts[counts["run_id"] == run_id].drop(columns="run_id").reset_index(drop=True)


def train_series(source: ShardUnits, results: cache.ResultsCache) -> pd.DataFrame:
    """`violations.train_series` of a shard store, per unit (a unit's metrics carry its step)."""
    return by_unit(source, results, "train_series")


def step_series(source: ShardUnits, results: cache.ResultsCache) -> pd.DataFrame:
    """`steps.step_series` of a shard store, per unit."""
    return by_unit(source, results, "step_series")


def list_sequences(source: ShardUnits, results: cache.ResultsCache, run_id: str, *, step: int | None = None
                   ) -> pd.DataFrame:
    """`browse.list_sequences(run_id, step=step)` of a shard store: that unit's part of `steps.step_sequences`
    (computed with the unit's other parts when the unit is new); every step's (`step` None) from the kept parts."""
    from mismatch_lab.analysis import browse

    if step is None:
        seqs = by_unit(source, results, "sequences")
        found = seqs[seqs["run_id"] == run_id].sort_values("seq_id", kind="stable")
        return found.drop(columns="run_id").reset_index(drop=True)
    unit, fps = (run_id, int(step)), source.fingerprints()
    if unit not in fps:
        return _on(source, [], browse.list_sequences, run_id, step=int(step))
    part = _part(source, results, "sequences", unit, fps[unit])
    if part is cache.MISSING:
        part = _compute(source, results, fps, [unit], "sequences")["sequences"][0][unit]
    return part.drop(columns="run_id").reset_index(drop=True)


def _on_sequence(source: ShardUnits, results: cache.ResultsCache, fn, run_id: str, seq_id: int, *args):
    """`fn(con, run_id, seq_id, *args)` on a connection over the sequence's unit alone (its step from the kept
    per-unit sequences): what `browse` reads of one sequence (its tokens, scores, top-K lists) and of its prompt
    group (same run and step) lies in that unit. A sequence no unit holds: over the run rows alone (no rows).
    (`token_topk` names a top-K token by the text of any token of the store with that id: see there.)"""
    seqs = by_unit(source, results, "sequences")
    step = seqs.loc[(seqs["run_id"] == run_id) & (seqs["seq_id"] == int(seq_id)), "step"]
    unit = (run_id, int(step.iloc[0])) if len(step) and pd.notna(step.iloc[0]) else None
    fp = source.fingerprints().get(unit)
    if fp is None:
        return _on(source, [], fn, run_id, int(seq_id), *args)
    # kept under the unit's fingerprint: a refresh that adds other steps reads it back, opening no connection
    return results.get_or_compute(("unit_look_up", fn.__name__, run_id, int(seq_id), args), fp,
                                  lambda: _on(source, [unit], fn, run_id, int(seq_id), *args))


def sequence_tokens(source: ShardUnits, results: cache.ResultsCache, run_id: str, seq_id: int) -> pd.DataFrame:
    """`browse.sequence_tokens` of a shard store, on the sequence's unit alone (a whole-store read scans every
    unit's tokens for one sequence: ~0.2 CPU s on 1 M tokens)."""
    from mismatch_lab.analysis import browse

    return _on_sequence(source, results, browse.sequence_tokens, run_id, seq_id)


def token_topk(source: ShardUnits, results: cache.ResultsCache, run_id: str, seq_id: int, pos: int) -> pd.DataFrame:
    """`browse.token_topk` of a shard store: none on the sequence's unit alone means none in the store (a token's
    lists lie in its unit); where there are some, over every unit (it names a top-K token by the text of any
    token of the store with that id)."""
    from mismatch_lab.analysis import browse

    found = _on_sequence(source, results, browse.token_topk, run_id, seq_id, int(pos))
    return found if found.empty else _on(source, list(source.fingerprints()), browse.token_topk, run_id, int(seq_id),
                                         int(pos))
