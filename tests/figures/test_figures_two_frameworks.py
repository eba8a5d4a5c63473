"""Figures of a store holding two runs of one rollout engine and dtype from two frameworks (a Recorder run
and an import without a model name): both runs are drawn, the captions say what μ, π and the weights are
for such runs, and nothing is labelled 'nan'."""

from __future__ import annotations

import numpy as np
import pytest

from mismatch_lab.figures.base import WEIGHTS_NOTE, one_per_rollout, token_label
from mismatch_lab.record import Recorder
from mismatch_lab.store.reader import open_store


def test_one_pair_per_rollout_and_scorer_family():
    pairs = [("vllm:bf16", "hf:bf16"), ("vllm:bf16", "hf:fp32"), ("vllm:bf16", "own:bf16"), ("vllm:bf16", "jsonl:fp32"),
             ("vllm:bf16", "jsonl:bf16"), ("vllm:fp16", "vllm:fp32"), ("sglang", "slime:fp32")]
    assert one_per_rollout(pairs, "same") == [("vllm:bf16", "hf:bf16"), ("vllm:bf16", "own:bf16"),
                                              ("vllm:bf16", "jsonl:bf16"), ("vllm:fp16", "vllm:fp32"),
                                              ("sglang", "slime:fp32")]
    assert one_per_rollout(pairs, "reference")[:3] == [("vllm:bf16", "hf:fp32"), ("vllm:bf16", "own:bf16"),
                                                       ("vllm:bf16", "jsonl:fp32")]


def test_token_labels_keep_their_quotes():
    assert [token_label(t, None) for t in (" ", " the", "the", "`")] == ["' '", "' the'", "'the'", "'`'"]
    assert token_label(None, 7) == "id 7"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("two") / "store"
    rng = np.random.default_rng(3)
    for run, framework, dtype, model in (("a", "own", "bf16", "org/m"), ("b", "jsonl", "fp32", None)):
        with Recorder(path, run, framework=framework, rollout_engine="vllm", rollout_dtype="bf16",
                      trainer_dtype=dtype, model=model, kind="record" if model else "import") as rec:
            for step in range(4):
                lmu = -rng.exponential(0.7, (6, 9))
                rec.log_step(step, rng.integers(100, 4000, (6, 9)), np.ones((6, 9), bool), lmu,
                             np.minimum(lmu + rng.normal(0, 0.1 + 0.05 * step, (6, 9)), 0.0), advantages=rng.normal(size=6))
    return path


def _caption(fig) -> str:
    return " ".join(t.get_text() for t in fig.texts).replace("\n", " ")


def test_both_runs_are_drawn_and_the_captions_say_what_mu_pi_and_the_weights_are(store):
    from mismatch_lab.figures.tokens import (
        fig1_volatility,
        fig2_precision_scatter,
        fig3_precision_summary,
    )

    con = open_store(store)
    [(_, f1)] = fig1_volatility(con)
    titles = " ".join(ax.get_title() for ax in f1.axes)
    assert "π own:bf16" in titles and "π jsonl:fp32" in titles
    for fn in (fig1_volatility, fig2_precision_scatter, fig3_precision_summary):
        [(_, fig)] = fn(con)
        caption = " ".join(_caption(fig).split())
        # identical weights are claimed for collect runs only
        assert " ".join(WEIGHTS_NOTE.split()) in caption and caption.count("identical") == 1
    [(_, f3)] = fig3_precision_summary(con)
    assert "No noise floor is drawn" in _caption(f3) and "Hatched" not in _caption(f3)


def test_a_run_without_a_model_name_is_not_labelled_nan(store):
    from mismatch_lab.figures.training import fig9_steps

    [(_, fig)] = fig9_steps(open_store(store))
    labels = [line.get_label() for ax in fig.axes for line in ax.lines] + [_caption(fig)]
    assert not any("nan" in lab.split() or "· nan" in lab for lab in labels)
