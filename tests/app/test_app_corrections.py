"""The Corrections page under Streamlit's AppTest on real DuckDB and Parquet stores, checked against
`mismatch_lab.corrections.compare.compare` on the same store, and `corrections.dropped` (the tokens one
method drops, the page's click-through to the token inspector) checked against the comparison's counts."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from app_paths import APP
from streamlit.testing.v1 import AppTest

from mismatch_lab.corrections.compare import compare
from mismatch_lab.corrections.dropped import dropped_sequences, dropped_tokens
from mismatch_lab.store.reader import open_store

TIMEOUT_S = 60
SHARES = ["frac_tokens_masked", "frac_seqs_masked", "frac_tokens_weight_changed", "ess", "weight_mean", "weight_max"]


@pytest.fixture(params=["duckdb", "parquet"])
def full_store(request, duckdb_store, parquet_store):
    return duckdb_store if request.param == "duckdb" else parquet_store


@pytest.fixture(scope="module")
def tables(duckdb_store):
    """compare() on the full store (the Parquet copy holds the same rows)."""
    con = open_store(duckdb_store)
    try:
        return compare(con)
    finally:
        con.close()


def open_page(monkeypatch, store) -> AppTest:
    monkeypatch.setenv("MISMATCH_LAB_STUDY", str(store))
    at = AppTest.from_file(str(APP), default_timeout=TIMEOUT_S)
    at.run()
    at.switch_page("app_pages/corrections.py").run()
    assert not at.exception, at.exception
    return at


def rerun(at: AppTest) -> AppTest:
    at.run()
    assert not at.exception, at.exception
    return at


def methods_table(at: AppTest) -> pd.DataFrame:
    return next(d.value for d in at.dataframe if "framework" in d.value.columns)


def texts(elements) -> str:
    return " ".join(str(e.value) for e in elements)


def pair_rows(tables, name: str, rollout: str, scorer: str) -> pd.DataFrame:
    t = tables[name]
    return t[(t["rollout"] == rollout) & (t["scorer"] == scorer)]


def assert_same_numbers(shown: pd.DataFrame, want: pd.DataFrame, columns=SHARES) -> None:
    got = shown.set_index("method").loc[want["method"]]
    for c in columns:
        np.testing.assert_allclose(got[c].to_numpy(float), want[c].to_numpy(float), rtol=1e-9, atol=1e-12,
                                   equal_nan=True, err_msg=c)


def test_the_page_shows_every_method_with_its_shares_framework_and_parameters(monkeypatch, full_store, tables):
    at = open_page(monkeypatch, full_store)
    assert [t.value for t in at.title] == ["Corrections"]
    assert [s.value for s in at.subheader] == ["What each method does to these tokens", "Tokens a method drops"]
    assert at.selectbox(key="corr_pair").options == ["hf:fp16 → hf:fp32", "vllm:bf16 → hf:bf16", "vllm:bf16 → hf:fp32"]
    (chart,) = at.get("vega_lite_chart")  # shares as bars beside ESS as points, one y scale: rows line up
    spec = json.loads(chart.proto.spec)
    assert [v["mark"]["type"] for v in spec["hconcat"]] == ["bar", "point"]
    assert spec["resolve"]["scale"]["y"] == "shared"
    for i, (rollout, scorer) in enumerate([("hf:fp16", "hf:fp32"), ("vllm:bf16", "hf:bf16"), ("vllm:bf16", "hf:fp32")]):
        if i:
            at.selectbox(key="corr_pair").set_value(i)
            rerun(at)
        want = pair_rows(tables, "corrections", rollout, scorer)
        shown = methods_table(at)
        assert shown["method"].tolist() == want["method"].tolist()  # every method, in the registry's order
        assert_same_numbers(shown, want)
        assert shown.set_index("method").loc["seq_mis", "framework"].startswith("TRL: vllm_importance_sampling_mode=sequence_mask")
        assert shown.set_index("method").loc["geo_mis", "params"] == "low=0.999, high=1.001"
        metrics = {m.label: m.value for m in at.metric}
        assert metrics["Finite tokens"] == f"{int(want['n_tokens'].max()):,}"
        short = {"advantage": "stored", "reward minus group mean": "derived"}  # shown short, named in full in the help
        assert metrics["Advantage"] == " + ".join(short.get(x, x) for x in want["advantage_source"].iloc[0].split(" + "))
    # vllm:bf16 -> hf:fp32 mixes the collect run (top-K) with the training runs (none): top-K rules are not computed
    assert "Not computed for this pair (needs top-K" in texts(at.caption)
    assert np.isnan(methods_table(at).set_index("method").loc["dppo_topk_tv", "frac_tokens_masked"])
    at.selectbox(key="corr_pair").set_value(1)
    rerun(at)
    assert "Not computed" not in texts(at.caption)  # the collect run alone carries top-K
    assert methods_table(at).set_index("method").loc["dppo_topk_tv", "n_tokens"] > 0


@pytest.mark.parametrize("split,key,table", [("category", "category", "by_category"),
                                             ("mu_bucket", "mu_bucket", "by_mu_bucket"),
                                             ("adv_sign", "adv_sign", "by_adv_sign")])  # fmt: skip
def test_filters_rebuild_the_shares_from_the_split_tables(monkeypatch, duckdb_store, tables, split, key, table):
    at = open_page(monkeypatch, duckdb_store)
    at.selectbox(key="corr_pair").set_value(2)  # vllm:bf16 -> hf:fp32: collect and training runs, with advantages
    at.radio(key="corr_split").set_value(split)
    rerun(at)
    rows = pair_rows(tables, table, "vllm:bf16", "hf:fp32")
    values = at.multiselect(key=f"corr_{key}").value
    assert sorted(values) == sorted(set(rows[key]))
    # every value chosen: the numbers of the whole pair again (sequences: only the sign split counts them)
    main = pair_rows(tables, "corrections", "vllm:bf16", "hf:fp32")
    main = main[main["note"] == ""]
    columns = SHARES if split == "adv_sign" else [c for c in SHARES if c != "frac_seqs_masked"]
    assert_same_numbers(methods_table(at), main, columns)
    # one value: that row of the split table
    one = values[0]
    at.multiselect(key=f"corr_{key}").set_value([one])
    rerun(at)
    shown = methods_table(at)
    want = rows[rows[key] == one]
    assert_same_numbers(shown, want, columns)
    if split == "adv_sign":
        assert shown["frac_seqs_masked"].notna().any()
    else:
        assert shown["frac_seqs_masked"].isna().all()
        assert "not split by category or μ bucket" in texts(at.caption)
    if split == "mu_bucket":
        assert all(o.startswith("μ ∈ [") for o in at.multiselect(key="corr_mu_bucket").options)


def test_threshold_overrides_are_applied_and_bad_ones_reported(monkeypatch, duckdb_store):
    at = open_page(monkeypatch, duckdb_store)
    at.text_input(key="corr_overrides").input("seq_mis.cap=1.0001, geo_mis.low=0.5")
    next(b for b in at.button if b.label == "Apply").click()
    rerun(at)
    shown = methods_table(at).set_index("method")
    assert shown.loc["seq_mis", "params"] == "cap=1.0001" and shown.loc["geo_mis", "params"] == "low=0.5, high=1.001"
    con = open_store(duckdb_store)
    want = compare(con, overrides={"seq_mis": {"cap": 1.0001}, "geo_mis": {"low": 0.5}})["corrections"]
    con.close()
    assert_same_numbers(methods_table(at), pair_rows({"c": want}, "c", "hf:fp16", "hf:fp32"))
    assert "Overrides applied: seq_mis.cap=1.0001, geo_mis.low=0.5" in texts(at.caption)
    at.text_input(key="corr_overrides").input("seq_mis.nope=2")
    next(b for b in at.button if b.label == "Apply").click()
    rerun(at)
    assert "Overrides not applied" in texts(at.error) and "nope" in texts(at.error)
    assert methods_table(at).set_index("method").loc["seq_mis", "params"] == "cap=3"  # the defaults


def test_a_dropped_sequence_opens_in_the_token_inspector_at_a_dropped_token(monkeypatch, full_store):
    at = open_page(monkeypatch, full_store)
    at.selectbox(key="corr_pair").set_value(2)
    rerun(at)
    at.selectbox(key="corr_method").set_value("grpo")
    rerun(at)
    con = open_store(full_store)
    tokens = dropped_tokens(con, "grpo", "vllm:bf16", "hf:fp32")
    con.close()
    seqs = dropped_sequences(tokens)
    assert len(at.selectbox(key="corr_seq").options) == len(seqs) > 1
    at.selectbox(key="corr_seq").set_value(1)
    rerun(at)
    run_id, seq_id, first = seqs.run_id[1], int(seqs.seq_id[1]), int(seqs.first_pos[1])
    positions = next(d.value for d in at.dataframe if "log_ratio" in d.value.columns)
    assert positions["pos"].tolist() == tokens[(tokens.run_id == run_id) & (tokens.seq_id == seq_id)]["pos"].tolist()
    next(b for b in at.button if b.label == f"Open sequence {seq_id} of {run_id} in the token inspector").click()
    rerun(at)
    assert [t.value for t in at.title] == ["Token inspector"]
    assert at.radio(key="insp_mode").value == "By run and sequence"
    assert at.selectbox(key="insp_run").value == run_id and at.selectbox(key="insp_seq").value == seq_id
    assert at.selectbox(key="insp_scorer").value == "hf:fp32"
    assert at.selectbox(key=f"insp_pos:{run_id}:{seq_id}:hf:fp32").value == first  # the first dropped token
    assert at.subheader[0].value == f"{run_id} · sequence {seq_id}"


def test_dropped_tokens_are_the_tokens_the_comparison_counts(duckdb_store, tables):
    con = open_store(duckdb_store)
    main = tables["corrections"]
    checked = 0
    for r in main.itertuples():
        tokens = dropped_tokens(con, r.method, r.rollout, r.scorer)
        if r.note:
            assert tokens.empty
            continue
        seqs = dropped_sequences(tokens)
        assert len(tokens) == round(r.frac_tokens_masked * r.n_tokens), (r.method, r.rollout, r.scorer)
        assert int(seqs["seq_dropped"].sum()) == round(r.frac_seqs_masked * r.n_seqs), (r.method, r.rollout, r.scorer)
        assert not tokens.duplicated(["run_id", "seq_id", "pos"]).any()
        checked += len(tokens) > 0
    assert checked >= 10  # most methods drop something on this store
    # the rows are real tokens of the pair: a whole-sequence drop lists every finite token of its sequence
    tokens = dropped_tokens(con, "geo_mis", "vllm:bf16", "hf:bf16")
    whole = tokens[tokens["seq_dropped"]]
    assert not whole.empty
    run_id, seq_id = whole.iloc[0][["run_id", "seq_id"]]
    n = con.execute("SELECT count(*) FROM scores WHERE run_id = ? AND seq_id = ? AND scorer = 'hf:bf16' "
                    "AND logp IS NOT NULL AND NOT nonfinite", [run_id, int(seq_id)]).fetchone()[0]
    assert len(whole[(whole.run_id == run_id) & (whole.seq_id == seq_id)]) == n
    # an override moves the rule: a tighter sequence cap drops at least as many sequences
    assert len(dropped_tokens(con, "seq_mis", "vllm:bf16", "hf:bf16", overrides={"seq_mis": {"cap": 1.0001}})) >= len(
        dropped_tokens(con, "seq_mis", "vllm:bf16", "hf:bf16"))
    with pytest.raises(ValueError, match="no method named"):
        dropped_tokens(con, "nope", "vllm:bf16", "hf:bf16")
    assert dropped_tokens(con, "grpo", "vllm:bf16", "no-such-scorer").empty
    con.close()


def test_a_store_without_top_k_or_rewards_shows_what_it_can(monkeypatch, bare_store):
    at = open_page(monkeypatch, bare_store)
    assert at.selectbox(key="corr_pair").options == ["vllm:bf16 → hf:bf16", "vllm:bf16 → hf:fp32"]
    assert "Not computed for this pair (needs top-K log-probs" in texts(at.caption)
    shown = methods_table(at).set_index("method")
    assert shown.loc[["dppo_topk_tv", "dppo_topk_kl"], "frac_tokens_masked"].isna().all()
    assert shown.drop(index=["dppo_topk_tv", "dppo_topk_kl"])["frac_tokens_masked"].notna().all()
    assert {m.label: m.value for m in at.metric}["Advantage"] == "none (two-sided)"
    assert at.radio(key="corr_split").options == ["all tokens of the pair", "token categories", "μ buckets",
                                                  "advantage sign"]  # fmt: skip
    at.radio(key="corr_split").set_value("adv_sign")
    rerun(at)
    assert at.multiselect(key="corr_adv_sign").options == ["unknown"]  # no advantage: every rule two-sided


def test_a_store_without_scored_tokens_says_so(monkeypatch, tmp_path):
    import duckdb

    from mismatch_lab.store.schema import create_schema

    path = tmp_path / "empty.duckdb"
    con = duckdb.connect(str(path))
    create_schema(con)
    con.close()
    at = open_page(monkeypatch, path)
    assert "No scored tokens yet" in texts(at.info)
