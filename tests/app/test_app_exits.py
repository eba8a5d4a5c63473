"""Clean exits: a process running the app ends with exit code 0 and no DuckDB noise, even when it ends
while the app's warm-up thread is inside a DuckDB query.

Before the app stopped its warm-up at exit, AppTest in a plain `python` process aborted at interpreter
exit (`terminate called after throwing an instance of ''`, exit code 134) and a served app stopped with
Ctrl+C or SIGTERM printed `nanobind: leaked N instances!` for the DuckDB objects its daemon thread still
held. The warm-up of the committed precision-sweep study takes seconds, so it is still running when these
processes are told to end.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from app_paths import APP, REPO

STUDY = REPO / "studies" / "precision-sweep"
BAD_OUTPUT = ("terminate called", "nanobind: leaked", "FATAL", "Traceback")
START_TIMEOUT_S = 90

# AppTest in a plain Python process: open the app, leave while the warm-up thread is still querying
APPTEST_CHILD = r"""
import os, sys, threading, time
os.environ["MISMATCH_LAB_STUDY"], os.environ["MISMATCH_LAB_APP_WARMUP"] = sys.argv[2], "1"
from streamlit.testing.v1 import AppTest
at = AppTest.from_file(sys.argv[1], default_timeout=120)
at.run()
assert not at.exception, at.exception
time.sleep(0.5)
alive = [t for t in threading.enumerate() if t.name.startswith("mismatch-lab warm-up") and t.is_alive()]
print(f"warm-up threads alive at exit: {len(alive)}", flush=True)
"""


def assert_clean(proc: subprocess.CompletedProcess | subprocess.Popen, output: str) -> None:
    assert proc.returncode == 0, f"exit code {proc.returncode}:\n{output[-4000:]}"
    for bad in BAD_OUTPUT:
        assert bad not in output, f"{bad!r} in the output:\n{output[-4000:]}"


@pytest.fixture
def big_study(tmp_path):
    """A private copy of the committed precision-sweep study (warm-up: seconds, not milliseconds)."""
    if not (STUDY / "results").is_dir():
        pytest.fail(f"{STUDY}/results is missing: the committed study these tests open")
    copy = tmp_path / "precision-sweep"
    shutil.copytree(STUDY / "results", copy / "results")
    return copy


def test_apptest_in_plain_python_exits_cleanly_while_the_warm_up_queries(big_study):
    proc = subprocess.run([sys.executable, "-c", APPTEST_CHILD, str(APP), str(big_study)], check=False,
                          capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
    output = proc.stdout + proc.stderr
    assert "warm-up threads alive at exit: 1" in output, output[-4000:]  # the race this test is about
    assert_clean(proc, output)


# The same with a page that keeps DuckDB objects in Streamlit's resource cache (the Volatility page's joined
# rows hold a cursor) in a process that has imported torch, as the pytest suite has: there the caches
# outlive the interpreter's last collection and every DuckDB object still in them is reported as leaked.
CACHED_CHILD = r"""
import os, sys
os.environ["MISMATCH_LAB_STUDY"], os.environ["MISMATCH_LAB_APP_WARMUP"] = sys.argv[2], "0"
import torch  # noqa: F401
from streamlit.testing.v1 import AppTest
at = AppTest.from_file(sys.argv[1], default_timeout=120)
at.run()
at.switch_page("app_pages/volatility.py").run()
assert not at.exception, at.exception
print("volatility page shown", flush=True)
"""


def test_apptest_exits_cleanly_with_duckdb_objects_in_the_resource_cache(parquet_store):
    proc = subprocess.run([sys.executable, "-c", CACHED_CHILD, str(APP), str(parquet_store)], check=False,
                          capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
    output = proc.stdout + proc.stderr
    assert "volatility page shown" in output, output[-4000:]
    assert_clean(proc, output)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _open_a_session(port: int) -> None:
    """What a browser tab does: connect to the app's stream and run the script once (opens the store and
    starts the warm-up)."""
    from streamlit.proto.BackMsg_pb2 import BackMsg
    from streamlit.proto.ForwardMsg_pb2 import ForwardMsg
    from websockets.sync.client import connect

    with connect(f"ws://127.0.0.1:{port}/_stcore/stream", subprotocols=["streamlit"], max_size=None) as ws:
        msg = BackMsg()
        msg.rerun_script.query_string = ""
        ws.send(msg.SerializeToString())
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            forward = ForwardMsg()
            forward.ParseFromString(ws.recv(timeout=START_TIMEOUT_S))
            if forward.WhichOneof("type") == "script_finished":
                return
    pytest.fail("the app's script did not finish")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_the_served_app_stopped_while_the_warm_up_queries_exits_cleanly(big_study, sig):
    port = _free_port()
    cmd = [sys.executable, "-m", "mismatch_lab.cli", "app", "--study", str(big_study), "--port", str(port),
           "--headless"]
    env = dict(os.environ, MISMATCH_LAB_APP_WARMUP="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2) as r:
                    if r.read().strip() == b"ok":
                        break
            except OSError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "the app did not start"
            time.sleep(0.3)
        _open_a_session(port)
        time.sleep(0.5)  # the warm-up is under way (it takes seconds on this study)
        proc.send_signal(sig)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert "Stopping" in output  # Streamlit's own shutdown ran
    assert_clean(proc, output)


# --- the parts, in this process -----------------------------------------------------------------------


def test_stop_interrupts_the_warm_up_inside_its_query_and_joins_it(lab_ui, big_study):
    from mismatch_lab.analysis import browse

    path = str(big_study.resolve())
    thread = lab_ui._warm_up(path)
    store = lab_ui._connection(path)
    deadline = time.monotonic() + 60
    while not store._busy and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store._busy and thread.is_alive(), "the warm-up was never seen inside a query"
    t0 = time.monotonic()
    assert thread.stop() and not thread.is_alive()
    assert time.monotonic() - t0 < 10  # an interrupted query, not the rest of the warm-up
    assert not store._busy
    assert len(lab_ui._call(path, browse.list_runs)) > 0  # the store serves the pages as before


def test_a_store_the_cache_drops_is_closed_once_its_queries_are_done(lab_ui, big_study):
    import streamlit as st

    path = str(big_study.resolve())
    store = lab_ui._connection(path)
    with store.using() as cur:
        st.cache_resource.clear()  # what *Reload data* does, here while a query holds a cursor
        assert store.con is not None and cur.execute("SELECT count(*) FROM runs").fetchone()[0] > 0
    assert store.con is None  # closed when the last query returned
    fresh = lab_ui._connection(path)
    assert fresh is not store and fresh.usable


def test_shutdown_interrupts_every_query_and_closes_every_store(lab_ui, big_study):
    path = str(big_study.resolve())
    store = lab_ui._connection(path)
    outcome = {}

    def long_query():
        try:
            with store.using() as cur:
                cur.execute("SELECT count(*) FROM range(10000000000) t(i) WHERE i % 7 = 3").fetchall()
            outcome["query"] = "finished"
        except Exception as exc:  # noqa: BLE001 -- the interrupt is what this test expects
            outcome["query"] = type(exc).__name__

    worker = threading.Thread(target=long_query)
    worker.start()
    while not store._busy and worker.is_alive():
        time.sleep(0.01)
    store.shutdown()
    worker.join(timeout=30)
    assert outcome == {"query": "InterruptException"} and store.con is None
    with pytest.raises(lab_ui.StoreClosed), store.using():
        pass
    lab_ui._store_at.clear()  # a fresh store for whoever opens this path next
