"""The Corrections page of a large store opens on a sample of its prompt groups (`lab_corrections.corrections_pairs`):
the sample equals a store holding only those sequences, the page says it shows a sample and of how many
tokens, and *Every token* shows the comparison of the whole store."""

from __future__ import annotations

import sys

import duckdb
import pandas as pd
import pytest
from app_paths import APP
from streamlit.testing.v1 import AppTest

from mismatch_lab.analysis.sample import sampled as sample_views
from mismatch_lab.corrections.compare import compare
from mismatch_lab.store.reader import open_store
from mismatch_lab.store.synthetic import SyntheticSpec, synthetic_store, write_store

if str(APP.parent) not in sys.path:
    sys.path.insert(0, str(APP.parent))
import lab_corrections  # (the module the app script imports: one object, so the monkeypatch reaches it)

EVERY = 3


@pytest.fixture(scope="module")
def grouped(tmp_path_factory):
    """A store of 64 sequences in prompt groups of 4 with rewards only (advantages derived per group)."""
    path = tmp_path_factory.mktemp("sample") / "grouped.duckdb"
    spec = SyntheticSpec(rollouts=("vllm:bf16",), scorers=("hf:fp32", "hf:bf16"), n_sequences=64, rewards="reward",
                         group_size=4, max_len=30, seed=3)
    return synthetic_store(path, spec)


def test_the_sample_keeps_prompt_groups_whole_and_compares_like_a_store_of_only_those_sequences(grouped, tmp_path):
    con = open_store(grouped.path)
    try:
        cur = sample_views(con.cursor(), EVERY)
        kept = cur.execute("SELECT run_id, seq_id FROM sequences").df()
        sampled = compare(cur)
        whole = con.execute("SELECT count(*) FROM sequences").fetchone()[0]
    finally:
        con.close()
    assert 0 < len(kept) < whole
    seqs = grouped.frames["sequences"]
    chosen = seqs.merge(kept, on=["run_id", "seq_id"])
    groups = chosen.groupby(["run_id", "prompt_id"]).size()
    assert (groups == seqs.groupby(["run_id", "prompt_id"]).size().loc[groups.index]).all()  # whole groups only
    keys = kept.set_index(["run_id", "seq_id"]).index
    subset = {name: (df[df.set_index(["run_id", "seq_id"]).index.isin(keys)] if "seq_id" in df else df)
              for name, df in grouped.frames.items()}
    write_store(tmp_path / "subset.duckdb", subset)
    sub = open_store(tmp_path / "subset.duckdb")
    try:
        expected = compare(sub)
    finally:
        sub.close()
    for name, table in expected.items():
        pd.testing.assert_frame_equal(sampled[name], table)  # bitwise: the same rows in the same order


def test_the_sample_of_one_pair_holds_that_pairs_rows_of_the_sample_of_every_pair(grouped):
    con = open_store(grouped.path)
    try:
        every_pair = compare(sample_views(con.cursor(), EVERY))
        one = compare(sample_views(con.cursor(), EVERY, ("vllm:bf16", "hf:bf16")))
    finally:
        con.close()
    for name, table in one.items():
        assert set(zip(table["rollout"], table["scorer"])) == {("vllm:bf16", "hf:bf16")}
        mine = every_pair[name][every_pair[name]["scorer"] == "hf:bf16"].reset_index(drop=True)
        pd.testing.assert_frame_equal(table.reset_index(drop=True), mine)


def test_the_page_shows_a_sample_of_a_large_store_with_its_size_and_every_token_on_demand(grouped, monkeypatch):
    monkeypatch.setenv("MISMATCH_LAB_STUDY", str(grouped.path))
    monkeypatch.setenv("MISMATCH_LAB_APP_WARMUP", "0")
    n_tokens = duckdb.connect(str(grouped.path), read_only=True).execute("SELECT count(*) FROM tokens").fetchone()[0]
    monkeypatch.setattr(lab_corrections, "CORRECTIONS_SAMPLE_TOKENS", n_tokens // EVERY + 1)  # stride EVERY
    at = AppTest.from_file(str(APP), default_timeout=120)
    at.run()
    at.switch_page("app_pages/corrections.py").run()
    assert not at.exception, at.exception
    (note,) = [i.value for i in at.info if i.value.startswith("Computed on a sample")]
    con = open_store(grouped.path)
    try:
        sampled = compare(sample_views(con.cursor(), EVERY))["corrections"]
        full = compare(con)["corrections"]
        sampled, full = (t[t["scorer"] == "hf:bf16"] for t in (sampled, full))  # the first pair, as listed
    finally:
        con.close()
    assert f"of the store's {n_tokens:,} tokens" in note and f"1 of {EVERY}" in note
    assert at.metric[0].value == f"{int(sampled['n_tokens'].max()):,}"  # the first pair's finite tokens, sampled
    assert int(sampled["n_tokens"].max()) < int(full["n_tokens"].max())
    at.toggle(key="corr_exact").set_value(True).run()
    assert not at.exception, at.exception
    assert not [i for i in at.info if i.value.startswith("Computed on a sample")]
    assert at.metric[0].value == f"{int(full['n_tokens'].max()):,}"
