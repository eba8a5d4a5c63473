"""An import stopped by a real signal (SIGTERM, SIGINT, SIGKILL) at any point leaves the store holding the
run whole, or marked running so that importing again finishes it, or nothing of it: never committed rows
without their run row (which `runs` and `analyze` would not show, and `runs --drop` could not remove).

Each case runs `mismatch-lab import jsonl` in a child process. Where the signal has to land at a given
point (between two commit renames, just after the commit), the child is paused there for a moment by a
wrapper around the store's functions, and the test sends the signal from outside while it waits: the
wrapper only orchestrates, the signal and its handling are the real ones. A sweep of plain delays covers
the points nobody named.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

N_FILES, STEPS, LINES, TOKENS = 6, 4, 300, 40
"""Six source files of 300 sequences of 40 tokens over four steps: 24 units, 72 shard files to commit."""

_PAUSING = """
import os, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # a shell's background job passes SIGINT ignored
from mismatch_lab.store import shards
point, k = sys.argv[1], int(sys.argv[2])
def pause():
    print(f"paused at {point}", file=sys.stderr, flush=True)
    time.sleep(1.0)
def after(obj, name, when=lambda *a, **kw: True):
    real = getattr(obj, name)
    def wrapped(*a, **kw):
        out = real(*a, **kw)
        if when(*a, **kw):
            pause()
        return out
    setattr(obj, name, wrapped)
if point.startswith("rename:"):  # after the k-th rename of a shard into place in that table
    table, seen, real_replace = point.split(":")[1], [], os.replace
    def replace(src, dst):
        real_replace(src, dst)
        if f"/{table}/" in str(dst) and ".tmp-" in str(src):
            seen.append(dst)
            if len(seen) == k:
                pause()
    os.replace = replace
elif point.startswith("row:"):  # after the run row of that status is written
    after(shards, "write_run_row", lambda root, row, rank: row["status"] == point.split(":")[1])
else:  # after a Transaction method: add (staging), sync, commit
    after(shards.Transaction, point)
from mismatch_lab.cli import main
sys.exit(main(sys.argv[3:]))
"""


def _sources(folder: Path) -> list[Path]:
    """N_FILES JSON-lines files (log-probs <= 0), each holding LINES sequences over STEPS steps."""
    rng = np.random.default_rng(7)
    folder.mkdir()
    files = []
    for i in range(N_FILES):
        lines = []
        for j in range(LINES):
            mu = -rng.exponential(0.5, TOKENS)
            pi = mu - np.abs(rng.normal(0, 0.02, TOKENS))
            lines.append(json.dumps({"step": j % STEPS, "rank": i % 2, "token_ids": rng.integers(0, 50000, TOKENS).tolist(),
                                     "logp_rollout": mu.tolist(), "logp_trainer": pi.tolist()}))
        files.append(folder / f"part-{i}.jsonl")
        files[-1].write_text("\n".join(lines) + "\n")
    return files


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Path:
    return _sources(tmp_path_factory.mktemp("signals") / "src")[0].parent


def _command(src: Path, store: Path) -> list[str]:
    return ["import", "jsonl", str(src), "--out", str(store), "--run-name", "r"]


def _child(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-c", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)


def _signal_at(point: str, k: int, sig: int, src: Path, store: Path) -> tuple[int, str]:
    """Run the import paused after `point` (its k-th time for a rename), send `sig` while it waits;
    (exit status, stderr)."""
    proc = _child([_PAUSING, point, str(k), *_command(src, store)])
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if line.startswith("paused at"):
            proc.send_signal(sig)
            break
    rest = proc.communicate(timeout=120)[1]
    assert any(x.startswith("paused at") for x in seen), "".join(seen) + rest  # the signal came at that point
    return proc.returncode, "".join(seen) + rest


def _runs_with_rows(store: Path) -> set[str]:
    return {p.parts[-3] for p in store.glob("sequences/*/step-*/*.parquet")}


def _runs_with_row(store: Path) -> set[str]:
    return {d.name for d in store.glob("runs/*") if any(d.glob("rank-*.parquet"))}


def _stored(store: Path) -> tuple[list, int, int]:
    from mismatch_lab.store.reader import open_store

    con = open_store(store)
    try:
        runs = con.execute("SELECT run_id, status FROM runs").fetchall()
        (seqs,) = con.execute("SELECT count(*) FROM sequences").fetchone()
        (toks,) = con.execute("SELECT count(*) FROM tokens t JOIN scores s USING (run_id, seq_id, pos)").fetchone()
    finally:
        con.close()
    return runs, seqs, toks


def _check_left(store: Path) -> str:
    """The invariant after the signal; returns what the store holds: 'nothing', 'complete' or 'running'."""
    if not store.exists() or not _runs_with_rows(store):  # no committed row of the import
        if store.exists() and _runs_with_row(store):  # a kill after the run row was written
            assert _stored(store)[0] == [("r", "running")]
        return "nothing"
    assert _runs_with_rows(store) <= _runs_with_row(store), "committed rows without their run row"
    runs, seqs, toks = _stored(store)
    assert len(runs) == 1 and runs[0][0] == "r"
    if runs[0][1] == "complete":  # a run that says it is complete is whole
        assert (seqs, toks) == (N_FILES * LINES, N_FILES * LINES * TOKENS)
    return runs[0][1]


def _check_rerun_completes(cli, src: Path, store: Path) -> None:
    code, _, err = cli(*_command(src, store))
    assert code == 0, err
    assert _stored(store) == ([("r", "complete")], N_FILES * LINES, N_FILES * LINES * TOKENS)
    assert not list(store.rglob("*.tmp-*")) and not list(store.rglob("import-commit.json"))


PAUSES = [("add", 1), ("sync", 1), ("row:running", 1), ("rename:tokens", 1), ("rename:scores", 5),
          ("rename:sequences", 1), ("rename:sequences", N_FILES * STEPS - 1), ("commit", 1), ("row:complete", 1)]
"""Where the child waits for the signal: staging, after the sync, after the run row written as running,
between the commit's renames (tokens, scores, sequences: its first and second-to-last commit point),
just after the commit, after the run row written as complete."""


@pytest.mark.parametrize("point,k", PAUSES)
def test_a_sigterm_at_each_point_of_an_import_leaves_the_run_whole_or_finishable(cli, sources, tmp_path, point, k):
    store = tmp_path / "store"
    code, err = _signal_at(point, k, signal.SIGTERM, sources, store)
    assert code == 143 and "terminated (SIGTERM)" in err, err
    left = _check_left(store)
    # before the commit's critical section the import is undone; from the run row on it completes first
    assert left == ("nothing" if point in ("add", "sync") else "complete"), left
    _check_rerun_completes(cli, sources, store)


@pytest.mark.parametrize("point,k", [("row:running", 1), ("rename:tokens", 3), ("rename:sequences", 2),
                                     ("commit", 1)])
def test_a_sigkill_during_the_commit_leaves_a_run_the_next_import_finishes(cli, sources, tmp_path, point, k):
    store = tmp_path / "store"
    code, err = _signal_at(point, k, signal.SIGKILL, sources, store)
    assert code == -signal.SIGKILL, err
    assert _check_left(store) in ("nothing", "running")
    _check_rerun_completes(cli, sources, store)


def test_a_sigint_between_two_commit_renames_lets_them_finish(cli, sources, tmp_path):
    store = tmp_path / "store"
    code, err = _signal_at("rename:sequences", 3, signal.SIGINT, sources, store)
    assert code == 130 and "interrupted" in err, err
    assert _check_left(store) == "complete"


def test_sigterm_at_a_sweep_of_delays_never_leaves_rows_without_their_run_row(cli, sources, tmp_path):
    """No pause: the signal lands wherever the import happens to be, from start-up to its last write."""
    t0 = time.perf_counter()
    plain = subprocess.run([sys.executable, "-m", "mismatch_lab.cli", *_command(sources, tmp_path / "timed")],
                           check=False, capture_output=True, text=True, timeout=300)
    took = time.perf_counter() - t0
    assert plain.returncode == 0, plain.stderr
    outcomes = []
    for i, frac in enumerate(np.linspace(0.3, 1.1, 6)):
        store = tmp_path / f"s{i}"
        proc = subprocess.Popen([sys.executable, "-m", "mismatch_lab.cli", *_command(sources, store)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(took * frac)
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
        outcomes.append(_check_left(store))
        if outcomes[-1] != "complete":
            _check_rerun_completes(cli, sources, store)
    assert len(outcomes) == 6


def test_runs_lists_and_drops_rows_left_without_a_run_row(cli, sources, tmp_path):
    """What an older version could leave (its run row removed after the commit): `runs` names the rows,
    `runs --drop` removes them, a re-import says to drop them first."""
    store = tmp_path / "store"
    assert cli(*_command(sources, store))[0] == 0
    import shutil

    shutil.rmtree(store / "runs" / "r")
    code, out, err = cli("runs", "--db", store)
    assert code == 0 and f"orphan rows of run r: {3 * N_FILES * STEPS} shards, no run row; drop with " \
        f"mismatch-lab runs --db {store} --drop r" in out, out + err
    code, _, err = cli(*_command(sources, store))
    assert code == 2 and "no run row" in err and "--drop r" in err, err
    code, out, _ = cli("runs", "--db", store, "--drop", "r")
    assert code == 0 and f"dropped r: {3 * N_FILES * STEPS} files" in out and "orphan" not in out
    assert not list(store.glob("*/r"))
    _check_rerun_completes(cli, sources, store)


def test_a_signal_inside_signals_deferred_reaches_its_handler_once_the_block_ended():
    from mismatch_lab.store import shards

    seen = []

    def handler(signum, frame):
        seen.append(signum)
        raise KeyboardInterrupt

    old, before_int = signal.signal(signal.SIGTERM, handler), signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(KeyboardInterrupt), shards.signals_deferred():
            os.kill(os.getpid(), signal.SIGTERM)  # a real signal: handled (recorded) at once, raised later
            time.sleep(0.05)
            with shards.signals_deferred():  # nested: one block
                pass
            seen.append("block ended")
        assert seen == ["block ended", signal.SIGTERM]
        assert signal.getsignal(signal.SIGTERM) is handler and signal.getsignal(signal.SIGINT) is before_int
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        with shards.signals_deferred():
            os.kill(os.getpid(), signal.SIGTERM)  # an ignored signal stays ignored
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, old)
