"""`--run-id` of analyze, doctor and corrections (store/run_option.py): the named runs measured as a store
holding them alone would be, an unknown id refused in one line naming `mismatch-lab runs`, a damaged run
asked for by name refused with the file and the fix. Small real stores: synthetic DuckDB stores and a
shard store the Recorder wrote, through the CLI's main."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from mismatch_lab.cli import main
from mismatch_lab.store import shards
from mismatch_lab.store.synthetic import SyntheticSpec, synthetic_store, write_store

A, B = "synthetic-0-vllm-bf16", "synthetic-1-vllm-bf16"  # two runs of ONE rollout label: only --run-id parts them
EPS = sys.float_info.epsilon
# Checks whose value is a mean of terms near 1 minus 1 (χ² = mean(r²) − 1): the rounding of the sum is relative to
# the terms (~1), so after the subtraction it is absolute, however small the value (a CI run differed by 2.2e-16
# on a value of -3.3e-4 when DuckDB added the 600 r² in another order).
TERMS_NEAR_ONE = {"chi2"}


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> dict[str, Path]:
    """{'both': runs A and B, 'b': run B alone (the same rows)}."""
    root = tmp_path_factory.mktemp("run-id")
    both = synthetic_store(root / "both.duckdb", SyntheticSpec(rollouts=("vllm:bf16", "vllm:bf16"), n_sequences=16,
                                                               rewards="advantage", seed=3))
    alone = {t: f[f["run_id"] == B] for t, f in both.frames.items()}
    write_store(root / "b.duckdb", alone)
    return {"both": both.path, "b": root / "b.duckdb"}


def _cli(capsys, *args) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def _json(capsys, tmp_path, command: str, store: Path, *extra: str) -> dict:
    target = tmp_path / f"{command}-{len(list(tmp_path.iterdir()))}.json"
    code, _, err = _cli(capsys, command, "--db", store, "--json", target, *extra)
    assert code == 0, err
    return json.loads(target.read_text())


def _same_rows(got: list[dict], want: list[dict], key: tuple[str, ...], n_terms: int) -> None:
    """Equal rows, floats within the rounding of a sum of `n_terms` doubles in another order (relative to the
    value, or to the terms' magnitude 1 for the checks in TERMS_NEAR_ONE)."""
    by = {tuple(r[k] for k in key): r for r in want}
    assert sorted(by) == sorted(tuple(r[k] for k in key) for r in got)
    for r in got:
        w = by[tuple(r[k] for k in key)]
        tol = 4 * n_terms * EPS
        for name, value in r.items():
            if isinstance(value, float):
                near_one = name == "value" and r.get("check") in TERMS_NEAR_ONE
                assert value == pytest.approx(w[name], rel=tol, abs=tol if near_one else 0.0), (name, r)
            else:
                assert value == w[name], (name, r)


def test_doctor_with_a_run_id_judges_that_run_as_a_store_holding_it_alone(capsys, tmp_path, stores):
    got = _json(capsys, tmp_path, "doctor", stores["both"], "--run-id", B)
    want = _json(capsys, tmp_path, "doctor", stores["b"])
    whole = _json(capsys, tmp_path, "doctor", stores["both"])
    value = lambda doc: next(c["value"] for c in doc["checks"] if c["check"] == "abs_dp_mean")
    assert value(got) != pytest.approx(value(whole), rel=1e-6)  # the other run's rows would move the number
    assert got["run_ids"] == [B] and whole["run_ids"] is None and want["store"] != got["store"]  # which runs
    _same_rows(got["checks"], want["checks"], ("pair", "run_id", "check"), 600)
    assert [a["because"] for a in got["recommendations"]] == [a["because"] for a in want["recommendations"]]
    _same_rows(got["attribution"], want["attribution"], ("rollout", "scorer", "source"), 600)


def test_corrections_with_a_run_id_compare_that_runs_tokens_alone(capsys, tmp_path, stores):
    got = _json(capsys, tmp_path, "corrections", stores["both"], "--run-id", B)["corrections"]
    want = _json(capsys, tmp_path, "corrections", stores["b"])["corrections"]
    whole = _json(capsys, tmp_path, "corrections", stores["both"])["corrections"]
    import duckdb

    con = duckdb.connect(str(stores["b"]), read_only=True)
    (n_b,) = con.execute("SELECT count(*) FROM tokens").fetchone()
    con.close()
    counted = lambda rows: {r["n_tokens"] for r in rows if r["n_tokens"]}  # (a method that needs absent columns counts 0)
    assert counted(got) == {n_b} and counted(whole) != {n_b}
    _same_rows(got, want, ("method", "rollout", "scorer"), 600)


def test_a_comma_list_and_the_repeated_option_name_the_same_runs(capsys, tmp_path, stores):
    """(One parser for the three commands, store/run_option.py; each parses a comma list in the next test.)"""
    listed = _json(capsys, tmp_path, "doctor", stores["both"], "--run-id", f"{A},{B}")
    repeated = _json(capsys, tmp_path, "doctor", stores["both"], "--run-id", A, "--run-id", f" {B} ")
    whole = _json(capsys, tmp_path, "doctor", stores["both"])
    for other in (repeated, whole):
        _same_rows(listed["checks"], other["checks"], ("pair", "run_id", "check"), 600)
    assert listed["run_ids"] == repeated["run_ids"] == [A, B]


@pytest.mark.parametrize("command", ["analyze", "doctor", "corrections"])
def test_an_unknown_run_id_exits_2_in_one_line_naming_the_runs_command(capsys, stores, command):
    code, out, err = _cli(capsys, command, "--db", stores["both"], "--run-id", f"{B},no-such-run")
    assert code == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith(f"mismatch-lab {command}: error: --run-id no-such-run: no such run in")
    assert f"it holds {A}, {B}" in line and f"`mismatch-lab runs --db {stores['both']}` lists them" in line


def test_doctor_refuses_a_run_id_with_the_probe_before_probing(capsys, tmp_path):
    code, out, err = _cli(capsys, "doctor", "--model", "default", "--db", tmp_path / "probe.duckdb", "--run-id", A)
    assert code == 2 and out == "" and not (tmp_path / "probe.duckdb").exists()
    (line,) = err.strip().splitlines()
    assert "--run-id picks runs of the store --db names" in line and "drop --run-id" in line


def _record(root: Path) -> None:
    import numpy as np

    from mismatch_lab.record import Recorder

    rng = np.random.default_rng(0)
    for run in ("A", "B"):
        with Recorder(root, run, framework="verl", rollout_engine="vllm", trainer_dtype="bf16") as rec:
            for step in range(3):
                lmu = -rng.random((4, 16)) * 3
                lpi = np.minimum(lmu + 0.01 * rng.standard_normal((4, 16)), 0.0)
                rec.log_step(step, rng.integers(0, 500, (4, 16)), np.ones((4, 16), bool), lmu, lpi)


@pytest.fixture(scope="module")
def damaged(tmp_path_factory) -> tuple[Path, Path]:
    """(a shard store of runs A and B, the scores shard of B's step 1 cut to half its size)"""
    root = tmp_path_factory.mktemp("damaged-run-id") / "store"
    _record(root)
    bad = shards.shard_path(root, "scores", "B", 1, f"{shards.rank_prefix(0)}-part-0000")
    os.truncate(bad, bad.stat().st_size // 2)
    return root, bad


@pytest.mark.parametrize("command", ["doctor", "corrections"])
def test_a_damaged_run_asked_for_by_name_is_refused_with_the_file_and_the_fix(capsys, tmp_path, damaged, command):
    root, bad = damaged
    code, out, err = _cli(capsys, command, "--db", root, "--run-id", "B", "--json", tmp_path / "b.json")
    assert code == 2 and out == "" and not (tmp_path / "b.json").exists()
    (line,) = err.strip().splitlines()
    assert f"run 'B' is incomplete: damaged shard {bad}" in line and "log step 1 again" in line
    code, _, err = _cli(capsys, command, "--db", root, "--run-id", "A", "--json", tmp_path / "a.json")
    assert code == 0 and f"warning: damaged shard {bad} of run 'B'" in err, err
    doc = json.loads((tmp_path / "a.json").read_text())
    n_a = 3 * 4 * 16  # run A's tokens: 3 steps of 4 sequences of 16
    if command == "doctor":
        (check,) = [c for c in doc["checks"] if c["check"] == "abs_dp_mean"]
        assert check["detail"].startswith(f"n = {n_a} finite rows")
        assert doc["incomplete"] == {}  # B is not read, so no verdict stands on it
    else:
        assert {r["n_tokens"] for r in doc["corrections"] if r["n_tokens"]} == {n_a}


def test_a_parquet_export_names_the_duckdb_it_came_from(capsys, tmp_path, stores):
    import duckdb

    export = tmp_path / "export"
    export.mkdir()
    con = duckdb.connect(str(stores["both"]), read_only=True)
    for table in ("runs", "sequences", "tokens", "scores"):
        con.execute(f"COPY {table} TO '{export / (table + '.parquet')}' (FORMAT parquet)")
    con.close()
    code, _, err = _cli(capsys, "doctor", "--db", export, "--run-id", "x")
    assert code == 2 and "`mismatch-lab runs --db <the .duckdb it was exported from>` lists them" in err
