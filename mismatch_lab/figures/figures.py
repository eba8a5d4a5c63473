"""The paper-style figures, one function per figure, each reading a store (any `open_store` connection).

Every function takes a read-only DuckDB connection (and optionally the shared `Rows` of `study_rows`) and
returns `[(file stem, matplotlib Figure), ...]`,
or raises `Skip(reason)` when the store lacks what the figure needs (no training run, no batch-size
variation, no exact TV): a figure is never drawn empty. Each figure has a title, axes labelled with their
units, and a caption at the bottom saying what was measured, on what, with n. Densities are computed in
SQL (2-D histograms, GROUP BY) and only the grid reaches matplotlib; per-sequence scatters draw one point
per sequence. Figures 1-5 read the token runs, the kinds of `schema.TOKEN_FIGURE_KINDS` (collect, and
runs recorded or imported from a user's RL framework: μ and π taken at identical parameters); figure 7
the `collect` runs; figure 6 the `train` runs; figure 9 every run whose sequences carry a training step
(train, recorded, imported runs). Definitions (r, binary TV, k3, clip range, delta) are those of `mismatch_lab.analysis`
(docs/analysis.md).

    1 fig1_ratio_tv_vs_mu               ratio and binary TV against mu per pair     (DPPO Fig. 2)
    2 fig2_pi_vs_mu_seq_drift           pi vs mu; per-sequence log-ratio vs length  (FP16 study)
    3 fig3_precision_summary            mean |dp|, k3 KL, share outside clip + noise floor
    4 fig4_clipped_tokens               clipped categories and top-30 clipped tokens (DPPO Figs. 6-7)
    5 fig5_tv_approximation             binary / top-K TV against exact TV
    6 fig6_training_curves              per-objective training curves               (DPPO Figs. 3, 5)
    7 fig7_batch_invariance             identical sequences and |dlogp| by batch size
    8 fig8_corrections                  each correction method's masked / dropped / reweighted shares, ESS (corrections.py)
    9 fig9_mismatch_over_steps          mean |dp| and k3 per training step per run and pair
"""

from __future__ import annotations

import json
import math
import textwrap
from collections.abc import Callable

import duckdb
import matplotlib

matplotlib.use("Agg")  # no display; Figure objects are drawn by the Agg and PDF backends

import numpy as np
import pandas as pd
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from mismatch_lab.analysis import definitions as d
from mismatch_lab.analysis.clipping import clipping_by_category, top_clipped_tokens
from mismatch_lab.analysis.precision import DRIFT_COLUMNS, noise_floor, precision_table
from mismatch_lab.analysis.relations import Filters, query
from mismatch_lab.analysis.rows import Rows
from mismatch_lab.analysis.volatility import volatility_table
from mismatch_lab.categories import CATEGORIES
from mismatch_lab.figures.corrections import fig8_corrections
from mismatch_lab.figures.training import fig6_training, fig9_steps
from mismatch_lab.scoring.hf_scorer import SCORE_BATCH_TOKENS, SCORE_CHUNK_ROWS
from mismatch_lab.store.schema import TOKEN_FIGURE_KINDS


class Skip(Exception):
    """The store holds no data for this figure; the message says what is missing."""


NX = NY = 60  # 2-D histogram resolution
DTYPE_COLORS = {"bf16": "tab:red", "fp16": "tab:blue", "fp32": "tab:green"}
CAT_COLORS = dict(zip(CATEGORIES, ("tab:gray", "tab:olive", "tab:red", "tab:purple", "tab:orange", "tab:brown", "tab:blue")))
MAX_PAIRS_FIG4 = 3
MIN_WIDTH = 7.5  # inches


# -- helpers ---------------------------------------------------------------------------------------
def _fig(nrows: int, ncols: int, w: float = 3.0, h: float = 2.4, *, left: float = 0.8, right: float = 0.3,
         top: float = 0.95, bottom: float = 0.6, wgap: float = 0.8, hgap: float = 0.95,
         colorbar: bool = False, **kw) -> tuple[Figure, np.ndarray]:
    """A figure of nrows x ncols panels, each w x h inches, with fixed margins in inches (a fixed layout:
    tight_layout measures every text and costs seconds per figure on a busy 2-core machine). `_finish`
    adds the caption below by growing the figure. colorbar=True reserves room for one shared colorbar."""
    right += 0.9 if colorbar else 0.0
    W = left + right + ncols * w + (ncols - 1) * wgap
    if W < MIN_WIDTH:  # room for the title and caption: centre the panels
        left, right, W = left + (MIN_WIDTH - W) / 2, right + (MIN_WIDTH - W) / 2, MIN_WIDTH
    H = top + bottom + nrows * h + (nrows - 1) * hgap
    fig = Figure(figsize=(W, H))
    fig.subplots_adjust(left=left / W, right=1 - right / W, top=1 - top / H, bottom=bottom / H,
                        wspace=wgap / w, hspace=hgap / h)
    axes = fig.subplots(nrows, ncols, squeeze=False, **kw)
    fig._layout = {"top": top, "bottom": bottom, "right": right, "colorbar": colorbar}
    return fig, axes


def _grid(n: int, ncols: int = 4, **kw) -> tuple[Figure, list]:
    """A figure with n panels on a grid; the grid's unused cells are removed (no empty panel)."""
    ncols = max(1, min(ncols, n))
    nrows = math.ceil(n / ncols)
    fig, axes = _fig(nrows, ncols, **kw)
    flat = list(axes.ravel())
    for ax in flat[n:]:
        ax.remove()
    return fig, flat[:n]


def _finish(fig: Figure, title: str, caption: str, mappable=None) -> Figure:
    """Suptitle on top, the caption wrapped below the panels (the figure grows to hold it), and the shared
    colorbar of `mappable` at the right margin."""
    lay = fig._layout
    W, H = fig.get_size_inches()
    text = textwrap.fill(caption, width=int(W * 17.5))
    cap_h = (text.count("\n") + 1) * 0.135 + 0.2
    new_h = H + cap_h
    sp = fig.subplotpars
    fig.set_size_inches(W, new_h)
    fig.subplots_adjust(bottom=(lay["bottom"] + cap_h) / new_h, top=1 - lay["top"] / new_h,
                        hspace=sp.hspace, wspace=sp.wspace)
    fig.suptitle(title, fontsize=11, y=1 - 0.12 / new_h, va="top")
    fig.text(0.01, 0.08 / new_h, text, fontsize=7.5, va="bottom", ha="left")
    if mappable is not None and lay.get("colorbar"):
        bottom, top = (lay["bottom"] + cap_h) / new_h, 1 - lay["top"] / new_h
        x0 = sp.right + 0.15 / W
        cax = fig.add_axes((x0, bottom, 0.14 / W, top - bottom), label="colorbar")
        cb = fig.colorbar(mappable, cax=cax)
        cb.set_label("tokens per cell (count, log scale)", fontsize=8)
        cax.tick_params(labelsize=7)
    return fig


def _collect_run_ids(con: duckdb.DuckDBPyConnection) -> list[str]:
    ids = [r[0] for r in con.execute("SELECT run_id FROM runs WHERE list_contains(?, kind) ORDER BY run_id",
                                     [list(TOKEN_FIGURE_KINDS)]).fetchall()]
    if not ids:
        raise Skip("no collect, recorded or imported runs in this store")
    return ids


def _dtype(label: str) -> str:
    """The compute dtype of a rollout or scorer label: 'vllm:bf16' and 'vllm:bf16-wfp8' (rounded weights) -> 'bf16'."""
    return label.split(":")[-1].split("-w")[0]


def _pair_key(rollout: str, scorer: str) -> tuple:
    order = {"bf16": 0, "fp16": 1, "fp32": 2}
    return (order.get(_dtype(rollout), 9), rollout, scorer.startswith("vllm"), order.get(_dtype(scorer), 9), scorer)


def _sorted_pairs(df: pd.DataFrame) -> list[tuple[str, str]]:
    pairs = {(r, s) for r, s in zip(df["rollout"], df["scorer"])}
    return sorted(pairs, key=lambda p: _pair_key(*p))


def _one_per_rollout(pairs: list[tuple[str, str]], prefer: str = "same") -> list[tuple[str, str]]:
    """One pair per rollout. prefer='same': the HF scorer of the rollout's own dtype (the RL setting, both
    sides at one precision), else the reference scorer hf:fp32, else the first scorer. prefer='reference':
    hf:fp32 first (a common trainer, so rollouts differ only in their own dtype), then the same-dtype one."""
    out = []
    for rollout in dict.fromkeys(r for r, _ in pairs):
        scorers = [s for r, s in pairs if r == rollout]
        same = [s for s in scorers if s.startswith("hf:") and _dtype(s) == _dtype(rollout)]
        ref = [s for s in scorers if s == d.REFERENCE_SCORER]
        order = (same + ref) if prefer == "same" else (ref + same)
        out.append((rollout, (order or scorers)[0]))
    return out


def _pair_label(rollout: str, scorer: str) -> str:
    return f"μ {rollout} vs π {scorer}"


def _token_label(text, token_id) -> str:
    """A token string as drawn; a token stored without text (no tokenizer was given) by its id."""
    if isinstance(text, str):
        return repr(text)[1:-1]
    return f"id {int(token_id)}" if pd.notna(token_id) else "∅"


def study_rows(con: duckdb.DuckDBPyConnection, *, materialize: bool = True) -> Rows:
    """The row sets of the token runs (collect, record, import: `schema.TOKEN_FIGURE_KINDS`), joined once
    (materialize) and shared by figures 1-5: pass the result as `rows=` so their analyses reuse each
    other's passes. Raises Skip without such runs."""
    return Rows(con, Filters.make(run_ids=_collect_run_ids(con)), materialize=materialize)


def _rows(con: duckdb.DuckDBPyConnection, rows: Rows | None) -> Rows:
    if rows is None:
        rows = study_rows(con, materialize=False)
    if not rows.ok:
        raise Skip("the store has no tokens/scores/runs tables")
    return rows


def _hist2d(con, base: str, params: dict, x: str, y: str, xr: tuple, yr: tuple, keys=("rollout", "scorer")) -> pd.DataFrame:
    """Counts on an NX x NY grid of expressions x, y over the finite rows of `base`, values outside the
    ranges clamped to the edge bins. Columns: *keys, bx, by, c."""
    (x0, x1), (y0, y1) = (float(v) for v in xr), (float(v) for v in yr)
    k = ", ".join(keys)
    sql = f"""
        SELECT {k},
               least(greatest(floor(({x} - {x0!r}) / {(x1 - x0)!r} * {NX}), 0), {NX - 1})::INTEGER AS bx,
               least(greatest(floor(({y} - {y0!r}) / {(y1 - y0)!r} * {NY}), 0), {NY - 1})::INTEGER AS by,
               count(*) AS c
        FROM ({base}) WHERE finite AND isfinite({x}) AND isfinite({y})
        GROUP BY ALL"""
    return query(con, sql, params)


def _mesh(ax, h: pd.DataFrame, xr, yr, vmax: float):
    grid = np.zeros((NY, NX))
    grid[h["by"].to_numpy(int), h["bx"].to_numpy(int)] = h["c"].to_numpy(float)
    masked = np.ma.masked_equal(grid, 0)
    xs, ys = np.linspace(*xr, NX + 1), np.linspace(*yr, NY + 1)
    return ax.pcolormesh(xs, ys, masked, cmap="viridis", norm=LogNorm(vmin=1, vmax=max(vmax, 2.0)),
                         rasterized=True, shading="flat")


# -- 1: ratio and TV against mu --------------------------------------------------------------------
def fig1_volatility(con: duckdb.DuckDBPyConnection, rows: Rows | None = None) -> list[tuple[str, Figure]]:
    """Claim (DPPO Fig. 2): at identical parameters the ratio r = π/μ is volatile for rare tokens (spreads
    as μ → 0, converges to 1 as μ → 1) while the binary TV |π − μ| stays small everywhere (largest near
    μ = 0.5). One column per rollout (scored by the HF scorer of its own dtype, else hf:fp32): density of
    tokens, with the r quantiles (1 %, 50 %, 99 %) and the TV mean / p99 per linear μ bucket from
    `volatility_table`."""
    rows = _rows(con, rows)
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
    hr = _hist2d(con, base, params, "exp(lmu)", r_expr, (0.0, 1.0), r_range)
    ht = _hist2d(con, base, params, "exp(lmu)", tv_expr, (0.0, 1.0), tv_range)
    vol = volatility_table(con, buckets="linear", _rows=rows)
    vol = vol[(vol["bucket"] >= 0) & (vol["n_tokens"] > 0)]
    all_pairs = _sorted_pairs(hr)
    pairs = _one_per_rollout(all_pairs, "same")
    n_tok = hr.groupby(["rollout", "scorer"])["c"].sum()
    vmax = float(max(hr["c"].max(), ht["c"].max()))
    fig, axes = _fig(2, len(pairs), colorbar=True)
    m = None
    for row, (h, yr, ylabel, lines) in enumerate((
        (hr, r_range, "r = π/μ (ratio, unitless)",
         (("r_p01", "r 1 %", ":"), ("r_p50", "r median", "-"), ("r_p99", "r 99 %", ":"))),
        (ht, tv_range, "binary TV |π − μ| (probability)",
         (("binary_tv_mean", "TV mean", "-"), ("binary_tv_p99", "TV 99 %", ":"))),
    )):  # fmt: skip
        for ax, (ro, sc) in zip(axes[row], pairs):
            m = _mesh(ax, h[(h["rollout"] == ro) & (h["scorer"] == sc)], (0.0, 1.0), yr, vmax)
            v = vol[(vol["rollout"] == ro) & (vol["scorer"] == sc)]
            for col, lab, ls in lines:
                ax.plot(v["mu_mean"], v[col], ls, color="tab:red", lw=1.2, label=lab)
            if row == 0:
                for edge in (d.CLIP_LOW, d.CLIP_HIGH):
                    if yr[0] < edge < yr[1]:
                        ax.axhline(edge, color="k", lw=0.6, ls="--")
            elif tv_range[1] > d.DELTA_TV:
                ax.axhline(d.DELTA_TV, color="k", lw=0.6, ls="--")
            ax.set_title(f"{_pair_label(ro, sc)}\nn = {int(n_tok[(ro, sc)]):,} tokens", fontsize=8)
            ax.set_xlabel("μ = rollout probability (probability)", fontsize=8)
            ax.set_ylabel(ylabel, fontsize=8)
            ax.tick_params(labelsize=7)
            ax.legend(fontsize=6, loc="upper right")
    n_rows = int(n_tok[pairs].sum())
    caption = (
        "Ratio r = π/μ (top) and binary TV |π − μ| (bottom) of the sampled token against its rollout probability "
        "μ, at identical weights: every generated token of the collect, recorded and imported runs, scored by the trainer-side HF scorer "
        f"of the rollout's own dtype, else by hf:fp32 (teacher forcing); n = {n_rows:,} finite (token, scorer) rows in {len(pairs)} "
        f"pairs (the store holds {len(all_pairs)} pairs; figure 3 summarises all). Shading: tokens per cell "
        "(log scale); values beyond the axis range are drawn at its edge. Red: statistics per linear μ bucket "
        f"(10 buckets, volatility analysis). Dashed: PPO clip range [{d.CLIP_LOW:g}, {d.CLIP_HIGH:g}] (top, where "
        f"in range), DPPO's δ_TV = {d.DELTA_TV:g} (bottom, where in range)."
    )
    return [("fig1_ratio_tv_vs_mu", _finish(fig, "Ratio and binary TV vs μ per precision pair (DPPO Fig. 2 analogue)",
                                            caption, m))]


# -- 2: pi vs mu, sequence drift -------------------------------------------------------------------
def fig2_precision_scatter(con: duckdb.DuckDBPyConnection, rows: Rows | None = None) -> list[tuple[str, Figure]]:
    """Claim (FP16 study): FP16 shrinks the training–inference mismatch far below BF16 — π hugs the
    diagonal π = μ more tightly, and the per-sequence Σ log(π/μ) drifts with response length (BF16 slope
    ≈ −1.0 per 1K tokens vs FP16 ≈ −0.07). Panels: each rollout dtype against the fp32 HF scorer (a common
    trainer, so the panels differ only in the rollout's dtype), else against the HF scorer of its own dtype."""
    rows = _rows(con, rows)
    base, params = rows.sql["rollout"]
    h = _hist2d(con, base, params, "exp(lmu)", "exp(lpi)", (0.0, 1.0), (0.0, 1.0))
    if h.empty:
        raise Skip("no finite (token, scorer) rows in the collect, recorded and imported runs")
    pairs = _one_per_rollout(_sorted_pairs(h), "reference")
    n_tok = h.groupby(["rollout", "scorer"])["c"].sum()
    prec = precision_table(con, _rows=rows).set_index(["rollout", "scorer"])
    drift = rows.sequences("rollout")[DRIFT_COLUMNS]
    drift = drift[drift["logratio_sum"].notna()]
    fig, axes = _fig(2, len(pairs), colorbar=True, hgap=1.0)
    m = None
    vmax = float(h["c"].max())
    n_seq = 0
    for ax, ax2, (ro, sc) in zip(axes[0], axes[1], pairs):
        m = _mesh(ax, h[(h["rollout"] == ro) & (h["scorer"] == sc)], (0.0, 1.0), (0.0, 1.0), vmax)
        ax.plot([0, 1], [0, 1], color="tab:red", lw=0.6, ls="--", label="π = μ")
        p = prec.loc[(ro, sc)]
        ax.set_title(f"{_pair_label(ro, sc)}\nn = {int(n_tok[(ro, sc)]):,} tokens; mean |π−μ| = {p['abs_dp_mean']:.2g}",
                     fontsize=8)
        ax.set_xlabel("μ = rollout probability (probability)", fontsize=8)
        ax.set_ylabel("π = trainer probability (probability)", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=6, loc="upper left")

        g = drift[(drift["rollout"] == ro) & (drift["scorer"] == sc)]
        if g.empty:
            ax2.remove()
            continue
        n_seq += len(g)
        ax2.scatter(g["response_len"], g["logratio_sum"], s=5, alpha=0.35, color=DTYPE_COLORS.get(_dtype(ro), "k"),
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
    caption = (
        "Top: trainer-side probability π against rollout probability μ of the same sampled token at identical "
        f"weights, every token of the collect, recorded and imported runs (n = {int(n_tok[pairs].sum()):,} finite (token, scorer) rows over "
        f"{len(pairs)} pairs: each rollout dtype scored by the hf:fp32 scorer where stored, else by the HF scorer "
        "of its own dtype); shading: "
        "tokens per cell (log scale); dashed: π = μ. Bottom: per sequence without a non-finite token "
        f"(n = {n_seq:,} sequences), the sum over the response of log π − log μ (log of the sequence-level ratio) "
        "against response length, with its least-squares fit (solid) and the fit through the origin (dashed, "
        "the drift rate), each with its 95 % t-interval in brackets (FP16 paper: BF16 ≈ −1.0, FP16 ≈ −0.07 nats "
        "per 1K tokens); 'seq. KL k1' is the mean over sequences of "
        f"Σ_t (log μ − log π). {_length_span(drift['response_len'])}: where that is far below 1K, the slope per "
        "1K tokens is an extrapolation."
    )
    return [("fig2_pi_vs_mu_seq_drift", _finish(fig, "π vs μ and sequence drift per precision (FP16 study)", caption, m))]


def _length_span(lengths: pd.Series) -> str:
    return f"Responses are {int(lengths.min())}–{int(lengths.max())} tokens long" if len(lengths) else "No complete sequence"


# -- 3: precision summary --------------------------------------------------------------------------
def fig3_precision_summary(con: duckdb.DuckDBPyConnection, rows: Rows | None = None) -> list[tuple[str, Figure]]:
    """Claim (FP16 study): FP16's mismatch is far below BF16's (mean |π − μ| ≈ 0.0005 vs 0.004; token KL
    ≈ 1e-5 vs 1e-3), and (docs/papers.md, typical values) 4–8 % of BF16 tokens leave [0.9, 1.1]. Bars: mean
    |Δp|, k3 KL(μ‖π) and the share outside PPO's clip range per (rollout, scorer) pair, next to the
    scorer-vs-scorer noise floor (each scorer against hf:fp32 on the same tokens)."""
    rows = _rows(con, rows)
    prec = precision_table(con, _rows=rows)
    if prec.empty:
        raise Skip("no (rollout, scorer) pairs in the collect, recorded and imported runs")
    floor = noise_floor(con, _rows=rows)
    prows = [(f"{r} vs {s}", r, "pair", row) for (r, s), row in
             zip(zip(prec["rollout"], prec["scorer"]), prec.to_dict("records"))]
    prows.sort(key=lambda x: _pair_key(x[3]["rollout"], x[3]["scorer"]))
    frows = [(f"{s} vs {ref}\n(on {r} tokens)", r, "floor", row) for r, s, ref, row in
             zip(floor["rollout"], floor["scorer"], floor["reference"], floor.to_dict("records"))]
    frows.sort(key=lambda x: _pair_key(x[3]["rollout"], x[3]["scorer"]))
    allrows = prows + frows
    metrics = [
        ("abs_dp_mean", "mean |π − μ| (probability)", "mean |Δp|"),
        ("kl_k3", "mean k3 = r − log r − 1 (nats)", "token KL(μ‖π), k3"),
        ("frac_ratio_outside_clip", f"share with r ∉ [{d.CLIP_LOW:g}, {d.CLIP_HIGH:g}] (fraction)", "share outside clip range"),
    ]
    drawn = [m for m in metrics if any(np.isfinite(x[3][m[0]]) and x[3][m[0]] > 0 for x in allrows)]
    if not drawn:
        raise Skip("every pair has zero mismatch on every metric")
    h = 0.2 * len(allrows) + 0.3
    fig, axes = _fig(1, len(drawn), w=3.0, h=h, left=2.6, wgap=0.55, top=0.75, bottom=0.55, sharey=True)
    axes = axes[0]
    y = np.arange(len(allrows))[::-1]
    for ax, (col, xlabel, title) in zip(axes, drawn):
        vals = np.array([float(r[3][col]) if pd.notna(r[3][col]) else np.nan for r in allrows])
        colors = [DTYPE_COLORS.get(_dtype(r[1]), "gray") for r in allrows]
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
        f"Token-level mismatch at identical weights over the collect, recorded and imported runs: {len(prows)} (rollout, scorer) pairs "
        f"with n = {n_rows:,} finite (token, scorer) rows in all (per pair: " +
        ", ".join(f"{r['rollout']}/{r['scorer']} n={int(r['n_finite']):,}" for _, _, _, r in prows[:12]) +
        (", …" if len(prows) > 12 else "") + "). Hatched bars below the line: the same metrics between a scorer "
        "and the hf:fp32 scorer on the same tokens (the noise floor a rollout cannot be told apart from). k3 is an "
        "unbiased estimator of KL(μ‖π) from tokens sampled from μ; all means over finite rows; colour = dtype of "
        "the rollout (red bf16, blue fp16, green fp32); log axes where values span more than two decades."
    )  # fmt: skip
    return [("fig3_precision_summary", _finish(fig, "Precision summary: mismatch per (rollout, scorer) pair", caption))]


# -- 4: clipped tokens -----------------------------------------------------------------------------
def fig4_clipping(con: duckdb.DuckDBPyConnection, rows: Rows | None = None) -> list[tuple[str, Figure]]:
    """Claim (DPPO Figs. 6–7): the tokens PPO's ratio clip drops are mostly rare (low μ) tokens, and the most
    clipped strings are numbers, math symbols and reasoning connectives; DPPO's TV/KL masks drop far fewer
    of them. One pair per rollout (its same-dtype HF scorer, else hf:fp32; at most three; only pairs where anything
    is clipped): the
    share of each token category ratio-clipped vs TV/KL-masked, and the 30 most clipped token strings."""
    rows = _rows(con, rows)
    cat = clipping_by_category(con, _rows=rows)
    cat = cat[cat["adv_sign"] == "all"]
    top = top_clipped_tokens(con, d.TOP_N_TOKENS, _rows=rows)
    if top.empty:
        raise Skip("no token is ratio-clipped in any pair of the collect, recorded and imported runs")
    clipped = top.groupby(["rollout", "scorer"])["n_ratio_clip"].sum()
    all_pairs = _sorted_pairs(cat)
    pairs = [p for p in _one_per_rollout(all_pairs, "same") if clipped.get(p, 0) > 0]
    if not pairs:
        pairs = sorted(clipped.index, key=lambda p: -clipped[p])
    skipped = [p for p in _one_per_rollout(all_pairs, "same") if clipped.get(p, 0) == 0]
    for p in skipped:
        print(f"    fig4: {_pair_label(*p)}: no ratio-clipped token, panel left out")
    pairs = pairs[:MAX_PAIRS_FIG4]
    fig, axes = _fig(len(pairs), 2, w=4.4, h=3.8, left=0.7, wgap=1.4, hgap=1.1, top=0.8)
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
        ax_c.set_title(f"{_pair_label(ro, sc)}\n{n_clip:,} of {int(c['n_tokens'].sum()):,} tokens ratio-clipped, "
                       f"mean μ of the clipped = {mu_cl:.2f}", fontsize=8)
        ax_c.legend(fontsize=7)
        ax_c.tick_params(axis="y", labelsize=7)
        t = top[(top["rollout"] == ro) & (top["scorer"] == sc)].sort_values("rank", ascending=False)
        y = np.arange(len(t))
        ax_t.barh(y, t["n_ratio_clip"], color=[CAT_COLORS.get(k, "k") for k in t["category"]])
        ax_t.set_yticks(y, [_token_label(s, i) for s, i in zip(t["token_text"], t["token_id"])], fontsize=6)
        ax_t.set_xlabel("times ratio-clipped (count of occurrences)", fontsize=8)
        ax_t.set_ylabel("token string (colour = category)", fontsize=8)
        ax_t.set_title(f"top {len(t)} ratio-clipped token strings", fontsize=8)
        handles = [Patch(color=CAT_COLORS[k], label=k) for k in CATEGORIES if k in set(t["category"])]
        ax_t.legend(handles=handles, fontsize=6, loc="lower right")
        ax_t.tick_params(axis="x", labelsize=7)
        parts.append(f"{ro}/{sc}: n={int(c['n_tokens'].sum()):,}")
    caption = (
        f"Which sampled tokens PPO's two-sided ratio clip (r ∉ [{d.CLIP_LOW:g}, {d.CLIP_HIGH:g}]) would drop at "
        f"identical weights, against DPPO's binary-TV (|π − μ| > {d.DELTA_TV:g}) and binary-KL (> {d.DELTA_KL:g}) "
        f"masks, by token category, for every token of the collect, recorded and imported runs ({'; '.join(parts)} finite tokens). "
        "Right: the token strings ratio-clipped most often (count over all their occurrences). "
        + (f"Pairs with no clipped token are left out: {', '.join(f'{a}/{b}' for a, b in skipped)}." if skipped else "")
    )
    return [("fig4_clipped_tokens", _finish(fig, "Clipped tokens: PPO ratio clip vs DPPO masks", caption))]


# -- 5: approximation ------------------------------------------------------------------------------
def fig5_approximation(con: duckdb.DuckDBPyConnection, rows: Rows | None = None) -> list[tuple[str, Figure]]:
    """Claim (DPPO): binary and top-K divergences perform about the same as trust-region measures; here
    tested as how closely each tracks the exact full-vocabulary TV (known between a scorer and the hf:fp32
    reference scorer on the same prefix). Density of binary TV and of top-K TV against exact TV, one
    column per scorer, with Pearson r and the agreement of the δ_TV decision from `approximation_table`'s
    definitions."""
    rows = _rows(con, rows)
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
        h[key] = _hist2d(con, rel, params, f"log10(greatest(tv_exact, {floor_v!r}))",
                         f"log10(greatest({expr}, {floor_v!r}))", rng, rng, keys=("scorer",))
    scorers = sorted(stats["scorer"], key=lambda s: _pair_key("x:" + _dtype(s), s))
    fig, axes = _fig(len(kinds), len(scorers), w=2.9, h=2.6, colorbar=True, hgap=1.0)
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
            m = _mesh(ax, hh, rng, rng, vmax)
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
    return [("fig5_tv_approximation", _finish(fig, "Binary and top-K TV against exact TV", caption, m))]


# -- 7: batch invariance ---------------------------------------------------------------------------
DEFAULT_SCORER_SETTING = (SCORE_BATCH_TOKENS, SCORE_CHUNK_ROWS)  # the scorer's defaults: padded tokens per forward, rows per vocab chunk


def _batch_settings(config) -> tuple[int | None, tuple[int, int]]:
    """(generation batch size, (scorer batch tokens, scorer vocab chunk rows)) of a collect run's config;
    a generation batch of 0 means the whole chunk (chunk_prompts x samples requests per engine call)."""
    try:
        cfg = json.loads(config) if isinstance(config, str) else (config or {})
    except ValueError:
        cfg = {}
    cfg = cfg if isinstance(cfg, dict) else {}
    scorer = cfg.get("scorer") if isinstance(cfg.get("scorer"), dict) else {}
    setting = (int(scorer.get("batch_tokens", cfg.get("score_batch_tokens", DEFAULT_SCORER_SETTING[0]))),
               int(scorer.get("chunk_rows", cfg.get("score_chunk_rows", DEFAULT_SCORER_SETTING[1]))))
    v = cfg.get("gen_batch")
    if v is None:
        return None, setting
    v = int(v)
    if v == 0:
        cp, sm = cfg.get("chunk_prompts"), cfg.get("samples")
        v = int(cp) * int(sm) if cp and sm else 0
    return v, setting


# token pairs of two runs on the same (prompt_id, sample_idx), kept up to the first differing token
_SHARED_PREFIX = """
    common AS (SELECT prompt_id, sample_idx FROM sequences WHERE run_id = $a
               INTERSECT SELECT prompt_id, sample_idx FROM sequences WHERE run_id = $b),
    a AS (SELECT q.prompt_id, q.sample_idx, t.pos, t.token_id, t.logp_rollout
          FROM sequences q JOIN tokens t USING (run_id, seq_id) JOIN common c USING (prompt_id, sample_idx)
          WHERE q.run_id = $a),
    b AS (SELECT q.prompt_id, q.sample_idx, t.pos, t.token_id, t.logp_rollout
          FROM sequences q JOIN tokens t USING (run_id, seq_id) JOIN common c USING (prompt_id, sample_idx)
          WHERE q.run_id = $b),
    j AS (SELECT coalesce(a.prompt_id, b.prompt_id) AS prompt_id, coalesce(a.sample_idx, b.sample_idx) AS sample_idx,
                 coalesce(a.pos, b.pos) AS pos, coalesce(a.token_id = b.token_id, false) AS same,
                 abs(a.logp_rollout - b.logp_rollout) AS adl
          FROM a FULL OUTER JOIN b ON a.prompt_id = b.prompt_id AND a.sample_idx = b.sample_idx AND a.pos = b.pos),
    first_diff AS (SELECT prompt_id, sample_idx, min(pos) FILTER (WHERE NOT same) AS fd, bool_and(same) AS ident
                   FROM j GROUP BY ALL),
    prefix AS (SELECT j.* FROM j JOIN first_diff f USING (prompt_id, sample_idx) WHERE f.fd IS NULL OR j.pos < f.fd)"""


def _rollout_batch_rows(con, groups) -> pd.DataFrame:
    found = []
    for rollout, g in groups.items():
        base_run, b0 = g.iloc[0]["run_id"], int(g.iloc[0]["batch"])
        for _, other in g.iloc[1:].iterrows():
            r = query(con, "WITH " + _SHARED_PREFIX + """
                SELECT count(*) AS n_seq, avg(ident::DOUBLE) AS frac_identical,
                       (SELECT avg(adl) FROM prefix WHERE isfinite(adl)) AS abs_dlogp_mean,
                       (SELECT count(*) FROM prefix WHERE isfinite(adl)) AS n_tok
                FROM first_diff""", {"a": base_run, "b": other["run_id"]}).iloc[0]
            if r["n_seq"]:
                found.append({"rollout": rollout, "b0": b0, "batch": int(other["batch"]), **r.to_dict()})
    return pd.DataFrame(found)


def _scorer_batch_rows(con, groups) -> pd.DataFrame:
    found = []
    for (rollout, batch), g in groups.items():
        base = g.iloc[0]
        for _, other in g.iloc[1:].iterrows():
            r = query(con, "WITH " + _SHARED_PREFIX + """,
                sa AS (SELECT q.prompt_id, q.sample_idx, s.pos, s.scorer, s.logp
                       FROM sequences q JOIN scores s USING (run_id, seq_id) WHERE q.run_id = $a),
                sb AS (SELECT q.prompt_id, q.sample_idx, s.pos, s.scorer, s.logp
                       FROM sequences q JOIN scores s USING (run_id, seq_id) WHERE q.run_id = $b)
                SELECT sa.scorer, count(*) AS n_tok, avg(abs(sa.logp - sb.logp)) AS abs_dlogp_mean,
                       max(abs(sa.logp - sb.logp)) AS abs_dlogp_max, avg((sa.logp = sb.logp)::DOUBLE) AS frac_identical
                FROM prefix JOIN sa USING (prompt_id, sample_idx, pos) JOIN sb USING (prompt_id, sample_idx, pos, scorer)
                WHERE isfinite(sa.logp) AND isfinite(sb.logp)
                GROUP BY sa.scorer ORDER BY sa.scorer""", {"a": base["run_id"], "b": other["run_id"]})
            for rec in r.to_dict("records"):
                found.append({"rollout": rollout, "batch": batch, "base": base["setting"], "setting": other["setting"], **rec})
    return pd.DataFrame(found)


def _setting_label(setting: tuple[int, int]) -> str:
    tokens, rows = setting
    return f"{tokens} tok/fwd, {rows} rows/chunk"


def fig7_batch_invariance(con: duckdb.DuckDBPyConnection, rows: Rows | None = None) -> list[tuple[str, Figure]]:
    """Claim (batch invariance, FP16 study / docs/papers.md): the rollout engine's output
    depends on how many requests share a batch — in bf16 more than in fp32 — and the trainer's scores on
    how sequences are batched and chunked. Rollout panels: for runs of the same rollout (engine, dtype) whose
    `runs.config` has a different `gen_batch` (0 = the whole chunk), identical (prompt_id, sample_idx) are
    compared against the smallest batch size: the share of identical token sequences, and mean |Δ log μ| on
    the shared prefix (positions before the first differing token). Scorer panel: runs of one rollout and
    generation batch that differ only in the scorer's batch composition (`scorer.batch_tokens`, padded
    tokens per forward) or vocabulary chunk (`scorer.chunk_rows`), compared per scorer on the shared
    prefix: mean |Δ log π| and the share of bit-identical log π."""
    runs = query(con, f"SELECT run_id, {d.rollout_label_sql(None)} AS rollout, config FROM runs "
                      "WHERE kind = 'collect' ORDER BY run_id")
    parsed = [_batch_settings(c) for c in runs["config"]]
    runs["batch"] = [b for b, _ in parsed]
    runs["setting"] = [st for _, st in parsed]
    runs["default_setting"] = [st == DEFAULT_SCORER_SETTING for st in runs["setting"]]
    runs = runs[runs["batch"].notna()].sort_values(["default_setting", "run_id"], ascending=[False, True])
    # rollout comparison: one run per (rollout, batch), preferring the default scorer setting
    per_batch = runs.drop_duplicates(["rollout", "batch"]).sort_values(["batch", "run_id"])
    rollout_groups = {r: g for r, g in per_batch.groupby("rollout") if g["batch"].nunique() > 1}
    scorer_groups = {k: g.drop_duplicates("setting") for k, g in runs.groupby(["rollout", "batch"])
                     if g["setting"].nunique() > 1}
    if not rollout_groups and not scorer_groups:
        raise Skip("no two collect runs of one rollout differ in gen_batch or scorer batching (no batch-invariance runs)")
    res = _rollout_batch_rows(con, rollout_groups) if rollout_groups else pd.DataFrame()
    sres = _scorer_batch_rows(con, scorer_groups) if scorer_groups else pd.DataFrame()
    if res.empty and sres.empty:
        raise Skip("batch-invariance runs share no (prompt_id, sample_idx)")
    n_panels = (2 if not res.empty else 0) + (1 if not sres.empty else 0)
    fig, axes = _grid(n_panels, ncols=3, w=3.6, h=3.0, left=0.9)
    parts = []
    if not res.empty:
        ticks = set()
        for rollout, g in res.groupby("rollout"):
            g = g.sort_values("batch")
            c = DTYPE_COLORS.get(_dtype(rollout), "k")
            b0 = int(g["b0"].iloc[0])
            lab = f"{rollout} (vs batch {b0})"
            # the reference run against itself: every sequence identical, no difference (drawn hollow)
            xs = [b0, *g["batch"]]
            axes[0].plot(xs, [100.0, *(100 * g["frac_identical"])], "o-", color=c, label=lab)
            axes[1].plot(xs, [0.0, *g["abs_dlogp_mean"].fillna(0)], "o-", color=c, label=lab)
            for ax in axes[:2]:
                ax.plot([b0], [100.0 if ax is axes[0] else 0.0], "o", color="white", ms=3)
            ticks.update(xs)
        axes[0].set_ylim(-3, 103)
        axes[0].set_title("identical token sequences", fontsize=9)
        axes[0].set_ylabel("sequences identical to the small-batch run (%)", fontsize=8)
        axes[1].set_title("rollout log-prob difference on the shared prefix", fontsize=9)
        axes[1].set_ylabel("mean |Δ log μ| (nats)", fontsize=8)
        for ax in axes[:2]:
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted(ticks), [str(t) for t in sorted(ticks)])
            ax.minorticks_off()
            ax.set_xlabel("generation batch size (requests per engine call)", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.legend(fontsize=7)
        parts.append(
            "Rollout panels: the same prompts and per-request seeds generated at different generation batch sizes "
            "(runs.config gen_batch; 0 = the whole chunk of chunk_prompts × samples requests), compared request "
            "by request on (prompt_id, sample_idx) against the run of the smallest batch size of the same rollout: "
            + "; ".join(f"{r.rollout} batch {r.b0} vs {r.batch}: n = {int(r.n_seq):,} sequences, "
                        f"{100 * r.frac_identical:.0f} % identical, mean |Δ log μ| {r.abs_dlogp_mean:.2g} over "
                        f"{int(r.n_tok or 0):,} prefix tokens" for r in res.itertuples())
            + ". |Δ log μ| is averaged over the positions before the first differing token (identical prefixes); "
            "the hollow point is the reference run itself (100 %, 0 by definition).")
    if not sres.empty:
        ax = axes[-1]
        sres = sres.assign(label=[f"{r.rollout} b{r.batch}: {_setting_label(r.setting)}" for r in sres.itertuples()])
        labels = list(dict.fromkeys(sres["label"]))
        scorers = sorted(sres["scorer"].unique(), key=lambda s: _pair_key("", s))
        width = 0.8 / len(scorers)
        for k, sc in enumerate(scorers):
            g = sres[sres["scorer"] == sc].set_index("label").reindex(labels)
            xs = np.arange(len(labels)) + (k - (len(scorers) - 1) / 2) * width
            ax.bar(xs, g["abs_dlogp_mean"].fillna(0), width, color=DTYPE_COLORS.get(_dtype(sc), "k"), label=sc)
            for x, v, ident in zip(xs, g["abs_dlogp_mean"], g["frac_identical"]):
                if pd.notna(v):
                    ax.annotate(f"{100 * ident:.0f}% =", (x, v), ha="center", va="bottom", fontsize=6)
        ax.set_xticks(np.arange(len(labels)), [lab.split(": ", 1)[1] for lab in labels], fontsize=6, rotation=15)
        ax.set_title("trainer scores vs scorer batching", fontsize=9)
        ax.set_ylabel("mean |Δ log π| vs default batching (nats)", fontsize=8)
        ax.set_xlabel("scorer setting compared with 8192 tok/fwd, 1024 rows/chunk (setting)", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=7)
        parts.append(
            "Scorer panel: runs of one rollout and generation batch (same sequences) scored with a different "
            "scorer batch composition (padded tokens per forward; 1 = one sequence per forward) or vocabulary "
            "chunk (rows per chunk), compared per scorer on the shared prefix against the default setting "
            "(8192 tokens per forward, 1024 rows per chunk); the label above a bar is the share of bit-identical "
            "log π: " + "; ".join(f"{r.scorer} {r.rollout} b{r.batch} {_setting_label(r.setting)}: n = "
                                  f"{int(r.n_tok):,} tokens, {100 * r.frac_identical:.0f} % bit-identical, mean "
                                  f"|Δ log π| {r.abs_dlogp_mean:.2g}, max {r.abs_dlogp_max:.2g}"
                                  for r in sres.itertuples()) + ".")
    title = "Batch invariance of the rollout engine and the trainer's scorer"
    return [("fig7_batch_invariance", _finish(fig, title, " ".join(parts)))]


FIGURES: dict[str, Callable[[duckdb.DuckDBPyConnection], list[tuple[str, Figure]]]] = {
    "1": fig1_volatility,
    "2": fig2_precision_scatter,
    "3": fig3_precision_summary,
    "4": fig4_clipping,
    "5": fig5_approximation,
    "6": fig6_training,
    "7": fig7_batch_invariance,
    "8": fig8_corrections,
    "9": fig9_steps,
}
"""Figure number -> function; the command draws them in this order."""
