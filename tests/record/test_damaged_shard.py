"""A shard cut short (a node died while writing it) damages its unit, not the store: the other runs read
as before, every command names the file and the fix, and `runs --check` lists it."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from mismatch_lab.cli import main
from mismatch_lab.record import Recorder
from mismatch_lab.store import shards

STEPS, B, T = 3, 4, 16


def _record(root: Path) -> None:
    rng = np.random.default_rng(0)
    for run in ("A", "B"):
        with Recorder(root, run, framework="verl", rollout_engine="vllm", trainer_dtype="bf16") as rec:
            for step in range(STEPS):
                lmu = -rng.random((B, T)) * 3
                lpi = np.minimum(lmu + 0.01 * rng.standard_normal((B, T)), 0.0)
                rec.log_step(step, rng.integers(0, 500, (B, T)), np.ones((B, T), bool), lmu, lpi)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("damaged") / "pristine"
    _record(root)
    return root


def _cut(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)  # what a node dying in the middle of the write leaves


def _unit(root: Path, table: str) -> Path:
    return shards.shard_path(root, table, "B", 1, f"{shards.rank_prefix(0)}-part-0000")


def _same(got, want) -> None:
    """Equal, floats up to the order of their sums: DuckDB's threads add run A's STEPS * B * T terms (of
    magnitude <= 1: log-ratios, r - 1) in another order when the store holds other files, which moves a
    float64 mean by at most that many roundings."""
    tol = STEPS * B * T * np.finfo(np.float64).eps
    if isinstance(got, dict):
        assert got.keys() == want.keys()
        for k in got:
            _same(got[k], want[k])
    elif isinstance(got, list):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            _same(g, w)
    elif isinstance(got, float) and isinstance(want, float):
        assert math.isclose(got, want, rel_tol=tol, abs_tol=tol), (got, want)
    else:
        assert got == want


def _cli(capsys, *args) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def store(pristine, tmp_path) -> Path:
    root = tmp_path / "store"
    shutil.copytree(pristine, root)
    return root


@pytest.mark.parametrize("table", ["scores", "sequences", "tokens"])
def test_a_shard_cut_short_leaves_the_other_run_analysed_as_before_and_names_the_file(capsys, pristine, store, table,
                                                                                     tmp_path):
    bad = _unit(store, table)
    _cut(bad)
    want, got = tmp_path / "want.json", tmp_path / "got.json"
    assert _cli(capsys, "analyze", "--db", pristine, "--run-id", "A", "--json", want)[0] == 0
    code, _, err = _cli(capsys, "analyze", "--db", store, "--run-id", "A", "--json", got)
    assert code == 0, err
    _same(json.loads(got.read_text()), json.loads(want.read_text()))  # run A: the same numbers
    assert f"damaged shard {bad} of run 'B'" in err and "cut short" in err and "log step 1 again" in err, err


def test_runs_lists_every_run_warns_of_the_damaged_file_and_reads_the_rest_of_its_run(capsys, store):
    bad = _unit(store, "scores")
    _cut(bad)
    code, out, err = _cli(capsys, "runs", "--db", store)
    assert code == 0, err
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:]}
    assert rows["A"][5:7] == [str(STEPS * B), str(STEPS * B * T)]
    assert rows["B"][5:7] == [str((STEPS - 1) * B), str((STEPS - 1) * B * T)]  # without the damaged unit
    assert err.count(str(bad)) == 1 and "delete it with the unit's other files" in err, err


def test_runs_check_lists_the_damaged_files_and_fails_until_they_are_gone(capsys, store):
    files = 2 + 2 * STEPS * 3  # two runs rows; each step's sequences, tokens and scores of two runs
    assert _cli(capsys, "runs", "--db", store, "--check")[:2] == (0, f"no damaged file among {files} committed files\n")
    cut = _unit(store, "scores")
    _cut(cut)
    garbled = shards.shard_path(store, "tokens", "A", 2, f"{shards.rank_prefix(0)}-part-0000")
    data = bytearray(garbled.read_bytes())  # its footer garbled, its length and magic intact: only a parse sees it
    footer = int.from_bytes(data[-8:-4], "little")
    data[-8 - footer:-8] = b"\xff" * footer
    garbled.write_bytes(bytes(data))
    code, out, err = _cli(capsys, "runs", "--db", store, "--check")
    assert code == 1, out + err
    lines = out.splitlines()
    assert lines[-1] == f"2 damaged of {files} committed files"
    assert any(str(cut) in x and "cut short" in x for x in lines) and any(str(garbled) in x and "footer" in x
                                                                           for x in lines), out
    for table in shards.STEP_TABLES:  # the fix it names: the units' files go, then the check passes
        for run in ("A", "B"):
            shards.shard_path(store, table, run, 2 if run == "A" else 1, f"{shards.rank_prefix(0)}-part-0000") \
                .unlink(missing_ok=True)
    assert _cli(capsys, "runs", "--db", store, "--check")[:2] == (0, f"no damaged file among {files - 6} committed files\n")


def test_a_damaged_run_row_is_named_with_the_drop_that_fixes_it(capsys, store):
    row = shards.run_row_path(store, "B", 0)
    _cut(row)
    code, out, err = _cli(capsys, "runs", "--db", store)
    assert code == 0 and f"damaged shard {row} of run 'B'" in err and "--drop B" in err, err
    assert [line.split()[0] for line in out.splitlines()[1:]] == ["A"]
    code, out, _ = _cli(capsys, "runs", "--db", store, "--drop", "B")
    assert code == 0 and "dropped B" in out and _cli(capsys, "runs", "--db", store, "--check")[0] == 0
