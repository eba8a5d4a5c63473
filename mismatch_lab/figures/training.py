"""Figures 6 and 9: runs over training steps.

    6 fig6_training_curves       the per-step metrics a training run logged (train_metrics): accuracy,
                                 mismatch, masked share, bad updates, entropy; one line per run
    9 fig9_mismatch_over_steps   mean |π − μ| and k3 per step measured from the stored tokens, with each
                                 line's growth (per-step OLS slope and 95 % t-interval, analysis.steps.growth)

A run is labelled by its objective and by whatever else tells it apart from the other runs of the store
(rollout engine and dtype, weights, checkpoint, correction): `run_labels`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import duckdb
import pandas as pd
from matplotlib.figure import Figure

OBJECTIVE_KEYS = ("loss", "objective", "loss_name", "algorithm")
TRAIN_PANELS = (
    # (title, y label, candidate metric names in order of preference)
    ("accuracy", "accuracy / mean reward (fraction of responses correct)",
     ("reward/accuracy/mean", "eval/accuracy", "accuracy", "train/accuracy", "reward/mean")),
    ("mismatch", "mean |π − μ| over response tokens (probability)", ("mismatch/abs_dp/mean", "training/rollout_probs_diff_mean")),
    ("masked share", "masked tokens (fraction of tokens with A ≠ 0)", ("mask/nonzero_adv/frac", "actor/pg_clipfrac")),
    ("bad-update share", "bad updates (fraction of tokens, see title)",
     ("bad_update/all/frac", "bad_update/negative_adv/frac", "mask/negative_adv/frac", "actor/invalid_tr_negative_advantage")),
    ("entropy", "mean entropy of π over response tokens (nats)", ("entropy/mean", "actor/entropy")),
)  # fmt: skip
MAX_LEGEND_LINES = 12


def _config(config) -> dict:
    try:
        cfg = json.loads(config) if isinstance(config, str) else (config or {})
    except ValueError:
        return {}
    return cfg if isinstance(cfg, dict) else {}


def _objective(config) -> str | None:
    cfg = _config(config)
    return next((str(cfg[k]) for k in OBJECTIVE_KEYS if cfg.get(k)), None)


def _given(value):
    """A runs column's value, None where it is missing (None, or NaN from pandas)."""
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else value


def _label_parts(row) -> dict[str, str]:
    cfg = _config(row.config)
    correction = str(cfg.get("correction") or "none")
    return {
        "objective": _objective(row.config) or row.run_id,
        "correction": "" if correction == "none" else f"+{correction}",
        "rollout": f"{row.engine}:{row.engine_dtype}" if row.engine_dtype else str(row.engine or ""),
        "model": Path(str(_given(row.model) or cfg.get("model") or "")).name,
        "seed": f"seed {cfg['seed']}" if cfg.get("seed") is not None else "",
    }


def run_labels(con: duckdb.DuckDBPyConnection, run_ids=None) -> dict[str, str]:
    """run_id -> '<objective>[ +<correction>] · <what else differs between the runs>' (rollout, checkpoint,
    seed): a part shared by every run is left out; two runs that still read the same get their
    run id appended."""
    from mismatch_lab.analysis.relations import query

    runs = query(con, "SELECT run_id, config, model, engine, engine_dtype FROM runs ORDER BY run_id")
    if run_ids is not None:
        runs = runs[runs["run_id"].isin(list(run_ids))]
    parts = {r.run_id: _label_parts(r) for r in runs.itertuples(index=False)}
    varying = [k for k in ("rollout", "model", "seed") if len({p[k] for p in parts.values()}) > 1]
    labels = {r: " · ".join([p["objective"] + p["correction"], *(p[k] for k in varying if p[k])])
              for r, p in parts.items()}
    counts = pd.Series(list(labels.values())).value_counts()
    return {r: (f"{lab} ({r})" if counts[lab] > 1 else lab) for r, lab in labels.items()}


def fig6_training(con: duckdb.DuckDBPyConnection, rows=None) -> list[tuple[str, Figure]]:
    """Claim (DPPO sanity test, Figs. 3 and 5): without a trust region anchored on μ (PG-IS, CISPO/TIS)
    training drifts — mismatch |π − μ| grows and accuracy collapses — while DPPO stays stable; and the
    updates that cause it are a small share (≤ 0.5 %) that sit on negative-advantage samples. One line per
    training run (run_labels), panels: accuracy, mismatch, masked share, bad-update share, entropy."""
    from mismatch_lab.analysis.relations import query
    from mismatch_lab.analysis.violations import train_series
    from mismatch_lab.figures.base import Skip, finish, line_styles, panel_grid

    runs = query(con, "SELECT run_id FROM runs WHERE kind = 'train' ORDER BY run_id")
    series = train_series(con, list(runs["run_id"])) if not runs.empty else pd.DataFrame()
    if series.empty:
        raise Skip("no run of the reference train loop (kind 'train') with train_metrics in this store; a recorded "
                   "or imported run's own metrics are on the app's Training page, its mismatch per step in figure 9")
    label = run_labels(con, runs["run_id"])
    names = set(series["name"])
    panels = []
    for title, ylabel, cands in TRAIN_PANELS:
        name = next((c for c in cands if c in names), None)
        if name is None:
            print(f"    fig6: no metric for panel '{title}' (looked for {', '.join(cands)}), panel left out")
            continue
        panels.append((title, ylabel, name))
    if not panels:
        raise Skip("the training runs log none of the metrics figure 6 plots")
    ncols = 2
    fig, axes = panel_grid(len(panels), ncols=ncols, w=4.2, h=2.8, left=0.9)
    style = dict(zip(sorted(label), line_styles(len(label))))
    n_steps = series.groupby("run_id")["step"].nunique()
    smooth = n_steps.max() > SMOOTH_ABOVE_STEPS  # long runs: faint per-step values under a trailing mean
    for ax, (title, ylabel, name) in zip(axes, panels):
        for run_id, s in series[series["name"] == name].groupby("run_id", sort=True):
            s = s.sort_values("step")
            if smooth:
                ax.plot(s["step"], s["value"], lw=0.5, alpha=0.3, color=style[run_id]["color"])
                trail = s["value"].rolling(SMOOTH_STEPS, min_periods=1).mean()
                ax.plot(s["step"], trail, lw=1.4, **style[run_id], label=label[run_id])
            else:
                ax.plot(s["step"], s["value"], marker="o", ms=2.5, lw=1.1, **style[run_id], label=label[run_id])
        ax.set_title(f"{title}: {name}", fontsize=9)
        ax.set_xlabel("training step (optimizer steps)", fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.tick_params(labelsize=7)
    if len(label) <= MAX_LEGEND_LINES:
        _legends(fig, axes, ncols)
    caption = (
        f"Per-step metrics logged by n = {len(n_steps)} training run(s) ({', '.join(f'{label[r]}: {int(n)} steps' for r, n in n_steps.items())}), "
        "one line per run. Mismatch is |π − μ| of the sampled tokens between the trainer and "
        "the rollout engine before the update; masked share counts tokens the objective masked or clipped over "
        "tokens with non-zero advantage (DPPO's actor/pg_clipfrac); a bad update (bad_update/*) is a token with "
        "A < 0 whose probability fell by at least δ = 0.5 below μ in the update, over response tokens (all/frac) "
        "or over tokens with A < 0 (negative_adv/frac); entropy is the trainer's full-vocabulary entropy of π at "
        "each response token, averaged over response tokens; the panel title names the metric drawn (definitions "
        "in docs/rl.md)."
        + (f" Runs of more than {SMOOTH_ABOVE_STEPS} steps: thin lines are the per-step values, thick lines their "
           f"trailing mean over {SMOOTH_STEPS} steps." if smooth else "")
    )
    return [("fig6_training_curves", finish(fig, "Training curves per run (DPPO Figs. 3 and 5 analogue)", caption))]


SMOOTH_ABOVE_STEPS, SMOOTH_STEPS = 40, 5
"""Figure 6 draws a trailing mean over SMOOTH_STEPS steps (beside faint per-step values) for longer runs."""


def _legends(fig: Figure, axes: list, ncols: int) -> None:
    """One legend in the first empty cell of the grid (`panel_grid` with `ncols` columns; right of the last panel)
    where there is one, else one per panel."""
    handles, names = axes[0].get_legend_handles_labels()
    empty = len(axes) % ncols  # the column of the first empty cell in the last row
    if empty and len(axes) > ncols:
        last, column = axes[-1].get_position(), axes[empty].get_position()
        fig.legend(handles, names, loc="center left", fontsize=7, frameon=False,
                   bbox_to_anchor=(column.x0, last.y0, column.width, last.height))
        return
    for ax in axes:
        ax.legend(fontsize=6.5)


def _growth_text(fit, scale: float = 100.0) -> str:
    return f"{scale * fit.slope:+.2g} per {scale:g} steps [{scale * fit.ci_low:+.2g}, {scale * fit.ci_high:+.2g}]"


def fig9_steps(con: duckdb.DuckDBPyConnection, rows=None) -> list[tuple[str, Figure]]:
    """Claim (DPPO Figs. 3 and 5; FP16 study): the training–inference mismatch a run carries is not a
    constant of the engines — it moves with training (a policy drifting into regions where the two
    precisions disagree more), and a run whose mismatch grows is one a trust region anchored on μ has to
    hold. Measured from the stored tokens, not from logged metrics: mean |π − μ| and mean k3 (KL(μ‖π))
    per training step (`steps.step_series`), one line per (run, rollout, scorer), for every run whose
    sequences carry a step (train runs, runs recorded in or imported from an RL framework), each with its
    growth: the per-step slope and its 95 % t-interval (`steps.growth`). `rows` (figures 1-5's row set) is
    not used: train runs are not in it, and collect runs have no steps."""
    from mismatch_lab.analysis.steps import growth, step_series
    from mismatch_lab.figures.base import (
        Skip,
        finish,
        line_styles,
        pair_label,
        panel_figure,
    )

    keys = ["run_id", "rollout", "scorer"]
    series = step_series(con)
    has_finite = series.groupby(keys)["n_finite"].transform("sum") > 0 if len(series) else series["n_finite"] > 0
    unmeasured = series[~has_finite]  # lines without a single finite row: nothing to draw
    series = series[has_finite]
    if series.empty:
        raise Skip("no run over training steps (sequences.step) with finite scored tokens in this store")
    label = run_labels(con, series["run_id"].unique())
    lines = [(key, g.sort_values("step")) for key, g in series.groupby(keys, sort=True)]
    styles = line_styles(len(lines))
    panels = (
        ("abs_dp_mean", "mean |π − μ| per step (probability)", "mean |Δp|"),
        ("kl_k3", "mean k3 = r − log r − 1 per step (nats)", "token KL(μ‖π), k3"),
    )
    fits = {col: {tuple(f[:3]): f for f in growth(series, col).itertuples(index=False)} for col, _, _ in panels}
    marker = "o" if series["step"].nunique() <= SMOOTH_ABOVE_STEPS else None  # markers where fig6 draws no mean
    legend_room = 0.11 * len(lines) if len(lines) <= MAX_LEGEND_LINES else 0.0  # inches under the axes
    fig, axes = panel_figure(1, 2, w=4.2, h=2.9, left=0.9, wgap=1.0, bottom=0.75 + legend_room)
    per_run = pd.Series([key[0] for key, _ in lines]).value_counts()
    for ax, (col, ylabel, title) in zip(axes[0], panels):
        for i, (key, g) in enumerate(lines):
            fit = fits[col].get(key)
            # the run's label names its rollout; the pair is added where a run has several scorers
            name = label.get(key[0], key[0]) + (f": {pair_label(*key[1:])}" if per_run[key[0]] > 1 else "")
            name += f", {_growth_text(fit)}" if fit else ""
            ax.plot(g["step"], g[col], marker=marker, ms=2.5, lw=1.1, **styles[i], label=name)
        vals = series[col].dropna()
        pos = vals[vals > 0]
        if len(pos) and pos.max() / pos.min() > 100 and (vals > 0).all():
            ax.set_yscale("log")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("training step (optimizer steps)", fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.tick_params(labelsize=7)
        if len(lines) <= MAX_LEGEND_LINES:  # under the axes: long labels would cover the curves
            ax.legend(fontsize=5.5, loc="upper left", bbox_to_anchor=(0.0, -0.18), frameon=False)
    caption = _steps_caption(series, lines, label, fits["abs_dp_mean"], unmeasured)
    return [("fig9_mismatch_over_steps", finish(fig, "Mismatch over training steps", caption))]


def _steps_caption(series: pd.DataFrame, lines: list, label: dict, dp_fits: dict, unmeasured: pd.DataFrame) -> str:
    """Figure 9's caption: each line's steps, tokens and growth of mean |dp| (`dp_fits`: line key -> fit),
    the steps without a finite row (gaps) and the lines not drawn (`unmeasured`: no finite row at all)."""
    from mismatch_lab.figures.base import pair_label

    keys = ["run_id", "rollout", "scorer"]
    gaps = series[series["n_finite"] == 0]  # steps whose every row is non-finite: a gap in their line
    per_line = "; ".join(
        f"{label.get(key[0], key[0])} {pair_label(*key[1:])}: {g['step'].nunique()} steps"
        + (f" ({int((g['n_finite'] == 0).sum())} without a finite row)" if (g["n_finite"] == 0).any() else "")
        + f", n = {int(g['n_finite'].sum()):,} tokens"
        + (f", mean |Δp| {_growth_text(dp_fits[key])}" if key in dp_fits else "")
        for key, g in lines[:12]
    ) + ("; …" if len(lines) > 12 else "")
    caption = (
        f"Mismatch per training step measured from the stored tokens of the runs over steps: {len(lines)} "
        f"(run, rollout, scorer) lines ({per_line}), n = {int(series['n_finite'].sum()):,} finite (token, scorer) "
        "rows in all. μ = the rollout engine's probability of the sampled token, π = the scorer's (trainer side) on "
        "the same token; per step the mean over its finite rows of |π − μ| (left) and of k3 = r − log r − 1, an "
        "unbiased estimator of KL(μ‖π) from tokens sampled from μ (right); non-finite rows are excluded and "
        "counted in the analysis (`analyze`, key steps). Growth: least-squares slope of the per-step mean on the "
        "step number, times 100, with its 95 % t-interval (n_steps − 2 degrees of freedom), for lines of ≥ 3 steps. "
        "Log axes where values span more than two decades."
        + (f" {len(gaps)} step(s) hold no finite row ({int(gaps['n_nonfinite'].sum()):,} non-finite rows): gaps in "
           "their lines." if len(gaps) else "")
        + (f" Not drawn, no finite row at all: {unmeasured.groupby(keys).ngroups} line(s) "
           f"({int(unmeasured['n_nonfinite'].sum()):,} non-finite rows)." if len(unmeasured) else "")
        + ("" if len(lines) <= MAX_LEGEND_LINES else " Too many lines for a legend: see the analysis table.")
    )
    return caption
