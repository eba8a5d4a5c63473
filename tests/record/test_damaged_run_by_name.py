"""A run that lost a unit to a damaged shard, asked for by name, is refused in one line naming the file and
the fix (a result without the unit would pass for the run's); read with the whole store it is read without
the unit (a warning), and doctor says which pairs' verdicts stand on such a run."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from mismatch_lab.cli import main
from mismatch_lab.store import shards
from mismatch_lab.store.reader import damaged_units, open_store


def _record(root: Path) -> None:
    import numpy as np

    from mismatch_lab.record import Recorder

    rng = np.random.default_rng(0)
    for run, engine in (("A", "vllm"), ("B", "sglang")):  # B alone behind the sglang/... pair
        with Recorder(root, run, framework="verl", rollout_engine=engine, trainer_dtype="bf16") as rec:
            for step in range(3):
                lmu = -rng.random((4, 16)) * 3
                lpi = np.minimum(lmu + 0.01 * rng.standard_normal((4, 16)), 0.0)
                rec.log_step(step, rng.integers(0, 500, (4, 16)), np.ones((4, 16), bool), lmu, lpi)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("damaged-by-name") / "pristine"
    _record(root)
    return root


@pytest.fixture
def store(pristine, tmp_path) -> tuple[Path, Path]:
    """(store, the scores shard of run B's step 1 cut to half its size, as a node dying mid-write leaves it)"""
    root = tmp_path / "store"
    shutil.copytree(pristine, root)
    bad = shards.shard_path(root, "scores", "B", 1, f"{shards.rank_prefix(0)}-part-0000")
    os.truncate(bad, bad.stat().st_size // 2)
    return root, bad


def _cli(capsys, *args) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_analyze_of_the_damaged_run_by_name_exits_2_naming_the_file_and_the_fix(capsys, store, tmp_path):
    root, bad = store
    code, out, err = _cli(capsys, "analyze", "--db", root, "--run-id", "B", "--json", tmp_path / "b.json")
    assert code == 2 and out == "" and not (tmp_path / "b.json").exists()
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert f"run 'B' is incomplete: damaged shard {bad}" in lines[0]
    assert f"delete it with the unit's other files ({root}/*/B/step-00000001/" in lines[0] and "log step 1 again" in lines[0]


def test_the_run_beside_it_by_name_and_the_whole_store_read_without_the_unit_with_a_warning(capsys, store, tmp_path):
    root, bad = store
    code, _, err = _cli(capsys, "analyze", "--db", root, "--run-id", "A", "--json", tmp_path / "a.json")
    assert code == 0 and f"warning: damaged shard {bad} of run 'B'" in err, err
    code, _, err = _cli(capsys, "analyze", "--db", root, "--json", tmp_path / "all.json")
    assert code == 0 and f"warning: damaged shard {bad} of run 'B'" in err, err
    con = open_store(root)
    assert [r[:2] for r in damaged_units(con)] == [("B", str(bad))]
    assert con.execute("SELECT count(*) FROM sequences WHERE run_id = 'B'").fetchone()[0] == 2 * 4  # step 1 left out


def test_doctor_marks_the_pairs_of_the_damaged_run_incomplete_and_no_other(capsys, pristine, store, tmp_path):
    root, bad = store
    code, out, _ = _cli(capsys, "doctor", "--db", root, "--json", tmp_path / "d.json")
    assert code == 0
    incomplete = json.loads((tmp_path / "d.json").read_text())["incomplete"]
    assert list(incomplete) == ["sglang/verl:bf16"] and str(bad) in incomplete["sglang/verl:bf16"][0]
    matrix = {line.split()[0]: line for line in out.splitlines() if line.startswith(("sglang/", "vllm/"))}
    assert " incomplete" in matrix["sglang/verl:bf16"] and "incomplete" not in matrix["vllm/verl:bf16"]
    assert "incomplete: the verdicts of sglang/verl:bf16 are on runs read without these units:" in out
    code, out, _ = _cli(capsys, "doctor", "--db", pristine, "--json", tmp_path / "whole.json")
    assert code == 0 and "incomplete" not in out
    assert json.loads((tmp_path / "whole.json").read_text())["incomplete"] == {}


def test_a_shard_whose_ends_are_intact_but_footer_is_not_is_named_with_its_run_and_the_fix(capsys, pristine, tmp_path):
    root = tmp_path / "store"
    shutil.copytree(pristine, root)
    bad = shards.shard_path(root, "tokens", "B", 1, f"{shards.rank_prefix(0)}-part-0000")
    data = bytearray(bad.read_bytes())
    for i in range(len(data) - 200, len(data) - 12):  # inside the footer's metadata; 'PAR1' and its length kept
        data[i] ^= 0x5A
    bad.write_bytes(bytes(data))
    code, out, err = _cli(capsys, "analyze", "--db", root)
    assert code == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert f"damaged shard {bad} of run 'B'" in line and "--drop B" in line and "re-export" not in line
