"""`analyze` key `routing`: the SQL over the store's routing rows against routing.compare and a numpy pass."""

from __future__ import annotations

import json

import numpy as np
import pytest
from routing_stores import routing_store

from mismatch_lab.analysis import run_all
from mismatch_lab.analysis.routing import routing_table
from mismatch_lab.cli import main
from mismatch_lab.routing.compare import compare
from mismatch_lab.store.reader import open_store

REL = 1e-12  # sums of float64 in another order


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return routing_store(tmp_path_factory.mktemp("routing") / "moe.duckdb")


@pytest.fixture(scope="module")
def table(store):
    con = open_store(store.path)
    try:
        return routing_table(con)
    finally:
        con.close()


def _pair(table, scorer):
    rows = table[(table["view"] == "pair") & (table["scorer"] == scorer)]
    assert len(rows) == 1
    return rows.iloc[0]


@pytest.mark.parametrize("scorer", ["hf:fp32", "hf:fp32-r3"])
def test_the_flip_counts_equal_routing_compare_on_the_same_routings(store, table, scorer):
    want = compare(store.rollout, store.sides[scorer])
    got = _pair(table, scorer)
    for key in ("tokens", "layers", "k", "flips"):
        assert got[key] == want[key], key
    assert got["flip_rate"] == pytest.approx(want["flip_rate"], rel=REL)
    assert got["any_layer_differs"] == pytest.approx(want["any_layer_differs"], rel=REL)
    assert got["flip_rate_per_layer"] == pytest.approx(want["flip_rate_per_layer"], rel=REL)
    assert [(b["cells"], b["flips"]) for b in got["flips_by_margin"]] == [
        (b["cells"], b["flips"]) for b in want["flips_by_margin"]]
    layers = table[(table["view"] == "layer") & (table["scorer"] == scorer)]
    assert layers["flip_rate"].tolist() == pytest.approx(want["flip_rate_per_layer"], rel=REL)


def test_the_planted_flips_are_found_and_replay_has_none(table):
    assert 0 < _pair(table, "hf:fp32")["flips"] < _pair(table, "hf:fp32")["cells"]
    assert _pair(table, "hf:fp32-r3")["flips"] == 0


def _naive_mismatch(store, scorer, flipped):
    lmu, lpi = store.logp_rollout[flipped], store.logp[scorer][flipped]
    ok = np.isfinite(lpi)
    lmu, lpi = lmu[ok], lpi[ok]
    r = np.exp(lpi - lmu)
    return {"abs_dp": np.abs(np.exp(lpi) - np.exp(lmu)).mean(), "abs_dlogp": np.abs(lpi - lmu).mean(),
            "k3": (r - 1 - np.log(r)).mean(), "n": ok.sum()}


def test_the_mismatch_with_and_without_a_flip_equals_a_numpy_pass(store, table):
    got = _pair(table, "hf:fp32")
    any_flip = np.any(np.sort(store.sides["hf:fp32"].ids, -1) != np.sort(store.rollout.ids, -1), axis=(1, 2))
    assert not np.isfinite(store.logp["hf:fp32"]).all()  # the non-finite row is there
    for side, mask in (("flip", any_flip), ("no_flip", ~any_flip)):
        want = _naive_mismatch(store, "hf:fp32", mask)
        assert got[f"tokens_{side}"] == mask.sum()
        assert got[f"n_finite_{side}"] == want["n"]
        for m in ("abs_dp", "abs_dlogp", "k3"):
            assert got[f"{m}_mean_{side}"] == pytest.approx(want[m], rel=1e-9), (side, m)


def test_the_r3_share_is_one_minus_the_ratio_of_mean_abs_dp_of_replay_and_plain(store, table):
    every = np.ones(len(store.keys), bool)
    plain, r3 = (_naive_mismatch(store, s, every)["abs_dp"] for s in ("hf:fp32", "hf:fp32-r3"))
    got = _pair(table, "hf:fp32")
    assert got["r3_scorer"] == "hf:fp32-r3"
    assert got["r3_share"] == pytest.approx(1 - r3 / plain, rel=1e-9)
    assert 0.5 < got["r3_share"] < 1  # the planted replay removes most of the mismatch
    assert _pair(table, "hf:fp32-r3")["r3_share"] is None or np.isnan(_pair(table, "hf:fp32-r3")["r3_share"])


def test_a_margin_on_a_bucket_edge_goes_to_the_bucket_above_as_np_digitize_puts_it(store, table):
    assert store.rollout.margin[0, 0] == 1.0
    want = compare(store.rollout, store.sides["hf:fp32"])["flips_by_margin"]
    assert [b["cells"] for b in _pair(table, "hf:fp32")["flips_by_margin"]] == [b["cells"] for b in want]


def test_a_store_without_routing_gives_an_empty_routing_key_in_analyze_json(plain_store, tmp_path):
    target = tmp_path / "a.json"
    assert main(["analyze", "--db", str(plain_store.path), "--json", str(target)]) == 0
    assert json.loads(target.read_text())["routing"] == []


def test_analyze_prints_the_routing_table_and_writes_its_rows_as_json(store, tmp_path, capsys):
    target = tmp_path / "a.json"
    assert main(["analyze", "--db", str(store.path), "--table", "routing", "--json", str(target)]) == 0
    out = capsys.readouterr().out
    assert "== routing [view = pair]" in out and "== routing [view = layer]" in out
    rows = json.loads(target.read_text())["routing"]
    pair = next(r for r in rows if r["view"] == "pair" and r["scorer"] == "hf:fp32")
    assert pair["flips_by_margin"][-1]["hi"] is None  # +inf as null


def test_run_all_filters_the_routing_rows_by_scorer(store):
    con = open_store(store.path)
    try:
        got = run_all(con, scorer="hf:fp32-r3")["routing"]
    finally:
        con.close()
    assert set(got["scorer"]) == {"hf:fp32-r3"}


def test_the_summary_has_a_routing_line_per_pair_only_when_the_store_holds_routing(store, plain_store, capsys):
    assert main(["analyze", "--db", str(store.path)]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("  vllm:bf16 vs ")]
    assert len(lines) == 2 and "R3 share" in lines[0] and all(len(x) <= 120 for x in lines)
    assert main(["analyze", "--db", str(plain_store.path)]) == 0
    assert "MoE routing" not in capsys.readouterr().out
