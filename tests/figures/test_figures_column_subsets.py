"""Every figure on stores holding only the required columns plus any subset of the optional groups (top-K,
entropy, exact TV/KL, token text + category), as a Parquet directory and as a DuckDB file whose tables
physically lack the other columns. A figure whose data is absent is skipped (never drawn empty); the drawn
ones plot the same numbers as a pandas reference computed from the frames the generator wrote.

The source store holds a collect run (vllm:bf16 scored by hf:fp32 and hf:bf16), a run recorded in an RL
framework (dtype unknown: rollout 'vllm'; scorers 'trl:fp32', 'trl:bf16'; three training steps) and a
training run's metric series."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest

from mismatch_lab.cli import main
from mismatch_lab.figures import FIGURES, Skip
from mismatch_lab.figures.base import study_rows
from mismatch_lab.store.reader import open_store
from mismatch_lab.store.synthetic import (
    SyntheticSpec,
    stepped_frames,
    subset_store,
    synthetic_store,
    write_store,
)

SPEC = SyntheticSpec(
    rollouts=("vllm:bf16", "vllm:fp16"),
    scorers=("hf:fp32", "hf:bf16"),
    n_sequences=12,
    max_len=12,
    n_planted=4,
    n_nonfinite=1,
    rewards="advantage",
    topk=4,
    exact_tv=True,
    train_steps=4,
    seed=21,
)
RECORDED = "synthetic-1-vllm-fp16"
GROUPS = ("topk", "entropy", "exact", "text")
SUBSETS = [g for k in range(len(GROUPS) + 1) for g in itertools.combinations(GROUPS, k)]
# DuckDB files whose tables physically lack the columns: every subset. Parquet (absent columns read as NULL
# by the reader): none, each group alone, all -- drawing eight figures per store is the cost of this file.
CASES = [("duckdb", g) for g in SUBSETS] + [("parquet", g) for g in SUBSETS if len(g) in (0, 1, len(GROUPS))]
UNIT = re.compile(r"\([^)]*[a-z%][^)]*\)")


def _id(case) -> str:
    return f"{case[0]}:{'+'.join(case[1]) or 'required-only'}"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fig-subsets")
    base = synthetic_store(tmp / "base.duckdb", SPEC)
    frames = stepped_frames(base.frames, 3, run_ids=[RECORDED], kind="record", engine_dtype=None,
                            scorers={"hf:fp32": "trl:fp32", "hf:bf16": "trl:bf16"})  # fmt: skip
    return write_store(tmp / "source.duckdb", frames), frames


@pytest.fixture(scope="module")
def naive(source):
    """Per (token, scorer) row: rollout label, finite, |dp|, k3 and the step, from the frames with pandas."""
    f = source[1]
    runs = f["runs"].assign(rollout=[e if d is None else f"{e}:{d}" for e, d in zip(f["runs"]["engine"], f["runs"]["engine_dtype"])])
    df = f["tokens"].merge(runs[["run_id", "rollout", "kind"]], on="run_id").merge(f["scores"], on=["run_id", "seq_id", "pos"])
    df = df.merge(f["sequences"][["run_id", "seq_id", "step"]], on=["run_id", "seq_id"])
    lmu = df["logp_rollout"].to_numpy(dtype=float, na_value=np.nan)
    lpi = df["logp"].to_numpy(dtype=float, na_value=np.nan)
    df["finite"] = np.isfinite(lmu) & np.isfinite(lpi) & ~df["nonfinite"].astype(bool)
    df["abs_dp"] = np.where(df["finite"], np.abs(np.exp(lpi) - np.exp(lmu)), np.nan)
    df["k3"] = np.where(df["finite"], np.exp(lpi - lmu) - (lpi - lmu) - 1.0, np.nan)
    return df


def _draw(con) -> dict[str, object]:
    """figure number -> [(stem, Figure)] or the Skip raised."""
    try:
        rows = study_rows(con)
    except Skip:
        rows = None
    out = {}
    for num, fn in FIGURES.items():
        try:
            out[num] = fn(con, rows)
        except Skip as exc:
            out[num] = exc
    if rows is not None:
        rows.close()
    return out


@pytest.fixture(scope="module", params=CASES, ids=_id)
def drawn(request, source, tmp_path_factory):
    """(groups, figure number -> figures or Skip) for one (form, subset of optional groups)."""
    form, groups = request.param
    tmp = tmp_path_factory.mktemp("fig-subset")
    path = subset_store(source[0], tmp / ("s.duckdb" if form == "duckdb" else "results"), groups + ("rewards",), form=form)
    con = open_store(path)
    yield set(groups), _draw(con)
    con.close()


def test_only_figures_whose_data_is_absent_are_skipped(drawn):
    groups, figs = drawn
    skipped = {num for num, f in figs.items() if isinstance(f, Skip)}
    # 5 needs the exact TV; 7 needs runs differing in batch size, 10 log S, 11 MoE routing (none here): the rest draws
    assert skipped == ({"7"} if "exact" in groups else {"5", "7"}) | {"10", "11"}
    assert "no two collect runs" in str(figs["7"])


def test_every_drawn_figure_has_filled_titled_panels_with_units(drawn):
    _, figs = drawn
    for f in figs.values():
        if isinstance(f, Skip):
            continue
        for stem, fig in f:
            assert fig._suptitle.get_text().strip(), stem
            panels = [ax for ax in fig.axes if ax.get_label() != "colorbar"]
            assert panels, stem
            for ax in panels:
                assert ax.lines or ax.collections or ax.patches or ax.images, f"{stem}: empty panel"
                assert ax.get_title().strip() and UNIT.search(ax.get_xlabel()) and UNIT.search(ax.get_ylabel()), stem


def test_precision_bars_equal_the_pandas_means_for_every_pair_including_the_recorded_run(drawn, naive):
    _, figs = drawn
    ax = figs["3"][0][1].axes[0]  # mean |dp|: one bar per pair, then the noise floor
    ticks = {round(y): t.get_text() for y, t in zip(ax.get_yticks(), ax.get_yticklabels())}
    bar_of = {ticks[round(p.get_y() + p.get_height() / 2)]: p.get_width() for p in ax.patches}  # label -> width
    want = naive[naive["finite"]].groupby(["rollout", "scorer"])["abs_dp"].mean()
    assert len(want) == 4 and ("vllm", "trl:fp32") in want.index  # the engine-only label of the recorded run
    for (ro, sc), v in want.items():
        assert bar_of[f"{ro} vs {sc}"] == pytest.approx(v, rel=1e-9)


def test_clipped_token_labels_fall_back_to_ids_without_token_text(drawn):
    groups, figs = drawn
    ax_tokens = figs["4"][0][1].axes[1]
    labels = [t.get_text() for t in ax_tokens.get_yticklabels()]
    assert labels
    if "text" in groups:
        assert not any(lab.startswith("id ") for lab in labels)
    else:
        assert all(re.fullmatch(r"id \d+", lab) for lab in labels)


def test_approximation_draws_top_k_panels_only_where_top_k_is_stored(drawn):
    groups, figs = drawn
    if "exact" not in groups:
        assert "no exact TV stored" in str(figs["5"])
        return
    panels = [ax for ax in figs["5"][0][1].axes if ax.get_label() != "colorbar"]
    assert len(panels) == (2 if "topk" in groups else 1)  # one scorer (hf:bf16 vs hf:fp32): binary [+ top-K]


def test_the_steps_figure_plots_the_recorded_runs_per_step_means(drawn, naive):
    _, figs = drawn
    ax_dp, ax_k3 = figs["9"][0][1].axes[:2]
    rec = naive[(naive["run_id"] == RECORDED) & naive["finite"]]
    per = rec.groupby(["scorer", "step"])[["abs_dp", "k3"]].mean()
    assert len(ax_dp.lines) == per.index.get_level_values(0).nunique() == 2
    for line_dp, line_k3, (scorer, g) in zip(ax_dp.lines, ax_k3.lines, per.groupby(level=0)):
        # the legend names the pair and its growth: OLS slope of the per-step means, per 100 steps
        slope = np.polyfit([0.0, 1.0, 2.0], g["abs_dp"].to_numpy(float), 1)[0]
        assert f"μ vllm vs π {scorer}, {100 * slope:+.2g} per 100 steps [" in line_dp.get_label()
        assert list(line_dp.get_xdata()) == [0, 1, 2]
        np.testing.assert_allclose(line_dp.get_ydata(), g["abs_dp"], rtol=1e-9)
        np.testing.assert_allclose(line_k3.get_ydata(), g["k3"], rtol=1e-9)


@pytest.mark.parametrize("form", ["duckdb", "parquet"])
def test_the_figures_command_on_a_required_columns_store_writes_what_it_can(form, source, tmp_path, capsys):
    store = subset_store(source[0], tmp_path / ("s.duckdb" if form == "duckdb" else "results"), (), form=form)
    out = tmp_path / "figs"
    assert main(["figures", str(store), "--out", str(out), "--format", "png"]) == 0
    printed = capsys.readouterr().out
    assert "figure 5 skipped: no exact TV" in printed and "figure 7 skipped" in printed
    written = sorted(p.stem for p in out.glob("*.png"))
    assert written == ["fig1_ratio_tv_vs_mu", "fig2_pi_vs_mu_seq_drift", "fig3_precision_summary",
                       "fig4_clipped_tokens", "fig6_training_curves", "fig8_corrections",
                       "fig9_mismatch_over_steps"]  # fmt: skip
    assert all(p.stat().st_size > 1000 for p in out.glob("*.png"))


def test_clipping_figure_of_a_run_recorded_without_token_ids_draws_its_categories(tmp_path):
    """token_ids=None (a loss-function hook): the clipped shares per category are known, the strings not."""
    from mismatch_lab.figures.tokens import fig4_clipping
    from mismatch_lab.record import Recorder

    rng = np.random.default_rng(0)
    lmu = -rng.uniform(0.05, 3.0, (8, 12))
    lpi = np.minimum(lmu + rng.normal(0, 0.4, lmu.shape), 0.0)  # |log r| > 0.22 often: many tokens ratio-clipped
    with Recorder(tmp_path / "s", "noids", framework="verl", rollout_engine="vllm", trainer_dtype="bf16") as rec:
        rec.log_step(1, None, np.ones_like(lmu, dtype=bool), lmu, lpi, advantages=rng.normal(size=8))
    [(_stem, fig)] = fig4_clipping(open_store(tmp_path / "s"))
    ax_cat, ax_tokens = fig.axes[:2]
    n_clip = int(((lpi - lmu > np.log(1.28)) | (lpi - lmu < np.log(0.8))).sum())
    assert f"{n_clip:,} of 96 tokens ratio-clipped" in ax_cat.get_title() and n_clip > 10
    assert [t.get_text() for t in ax_tokens.texts] == ["no token ids stored for this pair:\nno token strings to rank"]
