"""run_all and `mismatch-lab analyze`: the tables, the JSON document, user errors."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from mismatch_lab.analysis import (
    ANALYSES,
    clipping,
    precision,
    run_all,
    violations,
    volatility,
)
from mismatch_lab.cli import main


def test_run_all_returns_every_analysis_and_equals_the_single_functions(con):
    seen = []
    out = run_all(con, progress=lambda name, seconds: seen.append(name))
    assert list(out) == list(ANALYSES) and seen == ["join", *ANALYSES]
    assert set(out["volatility"]["scale"]) == {"linear", "log"}
    assert set(out["clipping"]["view"]) == {"category", "mu_bucket", "top_token"}
    assert set(out["precision"]["comparison"]) == {"rollout_vs_scorer", "scorer_vs_reference"}
    assert set(out["violations"]["source"]) == {"tokens", "train_metrics"}

    def same(stacked: pd.DataFrame, single: pd.DataFrame) -> None:
        got = stacked[single.columns].reset_index(drop=True)
        pd.testing.assert_frame_equal(got, single.reset_index(drop=True), check_dtype=False, rtol=1e-12)

    pairs = out["precision"][out["precision"]["comparison"] == "rollout_vs_scorer"]
    same(pairs, precision.precision_table(con))
    same(out["volatility"][out["volatility"]["scale"] == "log"].drop(columns="scale"),
         volatility.volatility_table(con, buckets="log").drop(columns="scale"))  # fmt: skip
    same(out["volatility"][out["volatility"]["scale"] == "linear"].drop(columns="scale"),
         volatility.volatility_table(con, buckets="linear").drop(columns="scale"))  # fmt: skip
    same(out["clipping"][out["clipping"]["view"] == "category"], clipping.clipping_by_category(con))
    same(out["clipping"][out["clipping"]["view"] == "top_token"], clipping.top_clipped_tokens(con))
    same(out["violations"][out["violations"]["source"] == "tokens"], violations.violations_table(con))


def test_run_all_leaves_no_temporary_tables_behind(con):
    run_all(con)
    left = con.execute("SELECT table_name FROM duckdb_tables() WHERE temporary").fetchall()
    assert left == []


def test_run_all_on_a_store_without_optional_data_never_raises(plain_con):
    out = run_all(plain_con)
    assert not out["precision"].empty
    assert out["approximation"].empty
    assert list(out) == list(ANALYSES)
    assert not (out["violations"]["source"] == "tokens").any()  # no rewards: no violation rows


def test_analyze_prints_tables_and_writes_json_with_nulls_for_nan(full_store, tmp_path, capsys):
    target = tmp_path / "out.json"
    assert main(["analyze", "--db", str(full_store.path), "--json", str(target), "--all"]) == 0
    printed = capsys.readouterr().out
    assert "== precision [comparison = rollout_vs_scorer]" in printed and "kl_k3" in printed
    doc = json.loads(target.read_text())
    assert list(doc) == list(ANALYSES)
    row = next(r for r in doc["precision"] if r["rollout"] == "vllm:bf16" and r["scorer"] == "hf:fp32")
    for key in ("n_tokens", "abs_dp_mean", "abs_dp_max", "abs_dlogp_mean", "kl_k3", "frac_ratio_outside_clip"):
        assert isinstance(row[key], (int, float))
    assert isinstance(row["n_tokens"], int)
    assert row["reference"] is None  # NaN became null
    vol = doc["volatility"]
    assert any(r["n_tokens"] == 0 and r["r_mean"] is None for r in vol)  # an empty bucket, kept


def test_analyze_filters_by_rollout_and_scorer(full_store, tmp_path):
    target = tmp_path / "f.json"
    argv = ["analyze", "--db", str(full_store.path), "--json", str(target), "--rollout", "vllm:fp16", "--scorer", "hf:fp32"]
    assert main(argv) == 0
    rows = json.loads(target.read_text())["precision"]
    assert {(r["rollout"], r["scorer"]) for r in rows} == {("vllm:fp16", "hf:fp32")}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--db", "/no/such/store.duckdb"], "no such file or directory"),
        (["--rollout", "sglang:bf16"], "--rollout sglang:bf16 is not in this store; it holds: vllm:bf16, vllm:fp16"),
        (["--json", "/no/such/folder/out.json"], "does not exist"),
    ],
)
def test_user_mistakes_exit_2_with_one_line_naming_the_fix(full_store, capsys, argv, message):
    base = ["analyze", "--db", str(full_store.path)]
    assert main(base + argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("mismatch-lab analyze: error:") and message in err[-1]


def test_analyze_reads_a_parquet_results_directory(full_store, tmp_path):
    import duckdb

    results = tmp_path / "study" / "results"
    results.mkdir(parents=True)
    src = duckdb.connect(str(full_store.path), read_only=True)
    for table in ("runs", "sequences", "tokens", "scores", "train_metrics"):
        src.execute(f"COPY {table} TO '{results / (table + '.parquet')}' (FORMAT parquet)")
    src.close()
    target = tmp_path / "p.json"
    assert main(["analyze", "--db", str(tmp_path / "study"), "--json", str(target)]) == 0
    from_parquet = json.loads(target.read_text())
    assert main(["analyze", "--db", str(full_store.path), "--json", str(tmp_path / "d.json")]) == 0
    from_duckdb = json.loads((tmp_path / "d.json").read_text())
    # the same rows; floats to rounding (DuckDB's parallel sums do not fix the order of additions)
    got, expect = pd.DataFrame(from_parquet["precision"]), pd.DataFrame(from_duckdb["precision"])
    pd.testing.assert_frame_equal(got, expect, rtol=1e-12)


def test_run_all_from_python_refuses_labels_the_store_does_not_hold(full_store):
    from mismatch_lab.analysis import run_all
    from mismatch_lab.errors import UserError
    from mismatch_lab.store.reader import open_store

    con = open_store(full_store.path)
    with pytest.raises(UserError, match=r"^rollout=sglang:bf16 is not in this store; it holds: vllm:bf16, vllm:fp16$"):
        run_all(con, rollout="sglang:bf16")
    with pytest.raises(UserError, match=r"^scorer=hf:fp8 is not in this store"):
        run_all(con, scorer=["hf:fp32", "hf:fp8"])
    tables = run_all(con, rollout=(r for r in ["vllm:bf16"]))  # any iterable, read once
    assert set(tables["precision"]["rollout"]) == {"vllm:bf16"}
