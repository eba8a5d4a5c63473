"""Run labels of the training figures: the objective plus only what tells runs apart."""

from __future__ import annotations

import json

import pandas as pd

from mismatch_lab.figures.training import run_labels
from mismatch_lab.store.reader import open_store
from mismatch_lab.store.synthetic import write_store


def _runs(rows, seeds=None):
    return pd.DataFrame([{"run_id": r, "kind": "train", "engine": "vllm", "engine_dtype": dt, "model": model,
                          "config": json.dumps({"loss": loss, "correction": corr, "seed": (seeds or {}).get(r, 0)})}
                         for r, loss, corr, dt, model in rows])


def test_labels_name_the_objective_and_only_the_parts_that_differ(tmp_path):
    runs = _runs([
        ("r1", "pg_is", "none", "bf16", "/m/smollm2-135m-instruct-bf16grid"),
        ("r2", "dppo_binary_tv", "none", "bf16", "/m/smollm2-135m-instruct-bf16grid"),
        ("r3", "pg_is", "none", "bf16-wfp8", "/m/smollm2-135m-instruct-bf16grid"),
        ("r4", "pg_is", "seq_mis", "bf16", "/m/smollm2-135m-instruct"),
    ])
    labels = run_labels(open_store(write_store(tmp_path / "s.duckdb", {"runs": runs})))
    assert labels == {
        "r1": "pg_is · vllm:bf16 · smollm2-135m-instruct-bf16grid",
        "r2": "dppo_binary_tv · vllm:bf16 · smollm2-135m-instruct-bf16grid",
        "r3": "pg_is · vllm:bf16-wfp8 · smollm2-135m-instruct-bf16grid",
        "r4": "pg_is+seq_mis · vllm:bf16 · smollm2-135m-instruct",
    }


def test_shared_parts_are_left_out_and_identical_labels_get_their_run_id(tmp_path):
    runs = _runs([("a", "grpo", "none", "bf16", "/m/x"), ("b", "grpo", "none", "bf16", "/m/x"),
                  ("c", "cispo", "none", "bf16", "/m/x")])
    labels = run_labels(open_store(write_store(tmp_path / "s.duckdb", {"runs": runs})))
    assert labels == {"a": "grpo (a)", "b": "grpo (b)", "c": "cispo"}


def test_a_seed_that_differs_between_runs_is_named_instead_of_the_run_id(tmp_path):
    runs = _runs([("a", "dppo_topk_tv", "none", "bf16", "/m/x"), ("b", "dppo_topk_tv", "none", "bf16", "/m/x"),
                  ("c", "pg_is", "none", "bf16", "/m/x")], seeds={"b": 1})
    labels = run_labels(open_store(write_store(tmp_path / "s.duckdb", {"runs": runs})))
    assert labels == {"a": "dppo_topk_tv · seed 0", "b": "dppo_topk_tv · seed 1", "c": "pg_is · seed 0"}


def test_line_styles_stay_distinct_past_the_ten_colours():
    from mismatch_lab.figures.base import line_styles

    styles = line_styles(25)
    keys = [(s["color"], s["ls"]) for s in styles]
    assert len(set(keys)) == 25  # the 11th run is not drawn like the 1st
    assert [s["ls"] for s in styles[:10]] == ["-"] * 10  # up to ten runs: solid, as before
    assert styles[10]["color"] == styles[0]["color"] and styles[10]["ls"] != styles[0]["ls"]

