"""A select box over positions in a list that changes under it keeps its item (apps/lab_select.py).

The browser sends a select box's value as the option's label; a position kept while its list changed showed one
item and acted on another, and the Corrections page's *Open ... in the token inspector* click was lost
(benchmarks/bench_app_browser.py's interactions, real Chromium). Here under AppTest, on the DuckDB fixture store.
"""

from __future__ import annotations

from app_paths import APP
from streamlit.testing.v1 import AppTest

from mismatch_lab.corrections.dropped import dropped_sequences, dropped_tokens
from mismatch_lab.store.reader import open_store

TIMEOUT_S = 60
PAIR = ("vllm:bf16", "hf:fp32")  # the corr_pair option 2 of the fixture store


def page(monkeypatch, store, name: str) -> AppTest:
    monkeypatch.setenv("MISMATCH_LAB_STUDY", str(store))
    at = AppTest.from_file(str(APP), default_timeout=TIMEOUT_S)
    at.run()
    return ran(at.switch_page(f"app_pages/{name}.py"))


def ran(changed) -> AppTest:
    """Run the app after a widget change (or an AppTest) and check that it raised nothing."""
    at = changed.run()
    assert not at.exception, at.exception
    return at


def moved(first: list, then: list) -> tuple[int, int]:
    """A position in `first` whose item is at another position in `then`."""
    return next((i, then.index(x)) for i, x in enumerate(first) if x in then and then.index(x) != i)


def sequences(con, method: str) -> list[tuple[str, int]]:
    seqs = dropped_sequences(dropped_tokens(con, method, *PAIR))
    return [(r, int(s)) for r, s in zip(seqs["run_id"], seqs["seq_id"])]


def test_the_dropped_sequence_picked_stays_picked_and_opens_when_another_method_reorders_the_list(
        monkeypatch, duckdb_store):
    con = open_store(duckdb_store)
    lists = {m: sequences(con, m) for m in ("grpo", "grpo_clip_higher", "gspo", "dppo_binary_tv", "seq_mis")}
    con.close()
    first, then, (i, j) = next((a, b, moved(lists[a], lists[b])) for a in lists for b in lists
                               if a != b and any(x in lists[b] and lists[b].index(x) != k
                                                 for k, x in enumerate(lists[a])))
    run_id, seq_id = lists[first][i]
    at = page(monkeypatch, duckdb_store, "corrections")
    ran(at.selectbox(key="corr_pair").set_value(2))
    ran(at.selectbox(key="corr_method").set_value(first))
    ran(at.selectbox(key="corr_seq").set_value(i))
    ran(at.selectbox(key="corr_method").set_value(then))
    assert at.selectbox(key="corr_seq").value == j  # the same sequence, at its place in the new list
    button = next(b for b in at.button if "token inspector" in b.label)
    assert button.label == f"Open sequence {seq_id} of {run_id} in the token inspector"
    ran(button.click())
    assert [t.value for t in at.title] == ["Token inspector"]
    assert at.subheader[0].value == f"{run_id} · sequence {seq_id}"


def test_a_picked_worst_sequence_stays_picked_when_another_scorer_reorders_the_list(monkeypatch, duckdb_store):
    at = page(monkeypatch, duckdb_store, "inspector")
    ran(at.radio(key="insp_mode").set_value("Worst sequences by max |Δp|"))
    ids = at.session_state["insp_worst_pick:ids"]
    lists = {}
    for scorer in ("hf:fp32", "hf:bf16"):
        lists[scorer] = ran(at.selectbox(key="insp_worst_scorer").set_value(scorer)).session_state["insp_worst_pick:ids"]
    ran(at.selectbox(key="insp_worst_scorer").set_value("any scorer"))
    scorer = next(s for s in lists if any(x in lists[s] and lists[s].index(x) != k for k, x in enumerate(ids)))
    i, j = moved(ids, lists[scorer])
    ran(at.selectbox(key="insp_worst_pick").set_value(i))
    ran(at.selectbox(key="insp_worst_scorer").set_value(scorer))
    assert at.selectbox(key="insp_worst_pick").value == j
    run_id, seq_id = ids[i]
    assert at.subheader[0].value == f"{run_id} · sequence {seq_id}"


def test_a_picked_sequence_gone_from_the_new_list_falls_back_to_the_first(monkeypatch, duckdb_store):
    at = page(monkeypatch, duckdb_store, "inspector")
    ran(at.radio(key="insp_mode").set_value("Worst sequences by max |Δp|"))
    ids = at.session_state["insp_worst_pick:ids"]
    ran(at.selectbox(key="insp_worst_scorer").set_value("hf:bf16"))
    bf16 = at.session_state["insp_worst_pick:ids"]
    ran(at.selectbox(key="insp_worst_scorer").set_value("any scorer"))
    i = next(k for k, x in enumerate(ids) if x not in bf16 and k > 0)
    ran(at.selectbox(key="insp_worst_pick").set_value(i))
    ran(at.selectbox(key="insp_worst_scorer").set_value("hf:bf16"))
    assert at.selectbox(key="insp_worst_pick").value == 0
    run_id, seq_id = bf16[0]
    assert at.subheader[0].value == f"{run_id} · sequence {seq_id}"
