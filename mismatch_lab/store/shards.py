"""A store as a directory of Parquet shards: how recorded and imported runs are written.

    STORE/
      mismatch-lab-store.json                          marker: format and schema version
      runs/<run_id>/rank-<R>.parquet                   one row per (run, writer rank), replaced when its status moves
      sequences/<run_id>/step-<N>/<shard>.parquet      the contract's tables, one file per written unit
      tokens/<run_id>/step-<N>/<shard>.parquet
      scores/<run_id>/step-<N>/<shard>.parquet
      routing/<run_id>/step-<N>/<shard>.parquet        MoE routing, only in units that hold some (absent: none)
      train_metrics/<run_id>/step-<N>/<shard>.parquet

`reader.open_store(STORE)` reads it as the contract's tables: each table is the union of its shards, and
`runs` is folded to one row per run (`RUNS_VIEW`). `analyze --db STORE`, `figures STORE` and
`app --study STORE` therefore take it as they take a study.

Why it is safe to write without a lock or a server:
* append-only, one file per unit: a writer never opens an existing shard. A unit (a step's sequences,
  tokens, scores, routing and metrics of one writer call) is first written under temporary names
  (`.<name>.tmp-*`, which no reader globs), fsynced, then renamed into place, `sequences` last: the
  rename of the sequences shard is the unit's commit point, and readers take a tokens/scores/metrics
  shard only when the sequences shard of the same name exists (`committed_files`). A killed writer
  leaves at most files of the unit in flight, which no reader sees (the next writer holding their lock
  removes them, `remove_stale_tmp`); earlier shards are never touched.
* multi-rank: shard names carry the writer's name (`rank-<R>-...` for the Recorder, `import-<digest>`
  for an importer), so ranks and processes never write the same file.
* idempotent: writing a unit whose sequences shard already exists under the same name is skipped
  (`Transaction.committed`): re-importing the same files adds nothing twice.
* signals: a commit's renames run with SIGINT/SIGTERM deferred (`signals_deferred`), so a signal never
  stops them half way; an import, which commits many units at once, defers them from its run row to its
  last rename and keeps a journal of the renames that its next run replays after a SIGKILL
  (`replay_journal`).
* damage: a committed file cut short (a node died while its data was written) is found from its first
  and last bytes when the store is opened, and its unit left out with a warning (`committed_files`,
  `parquet_damage`); `mismatch-lab runs --check` parses every footer.
The one exception: an import numbers its sequences after the highest index the run already holds, so two
imports into one run at the same time would pick the same ids. An import holds `run_lock` for its run (a
kernel file lock on `.import-<run_id>.lock`, gone with the process however it ends), and a second one
stops with an error instead. Likewise a Recorder holds `.record-rank-<R>-<run_id>.lock` while it is open:
two live writers of one rank would replace each other's steps.
Directory names hold no `=`: the reader's hive-partition parsing must not invent columns from them.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import socket
import sys
import threading
import uuid
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Self

from mismatch_lab.errors import UserError
from mismatch_lab.store.schema import SCHEMA_VERSION

MARKER = "mismatch-lab-store.json"
FORMAT = "parquet-shards"
STEP_TABLES = ("sequences", "tokens", "scores", "routing", "train_metrics")
"""Tables written per step unit (a unit may lack `routing` and `train_metrics`: none recorded); committed in
COMMIT_ORDER, `sequences` last (see module docstring)."""
COMMIT_ORDER = ("tokens", "scores", "routing", "train_metrics", "sequences")
COMPRESSION = "zstd"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,199}$")

RUNS_VIEW = """
    SELECT run_id,
           {firsts},
           CASE WHEN bool_or(status = 'failed') THEN 'failed'
                WHEN bool_and(status = 'complete') THEN 'complete'
                ELSE 'running' END AS status,
           count(*) AS n_ranks, max(updated_at) AS updated_at
    FROM {source} GROUP BY run_id"""
"""One row per run from its per-rank rows: descriptive columns from the lowest rank; the run is
'complete' when every rank that started it closed it, 'failed' when one failed, else 'running';
`n_ranks` counts the writers that wrote a runs row (Recorder ranks; an import writes one row, whatever
ranks its files name)."""


def check_name(name: str, what: str = "run name") -> str:
    """A run id or shard name usable as one path component; UserError naming the fix otherwise."""
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise UserError(
            f"{what} {name!r} is not usable: use letters, digits and . _ + - only (no '/', '=', spaces), "
            "at most 200 characters, starting with a letter or digit"
        )
    return name


def is_shard_store(path: str | Path) -> bool:
    return (Path(path) / MARKER).is_file()


def init_store(root: str | Path) -> Path:
    """Create (or accept) a shard store at `root`; refuses a directory that is something else."""
    root = Path(root).expanduser()
    if root.exists() and not root.is_dir():
        raise UserError(f"{root} exists and is not a directory; pass a new or existing store directory")
    if root.is_dir() and not is_shard_store(root) and any(root.iterdir()):
        raise UserError(
            f"{root} is a non-empty directory that is not a mismatch-lab shard store (no {MARKER}); "
            "pass a new directory or an existing store"
        )
    root.mkdir(parents=True, exist_ok=True)
    if not is_shard_store(root):
        marker = json.dumps({"format": FORMAT, "schema_version": SCHEMA_VERSION}, indent=1) + "\n"
        _atomic_bytes(root / MARKER, marker.encode())  # every rank writes the same bytes: a race is harmless
    return root


def committed_files(root: str | Path, check: bool = True, damaged: list | None = None) -> dict[str, list[str]]:
    """table -> its committed shard files (sorted): every runs file, and the step-table shards whose unit
    has its sequences shard (the commit point). Tables without a committed file are absent. `check`:
    leave out the files `damaged_files` finds cut short (their whole unit: every table's shard of that
    name and step), each with a warning on stderr naming it and the fix, so the store's other units and
    runs stay readable; with a `damaged` list, the `Damaged` files go there instead of the warnings (the
    reader refuses a run asked for by name that lost a unit, `reader.open_store`)."""
    root = Path(root)
    out: dict[str, list[str]] = {}
    runs = sorted(str(p) for p in root.glob("runs/*/*.parquet"))
    if runs:
        out["runs"] = runs
    done = {p.relative_to(root / "sequences") for p in root.glob("sequences/*/step-*/*.parquet")}
    for table in STEP_TABLES:
        files = sorted(str(p) for p in root.glob(f"{table}/*/step-*/*.parquet")
                       if p.relative_to(root / table) in done)
        if files:
            out[table] = files
    if check:
        bad = damaged_files(root, out)
        for d in bad:
            if damaged is None:
                print(f"warning: {d.line()}; read without it", file=sys.stderr)
            else:
                damaged.append(d)
        out = _without_units(root, out, {d.unit for d in bad})
    return out


PARQUET_MAGIC = b"PAR1"


def parquet_damage(path: str | Path, footer: bool = False) -> str | None:
    """Why the file at `path` is not a whole Parquet file (a node died while writing it, the disk lost
    its end), or None. Reads its first 4 and last 8 bytes: the magic at both ends and a footer length
    that fits (a file cut short ends in data bytes); with `footer`, also parses the footer (pyarrow)."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            head, tail = os.pread(fd, 4, 0), os.pread(fd, 8, max(size - 8, 0))
        finally:
            os.close(fd)
    except FileNotFoundError:  # removed since it was listed (a resumed writer replacing its step): not damage
        return None
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    if size < 12 or head != PARQUET_MAGIC or tail[4:] != PARQUET_MAGIC:
        return f"cut short: {size:,} bytes without a Parquet footer at the end"
    if int.from_bytes(tail[:4], "little") + 12 > size:
        return f"cut short: {size:,} bytes, fewer than its footer says"
    if footer:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            pq.read_metadata(path)
        except (OSError, pa.ArrowException) as exc:
            return f"its Parquet footer cannot be read ({str(exc).splitlines()[0]})"
    return None


class Damaged:
    """A damaged file of a shard store (`parquet_damage`): its path, why, and its unit (a path below a
    table folder: '<run>/step-<N>/<name>.parquet'; for a runs row '<run>/rank-<R>.parquet')."""

    def __init__(self, root: Path, table: str, path: str, why: str):
        self.root, self.table, self.path, self.why = root, table, path, why
        self.unit = Path(path).relative_to(root / table)
        self.run_id = self.unit.parts[0]

    def fix(self) -> str:
        drop = f"`mismatch-lab runs --db {self.root} --drop {self.run_id}`"
        if self.table == "runs" or self.unit.name.startswith("import-"):
            return f"drop the run ({drop}) and import or log it again"
        step = self.unit.parent
        return (f"delete it with the unit's other files ({self.root}/*/{step}/{self.unit.name}) and log step "
                f"{int(step.name.removeprefix('step-'))} again, or drop the run ({drop})")

    def line(self) -> str:
        return f"damaged shard {self.path} of run {self.run_id!r} ({self.why}): {self.fix()}"


def damaged_files(root: Path, files: dict[str, list[str]], footer: bool = False) -> list[Damaged]:
    """The `files` (table -> paths, as `committed_files` lists them) that `parquet_damage` finds damaged."""
    return [Damaged(Path(root), table, f, why) for table, paths in files.items() for f in paths
            if (why := parquet_damage(f, footer)) is not None]


def _without_units(root: Path, files: dict[str, list[str]], units: set[Path]) -> dict[str, list[str]]:
    """`files` without those of the given units (paths below a table folder) in any table."""
    if not units:
        return files
    out = {t: [f for f in paths if Path(f).relative_to(root / t) not in units] for t, paths in files.items()}
    return {t: paths for t, paths in out.items() if paths}


def orphan_runs(root: str | Path) -> dict[str, int]:
    """run -> its shard files, for the runs whose step-table folders hold shards but which have no runs
    row (an import of an older version stopped by a signal just after its commit removed the row)."""
    root = Path(root)
    rows = set(run_ids(root))
    out: dict[str, int] = {}
    for table in STEP_TABLES:
        for folder in (root / table).glob("*"):
            if folder.is_dir() and folder.name not in rows:
                n = sum(1 for _ in folder.glob("step-*/*.parquet"))
                if n:
                    out[folder.name] = out.get(folder.name, 0) + n
    return dict(sorted(out.items()))


def run_ids(root: str | Path) -> list[str]:
    """The runs of a shard store (those with a runs row)."""
    return sorted(p.name for p in (Path(root) / "runs").glob("*") if p.is_dir())


def drop_run(root: str | Path, run_id: str) -> int:
    """Remove every file of `run_id`, sequences first (the commit points: readers stop seeing the run's
    units at once), runs last; returns how many files were removed."""
    import shutil

    root = Path(root)
    check_name(run_id)
    n = 0
    for table in ("sequences", *(t for t in COMMIT_ORDER if t != "sequences"), "runs"):
        folder = root / table / run_id
        if folder.is_dir():
            n += sum(1 for p in folder.rglob("*") if p.is_file())
            shutil.rmtree(folder)
    return n


def step_dir(root: Path, table: str, run_id: str, step: int) -> Path:
    """The folder of one (table, run, step): every rank's shards of the step."""
    return root / table / run_id / f"step-{int(step):08d}"


def shard_path(root: Path, table: str, run_id: str, step: int, name: str) -> Path:
    return step_dir(root, table, run_id, step) / f"{name}.parquet"


def rank_prefix(rank: int) -> str:
    """The start of every file name one rank writes ('rank-00003'): its shards and its runs row."""
    return f"rank-{int(rank):05d}"


def run_row_path(root: Path, run_id: str, rank: int) -> Path:
    """The runs row one rank writes for a run (`write_run_row`)."""
    return root / "runs" / run_id / f"{rank_prefix(rank)}.parquet"


def existing_run(root: Path, run_id: str) -> dict | None:
    """The stored runs row of `run_id` of its lowest rank, or None when the store does not hold the run."""
    import pyarrow.parquet as pq

    rows = sorted((root / "runs" / run_id).glob("rank-*.parquet"))
    return pq.read_table(rows[0]).to_pylist()[0] if rows else None


SAME_RUN_KEYS = ("kind", "engine", "engine_dtype", "scorer", "format", "every", "max_sequences_per_step")
"""What a writer adding to an existing run must declare as the run did: its kind, rollout engine and dtype,
and (from its config) the scorer label, the import format and a Recorder's sampling (the config states it
for the whole run)."""


def run_differences(old: dict, new: dict) -> list[str]:
    """'<key> <old value> (now <new value>)' for each SAME_RUN_KEYS value `new` (a run row about to be
    written) declares differently from `old` (the stored row); config may be a dict or its JSON."""

    def values(row: dict) -> dict:
        cfg = row.get("config") or {}
        cfg = json.loads(cfg) if isinstance(cfg, str) else cfg
        out = {k: row.get(k) if k in row else cfg.get(k) for k in SAME_RUN_KEYS}
        # a Recorder before its input checks stored a numpy count as its string ("8"): the same number
        return {k: int(v) if isinstance(v, str) and v.isdigit() else v for k, v in out.items()}

    theirs, ours = values(old), values(new)
    return [f"{k} {theirs[k]!r} (now {ours[k]!r})" for k in SAME_RUN_KEYS if theirs[k] != ours[k]]


def run_steps(root: Path, run_id: str) -> list[int]:
    """The steps of the run that have a folder (`step_dir`) in its sequences table, any rank's, sorted."""
    return sorted(int(d.name.removeprefix("step-")) for d in (root / "sequences" / run_id).glob("step-*"))


def remove_stale_tmp(root: Path, run_id: str, prefix: str, tables: tuple[str, ...] = STEP_TABLES) -> int:
    """Remove the temporary files (`_tmp`) a killed writer left in run `run_id`'s step folders and runs
    folder whose names start with `prefix` (e.g. 'rank-00003': the rank's shards and runs row; 'import-');
    returns how many. Only a writer holding the lock of those names (a Recorder of that rank, an import of
    the run) calls it: no live writer can be staging them. `tables`: the step tables swept (the runs folder
    always is)."""
    n = 0
    folders = [(root / table / run_id, "step-*/") for table in tables] + [(root / "runs" / run_id, "")]
    for folder, steps in folders:
        for f in folder.glob(f"{steps}.{prefix}*.tmp-*"):
            f.unlink(missing_ok=True)
            n += 1
    return n


def drop_rank_step(root: Path, run_id: str, step: int, rank: int) -> int:
    """Remove rank `rank`'s committed shards of (run, step) in every step table, sequences first (the unit
    turns invisible before its parts go); returns how many files were removed. A resumed writer calls it
    before it logs the step again, so the step is replaced rather than added to."""
    n = 0
    for table in reversed(COMMIT_ORDER):  # = STEP_TABLES, sequences first
        for f in sorted(step_dir(root, table, run_id, step).glob(f"{rank_prefix(rank)}-part-*.parquet")):
            f.unlink()
            n += 1
    return n


def run_ranks(root: Path, run_id: str) -> list[int]:
    """The ranks that wrote a runs row of `run_id` (`run_row_path`), sorted."""
    return sorted(int(f.stem.removeprefix("rank-")) for f in (root / "runs" / run_id).glob("rank-*.parquet"))


def rank_has_shards(root: Path, run_id: str, rank: int) -> bool:
    """Whether rank `rank` has a committed shard of run `run_id` in any step (read from its sequences)."""
    return any((root / "sequences" / run_id).glob(f"step-*/{rank_prefix(rank)}-part-*.parquet"))


def _tmp(final: Path) -> Path:
    return final.with_name(f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_bytes(final: Path, data: bytes) -> None:
    """Write `data` to `final` through a temporary file, fsync and a rename (module docstring)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp(final)
    try:
        tmp.write_bytes(data)
        _fsync(tmp)
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_parquet_atomic(table, final: Path) -> None:
    """Write the (small) Arrow `table` to `final` as Parquet, atomically (`_atomic_bytes`)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = pa.BufferOutputStream()
    pq.write_table(table, buf, compression=COMPRESSION)
    _atomic_bytes(final, buf.getvalue().to_pybytes())


def now_utc() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)


def write_run_row(root: Path, row: dict, rank: int) -> None:
    """Replace this rank's row of a run (status moves running -> complete | failed)."""
    import pyarrow as pa

    from mismatch_lab.store.writer import RUN_TYPES

    run_id = check_name(row["run_id"])
    data = {k: row.get(k) for k in RUN_TYPES} | {"rank": rank, "updated_at": now_utc()}
    for k in ("versions", "config"):
        if not isinstance(data[k], str) and data[k] is not None:
            data[k] = json.dumps(data[k], default=str, sort_keys=True)
    types = RUN_TYPES | {"rank": pa.int32(), "updated_at": pa.timestamp("us")}
    table = pa.table({k: pa.array([data[k]], type=t) for k, t in types.items()})
    write_parquet_atomic(table, run_row_path(root, run_id, rank))


_HELD: weakref.WeakSet = weakref.WeakSet()
"""The RunLocks this process holds: a forked child drops its inherited copies (`_forget_in_child`)."""


def _forget_in_child() -> None:
    """After fork(): the child closes its inherited lock fds without unlinking anything. The lock stays the
    parent's (flock belongs to the open file, which the parent still holds) and dies with the parent
    even when the child lives on (a DataLoader worker, a helper process)."""
    for lock in list(_HELD):
        lock.forget()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


class RunLock:
    """The exclusive `what` lock of run `run_id` in store `root` (module docstring): an advisory flock on
    `root/.<what>-<run_id>.lock`, so a killed holder leaves no stale lock. The file names its holder for
    the error a second process gets (`UserError`: "another <label> into run ... is running (holder); <why>";
    label defaults to what; `own`: the advice when this process holds it), and is removed on release by the
    process that took it. A lock this process holds through an object it no longer references (a cycle the
    garbage collector has not reached yet) is freed by one collection before refusing. Where the file system has no flock, `acquire` warns and
    holds nothing."""

    def __init__(self, root: Path, run_id: str, what: str, why: str, label: str | None = None,
                 own: str = "wait for it to end"):
        lock = Path(root).resolve() / f".{what}-{check_name(run_id)}.lock"  # one spelling: a held lock is recognised
        self.path, self.run_id, self.why, self.own = lock, run_id, why, own
        self.what = label or what
        self._fd: int | None = None

    def acquire(self) -> None:
        collected = False
        while True:
            try:
                if self._try():
                    return
            except BlockingIOError as busy:
                mine = any(lock.path == self.path for lock in _HELD)
                if mine and not collected:
                    import gc

                    gc.collect()  # an unreachable Recorder of this process may hold it: its __del__ frees it
                    collected = True
                    continue
                raise UserError(self._busy(str(busy), mine)) from None

    def _busy(self, holder: str, mine: bool) -> str:
        if mine:
            return f"another {self.what} of this process still holds run {self.run_id!r} of {self.path.parent}; {self.own}"
        return f"another {self.what} into run {self.run_id!r} of {self.path.parent} is running ({holder}); {self.why}"

    def _try(self) -> bool:
        """One attempt: True when locked (or unguarded), False to retry (the file was replaced meanwhile);
        BlockingIOError (its text the holder) while another open file holds the lock."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by exec'd children (PEP 446)
        except OSError as exc:
            raise UserError(f"cannot create the lock file {self.path} ({exc.strerror}); the store must be "
                            "writable to write into it") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 512).decode(errors="replace").strip() or "a process"
            os.close(fd)
            raise BlockingIOError(holder) from None
        except OSError as exc:  # a file system without flock (some network mounts): go on, unguarded
            os.close(fd)
            print(f"warning: cannot lock {self.path} ({exc.strerror}); going on without the lock: do not run "
                  f"another {self.what} into run {self.run_id!r} until this one ends", file=sys.stderr)
            self.path.unlink(missing_ok=True)
            return True
        try:
            same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:  # the last holder removed the file between our open and our lock
            same = False
        if not same:
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {now_utc():%Y-%m-%d %H:%M:%S} UTC".encode())
        self._fd = fd
        _HELD.add(self)
        return True

    def release(self) -> None:
        if self._fd is not None:
            self.path.unlink(missing_ok=True)  # while still locked: a process that opened this file retries
            self.forget()

    def forget(self) -> None:
        """Close this process's fd of the lock, unlinking nothing (a forked child's copy, `release`)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        _HELD.discard(self)


@contextmanager
def run_lock(root: Path, run_id: str, what: str = "import") -> Iterator[None]:
    """Hold the import lock of run `run_id` (`RunLock`) while the block runs."""
    lock = RunLock(root, run_id, what, "wait for it to end: two at once would give their sequences the same ids")
    lock.acquire()
    try:
        yield
    finally:
        lock.release()


DEFERRED_SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""The signals `signals_deferred` holds back: Ctrl-C and `kill`/`timeout`/`scancel`/`docker stop`."""
_deferring: list[list[int]] = []
"""While a `signals_deferred` block runs in the main thread: one list, of the signals received meanwhile."""


def _defer(signum, frame) -> None:
    _deferring[0].append(signum)


def _restore(handlers: list[tuple[int, object]]) -> None:
    """Put the saved `handlers` back, each one even when a signal arriving meanwhile raises."""
    if handlers:
        try:
            signal.signal(*handlers[0])
        finally:
            _restore(handlers[1:])


@contextmanager
def signals_deferred() -> Iterator[None]:
    """Run the block with SIGINT and SIGTERM held back: a handler that records them replaces the process's
    (an ignored signal stays ignored), and once the block ended the first one received is raised again
    (`signal.raise_signal`) for the process's own handler, e.g. the CLI's, which raises then. For the few
    milliseconds a store needs to be consistent again: a commit's renames and the run row around them.
    Nested blocks are one block; outside the main thread (where Python runs no handler) it does nothing."""
    if _deferring or threading.current_thread() is not threading.main_thread():
        yield
        return
    saved: list[tuple[int, object]] = []
    _deferring.append([])
    try:
        for sig in DEFERRED_SIGNALS:
            handler = signal.getsignal(sig)
            if handler not in (signal.SIG_IGN, None):  # None: a handler not installed from Python
                saved.append((sig, handler))
                signal.signal(sig, _defer)
        yield
    finally:
        try:
            _restore(saved)
        finally:
            received = _deferring.pop()
        if received:
            signal.raise_signal(received[0])


def replay_journal(root: Path, journal: Path) -> int:
    """Finish the commit that `journal` (`Transaction.commit`) lists, left by a process killed during its
    renames: rename each staged file still there into place, in the listed order (its files were synced
    before the journal was written), then remove the journal; returns how many were renamed. Only the
    holder of the lock of those files calls it (e.g. the next import of the run)."""
    if not journal.is_file():
        return 0
    try:
        renames = json.loads(journal.read_text())["renames"]
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(f"the commit journal {journal} is damaged ({exc}); delete it and import again") from None
    n = 0
    for tmp, final in renames:
        if (root / tmp).exists():
            os.replace(root / tmp, root / final)
            n += 1
    journal.unlink()
    return n


class Transaction:
    """The shards of one unit: staged under temporary names, renamed into place by `commit()`
    (sequences last), or removed by `abort()`. Use as a context manager: an exception aborts."""

    def __init__(self, root: Path):
        self.root = root
        self._staged: list[tuple[str, Path, Path]] = []  # (table, tmp, final)
        self._before_rename: list = []
        self._synced = 0  # how many of the staged files `sync` fsynced
        self.left_renamed = False  # a rename happened that no rollback took back (`commit`)

    def before_rename(self, fn) -> None:
        """Call `fn()` in `commit()` once every staged file is written and synced, just before the renames
        (e.g. removing the files the unit replaces: whatever fails before it keeps them). Once one returned
        a true value (it removed something), an interrupt (Ctrl-C, SIGTERM) during the renames finishes them
        before it propagates: the unit is then committed, not taken back (its predecessor is gone)."""
        self._before_rename.append(fn)

    def committed(self, run_id: str, step: int, name: str) -> bool:
        """True when this unit was committed before (its sequences shard exists)."""
        return shard_path(self.root, "sequences", run_id, step, name).is_file()

    def add(self, table: str, run_id: str, step: int, name: str, data) -> None:
        """Stage the Arrow table `data` as shard `name` of (table, run, step)."""
        import pyarrow.parquet as pq

        assert table in STEP_TABLES, table
        final = shard_path(self.root, table, check_name(run_id), step, check_name(name, "shard name"))
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = _tmp(final)
        self._staged.append((table, tmp, final))
        pq.write_table(data, tmp, compression=COMPRESSION)

    def sync(self) -> None:
        """fsync every staged file (once): the slow part of a commit, done before its critical section so
        that an interrupt then still takes the unit back (`abort`)."""
        try:
            for _table, tmp, _final in self._staged[self._synced:]:
                _fsync(tmp)
                self._synced += 1
        except BaseException:
            self.abort()
            raise

    def commit(self, journal: Path | None = None) -> int:
        """Rename every staged file into place; returns how many shards were committed. The renames run
        with SIGINT/SIGTERM deferred (`signals_deferred`): a signal then lets them finish and takes effect
        once they are done. An error between the renames (a failing rename, an exception a test injects)
        takes the renamed ones back out again, sequences first, and removes the rest (except after a
        `before_rename` function removed what the unit replaces: an interrupt then finishes the renames);
        `left_renamed` tells whether any renamed shard stayed. `journal`: a file listing the renames, written
        before the first and removed after the last, so that `replay_journal` finishes a commit whose
        process was killed outright (SIGKILL) between two renames; without one such a commit leaves the
        units whose sequences shard was already renamed, the others stay invisible (`committed_files`)."""
        self.sync()
        with signals_deferred():
            try:
                replaced = [fn() for fn in self._before_rename]  # every one runs (no short-circuit)
                if journal is not None:
                    self._write_journal(journal)
            except BaseException:
                self.abort()
                raise
            try:
                return self._rename(replaced)
            finally:  # renamed, or taken back by `_rename`: nothing is left for `replay_journal` to do
                if journal is not None:
                    journal.unlink(missing_ok=True)

    def _write_journal(self, journal: Path) -> None:
        order = {t: i for i, t in enumerate(COMMIT_ORDER)}
        staged = sorted(self._staged, key=lambda s: order[s[0]])
        renames = [[str(tmp.relative_to(self.root)), str(final.relative_to(self.root))] for _t, tmp, final in staged]
        _atomic_bytes(journal, json.dumps({"renames": renames}).encode())

    def _rename(self, replaced: list) -> int:
        order = {t: i for i, t in enumerate(COMMIT_ORDER)}
        done: list[tuple[str, Path]] = []
        staged = sorted(self._staged, key=lambda s: order[s[0]])
        try:
            for table, tmp, final in staged:
                self.left_renamed = True
                os.replace(tmp, final)
                done.append((table, final))
        except BaseException as exc:
            if any(replaced) and isinstance(exc, KeyboardInterrupt):
                # what this unit replaces is gone already: finish the renames rather than leave neither
                for _table, tmp, final in staged[len(done):]:
                    if tmp.exists():
                        os.replace(tmp, final)
                self._staged = []
                raise
            for _table, final in sorted(done, key=lambda d: -order[d[0]]):
                final.unlink(missing_ok=True)  # (a shard it had replaced under the same name is not restored)
            self.abort()  # the staged files not renamed yet
            self.left_renamed = False
            raise
        n, self._staged = len(self._staged), []
        return n

    def abort(self) -> None:
        for _table, tmp, _final in self._staged:
            if tmp.exists():
                tmp.unlink()
        self._staged, self._synced = [], 0

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()
