"""A user who points one importer at another framework's files gets the expected layout and the command
that reads them, in one line, and nothing is written."""

from __future__ import annotations

import pytest
from import_fixtures import jsonl_lines, write_jsonl, write_prime_export


@pytest.fixture
def inputs(tmp_path):
    exports = write_prime_export(tmp_path / "outputs")
    (tmp_path / "empty").mkdir()
    return {"prime_dir": tmp_path / "outputs", "prime_file": exports / "step_0" / "rank_0.jsonl",
            "jsonl_file": write_jsonl(tmp_path / "mine.jsonl", jsonl_lines()), "empty": tmp_path / "empty"}


@pytest.mark.parametrize(("fmt", "what", "wants"), [
    ("jsonl", "prime_dir", ["no jsonl files to import under", "import jsonl reads a .jsonl file, or a folder",
                            "looks like a prime-rl token export: mismatch-lab import prime-rl"]),
    ("jsonl", "prime_file", ["rank_0.jsonl:1: field 'logp_rollout' is missing (or null)",
                             "looks like a prime-rl token export: mismatch-lab import prime-rl"]),
    ("slime", "empty", ["no slime files to import under", ("import slime reads the .pt train dumps of "
                                                          "--save-debug-train-data: <dump dir>/train_data/")]),
    ("slime", "prime_file", ["cannot be loaded with torch.load", ("looks like a prime-rl token export: "
                                                                 "mismatch-lab import prime-rl")]),
    ("prime-rl", "jsonl_file", ["is not a prime-rl export file", ("looks like a mismatch-lab jsonl file: "
                                                                 "mismatch-lab import jsonl")]),
    ("prime-rl", "empty", ["no prime-rl token exports under"]),
])  # fmt: skip
def test_another_frameworks_files_name_the_importer_that_reads_them(cli, inputs, tmp_path, fmt, what, wants):
    path = inputs[what]
    code, _, err = cli("import", fmt, path, "--out", tmp_path / "store", *(["--trust-pickle"] if fmt == "slime" else []))
    line = err.strip().splitlines()[-1]
    assert code == 2 and line.startswith("mismatch-lab import: error:"), err
    for want in wants:
        assert want in line
    assert line.count("looks like") <= 1  # named once, whether by the importer or by the shared reader
    if what == "empty":
        assert "looks like" not in line  # nothing to recognise: no guess
    assert not (tmp_path / "store").exists()
