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


def _recorded(path, nonfinite_steps=(), steps=5, lines=1):
    import numpy as np

    from mismatch_lab.record import Recorder

    rng = np.random.default_rng(0)
    for line in range(lines):
        with Recorder(path, f"run{line}", framework="verl", rollout_engine="vllm", rollout_dtype="bf16") as rec:
            for step in range(steps):
                lmu = -rng.exponential(1.0, (3, 6))
                lpi = lmu + rng.normal(0, 0.05 * (step + 1), (3, 6))
                if step in nonfinite_steps or line > 0:
                    lpi[:] = np.nan
                rec.log_step(step, rng.integers(0, 100, (3, 6)), np.ones((3, 6), bool), lmu, lpi)
    return open_store(path)


def test_a_step_without_a_finite_row_is_a_gap_named_in_the_caption(tmp_path):
    """Figure 9 draws every step of a line: one whose rows are all non-finite is a gap (NaN), not skipped
    over, and the caption counts it; a line with no finite row at all is named as not drawn."""
    import numpy as np

    from mismatch_lab.figures.training import fig9_steps

    con = _recorded(tmp_path / "s", nonfinite_steps=(2,), lines=2)
    (_, fig), = fig9_steps(con)
    ax = fig.axes[0]
    (line,) = ax.get_lines()
    x, y = line.get_xdata(), line.get_ydata()
    assert list(x) == [0, 1, 2, 3, 4] and np.isnan(y[2]) and np.isfinite(np.delete(y, 2)).all()
    caption = fig.texts[-1].get_text().replace("\n", " ")
    assert "5 steps (1 without a finite row)" in caption
    assert "1 step(s) hold no finite row (18 non-finite rows): gaps in their lines." in caption
    assert "Not drawn, no finite row at all: 1 line(s) (90 non-finite rows)." in caption


def test_a_store_without_a_finite_row_skips_figure_3_saying_so(tmp_path):
    import pytest

    from mismatch_lab.figures.base import Skip
    from mismatch_lab.figures.tokens import fig3_precision_summary

    con = _recorded(tmp_path / "s", nonfinite_steps=range(5))
    with pytest.raises(Skip, match="no pair has a finite"):
        fig3_precision_summary(con)
