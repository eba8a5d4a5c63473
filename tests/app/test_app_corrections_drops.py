"""The tokens a method drops, read off the decisions the comparison keeps (`dropped.compare_with_drops`): the
same rows as running that method's rule over the pair again, for every method, on a whole store and on a sample,
with and without overrides; and the Corrections page then lists another method's dropped tokens without running
a rule (benchmarks/bench_app_browser.py's "dropping method: second": ~1.7 CPU s on a 1 M-token store)."""

from __future__ import annotations

import functools

import numpy as np
import pandas as pd
import pytest
from app_paths import open_page

from mismatch_lab.analysis.sample import sampled
from mismatch_lab.corrections import dropped
from mismatch_lab.corrections.compare import _run, compare, variants
from mismatch_lab.corrections.layout import chunks, pair_info
from mismatch_lab.store.reader import open_store
from mismatch_lab.store.synthetic import SyntheticSpec, synthetic_store

OVERRIDES = {"seq_mis": {"cap": 1.0001}, "geo_mis": {"low": 0.999}, "grpo": {"eps_low": 0.01}}


def rerun_rule(con, method: str, rollout: str, scorer: str, overrides) -> pd.DataFrame:
    """The tokens `method` drops, by running its rule over the pair with each token its own group (the
    computation the Corrections page ran per method before the comparison kept its decisions)."""
    v = {v.label: v for v in variants(overrides)}[method]
    info = pair_info(con, (rollout, scorer))
    info = info.assign(has_topk=info["has_topk"] & ("topk" in v.method.needs))
    parts = []
    for chunk in chunks(con, info, chunk_tokens=1 << 20):
        sums, _, _ = _run(v, list(chunk.parts(np.arange(chunk.n), chunk.n, np.zeros(len(chunk.seq_start), int))),
                          chunk.n, 1)
        keep = sums["n_masked"] == 0
        whole = np.repeat(~np.logical_or.reduceat(keep, chunk.seq_start), chunk.lengths)
        hit = np.flatnonzero(~keep)
        part = chunk.rows.select(["run_id", "seq_id", "pos"]).take(hit).to_pandas()
        parts.append(part.assign(log_ratio=(chunk.lpi - chunk.lmu)[hit], seq_dropped=whole[hit]))
    return pd.concat(parts, ignore_index=True).astype({"seq_id": "int64", "pos": "int64"})


@pytest.fixture(scope="module")
def grouped(tmp_path_factory):
    """A store of 48 sequences in prompt groups of 4 with rewards only (a sample keeps whole groups)."""
    spec = SyntheticSpec(rollouts=("vllm:bf16",), scorers=("hf:fp32", "hf:bf16"), n_sequences=48, rewards="reward",
                         group_size=4, max_len=30, seed=5)
    return synthetic_store(tmp_path_factory.mktemp("drops") / "grouped.duckdb", spec).path


@pytest.mark.parametrize("overrides", [None, OVERRIDES], ids=["defaults", "overrides"])
@pytest.mark.parametrize("where", ["whole store", "sample"])
def test_every_methods_dropped_tokens_read_off_the_comparison_equal_a_rerun_of_its_rule(
        where, overrides, duckdb_store, grouped):
    con = open_store(duckdb_store if where == "whole store" else grouped)
    try:
        def cursor():
            return con.cursor() if where == "whole store" else sampled(con.cursor(), 3, ("vllm:bf16", "hf:bf16"))

        done = dropped.compare_with_drops(cursor(), overrides=overrides)
        tables, drops = done.tables, done.drops
        main = tables["corrections"]
        assert set(drops) == set(zip(main["rollout"], main["scorer"]))
        dropping = 0
        for r in main.itertuples():
            kept = drops[(r.rollout, r.scorer)].tokens(r.method)
            if r.note:  # (a top-K method on a pair without top-K lists: no numbers, no tokens)
                assert kept.empty and dropped.dropped_tokens(cursor(), r.method, r.rollout, r.scorer).empty
                continue
            assert len(kept) == round(r.frac_tokens_masked * r.n_tokens), (r.method, r.rollout, r.scorer)
            if kept.empty:
                continue
            dropping += 1
            expected = rerun_rule(cursor(), r.method, r.rollout, r.scorer, overrides)
            pd.testing.assert_frame_equal(kept, expected, check_exact=True)  # bitwise: the same rows, columns and dtypes
            rerun = dropped.dropped_tokens(cursor(), r.method, r.rollout, r.scorer, overrides=overrides)
            pd.testing.assert_frame_equal(rerun, expected, check_exact=True)
    finally:
        con.close()
    assert dropping >= (8 if where == "whole store" else 3)  # (the synthetic store's ratios are closer to 1)


def test_another_dropping_method_and_an_override_list_their_tokens_without_running_a_rule(
        duckdb_store, tmp_path, monkeypatch):
    db = tmp_path / "store.duckdb"
    db.write_bytes(duckdb_store.read_bytes())
    calls = []
    real = dropped.dropped_tokens
    monkeypatch.setattr(dropped, "dropped_tokens",
                        functools.wraps(real)(lambda con, *a, **kw: calls.append(a) or real(con, *a, **kw)))
    at = open_page(db, monkeypatch, "corrections")
    at.selectbox(key="corr_pair").set_value(2).run()
    methods = at.selectbox(key="corr_method").options
    assert len(methods) >= 3
    con = open_store(db)
    try:
        for method in methods[:3]:
            at.selectbox(key="corr_method").set_value(method).run()
            assert not at.exception, at.exception
            listed = at.selectbox(key="corr_seq").options
            assert len(listed) == len(dropped.dropped_sequences(real(con, method, "vllm:bf16", "hf:fp32")))
        at.text_input(key="corr_overrides").set_value("seq_mis.cap=1.0001")
        next(b for b in at.button if b.label == "Apply").click()
        at.run()
        at.selectbox(key="corr_method").set_value("seq_mis").run()
        assert not at.exception, at.exception
        expected = real(con, "seq_mis", "vllm:bf16", "hf:fp32", overrides={"seq_mis": {"cap": 1.0001}})
    finally:
        con.close()
    assert len(at.selectbox(key="corr_seq").options) == len(dropped.dropped_sequences(expected))
    assert not calls  # every list came from the decisions the comparison kept


@pytest.mark.parametrize("where", ["whole store", "sample"])
def test_an_override_computed_on_the_defaults_comparison_equals_the_whole_comparison_with_it(where, duckdb_store,
                                                                                            grouped):
    con = open_store(duckdb_store if where == "whole store" else grouped)
    try:
        def cursor():
            return con.cursor() if where == "whole store" else sampled(con.cursor(), 3, ("vllm:bf16", "hf:bf16"))

        base = dropped.compare_with_drops(cursor())
        spliced = dropped.compare_with_drops(cursor(), overrides=OVERRIDES, base=base)
        tables, drops = spliced.tables, spliced.drops
        whole = compare(cursor(), overrides=OVERRIDES)  # (what `mismatch-lab corrections --set` prints)
        whole_drops = dropped.compare_with_drops(cursor(), overrides=OVERRIDES).drops
        assert dropped.compare_with_drops(cursor(), overrides={"seq_mis": {"cap": 3.0}}, base=base) is base  # defaults
        other = dropped.compare_with_drops(cursor(), chunk_tokens=40)  # a base in other chunks: every method is run
        rerun = dropped.compare_with_drops(cursor(), overrides=OVERRIDES, base=other).tables
    finally:
        con.close()
    assert tables.keys() == whole.keys()
    for name, table in whole.items():
        pd.testing.assert_frame_equal(tables[name], table, check_exact=True)  # bitwise: the same rows and order
        pd.testing.assert_frame_equal(rerun[name], table, check_exact=True)
    assert drops.keys() == whole_drops.keys()
    for pair, d in whole_drops.items():
        for method in tables["corrections"]["method"]:
            pd.testing.assert_frame_equal(drops[pair].tokens(method), d.tokens(method), check_exact=True)
    main = tables["corrections"].set_index(["method", "scorer"])
    assert (main.loc["seq_mis", "params"] == "cap=1.0001").all()
    assert not main.loc["seq_mis", "frac_tokens_masked"].equals(
        base.tables["corrections"].set_index(["method", "scorer"]).loc["seq_mis", "frac_tokens_masked"])  # (it moved)


def test_an_override_on_a_sample_runs_only_the_method_it_changes_and_shows_the_sample_compared_with_it(
        grouped, monkeypatch, lab_ui):
    from mismatch_lab.corrections import compare as compare_module

    con = open_store(grouped)
    n_tokens = con.execute("SELECT count(*) FROM tokens").fetchone()[0]
    con.close()
    import lab_corrections  # (beside lab_ui: the fixture puts apps/ on the path)
    monkeypatch.setattr(lab_corrections, "CORRECTIONS_SAMPLE_TOKENS", n_tokens // 3 + 1)  # stride 3
    runs = []
    real = compare_module.accumulate
    monkeypatch.setattr(compare_module, "accumulate", functools.wraps(real)(
        lambda con, vs, *a, **kw: runs.append([v.label for v in vs]) or real(con, vs, *a, **kw)))
    at = open_page(grouped, monkeypatch, "corrections")
    assert any(i.value.startswith("Computed on a sample") for i in at.info)
    box = at.selectbox(key="corr_pair")
    pair = tuple(box.options[box.value].split(" → "))
    at.text_input(key="corr_overrides").set_value("seq_mis.cap=1.0001")
    next(b for b in at.button if b.label == "Apply").click()
    at.run()
    assert not at.exception, at.exception
    assert runs == [[v.label for v in variants()], ["seq_mis"]]  # the sample's pair at the defaults (first
    # load), then the method the override changes only
    con = open_store(grouped)
    try:
        want = compare(sampled(con.cursor(), 3, pair), overrides={"seq_mis": {"cap": 1.0001}})["corrections"]
    finally:
        con.close()
    shown = next(d.value for d in at.dataframe if "framework" in d.value.columns)
    assert shown["method"].tolist() == want["method"].tolist()
    for c in ("frac_tokens_masked", "frac_seqs_masked", "ess"):
        np.testing.assert_array_equal(shown[c].to_numpy(float), want[c].to_numpy(float))  # (the same computation)
