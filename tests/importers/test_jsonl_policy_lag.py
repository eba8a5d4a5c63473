"""`import jsonl`: the optional `policy_lag` field lands in sequences.policy_lag (one number, or one value per
token over the stored positions); a non-integer, negative or mixed lag refuses the file in one line."""

from __future__ import annotations

import json

import pytest
from import_fixtures import store_files

from mismatch_lab.analysis.staleness import staleness_table
from mismatch_lab.store.reader import open_store


def _line(step: int, **extra) -> str:
    return json.dumps({"step": step, "token_ids": [5, 6, 7], "logp_rollout": [-1.0, -2.0, -0.5],
                       "logp_trainer": [-1.25, -2.0, -0.5], **extra})


def _lags(store) -> list[tuple]:
    return open_store(store).execute("SELECT step, seq_id, policy_lag FROM sequences ORDER BY seq_id").fetchall()


def test_a_per_sequence_lag_is_stored_and_a_line_without_one_stores_null(cli, tmp_path):
    f = tmp_path / "run.jsonl"
    f.write_text("\n".join([_line(1, policy_lag=2), _line(1), _line(2, policy_lag=0)]) + "\n")
    code, _, err = cli("import", "jsonl", f, "--out", tmp_path / "store")
    assert code == 0, err
    assert [(s, lag) for s, _, lag in _lags(tmp_path / "store")] == [(1, 2), (1, None), (2, 0)]
    table = staleness_table(open_store(tmp_path / "store"))
    assert list(table["policy_lag"]) == [0, 2] and list(table["n_tokens"]) == [3, 3]


def test_a_per_token_lag_list_gives_its_value_over_the_stored_positions(cli, tmp_path):
    f = tmp_path / "run.jsonl"
    f.write_text("\n".join([_line(1, policy_lag=[3, 3, 3]),
                            _line(1, policy_lag=[1, 4, 4], mask=[False, True, True])]) + "\n")  # 1 on a prompt token
    code, _, err = cli("import", "jsonl", f, "--out", tmp_path / "store")
    assert code == 0, err
    assert [lag for _, _, lag in _lags(tmp_path / "store")] == [3, 4]


@pytest.mark.parametrize(("value", "needle"), [
    (-1, "field 'policy_lag' must be an integer in [0, 2^31)"),
    (1.5, "field 'policy_lag' must be an integer in [0, 2^31)"),
    (1.0, "field 'policy_lag' must be an integer in [0, 2^31)"),
    ("2", "field 'policy_lag' must be an integer in [0, 2^31)"),
    (2**31, "field 'policy_lag' must be an integer in [0, 2^31)"),
    ([0, 1, 1], "field 'policy_lag' differs between the stored tokens of the line"),
    ([1, 1], "field 'policy_lag' has a different length than token_ids"),
    ([1, -1, 1], "field 'policy_lag' must be an integer in [0, 2^31)"),
])
def test_a_bad_policy_lag_refuses_the_file_naming_its_line_and_commits_nothing(cli, tmp_path, value, needle):
    f = tmp_path / "bad.jsonl"
    f.write_text("\n".join([_line(1, policy_lag=1), _line(1, policy_lag=value), _line(2)]) + "\n")
    store = tmp_path / "store"
    code, _, err = cli("import", "jsonl", f, "--out", store)
    assert code == 2 and f"{f}:2: {needle}" in err and len(err.strip().splitlines()) == 1, err
    assert store_files(store) == []
