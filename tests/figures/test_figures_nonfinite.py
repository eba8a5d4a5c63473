"""Figures on stores with non-finite rows: what cannot be measured is shown as missing and counted, never
skipped over silently."""

from __future__ import annotations

from mismatch_lab.store.reader import open_store


def _recorded(path, nonfinite_steps=(), steps=5, lines=1):
    import numpy as np

    from mismatch_lab.record import Recorder

    rng = np.random.default_rng(0)
    for line in range(lines):
        with Recorder(path, f"run{line}", framework="verl", rollout_engine="vllm", rollout_dtype="bf16") as rec:
            for step in range(steps):
                lmu = -rng.exponential(1.0, (3, 6))
                lpi = np.minimum(lmu + rng.normal(0, 0.05 * (step + 1), (3, 6)), 0.0)
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
