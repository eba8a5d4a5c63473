"""`mismatch-lab app`: start the Streamlit app on a study.

    mismatch-lab app                                   # offers every study under studies/
    mismatch-lab app --study studies/precision-sweep   # a study folder (reads its results/ Parquet)
    mismatch-lab app --study runs/live.duckdb --port 8502

    mismatch-lab app --prepare --study runs/live   # compute what the pages show first into the results cache

Becomes `streamlit run apps/streamlit_app.py -- --study <path>` (exec, same process) and also passes the
path as $MISMATCH_LAB_STUDY. `--prepare` instead computes, without a server, what the app's warm-up computes
(every page's default analyses) into the store's results cache (`mismatch_lab/store/cache.py`), so that every
page of a server started later loads from it; it prints where the cache is and exits. The app opens stores read-only (a snapshot when a writer holds the DuckDB
lock), so it can run next to a `collect` or `train` that is still writing.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

from mismatch_lab.errors import UserError
from mismatch_lab.store.shards import is_shard_store

APP = Path(__file__).resolve().parents[1] / "apps" / "streamlit_app.py"
ENV_VAR = "MISMATCH_LAB_STUDY"  # read by apps/lab_ui.py
DEFAULT_PORT = 8501  # Streamlit's own default


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--study",
        type=Path,
        default=None,
        help="study folder (studies/<name>), .duckdb file, folder of <table>.parquet files, or the shard store "
        "of recorded / imported runs; default: pick any study under studies/ in the app",
    )
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"local port (default {DEFAULT_PORT})")
    parser.add_argument("--headless", action="store_true", help="do not open a browser window")
    parser.add_argument("--prepare", action="store_true",
                        help="compute every page's default analyses into the store's results cache and exit "
                        "(no server); needs --study")


def _check_study(study: Path) -> Path:
    if not study.exists():
        raise UserError(
            f"no study at {study}: pass a study folder (studies/<name>), a .duckdb file, a folder of Parquet "
            "files or the shard store of recorded / imported runs; `ls studies/` lists the studies of this checkout"
        )
    if study.is_dir():
        has_data = (
            any((study / "results").glob("*.parquet")) or any(study.glob("*.parquet")) or any(study.glob("*.duckdb"))
            or is_shard_store(study)
        )
        if not has_data:
            fix = (f"collect into it first (`mismatch-lab collect --study {study}/study.toml`)"
                   if (study / "study.toml").is_file() else
                   "pass a study folder, a store, or the --out folder of `mismatch-lab import` / a Recorder's path")
            raise UserError(f"{study} holds no results/*.parquet, *.parquet, *.duckdb or shard store: {fix}")
    elif study.suffix != ".duckdb":
        raise UserError(f"{study} is a file but not a .duckdb store: pass the .duckdb file or the study folder")
    return study.resolve()


def build_command(study: Path | None, port: int, headless: bool) -> list[str]:
    """The `streamlit run` command line for these arguments (checked; raises UserError on a mistake)."""
    if not 1 <= port <= 65535:
        raise UserError(f"--port {port} is not a TCP port: pick one in 1..65535 (default {DEFAULT_PORT})")
    if not APP.is_file():
        raise UserError(
            f"the app is not in this installation ({APP} missing): run from a checkout "
            "installed with `pip install -e .`"
        )
    if importlib.util.find_spec("streamlit") is None:
        raise UserError("streamlit is not installed: `pip install -e .` installs it")
    cmd = [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        str(APP),
        "--server.port",
        str(port),
        "--server.headless",
        "true" if headless else "false",
        "--browser.gatherUsageStats",
        "false",
    ]
    if study is not None:
        cmd += ["--", "--study", str(_check_study(study))]
    return cmd


def prepare(study: Path) -> int:
    """`--prepare`: the app's warm-up run in this process, into the store's results cache."""
    import time

    path = str(_check_study(study))
    sys.path.insert(0, str(APP.parent))
    import lab_ui  # the app's own plumbing: the very queries, arguments and cache keys the pages use

    t0 = time.perf_counter()
    where = lab_ui.prepare(path)
    print(f"cached every page's default analyses of {path} in {time.perf_counter() - t0:.1f} s"
          f" -> {where or 'memory only (no writable cache folder; set MISMATCH_LAB_CACHE=DIR)'}")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.prepare:
        if args.study is None:
            raise UserError("--prepare needs the store: mismatch-lab app --prepare --study <store>")
        return prepare(args.study)
    cmd = build_command(args.study, args.port, args.headless)
    env = dict(os.environ)
    if args.study is not None:
        env[ENV_VAR] = cmd[-1]
    print(f"mismatch-lab app: serving on http://localhost:{args.port} (Ctrl+C stops)", file=sys.stderr, flush=True)
    # Streamlit replaces this process, so Ctrl+C and a supervisor's SIGTERM reach the server itself and no
    # orphaned server is left behind.
    os.execve(cmd[0], cmd, env)
    raise AssertionError("os.execve returned")  # it does not: on failure it raises OSError
