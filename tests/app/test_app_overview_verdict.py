"""The Overview page opens with the doctor's verdict per pair and what to change, then the details; the Doctor
table shows the verdict next to the pair. AppTest on small real DuckDB stores."""

from __future__ import annotations

import pandas as pd
import pytest
from app_paths import APP
from streamlit.testing.v1 import AppTest

from mismatch_lab.doctor.report import diagnose, pair_verdicts
from mismatch_lab.store.reader import open_store
from mismatch_lab.store.synthetic import SyntheticSpec, synthetic_store, write_store

BOX = {"ok": "success", "warn": "warning", "fail": "error"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Two rollouts, one scorer, planted ratios: a bf16 pair over verl's band, a fp32 pair within it."""
    spec = SyntheticSpec(rollouts=("vllm:bf16", "vllm:fp32"), scorers=("hf:fp32",), n_sequences=6, max_len=12,
                         noise={"bf16": 0.3, "fp16": 0.004, "fp32": 1e-5}, seed=3)
    return synthetic_store(tmp_path_factory.mktemp("tiny") / "tiny.duckdb", spec).path


def _run(monkeypatch, path) -> AppTest:
    monkeypatch.setenv("MISMATCH_LAB_STUDY", str(path))
    at = AppTest.from_file(str(APP), default_timeout=60)
    at.run()
    assert not at.exception, at.exception
    return at


def _main(monkeypatch, path) -> list:
    """The page's top-level elements, in order."""
    return [node for node in _run(monkeypatch, path).main if node.type != "main"]


def test_overview_opens_with_the_verdict_per_pair_then_what_to_change(monkeypatch, tiny):
    con = open_store(tiny)
    dx = diagnose(con)
    con.close()
    expected = pair_verdicts(dx)
    assert {v["verdict"] for v in expected} == {"ok", "fail"}  # both boxes are exercised
    nodes = _main(monkeypatch, tiny)
    assert (nodes[0].type, nodes[0].value) == ("title", "Overview")
    boxes = nodes[1: 1 + len(expected)]
    assert [b.type for b in boxes] == [BOX[v["verdict"]] for v in expected]
    for box, v in zip(boxes, expected):
        assert box.value.startswith(f"**{v['pair']}**: {v['verdict']} · ")
        assert box.value.replace("\\|", "|").endswith(v["detail"])
    caption, advice = nodes[1 + len(expected)], nodes[2 + len(expected)]
    assert caption.type == "caption" and "verdict = the worst of" in caption.value
    assert advice.type == "markdown" and advice.value.startswith("**What to change**")
    assert dx.recommendations and all(a["advice"] in advice.value for a in dx.recommendations)
    first_details = next(i for i, n in enumerate(nodes) if n.type == "subheader")
    assert nodes[first_details].value == "Studies" and first_details == 3 + len(expected)


def test_the_doctor_table_shows_the_verdict_next_to_the_pair(monkeypatch, tiny):
    at = _run(monkeypatch, tiny)
    (table,) = [d.value for d in at.dataframe if "band" in d.value.columns]
    assert list(table.columns[:3]) == ["pair", "check", "verdict"]


def test_a_store_without_scored_tokens_opens_with_a_plain_message(monkeypatch, tmp_path):
    runs = pd.DataFrame([{"run_id": "r", "kind": "collect", "status": "complete", "engine": "vllm", "engine_dtype": "bf16"}])
    path = write_store(tmp_path / "noscores.duckdb", {"runs": runs})
    nodes = _main(monkeypatch, path)
    assert nodes[1].type == "info"
    assert nodes[1].value.startswith("No verdict yet")
