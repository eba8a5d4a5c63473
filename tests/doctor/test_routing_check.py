"""doctor on MoE routing: the `routing` check per pair, the R3 advice naming each framework's option, and the
routing source of the attribution (the R3 scorer's removal of the mismatch), on stores the real writer wrote."""

from __future__ import annotations

import json

import numpy as np
import pytest
from doctor_stores import Pair
from routing_stores import routing_store

from mismatch_lab.analysis.routing import routing_table
from mismatch_lab.cli import main
from mismatch_lab.doctor.recommend import R3_OPTIONS
from mismatch_lab.routing.compare import compare
from mismatch_lab.store.reader import open_store


def _doctor(path, tmp_path, capsys) -> dict:
    out = tmp_path / "doctor.json"
    assert main(["doctor", "--db", str(path), "--json", str(out)]) == 0
    capsys.readouterr()
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return routing_store(tmp_path_factory.mktemp("moe") / "moe.duckdb")


@pytest.fixture()
def doc(moe, tmp_path, capsys):
    return _doctor(moe.path, tmp_path, capsys)


def test_the_routing_check_is_the_share_of_tokens_with_a_flip_in_some_layer_per_pair(moe, doc):
    rows = {c["pair"]: c for c in doc["checks"] if c["check"] == "routing"}
    assert set(rows) == {"vllm:bf16/hf:fp32", "vllm:bf16/hf:fp32-r3"}
    want = compare(moe.rollout, moe.sides["hf:fp32"])["any_layer_differs"]
    assert rows["vllm:bf16/hf:fp32"]["value"] == pytest.approx(want, rel=1e-12)
    assert rows["vllm:bf16/hf:fp32"]["verdict"] == "warn"
    assert rows["vllm:bf16/hf:fp32-r3"]["value"] == 0.0 and rows["vllm:bf16/hf:fp32-r3"]["verdict"] == "ok"
    assert "Megatron-LM" in rows["vllm:bf16/hf:fp32"]["source"]


def test_where_r3_removes_most_of_the_mismatch_doctor_advises_r3_naming_every_frameworks_option(doc):
    advice = [a for a in doc["recommendations"] if a["rule"] == "routing"]
    assert len(advice) == 1 and advice[0]["advice"].startswith("enable R3")
    assert advice[0]["numbers"]["routing_share_pct"] > 50
    for framework, (option, _) in R3_OPTIONS.items():
        assert f"{framework}: {option}" in advice[0]["advice"]


def test_the_routing_source_is_what_the_r3_scorer_removes_of_mean_abs_dlogp_on_the_same_rows(moe, doc):
    rows = {(r["scorer"], r["source"]): r for r in doc["attribution"] if r["rollout"] == "vllm:bf16"}
    ok = np.isfinite(moe.logp["hf:fp32"]) & np.isfinite(moe.logp["hf:fp32-r3"])
    m = np.abs(moe.logp["hf:fp32"][ok] - moe.logp_rollout[ok]).mean()
    without = np.abs(moe.logp["hf:fp32-r3"][ok] - moe.logp_rollout[ok]).mean()
    assert rows[("hf:fp32", "routing")]["share"] == pytest.approx(1 - without / m, rel=1e-9)
    assert rows[("hf:fp32-r3", "routing")]["share"] == 0.0
    assert rows[("hf:fp32", "routing")]["rules"] == ["routing"]


def test_the_r3_advice_quotes_the_attributions_routing_share_not_a_second_definition(moe, doc):
    """One number for what R3 removes: the advice's share is the routing share 'where it comes from' lists
    (mean |Δ log p| on the same rows), not analyze's r3_share of mean |Δp|, which differs on this store."""
    (advice,) = [a for a in doc["recommendations"] if a["rule"] == "routing"]
    (source,) = [r for r in doc["attribution"] if (r["rollout"], r["scorer"], r["source"]) ==
                 ("vllm:bf16", "hf:fp32", "routing")]
    assert advice["numbers"]["routing_share_pct"] == 100 * source["share"]
    con = open_store(moe.path)
    table = routing_table(con)
    con.close()
    (r3_share,) = table.loc[(table["view"] == "pair") & (table["scorer"] == "hf:fp32"), "r3_share"]
    assert r3_share != pytest.approx(source["share"], rel=1e-6)  # the two definitions part on this store
    assert f"removes {100 * source['share']:.3g} % of mean |log π − log μ|" in advice["because"]
    (check,) = [c for c in doc["checks"] if c["check"] == "routing" and c["pair"] == "vllm:bf16/hf:fp32"]
    assert "|Δp|" not in check["detail"] and "'where it comes from'" in check["detail"]


def test_without_an_r3_scorer_doctor_advises_measuring_it_and_the_routing_source_is_not_measured(tmp_path, capsys):
    store = routing_store(tmp_path / "no_r3.duckdb", r3=False)
    doc = _doctor(store.path, tmp_path, capsys)
    advice = [a for a in doc["recommendations"] if a["rule"] == "routing"]
    assert len(advice) == 1 and advice[0]["advice"].startswith("measure R3")
    source = next(r for r in doc["attribution"] if r["source"] == "routing")
    assert source["share"] is None and "hf:fp32-r3" in source["reason"]


def test_a_store_without_routing_has_no_routing_row_advice_or_not_measured_entry(store, tmp_path, capsys):
    doc = _doctor(store(Pair(mu=0.5, n_seq=2, length=4, pi_at=lambda s, pos: 0.52)), tmp_path, capsys)
    assert not [c for c in doc["checks"] if c["check"] == "routing"]
    assert not [n for n in doc["not_measured"] if n["check"] == "routing"]
    assert not [a for a in doc["recommendations"] if a["rule"] == "routing"]
    source = next(r for r in doc["attribution"] if r["source"] == "routing")
    assert source["share"] is None and source["reason"].startswith("not measured")
