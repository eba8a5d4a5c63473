"""Fixtures for the app tests: small real stores built with the contract's DDL and real DuckDB.

`full` stores hold two collect runs (vllm:bf16 with top-K, hf:fp16 without) scored by hf:fp32 and
hf:bf16, one non-finite score, and a DPPO training run with rewards, advantages and train_metrics.
`bare` stores hold one collect run without top-K, rewards or training: every page must show a
plain message where that content would be.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path

import duckdb
import numpy as np
import pytest
from app_paths import APP, REPO  # noqa: F401

from mismatch_lab.categories import categorize
from mismatch_lab.store.schema import TABLES, create_schema

VOCAB = [
    " The",
    " answer",
    " is",
    " 4",
    "2",
    ".",
    " Wait",
    ",",
    " so",
    " 12",
    " +",
    " 35",
    " =",
    "\n",
    " Let",
    " x",
    "<|im_end|>",
]
SPECIAL = {len(VOCAB) - 1}
TOPK = 5


def _insert_run(con, rng, run_id, *, kind, engine, dtype, scorers, n_seq, topk, rewards, steps=(None,), config=None):
    con.execute(
        "INSERT INTO runs VALUES (?, 'fixture', ?, TIMESTAMP '2026-11-01 10:00:00', 'complete', 'SmolLM2-135M-Instruct',"
        " 'ab12cd34', ?, ?, 'cpu', '{}', ?)",
        [run_id, kind, engine, dtype, json.dumps(config or {})],
    )
    seq_rows, tok_rows, score_rows = [], [], []
    seq_id = 0
    for step in steps:
        for i in range(n_seq):
            length = int(rng.integers(8, 16))
            ids = rng.integers(0, len(VOCAB) - 1, size=length).tolist() + [len(VOCAB) - 1]
            reward = float(rng.integers(0, 2)) if rewards else None
            adv = (reward - 0.5) if rewards else None
            seq_rows.append(
                (
                    run_id,
                    seq_id,
                    f"p{i % 4}",
                    i // 4,
                    step,
                    "".join(VOCAB[t] for t in ids),
                    len(ids),
                    "stop",
                    reward,
                    adv,
                    20,
                )
            )
            for pos, tid in enumerate(ids):
                mu = float(rng.uniform(0.05, 0.99))
                tk_ids = [tid] + [int(v) for v in rng.choice(len(VOCAB), size=TOPK - 1, replace=False) if v != tid][
                    : TOPK - 1
                ]
                tk_p = sorted(rng.uniform(0.001, mu, size=len(tk_ids) - 1).tolist(), reverse=True)
                tk_lp = [float(np.log(mu))] + [float(np.log(p)) for p in tk_p]
                tok_rows.append(
                    (
                        run_id,
                        seq_id,
                        pos,
                        tid,
                        VOCAB[tid],
                        categorize(VOCAB[tid], tid in SPECIAL),
                        float(np.log(mu)),
                        tk_ids if topk else None,
                        tk_lp if topk else None,
                    )
                )
                for s_i, scorer in enumerate(scorers):
                    # every fourth token drifts far enough to leave PPO's clip range and DPPO's TV region
                    drift = 0.6 if (pos % 4 == 1 and s_i == 0) else 0.02 * (s_i + 1)
                    pi = min(max(mu * (1 + float(rng.normal(0, drift))), 1e-4), 0.9999)
                    nonfinite = run_id.endswith("bf16") and seq_id == 0 and pos == 2 and scorer == "hf:bf16"
                    logp = None if nonfinite else float(np.log(pi))
                    score_rows.append(
                        (
                            run_id,
                            seq_id,
                            pos,
                            scorer,
                            logp,
                            float(rng.uniform(0.1, 3.0)),
                            tk_ids if topk else None,
                            [float(np.log(pi))] + tk_lp[1:] if topk else None,
                            abs(pi - mu) / 2,
                            0.001,
                            nonfinite,
                            tk_lp if topk else None,
                            None,
                        )
                    )
            seq_id += 1
    for table, rows in (("sequences", seq_rows), ("tokens", tok_rows), ("scores", score_rows)):
        _insert_leading(con, table, rows)


def build_store(path: Path, *, full: bool = True) -> Path:
    """Write a small store to a DuckDB file at `path` and return it."""
    rng = np.random.default_rng(7)
    con = duckdb.connect(str(path))
    create_schema(con)
    _insert_run(
        con,
        rng,
        "collect-vllm-bf16",
        kind="collect",
        engine="vllm",
        dtype="bf16",
        scorers=["hf:fp32", "hf:bf16"],
        n_seq=8,
        topk=full,
        rewards=False,
    )
    if full:
        _insert_run(
            con,
            rng,
            "collect-hf-fp16",
            kind="collect",
            engine="hf",
            dtype="fp16",
            scorers=["hf:fp32"],
            n_seq=6,
            topk=False,
            rewards=False,
        )
        _insert_run(
            con,
            rng,
            "train-dppo",
            kind="train",
            engine="vllm",
            dtype="bf16",
            scorers=["hf:fp32"],
            n_seq=4,
            topk=False,
            rewards=True,
            steps=(0, 1, 2),
            config={"loss": "dppo_binary_tv"},
        )
        _insert_run(
            con,
            rng,
            "train-grpo",
            kind="train",
            engine="vllm",
            dtype="bf16",
            scorers=["hf:fp32"],
            n_seq=4,
            topk=False,
            rewards=True,
            steps=(0, 1, 2),
            config={"loss": "grpo"},
        )
        for run_id in ("train-dppo", "train-grpo"):
            for step in range(3):
                for name in ("mismatch/abs_dp/mean", "mask/negative_adv/frac", "reward/mean"):
                    con.execute(
                        "INSERT INTO train_metrics VALUES (?, ?, ?, ?)", [run_id, step, name, float(rng.uniform(0, 1))]
                    )
    con.close()
    return path


def export_parquet(db: Path, out: Path) -> Path:
    """Copy every table of a DuckDB store to `<out>/<table>.parquet`."""
    out.mkdir(parents=True, exist_ok=True)
    con = duckdb.connect(str(db), read_only=True)
    for table in TABLES:
        con.execute(f"COPY {table} TO '{out / (table + '.parquet')}' (FORMAT parquet)")
    con.close()
    return out


def write_png(path: Path, width: int = 8, height: int = 4) -> Path:
    """A tiny valid RGB PNG (a figure stand-in), written with the standard library only."""
    raw = b"".join(b"\x00" + bytes([200, 60, 60]) * width for _ in range(height))

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(raw))
        + chunk(b"IEND", b"")
    )
    return path


@pytest.fixture(scope="session")
def duckdb_store(tmp_path_factory) -> Path:
    """A full store as one DuckDB file."""
    return build_store(tmp_path_factory.mktemp("duck") / "fixture.duckdb")


@pytest.fixture(scope="session")
def bare_store(tmp_path_factory) -> Path:
    """One collect run: no top-K, no rewards, no training runs, no figures."""
    return build_store(tmp_path_factory.mktemp("bare") / "bare.duckdb", full=False)


@pytest.fixture(scope="session")
def study_dir(tmp_path_factory, duckdb_store) -> Path:
    """A study folder `studies/fixture/` with `results/*.parquet` and two figures."""
    study = tmp_path_factory.mktemp("studies") / "fixture"
    export_parquet(duckdb_store, study / "results")
    write_png(study / "figures" / "fig1_ratio_vs_mu.png")
    write_png(study / "figures" / "fig2_clipping_by_category.png")
    return study


@pytest.fixture(scope="session")
def parquet_store(study_dir) -> Path:
    """The full store as a directory of Parquet files (`<dir>/<table>.parquet`)."""
    return study_dir / "results"


@pytest.fixture
def in_ci() -> bool:
    return bool(os.environ.get("CI"))


@pytest.fixture(autouse=True)
def _no_background_warm_up(monkeypatch):
    """AppTest runs without the app's warm-up thread, so no test races another test's background queries;
    the warm-up has tests of its own and runs in the browser test's real server."""
    monkeypatch.setenv("MISMATCH_LAB_APP_WARMUP", "0")


@pytest.fixture(autouse=True)
def _results_cache_per_test(monkeypatch, tmp_path):
    """Each test gets its own disk cache of results (store/cache.py), so no test reads what another computed."""
    monkeypatch.setenv("MISMATCH_LAB_CACHE", str(tmp_path / "results-cache"))


@pytest.fixture
def lab_ui(monkeypatch):
    """The app's UI helpers module (apps/lab_ui.py), imported in this process."""
    monkeypatch.syspath_prepend(str(APP.parent))
    import lab_ui

    return lab_ui


def _insert_leading(con, table: str, rows: list[tuple]) -> None:
    """Insert rows holding the table's leading columns in DDL order: optional columns the contract gains
    later (appended at the end) stay NULL."""
    if not rows:
        return
    names = [r[0] for r in con.execute(f"DESCRIBE {table}").fetchall()][: len(rows[0])]
    marks = ", ".join("?" * len(names))
    con.executemany(f"INSERT INTO {table} ({', '.join(names)}) VALUES ({marks})", rows)
