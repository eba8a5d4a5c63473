"""Figure 8 (what each correction method does to the same tokens) draws the numbers of
`mismatch_lab.corrections.compare.compare` on the tiny stored study, one row of panels per rollout, and is
skipped on a store without scored tokens."""

from __future__ import annotations

import duckdb
import numpy as np
import pytest

from mismatch_lab.corrections.compare import compare
from mismatch_lab.figures import FIGURES, Skip
from mismatch_lab.figures.corrections import SHARES, fig8_corrections
from mismatch_lab.store.reader import open_store
from mismatch_lab.store.schema import create_schema


@pytest.fixture(scope="module")
def drawn(figure_study):
    con = open_store(figure_study)
    try:
        (stem, fig), = fig8_corrections(con)
        return stem, fig, compare(con)["corrections"]
    finally:
        con.close()


def test_figure_9_is_registered():
    assert FIGURES["8"] is fig8_corrections


def test_one_row_per_rollout_with_its_same_dtype_scorer(drawn):
    stem, fig, _ = drawn
    assert stem == "fig8_corrections"
    titles = [ax.get_title() for ax in fig.axes]
    # vllm:bf16 and vllm:fp16 by their own dtype's HF scorer; the recorded run ('vllm', dtype unknown) by the
    # reference scorer's name it carries none of, so its first scorer; the train run is vllm:bf16 too
    pair_titles = [t for t in titles if t.endswith("dropped and reweighted")]
    assert pair_titles[:2] == ["μ vllm:bf16 vs π hf:bf16: dropped and reweighted",
                               "μ vllm:fp16 vs π hf:fp16: dropped and reweighted"]  # fmt: skip
    assert len(pair_titles) == len(titles) // 2 == 3 and titles.count("effective sample size") == 3


def test_bars_and_ess_are_the_comparisons_numbers(drawn):
    _, fig, main = drawn
    axes = fig.axes
    methods = [t.get_text() for t in axes[0].get_yticklabels()]
    assert methods == list(dict.fromkeys(main["method"]))  # every method, top-K rules included
    ticks = dict(zip(np.round(axes[0].get_yticks()).astype(int), methods))
    for ax, ax_ess in zip(axes[0::2], axes[1::2]):
        rollout, scorer = ax.get_title().removeprefix("μ ").removesuffix(": dropped and reweighted").split(" vs π ")
        want = main[(main["rollout"] == rollout) & (main["scorer"] == scorer)].set_index("method")
        assert not want.empty, (rollout, scorer)
        containers = {c.get_label(): c for c in ax.containers}
        assert list(containers) == [label for _, label, _ in SHARES]
        for col, label, _ in SHARES:
            got = {ticks[round(p.get_y() + p.get_height() / 2)]: p.get_width() for p in containers[label].patches}
            expected = 100 * want[col].dropna()
            assert set(got) == set(expected.index), (rollout, scorer, col)
            np.testing.assert_allclose([got[m] for m in expected.index], expected.to_numpy(float), rtol=1e-12)
        (line,) = ax_ess.lines[:1]
        ess = dict(zip((ticks[round(y)] for y in line.get_ydata()), line.get_xdata()))
        expected = want["ess"].dropna()
        assert set(ess) == set(expected.index)
        np.testing.assert_allclose([ess[m] for m in expected.index], expected.to_numpy(float), rtol=1e-12)


def test_caption_names_the_denominators_and_n(drawn):
    _, fig, main = drawn
    caption = " ".join(t.get_text() for t in fig.texts).replace("\n", " ")
    row = main[(main["rollout"] == "vllm:bf16") & (main["scorer"] == "hf:bf16")].iloc[0]
    assert f"n = {int(row['n_tokens']):,} finite tokens in {int(row['n_seqs']):,} sequences" in caption
    for words in ("over the pair's finite tokens", "over the pair's sequences", "ESS = (Σw)² / (n Σw²)",
                  "seq_mis cap=3"):
        assert words in caption, words


def test_skipped_on_a_store_without_scored_tokens(tmp_path):
    path = tmp_path / "empty.duckdb"
    con = duckdb.connect(str(path))
    create_schema(con)
    con.close()
    con = open_store(path)
    with pytest.raises(Skip, match="no \\(rollout, scorer\\) pair"):
        fig8_corrections(con)
    con.close()
