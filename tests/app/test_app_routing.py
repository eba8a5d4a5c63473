"""The Routing page (AppTest, real DuckDB stores): the per-pair table and charts on a small MoE store the real
writer wrote, and the plain message naming `collect` on an MoE model on a store without routing."""

from __future__ import annotations

from app_paths import open_page
from routing_stores import routing_store

from mismatch_lab.routing.compare import compare


def test_the_routing_page_shows_each_pair_and_names_collect_on_an_moe_model_when_there_is_none(
        tmp_path, monkeypatch, bare_store):
    store = routing_store(tmp_path / "moe.duckdb", n_seq=3, length=6)
    at = open_page(store.path, monkeypatch, "routing")
    (table,) = at.dataframe
    rows = table.value.set_index("scorer")
    want = compare(store.rollout, store.sides["hf:fp32"])["any_layer_differs"]
    assert rows.loc["hf:fp32", "any_layer_differs"] == want
    assert rows.loc["hf:fp32", "r3_scorer"] == "hf:fp32-r3" and rows.loc["hf:fp32-r3", "flip_rate"] == 0
    assert not at.info
    at = open_page(bare_store, monkeypatch, "routing")
    assert "no routing recorded in this store" in " ".join(i.value for i in at.info).lower()
    assert "mismatch-lab collect" in at.info[0].value and "docs/moe.md" in at.info[0].value
