"""Figure 8: what every objective and rollout correction of the registry does to the same tokens.

One row of panels per rollout (its same-dtype HF scorer, else hf:fp32, as figures 1 and 4): left, per
method, the share of the pair's tokens it masks, of its sequences it drops whole and of its tokens whose
weight it changes; right, the effective sample size of the kept weights. The numbers are those of
`mismatch-lab corrections` (`mismatch_lab.corrections.compare.compare`, published defaults), which runs the
registry's rules (torch, CPU) on the stored tokens; definitions in mismatch_lab/corrections/report.py.
"""

from __future__ import annotations

import duckdb
import numpy as np
from matplotlib.figure import Figure

SHARES = (  # column, legend label, colour
    ("frac_tokens_masked", "tokens masked", "tab:red"),
    ("frac_seqs_masked", "sequences dropped whole", "tab:purple"),
    ("frac_tokens_weight_changed", "tokens with weight changed (w ≠ r)", "tab:blue"),
)
LINTHRESH_PCT = 0.1  # the share axis is linear below 0.1 % and logarithmic above


def fig8_corrections(con: duckdb.DuckDBPyConnection, rows=None) -> list[tuple[str, Figure]]:
    """Claim (issue 14; verl, TRL, slime and prime-rl each ship their own subset of corrections): on the
    same tokens the methods differ by orders of magnitude in what they drop. Token-level rules (ratio clip,
    DPPO masks, IcePop, prime-rl's Δp mask) drop a small share of rare tokens; sequence-level rejection on
    a product or tight geometric-mean ratio (TRL's default `sequence_mask`, verl's Geo-RS and k3) drops
    whole sequences, more of them the longer they are; TIS and GSPO/GMPO reweight instead of dropping.
    `rows` (figures 1-5's row set) is not used: the comparison reads the store in chunks of its own."""
    from mismatch_lab.corrections.compare import compare
    from mismatch_lab.corrections.layout import pair_info
    from mismatch_lab.figures.base import (
        Skip,
        finish,
        one_per_rollout,
        pair_label,
        panel_figure,
        sorted_pairs,
    )

    if pair_info(con).empty:  # (compare() itself fails on a store without any pair)
        raise Skip("no (rollout, scorer) pair with finite scored tokens in this store")
    main = compare(con)["corrections"]
    counted = main[main["n_tokens"].fillna(0) > 0]  # rows without numbers: a top-K rule on a pair without top-K
    if counted.empty:
        raise Skip("no (rollout, scorer) pair with finite scored tokens in this store")
    pairs = one_per_rollout(sorted_pairs(counted), prefer="same")
    methods = list(dict.fromkeys(main["method"]))
    n_obj = int(main.drop_duplicates("method")["axis"].eq("objective").sum())
    h = 0.16 * len(methods) + 0.4
    fig, axes = panel_figure(len(pairs), 2, w=3.6, h=h, left=1.35, wgap=0.35, hgap=0.9, top=0.75, bottom=0.55,
                     width_ratios=[3, 1], sharey=True)  # fmt: skip
    y = np.arange(len(methods))[::-1].astype(float)
    bar_h = 0.8 / len(SHARES)
    described = []
    for (rollout, scorer), (ax, ax_ess) in zip(pairs, axes):
        g = main[(main["rollout"] == rollout) & (main["scorer"] == scorer)].set_index("method").reindex(methods)
        for k, (col, label, color) in enumerate(SHARES):
            vals = 100 * g[col].to_numpy(dtype=float)
            ok = np.isfinite(vals)
            ax.barh(y[ok] + (1 - k) * bar_h, vals[ok], height=bar_h, color=color, label=label, edgecolor="none")
        for yi, note in zip(y, g["note"].fillna("")):
            if note:
                ax.text(0.0, yi, " not computed: the pair has no top-K lists", va="center", ha="left", fontsize=6, color="0.35")
        ax.set_xscale("symlog", linthresh=LINTHRESH_PCT, linscale=0.5)
        ax.set_xlim(0, 100)
        ax.set_xticks([0, 0.1, 1, 10, 100], ["0", "0.1", "1", "10", "100"])
        ax.set_xlabel("share of the pair's tokens / sequences (%)", fontsize=8)
        ax.set_ylabel("method (objective / correction)", fontsize=8)
        ax.set_title(f"{pair_label(rollout, scorer)}: dropped and reweighted", fontsize=9, pad=15)
        ess = g["ess"].to_numpy(dtype=float)
        ok = np.isfinite(ess)
        ax_ess.plot(ess[ok], y[ok], "D", color="k", ms=3.2, ls="none", label="ESS")
        ax_ess.axvline(1.0, color="0.6", lw=0.6, ls="--")
        lo = np.nanmin(ess) if ok.any() else 0.0
        ax_ess.set_xlim(min(lo, 0.98) - 0.01, 1.005)
        ax_ess.set_xlabel("ESS (fraction of kept tokens)", fontsize=8)
        ax_ess.set_ylabel("method (objective / correction)", fontsize=8)
        ax_ess.set_title("effective sample size", fontsize=9, pad=15)
        for a in (ax, ax_ess):
            a.axhline(y[n_obj - 1] - 0.5, color="k", lw=0.6)  # objectives above, rollout corrections below
            a.tick_params(labelsize=7)
            a.grid(axis="x", lw=0.3, alpha=0.5)
        first = g.dropna(subset=["n_tokens"]).iloc[0]
        described.append(f"{rollout} vs {scorer}: n = {int(first['n_tokens']):,} finite tokens in "
                         f"{int(first['n_seqs']):,} sequences, advantage: {first['advantage_source']}")
    axes[0][0].set_yticks(y, methods, fontsize=7)
    axes[0][0].legend(fontsize=6.5, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=3, frameon=False,
                      borderaxespad=0.1, handlelength=1.2, columnspacing=1.0)
    params = "; ".join(f"{m} {p}" for m, p in main.drop_duplicates("method")[["method", "params"]].itertuples(index=False) if p)
    caption = (
        f"Every base objective (above the line) and rollout correction (below) of the registry on the same stored "
        f"tokens, {len(pairs)} pair(s) (collect runs: one per rollout with its same-dtype HF scorer, else hf:fp32; "
        "recorded and imported runs: each with its trainer's scorer): "
        + "; ".join(described) + ". r = π/μ per token; a store holds no π_old, so π_old = π (the first mini-batch "
        "of a step). Red: tokens the method drops (M = 0), over the pair's finite tokens; purple: sequences every "
        "token of which is dropped, over the pair's sequences; blue: tokens kept with a weight w ≠ r, over the "
        "finite tokens (axis linear below 0.1 %, logarithmic above). Right: ESS = (Σw)² / (n Σw²) over the n kept "
        "tokens (1 = all weights equal). Sign-dependent rules read the stored advantage, else reward minus the "
        "prompt group's mean, else fire for either sign (two-sided). Published defaults: " + params
        + ". Top-K rules are not computed where the pair lacks top-K lists (`mismatch-lab corrections` has every pair)."
    )
    return [("fig8_corrections", finish(fig, "What each correction method does to the same tokens", caption))]

