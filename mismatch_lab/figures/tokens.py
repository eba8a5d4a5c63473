"""Figures 1-5: the token runs (collect, and runs recorded or imported from a user's RL framework: μ and π as
base.WEIGHTS_NOTE says), one function per figure; definitions are those of `mismatch_lab.analysis`."""

from __future__ import annotations

import math

import duckdb
import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from mismatch_lab.analysis import definitions as d
from mismatch_lab.analysis.clipping import clipping_by_category, top_clipped_tokens
from mismatch_lab.analysis.precision import DRIFT_COLUMNS, noise_floor, precision_table
from mismatch_lab.analysis.relations import query
from mismatch_lab.analysis.rows import Rows
from mismatch_lab.analysis.volatility import volatility_table
from mismatch_lab.categories import CATEGORIES
from mismatch_lab.figures.base import (
    CAT_COLORS,
    DTYPE_COLORS,
    SCORERS_NOTE,
    WEIGHTS_NOTE,
    Skip,
    dtype_of,
    finish,
    hist2d,
    mesh,
    one_per_rollout,
    pair_key,
    pair_label,
    panel_figure,
    sorted_pairs,
    token_label,
    token_rows,
)

MAX_PAIRS_FIG4 = 3


# -- 1: ratio and TV against mu --------------------------------------------------------------------
def fig1_volatility(con: duckdb.DuckDBPyConnection, rows: Rows | None = None) -> list[tuple[str, Figure]]:
    """Claim (DPPO Fig. 2): at identical parameters the ratio r = π/μ is volatile for rare tokens (spreads
    as μ → 0, converges to 1 as μ → 1) while the binary TV |π − μ| stays small everywhere (largest near
    μ = 0.5). One column per rollout (scored by the HF scorer of its own dtype, else hf:fp32): density of
    tokens, with the r quantiles (1 %, 50 %, 99 %) and the TV mean / p99 per linear μ bucket from
    `volatility_table`."""
    rows = token_rows(con, rows)
    base, params = rows.sql["rollout"]
    r_expr, tv_expr = "exp(lpi - lmu)", "abs(exp(lpi) - exp(lmu))"
    rng = query(con, f"""SELECT quantile_cont({r_expr}, 0.001) AS r_lo, quantile_cont({r_expr}, 0.999) AS r_hi,
                                quantile_cont({tv_expr}, 0.999) AS tv_hi, count(*) AS n
                         FROM ({base}) WHERE finite""", params).iloc[0]
    if not rng["n"]:
        raise Skip("no finite (token, scorer) rows in the collect, recorded and imported runs")
    w = min(max(abs(rng["r_lo"] - 1), abs(rng["r_hi"] - 1), 0.02) * 1.1, 1.0)
    r_range = (1.0 - w, 1.0 + w)
    tv_range = (0.0, max(float(rng["tv_hi"]) * 1.1, d.DELTA_TV * 1.1 if rng["tv_hi"] > 0.05 else 1e-3))
    hr = hist2d(con, base, params, "exp(lmu)", r_expr, (0.0, 1.0), r_range)
    ht = hist2d(con, base, params, "exp(lmu)", tv_expr, (0.0, 1.0), tv_range)
    vol = volatility_table(con, buckets="linear", _rows=rows)
    vol = vol[(vol["bucket"] >= 0) & (vol["n_tokens"] > 0)]
    all_pairs = sorted_pairs(hr)
    pairs = one_per_rollout(all_pairs, "same")
    n_tok = hr.groupby(["rollout", "scorer"])["c"].sum()
    vmax = float(max(hr["c"].max(), ht["c"].max()))
    fig, axes = panel_figure(2, len(pairs), colorbar=True)
    m = None
    for row, (h, yr, ylabel, lines) in enumerate((
        (hr, r_range, "r = π/μ (ratio, unitless)",
         (("r_p01", "r 1 %", ":"), ("r_p50", "r median", "-"), ("r_p99", "r 99 %", ":"))),
        (ht, tv_range, "binary TV |π − μ| (probability)",
         (("binary_tv_mean", "TV mean", "-"), ("binary_tv_p99", "TV 99 %", ":"))),
    )):  # fmt: skip
        for ax, (ro, sc) in zip(axes[row], pairs):
            m = mesh(ax, h[(h["rollout"] == ro) & (h["scorer"] == sc)], (0.0, 1.0), yr, vmax)
            v = vol[(vol["rollout"] == ro) & (vol["scorer"] == sc)]
            for col, lab, ls in lines:
                ax.plot(v["mu_mean"], v[col], ls, color="tab:red", lw=1.2, label=lab)
            if row == 0:
                for edge in (d.CLIP_LOW, d.CLIP_HIGH):
                    if yr[0] < edge < yr[1]:
                        ax.axhline(edge, color="k", lw=0.6, ls="--")
            elif tv_range[1] > d.DELTA_TV:
                ax.axhline(d.DELTA_TV, color="k", lw=0.6, ls="--")
            ax.set_title(f"{pair_label(ro, sc)}\nn = {int(n_tok[(ro, sc)]):,} tokens", fontsize=8)
            ax.set_xlabel("μ = rollout probability (probability)", fontsize=8)
            ax.set_ylabel(ylabel, fontsize=8)
            ax.tick_params(labelsize=7)
            ax.legend(fontsize=6, loc="upper right")
    n_rows = int(n_tok[pairs].sum())
    caption = (
        "Ratio r = π/μ (top) and binary TV |π − μ| (bottom) of the sampled token against its rollout probability "
        f"μ ({WEIGHTS_NOTE}): every stored response token of the collect, recorded and imported runs, {SCORERS_NOTE} "
        f"(collect: the HF scorer of the rollout's own dtype, else hf:fp32); n = {n_rows:,} finite (token, scorer) rows in {len(pairs)} "
        f"pairs (the store holds {len(all_pairs)} pairs; figure 3 summarises all). Shading: tokens per cell "
        "(log scale); values beyond the axis range are drawn at its edge. Red: statistics per linear μ bucket "
        f"(10 buckets, volatility analysis). Dashed: PPO clip range [{d.CLIP_LOW:g}, {d.CLIP_HIGH:g}] (top, where "
        f"in range), DPPO's δ_TV = {d.DELTA_TV:g} (bottom, where in range)."
    )
    return [("fig1_ratio_tv_vs_mu", finish(fig, "Ratio and binary TV vs μ per precision pair (DPPO Fig. 2 analogue)",
                                            caption, m))]


# -- 2: pi vs mu, sequence drift -------------------------------------------------------------------
def fig2_precision_scatter(con: duckdb.DuckDBPyConnection, rows: Rows | None = None) -> list[tuple[str, Figure]]:
    """Claim (FP16 study): FP16 shrinks the training–inference mismatch far below BF16 — π hugs the
    diagonal π = μ more tightly, and the per-sequence Σ log(π/μ) drifts with response length (BF16 slope
    ≈ −1.0 per 1K tokens vs FP16 ≈ −0.07). Panels: each rollout dtype against the fp32 HF scorer (a common
    trainer, so the panels differ only in the rollout's dtype), else against the HF scorer of its own dtype."""
    rows = token_rows(con, rows)
    base, params = rows.sql["rollout"]
    h = hist2d(con, base, params, "exp(lmu)", "exp(lpi)", (0.0, 1.0), (0.0, 1.0))
    if h.empty:
        raise Skip("no finite (token, scorer) rows in the collect, recorded and imported runs")
    pairs = one_per_rollout(sorted_pairs(h), "reference")
    n_tok = h.groupby(["rollout", "scorer"])["c"].sum()
    prec = precision_table(con, _rows=rows).set_index(["rollout", "scorer"])
    drift = rows.sequences("rollout")[DRIFT_COLUMNS]
    drift = drift[drift["logratio_sum"].notna()]
    fig, axes = panel_figure(2, len(pairs), colorbar=True, hgap=1.0)
    m = None
    vmax = float(h["c"].max())
    drawn: list[pd.Series] = []  # the response lengths of the sequences drawn, per pair
    for ax, ax2, (ro, sc) in zip(axes[0], axes[1], pairs):
        m = mesh(ax, h[(h["rollout"] == ro) & (h["scorer"] == sc)], (0.0, 1.0), (0.0, 1.0), vmax)
        ax.plot([0, 1], [0, 1], color="tab:red", lw=0.6, ls="--", label="π = μ")
        p = prec.loc[(ro, sc)]
        ax.set_title(f"{pair_label(ro, sc)}\nn = {int(n_tok[(ro, sc)]):,} tokens; mean |π−μ| = {p['abs_dp_mean']:.2g}",
                     fontsize=8)
        ax.set_xlabel("μ = rollout probability (probability)", fontsize=8)
        ax.set_ylabel("π = trainer probability (probability)", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=6, loc="upper left")

        g = drift[(drift["rollout"] == ro) & (drift["scorer"] == sc)]
        if g.empty:
            ax2.remove()
            continue
        drawn.append(g["response_len"])
        ax2.scatter(g["response_len"], g["logratio_sum"], s=5, alpha=0.35, color=DTYPE_COLORS.get(dtype_of(ro), "k"),
                    rasterized=True, label="sequences")
        slope, icpt = p["seq_logratio_slope_per_1k"], p["seq_logratio_intercept"]
        if pd.notna(slope):
            xs = np.array([g["response_len"].min(), g["response_len"].max()], float)
            lo, hi = p["seq_logratio_slope_ci_low_per_1k"], p["seq_logratio_slope_ci_high_per_1k"]
            ci = f" [{lo:+.3g}, {hi:+.3g}]" if pd.notna(lo) else ""
            ax2.plot(xs, icpt + slope / 1000.0 * xs, color="k", lw=1.2, label=f"fit: {slope:+.3g}{ci} nats per 1K tokens")
            rate, rlo, rhi = (p[f"seq_logratio_rate{k}_per_1k"] for k in ("", "_ci_low", "_ci_high"))
            ax2.plot(xs, rate / 1000.0 * xs, color="k", lw=0.9, ls="--",
                     label=f"through 0: {rate:+.3g} [{rlo:+.3g}, {rhi:+.3g}] per 1K")
        ax2.axhline(0, color="gray", lw=0.5)
        ax2.set_title(f"n = {len(g):,} sequences; mean seq. KL k1 = {p['seq_kl_k1_mean']:.2g} nats", fontsize=8)
        ax2.set_xlabel("response length (tokens)", fontsize=8)
        ax2.set_ylabel("Σ_t log(π/μ) per sequence (nats)", fontsize=8)
        ax2.tick_params(labelsize=7)
        ax2.legend(fontsize=6)
    lengths = pd.concat(drawn) if drawn else pd.Series(dtype=float)
    caption = (
        f"Top: trainer-side probability π against rollout probability μ of the same sampled token ({WEIGHTS_NOTE}), "
        f"every stored response token of the collect, recorded and imported runs (n = {int(n_tok[pairs].sum()):,} finite (token, scorer) rows over "
        f"{len(pairs)} pairs; {SCORERS_NOTE}: collect runs' rollout dtypes scored by hf:fp32 where stored, else by "
        "the HF scorer of their own dtype); shading: "
        "tokens per cell (log scale); dashed: π = μ. Bottom: per sequence without a non-finite token "
        f"(n = {len(lengths):,} sequences), the sum over the response of log π − log μ (log of the sequence-level ratio) "
        "against response length, with its least-squares fit (solid) and the fit through the origin (dashed, "
        "the drift rate), each with its 95 % t-interval in brackets (FP16 paper: BF16 ≈ −1.0, FP16 ≈ −0.07 nats "
        "per 1K tokens); 'seq. KL k1' is the mean over sequences of "
        f"Σ_t (log μ − log π). {_length_span(lengths)}: where that is far below 1K, the slope per "
        "1K tokens is an extrapolation."
    )
    return [("fig2_pi_vs_mu_seq_drift", finish(fig, "π vs μ and sequence drift per precision (FP16 study)", caption, m))]


def _length_span(lengths: pd.Series) -> str:
    return f"Responses are {int(lengths.min())}–{int(lengths.max())} tokens long" if len(lengths) else "No complete sequence"


# -- 3: precision summary --------------------------------------------------------------------------
def fig3_precision_summary(con: duckdb.DuckDBPyConnection, rows: Rows | None = None) -> list[tuple[str, Figure]]:
    """Claim (FP16 study): FP16's mismatch is far below BF16's (mean |π − μ| ≈ 0.0005 vs 0.004; token KL
    ≈ 1e-5 vs 1e-3), and (docs/papers.md, typical values) 4–8 % of BF16 tokens leave [0.9, 1.1]. Bars: mean
    |Δp|, k3 KL(μ‖π) and the share outside PPO's clip range per (rollout, scorer) pair, next to the
    scorer-vs-scorer noise floor (each scorer against hf:fp32 on the same tokens)."""
    rows = token_rows(con, rows)
    prec = precision_table(con, _rows=rows)
    if prec.empty:
        raise Skip("no (rollout, scorer) pairs in the collect, recorded and imported runs")
    floor = noise_floor(con, _rows=rows)
    prows = [(f"{r} vs {s}", r, "pair", row) for (r, s), row in
             zip(zip(prec["rollout"], prec["scorer"]), prec.to_dict("records"))]
    prows.sort(key=lambda x: pair_key(x[3]["rollout"], x[3]["scorer"]))
    frows = [(f"{s} vs {ref}\n(on {r} tokens)", r, "floor", row) for r, s, ref, row in
             zip(floor["rollout"], floor["scorer"], floor["reference"], floor.to_dict("records"))]
    frows.sort(key=lambda x: pair_key(x[3]["rollout"], x[3]["scorer"]))
    allrows = prows + frows
    metrics = [
        ("abs_dp_mean", "mean |π − μ| (probability)", "mean |Δp|"),
        ("kl_k3", "mean k3 = r − log r − 1 (nats)", "token KL(μ‖π), k3"),
        ("frac_ratio_outside_clip", f"share with r ∉ [{d.CLIP_LOW:g}, {d.CLIP_HIGH:g}] (fraction)", "share outside clip range"),
    ]
    drawn = [m for m in metrics if any(np.isfinite(x[3][m[0]]) and x[3][m[0]] > 0 for x in allrows)]
    if not drawn and not any(np.isfinite(x[3][m[0]]) for x in allrows for m in metrics):
        raise Skip("no pair has a finite (token, scorer) row: every log μ or log π is NaN or ±inf (counted as "
                   "n_nonfinite in `analyze`)")
    if not drawn:
        raise Skip("every pair has zero mismatch on every metric")
    h = 0.2 * len(allrows) + 0.3
    fig, axes = panel_figure(1, len(drawn), w=3.0, h=h, left=2.6, wgap=0.55, top=0.75, bottom=0.55, sharey=True)
    axes = axes[0]
    y = np.arange(len(allrows))[::-1]
    for ax, (col, xlabel, title) in zip(axes, drawn):
        vals = np.array([float(r[3][col]) if pd.notna(r[3][col]) else np.nan for r in allrows])
        colors = [DTYPE_COLORS.get(dtype_of(r[1]), "gray") for r in allrows]
        hatches = ["" if r[2] == "pair" else "////" for r in allrows]
        alphas = [0.9 if r[2] == "pair" else 0.5 for r in allrows]
        pos = vals[np.isfinite(vals) & (vals > 0)]
        log = len(pos) > 0 and pos.max() / pos.min() > 100
        for yi, v, c, hh, a in zip(y, vals, colors, hatches, alphas):
            if np.isfinite(v) and (v > 0 or not log):
                ax.barh(yi, v, color=c, hatch=hh, alpha=a, edgecolor="k", lw=0.4, height=0.75)
        if log:
            ax.set_xscale("log")
            for yi, v in zip(y, vals):
                if np.isfinite(v) and v <= 0:
                    ax.text(pos.min(), yi, " 0", ha="left", va="center", fontsize=6.5)
        if frows:
            ax.axhline(len(frows) - 0.5, color="k", lw=0.6)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.set_ylabel("pair (μ vs π)", fontsize=7)
        ax.tick_params(labelsize=7)
    axes[0].set_yticks(y, [r[0].replace("\n", " ") for r in allrows], fontsize=6.5)
    n_rows = int(prec["n_finite"].sum())
    caption = (
        f"Token-level mismatch ({WEIGHTS_NOTE}) over the collect, recorded and imported runs: {len(prows)} (rollout, scorer) pairs "
        f"with n = {n_rows:,} finite (token, scorer) rows in all (per pair: " +
        ", ".join(f"{r['rollout']}/{r['scorer']} n={int(r['n_finite']):,}" for _, _, _, r in prows[:12]) +
        (", …" if len(prows) > 12 else "") + "). "
        + ("Hatched bars below the line: the same metrics between a scorer and the hf:fp32 scorer on the same "
           "tokens (the noise floor a rollout cannot be told apart from). " if frows else
           "No noise floor is drawn: the store holds no scorer compared with hf:fp32 on the same tokens. ")
        + "k3 is an "
        "unbiased estimator of KL(μ‖π) from tokens sampled from μ; all means over finite rows; colour = dtype of "
        "the rollout (red bf16, blue fp16, green fp32); log axes where values span more than two decades."
    )  # fmt: skip
    return [("fig3_precision_summary", finish(fig, "Precision summary: mismatch per (rollout, scorer) pair", caption))]


# -- 4: clipped tokens -----------------------------------------------------------------------------
def fig4_clipping(con: duckdb.DuckDBPyConnection, rows: Rows | None = None) -> list[tuple[str, Figure]]:
    """Claim (DPPO Figs. 6–7): the tokens PPO's ratio clip drops are mostly rare (low μ) tokens, and the most
    clipped strings are numbers, math symbols and reasoning connectives; DPPO's TV/KL masks drop far fewer
    of them. One pair per rollout (its same-dtype HF scorer, else hf:fp32; at most three; only pairs where anything
    is clipped): the
    share of each token category ratio-clipped vs TV/KL-masked, and the 30 most clipped token strings."""
    rows = token_rows(con, rows)
    cat = clipping_by_category(con, _rows=rows)
    cat = cat[cat["adv_sign"] == "all"]
    top = top_clipped_tokens(con, d.TOP_N_TOKENS, _rows=rows)
    clipped = cat.groupby(["rollout", "scorer"])["n_ratio_clip"].sum()  # (top is empty without token ids)
    if not (clipped > 0).any():
        raise Skip("no token is ratio-clipped in any pair of the collect, recorded and imported runs")
    all_pairs = sorted_pairs(cat)
    pairs = [p for p in one_per_rollout(all_pairs, "same") if clipped.get(p, 0) > 0]
    if not pairs:
        pairs = sorted(clipped.index, key=lambda p: -clipped[p])
    skipped = [p for p in one_per_rollout(all_pairs, "same") if clipped.get(p, 0) == 0]
    for p in skipped:
        print(f"    fig4: {pair_label(*p)}: no ratio-clipped token, panel left out")
    pairs = pairs[:MAX_PAIRS_FIG4]
    fig, axes = panel_figure(len(pairs), 2, w=4.4, h=3.8, left=0.7, wgap=1.4, hgap=1.1, top=0.8)
    parts = []
    for (ax_c, ax_t), (ro, sc) in zip(axes, pairs):
        c = cat[(cat["rollout"] == ro) & (cat["scorer"] == sc)].set_index("category")
        c = c[c["n_tokens"] > 0]
        x = np.arange(len(c))
        for j, (col, lab, colr) in enumerate((("frac_ratio_clip", "PPO ratio clip", "tab:red"),
                                              ("frac_tv_mask", f"DPPO binary-TV mask (δ={d.DELTA_TV:g})", "tab:blue"),
                                              ("frac_kl_mask", f"DPPO binary-KL mask (δ={d.DELTA_KL:g})", "tab:cyan"))):
            ax_c.bar(x + (j - 1) * 0.27, 100 * c[col].fillna(0).to_numpy(float), width=0.27, color=colr, label=lab)
        ax_c.set_xticks(x, [f"{k}\nn={int(n):,}" for k, n in zip(c.index, c["n_tokens"])], fontsize=7)
        ax_c.set_ylabel("tokens dropped (% of the category)", fontsize=8)
        ax_c.set_xlabel("token category (n = finite tokens)", fontsize=8)
        n_clip = int(c["n_ratio_clip"].sum())
        mu_cl = (c["mu_mean_clipped"].fillna(0) * c["n_ratio_clip"]).sum() / max(n_clip, 1)
        ax_c.set_title(f"{pair_label(ro, sc)}\n{n_clip:,} of {int(c['n_tokens'].sum()):,} tokens ratio-clipped, "
                       f"mean μ of the clipped = {mu_cl:.2f}", fontsize=8)
        ax_c.set_ylim(top=ax_c.get_ylim()[1] * 1.35)  # room above the bars for the legend
        ax_c.legend(fontsize=7, loc="upper right")
        ax_c.tick_params(axis="y", labelsize=7)
        t = top[(top["rollout"] == ro) & (top["scorer"] == sc)].sort_values("rank", ascending=False)
        parts.append(f"{ro}/{sc}: n={int(c['n_tokens'].sum()):,}")
        if t.empty:  # a run recorded without token ids (token_ids=None): nothing to rank
            ax_t.text(0.5, 0.5, "no token ids stored for this pair:\nno token strings to rank", ha="center",
                      va="center", fontsize=8, transform=ax_t.transAxes)
            ax_t.set_axis_off()
            continue
        y = np.arange(len(t))
        ax_t.barh(y, t["n_ratio_clip"], color=[CAT_COLORS.get(k, "k") for k in t["category"]])
        ax_t.set_yticks(y, [token_label(s, i) for s, i in zip(t["token_text"], t["token_id"])], fontsize=6)
        ax_t.set_xlabel("times ratio-clipped (count of occurrences)", fontsize=8)
        ax_t.set_ylabel("token string (colour = category)", fontsize=8)
        ax_t.set_title(f"top {len(t)} ratio-clipped token strings", fontsize=8)
        handles = [Patch(color=CAT_COLORS[k], label=k) for k in CATEGORIES if k in set(t["category"])]
        ax_t.legend(handles=handles, fontsize=6, loc="lower right")
        ax_t.tick_params(axis="x", labelsize=7)
    caption = (
        f"Which sampled tokens PPO's two-sided ratio clip (r ∉ [{d.CLIP_LOW:g}, {d.CLIP_HIGH:g}]) would drop "
        f"({WEIGHTS_NOTE}), against DPPO's binary-TV (|π − μ| > {d.DELTA_TV:g}) and binary-KL (> {d.DELTA_KL:g}) "
        f"masks, by token category, for every token of the collect, recorded and imported runs ({'; '.join(parts)} finite tokens). "
        "Right: the token strings ratio-clipped most often (count over all their occurrences). "
        + (f"Pairs with no clipped token are left out: {', '.join(f'{a}/{b}' for a, b in skipped)}." if skipped else "")
    )
    return [("fig4_clipped_tokens", finish(fig, "Clipped tokens: PPO ratio clip vs DPPO masks", caption))]


# -- 5: approximation ------------------------------------------------------------------------------
def fig5_approximation(con: duckdb.DuckDBPyConnection, rows: Rows | None = None) -> list[tuple[str, Figure]]:
    """Claim (DPPO): binary and top-K divergences perform about the same as trust-region measures; here
    tested as how closely each tracks the exact full-vocabulary TV (known between a scorer and the hf:fp32
    reference scorer on the same prefix). Density of binary TV and of top-K TV against exact TV, one
    column per scorer, with Pearson r and the agreement of the δ_TV decision from `approximation_table`'s
    definitions."""
    rows = token_rows(con, rows)
    rel, params = rows.sql["scorer"]
    stats = query(con, f"""
        SELECT scorer, count(*) FILTER (WHERE finite AND isfinite(tv_exact)) AS n_exact,
               count(*) FILTER (WHERE finite AND isfinite(tv_exact) AND topk_tv IS NOT NULL) AS n_topk,
               corr(btv, tv_exact) FILTER (WHERE finite AND isfinite(tv_exact)) AS b_corr,
               corr(topk_tv, tv_exact) FILTER (WHERE finite AND isfinite(tv_exact)) AS k_corr,
               avg(((btv > {d.DELTA_TV!r}) = (tv_exact > {d.DELTA_TV!r}))::DOUBLE) FILTER (WHERE finite AND isfinite(tv_exact)) AS b_agree,
               avg(((topk_tv > {d.DELTA_TV!r}) = (tv_exact > {d.DELTA_TV!r}))::DOUBLE) FILTER (WHERE finite AND isfinite(tv_exact) AND topk_tv IS NOT NULL) AS k_agree,
               quantile_cont(tv_exact, 0.005) FILTER (WHERE finite AND tv_exact > 0) AS lo,
               max(tv_exact) FILTER (WHERE finite AND isfinite(tv_exact)) AS hi
        FROM ({rel}) GROUP BY scorer ORDER BY scorer""", params)  # fmt: skip
    stats = stats[stats["n_exact"] > 0]
    if stats.empty:
        raise Skip("no exact TV stored (scores.tv_exact_vs_ref) for any scorer against hf:fp32")
    lo = math.floor(math.log10(max(float(stats["lo"].min()), 1e-9)))
    hi = math.ceil(math.log10(max(float(stats["hi"].max()), 10 ** (lo + 1))))
    rng = (float(lo), float(hi))
    kinds = [("btv", "binary TV |π_s − π_ref| (probability, log scale)", "b")]
    if (stats["n_topk"] > 0).any():
        kinds.append(("topk_tv", "top-K TV (probability, log scale)", "k"))
    floor_v = 10.0 ** lo
    h = {}
    for expr, _, key in kinds:
        h[key] = hist2d(con, rel, params, f"log10(greatest(tv_exact, {floor_v!r}))",
                         f"log10(greatest({expr}, {floor_v!r}))", rng, rng, keys=("scorer",))
    scorers = sorted(stats["scorer"], key=lambda s: pair_key("x:" + dtype_of(s), s))
    fig, axes = panel_figure(len(kinds), len(scorers), w=2.9, h=2.6, colorbar=True, hgap=1.0)
    vmax = float(max(hh["c"].max() for hh in h.values()))
    m = None
    st = stats.set_index("scorer")
    for i, (expr, ylabel, key) in enumerate(kinds):
        for j, s in enumerate(scorers):
            ax = axes[i, j]
            hh = h[key][h[key]["scorer"] == s]
            n = int(st.loc[s, "n_exact" if key == "b" else "n_topk"])
            if hh.empty or n == 0:
                ax.remove()
                continue
            m = mesh(ax, hh, rng, rng, vmax)
            ax.plot(rng, rng, color="tab:red", lw=0.7, ls="--", label="approx = exact")
            if lo < math.log10(d.DELTA_TV) < hi:
                ax.axvline(math.log10(d.DELTA_TV), color="k", lw=0.5, ls=":")
                ax.axhline(math.log10(d.DELTA_TV), color="k", lw=0.5, ls=":", label=f"δ_TV = {d.DELTA_TV:g}")
            ax.set_title(f"{s} vs {d.REFERENCE_SCORER}: n = {n:,}\nPearson r = {st.loc[s, key + '_corr']:.3f}, "
                         f"δ decision agrees {100 * st.loc[s, key + '_agree']:.2f} %", fontsize=8)
            ax.set_xlabel("exact full-vocabulary TV (probability, log10)", fontsize=8)
            ax.set_ylabel(ylabel.replace("log scale", "log10"), fontsize=8)
            ax.tick_params(labelsize=7)
            ax.legend(fontsize=6, loc="upper left")
    caption = (
        "Binary TV (sampled token only) and top-K TV (the reference scorer's recorded top-K ids + the sampled "
        "token + one 'other' bucket) against the exact full-vocabulary TV between each scorer and the hf:fp32 "
        f"scorer on the same prefix, every finite token of the collect, recorded and imported runs (n = {int(stats['n_exact'].sum()):,} "
        f"(token, scorer) rows with exact TV; n per panel in its title). Axes log10; "
        f"values below 1e{lo} are drawn at the axis edge. Both approximations are lower bounds of the exact TV "
        "(points lie on or below the dashed line). 'Agrees' = share of tokens where approx > δ_TV and exact > δ_TV "
        "give the same decision."
    )
    return [("fig5_tv_approximation", finish(fig, "Binary and top-K TV against exact TV", caption, m))]

