"""User-facing errors: the CLI prints them as one line and exits with status 2.

Failures of the machine rather than of the program (a full disk, a read-only folder, a permission denied)
are printed the same way: `storage_error_line` turns an `OSError`, or a DuckDB error reporting one, into one
line naming the path, the operating system's words and the fix.
"""

from __future__ import annotations

import errno
import os
import re
import sys


class UserError(Exception):
    """A mistake in the user's input (bad flag, file, model, study). The message names the fix."""


class StoreBusyError(UserError):
    """Another process holds the write lock on the DuckDB file."""


_ELSEWHERE = "or pass a path on another disk (--db / --out)"
OS_FIXES = {
    errno.ENOSPC: f"free space on that disk {_ELSEWHERE}",
    errno.EDQUOT: f"free space within your disk quota {_ELSEWHERE}",
    errno.EROFS: f"that file system is mounted read-only: {_ELSEWHERE[3:]}",
    errno.EACCES: f"give this user access to it {_ELSEWHERE}",
    errno.EPERM: f"give this user access to it {_ELSEWHERE}",
    errno.ENOENT: "check the path (its folder must exist)",
}
"""errno -> the fix printed after the operating system's words (any other errno: `OTHER_FIX`)."""
OTHER_FIX = "check the path and the disk, then run the command again"

DUCKDB_OS_TEXTS = {"no space left on device": errno.ENOSPC, "disk quota exceeded": errno.EDQUOT,
                   "read-only file system": errno.EROFS, "permission denied": errno.EACCES}
"""What DuckDB's own IO errors say (it reports the OS error as text): text -> errno."""


TARGET_FLAGS = ("out", "json", "db")
"""The command's flags naming what it writes, in this order: named by the line of an OSError that names no
file (pyarrow's 'Error writing bytes to file' does not)."""


def storage_error_line(exc: BaseException, args=None) -> str | None:
    """One line for an `OSError` or a DuckDB error reporting a full disk, a read-only file system or a denied
    permission, found in `exc` or the exceptions it was raised from or during (a rollback after a failed
    commit raises again); None when the chain holds neither, so the caller re-raises. `args`: the command's
    parsed arguments, whose first `TARGET_FLAGS` flag is named when the error names no file."""
    seen: set[int] = set()
    target = next((f"writing --{f} {v}" for f in TARGET_FLAGS if (v := getattr(args, f, None))), None)
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError):
            return _os_line(exc, target)
        line = _duckdb_line(exc)
        if line is not None:
            return line
        exc = exc.__cause__ or exc.__context__
    return None


def _os_line(exc: OSError, target: str | None) -> str:
    what = exc.strerror or str(exc) or type(exc).__name__
    paths = " -> ".join(str(p) for p in (exc.filename, exc.filename2) if p is not None) or target
    return f"{paths + ': ' if paths else ''}{what}; {OS_FIXES.get(exc.errno, OTHER_FIX)}"


def _duckdb_line(exc: BaseException) -> str | None:
    duckdb = sys.modules.get("duckdb")  # an error of DuckDB's exists only once DuckDB was imported
    if duckdb is None or not isinstance(exc, duckdb.Error):
        return None
    text = str(exc)
    code = next((c for t, c in DUCKDB_OS_TEXTS.items() if t in text.lower()), None)
    if code is None:
        return None
    path = re.search(r'(?:file|directory) \\?"(.+?)\\?"', text)  # 'Could not write file "P"' (quotes escaped in JSON)
    return f"{path.group(1) + ': ' if path else ''}{os.strerror(code)}; {OS_FIXES[code]}"
