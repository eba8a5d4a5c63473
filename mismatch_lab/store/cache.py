"""A results cache on disk for the app: what a page computed from a store, kept beside the store and reused
by the next server, session or refresh for exactly the same data.

Keys. Every entry is filed under the query (module, function, arguments) and a *fingerprint* of the data it
was computed from: the path, size, modification time, change time and inode of every file the store reads
(`data_files`; the change time moves on any rewrite, even one that keeps the size and sets the mtime back),
and the content of this package's source files (`code_fingerprint`: a changed analysis recomputes). A shard
store's files are listed from its folders' stats (`units.Scan`: only the folders a writer changed are listed
again). A store that changes has another fingerprint, so nothing cached is ever shown for data that changed;
an entry is replaced when its query is computed again for new data (one file per query, the previous
fingerprint's removed). The fingerprint must be taken *before* the connection that computes the entry is
opened: data written after it then lands under a fingerprint that never recurs (harmless), never the other
way round.

Per-step units. The Training page's results of a store still being written are kept per (run, step) under
each unit's own fingerprint (`store.units`), so that a refresh computes only the new or changed steps.

Where. Inside a shard store (`<store>/.mismatch-lab-cache/`, a folder no reader globs) and beside a DuckDB
file (`.<name>.duckdb.mismatch-lab-cache/` in its folder): both are stores we wrote. Any other store (a Parquet
folder, a study's `results/`) and any store whose folder cannot be written (read-only) are cached under the
user's cache folder (`$XDG_CACHE_HOME` or `~/.cache`, `mismatch-lab/app/<hash of the store's path>/`); if that
cannot be written either, nothing is cached on disk. `MISMATCH_LAB_CACHE=0` turns the disk cache off,
`MISMATCH_LAB_CACHE=DIR` puts every store's cache under DIR.

Writes. An entry is written to a temporary file (`.<entry>.<pid>.<thread>`) and renamed into place: a reader
never sees half an entry. A write killed before its rename leaves the temporary, which the next `ResultsCache`
of the store removes once it is older than STALE_TMP_S.

Trust. Entries are pickles, and a store can come from someone else: each entry is signed with HMAC-SHA256
under a key private to the user (`mismatch-lab/app-cache.key` in the user's cache folder, mode 0600), and an
entry whose signature does not verify is ignored (computed again), never unpickled.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import pickle
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path

from mismatch_lab.store.shards import MARKER, STEP_TABLES, is_shard_store

ENV_VAR = "MISMATCH_LAB_CACHE"
DIR_NAME = ".mismatch-lab-cache"
KEY_FILE = "app-cache.key"
PACKAGE = Path(__file__).resolve().parents[1]
_MAC = hashlib.sha256().digest_size
MISSING = object()
STALE_TMP_S = 3600.0  # a temporary entry file older than this is a killed write's: removed at open


def _digest(parts) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def _stat_rows(root: Path, files) -> list[tuple]:
    rows = []
    for f in files:
        try:
            s = f.stat()
        except FileNotFoundError:  # removed between the listing and the stat (a writer replacing a unit)
            continue
        rows.append((str(f.relative_to(root)), s.st_size, s.st_mtime_ns, s.st_ctime_ns, s.st_ino))
    return sorted(rows)


def _visible(files) -> list[Path]:
    """Files, without temporaries (`.<name>.tmp-*`), locks and our own cache."""
    return [f for f in files if f.is_file() and not f.name.startswith(".") and DIR_NAME not in f.parts]


def data_files(path: str | Path) -> tuple[Path, list[Path]]:
    """(root, files): every file whose content the store at `path` is read from, as `reader.open_store` picks
    them (a study folder's results/ or its DuckDB file, a DuckDB file and its WAL, a Parquet folder, a shard
    store's run rows and step shards)."""
    from mismatch_lab.store.reader import study_duckdb

    p = Path(path).expanduser().resolve()
    if p.is_file() and p.name == "study.toml":
        p = p.parent
    if p.is_file():
        return p.parent, [f for f in (p, p.with_name(p.name + ".wal")) if f.is_file()]
    if (p / "results").is_dir():
        return p, _visible((p / "results").rglob("*"))
    if is_shard_store(p):
        tables = ("runs", *STEP_TABLES)
        return p, [p / MARKER] + [f for t in tables for f in _visible((p / t).rglob("*.parquet"))]
    parquet = _visible(p.rglob("*.parquet"))
    if parquet or not p.is_dir():
        return p, parquet
    db = study_duckdb(p)
    return p, [f for f in (db, db.with_name(db.name + ".wal")) if f.is_file()] if db else []


_CODE: list[str] = []


def code_fingerprint() -> str:
    """A digest of the content of this package's Python sources (~1 MB, read once per process): results of
    changed code never match, and a checkout that only touches the files keeps the cache."""
    if not _CODE:
        h = hashlib.sha256()
        for f in sorted(PACKAGE.rglob("*.py")):
            h.update(str(f.relative_to(PACKAGE)).encode() + b"\0" + f.read_bytes() + b"\0")
        _CODE.append(h.hexdigest())
    return _CODE[0]


def fingerprint(path: str | Path) -> str:
    """A digest of the data the store at `path` is read from (module doc); another one whenever it changes. A
    shard store's from its folders' stats, listing only the folders a writer changed (`units.Scan`)."""
    if is_shard_store(path):
        from mismatch_lab.store import units

        return units.scan(path).snapshot().store
    root, files = data_files(path)
    return _digest((code_fingerprint(), _stat_rows(root, files)))


def _user_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mismatch-lab"


def _writable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".probe-{os.getpid()}-{threading.get_ident()}"
        probe.write_bytes(b"")
        probe.unlink()
        return True
    except OSError:
        return False


def location(path: str | Path) -> Path | None:
    """The folder of the store's cache (module doc, "Where"), or None: no disk cache."""
    setting = os.environ.get(ENV_VAR, "")
    p = Path(path).expanduser().resolve()
    elsewhere = (Path(setting) if setting else _user_cache() / "app") / _digest(str(p))[:24]
    if setting == "0":
        return None
    beside = None if setting else p / DIR_NAME if is_shard_store(p) else (
        p.parent / f".{p.name}{DIR_NAME}" if p.is_file() and p.suffix == ".duckdb" else None)
    for folder in (beside, elsewhere):
        if folder is not None and _writable(folder):
            return folder
    return None


def _key() -> bytes | None:
    """The user's private signing key (made on first use), or None where it cannot be kept."""
    f = _user_cache() / KEY_FILE
    try:
        if not f.is_file():
            f.parent.mkdir(parents=True, exist_ok=True)
            tmp = f.with_name(f".{KEY_FILE}.{os.getpid()}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as out:
                out.write(secrets.token_bytes(32))
            try:
                os.link(tmp, f)  # the first writer's key wins
            except FileExistsError:
                pass
            tmp.unlink()
        key = f.read_bytes()
    except OSError:
        return None
    return key if len(key) == 32 else None


def _remove_stale_tmp(folder: Path) -> int:
    """Remove the temporary entry files (`ResultsCache.put`) older than STALE_TMP_S under `folder`: left by a
    write killed before its rename (a younger one may be a live write). Returns how many."""
    n, cutoff = 0, time.time() - STALE_TMP_S
    for tmp in folder.glob("*/.*.pkl.*"):
        try:
            if tmp.stat().st_mtime < cutoff:
                tmp.unlink()
                n += 1
        except FileNotFoundError:  # its write finished (renamed) or another process removed it
            pass
    return n


class ResultsCache:
    """The disk cache of one store: `get_or_compute(query, fingerprint, compute)`. Without a disk cache (off, or
    nowhere writable) the same entries are kept in this object's memory for the life of the process."""

    def __init__(self, path: str | Path):
        self.folder = location(path)
        self.key = _key() if self.folder is not None else None
        self.enabled = self.key is not None
        self._memory: dict[str, tuple[str, object]] = {}  # query digest -> (fingerprint, value), disk cache off
        if self.enabled:
            _remove_stale_tmp(self.folder)

    def _file(self, query, fp: str) -> Path:
        return self.folder / _digest(query)[:32] / f"{fp[:32]}.pkl"

    def get(self, query, fp: str):
        """The value stored for `query` on data of fingerprint `fp`, or MISSING (none, or not signed by us)."""
        if not self.enabled:
            fp_value = self._memory.get(_digest(query))
            return fp_value[1] if fp_value is not None and fp_value[0] == fp else MISSING
        try:
            blob = self._file(query, fp).read_bytes()
        except OSError:
            return MISSING
        mac, body = blob[:_MAC], blob[_MAC:]
        if not hmac.compare_digest(mac, hmac.new(self.key, body, hashlib.sha256).digest()):
            return MISSING
        return pickle.loads(body)

    def has(self, query, fp: str) -> bool:
        """Whether an entry for `query` on data of fingerprint `fp` exists (not yet verified: `get` does)."""
        if not self.enabled:
            return self.get(query, fp) is not MISSING
        return self._file(query, fp).is_file()

    def put(self, query, fp: str, value) -> None:
        """Store `value` (atomically); the entries of `query` for other fingerprints are removed. A folder that
        cannot be written (full, gone read-only) only leaves the value uncached."""
        if not self.enabled:
            self._memory[_digest(query)] = (fp, value)
            return
        final = self._file(query, fp)
        body = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        tmp = final.with_name(f".{final.name}.{os.getpid()}.{threading.get_ident()}")
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(hmac.new(self.key, body, hashlib.sha256).digest() + body)
            os.replace(tmp, final)
            for old in final.parent.glob("*.pkl"):
                if old != final:
                    old.unlink(missing_ok=True)
        except OSError:
            tmp.unlink(missing_ok=True)

    def get_or_compute(self, query, fp: str, compute: Callable[[], object]):
        value = self.get(query, fp)
        if value is MISSING:
            value = compute()
            self.put(query, fp, value)
        return value
