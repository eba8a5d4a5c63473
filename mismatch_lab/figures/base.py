"""What every figure shares: the Skip signal, the fixed panel layout with its caption, the pair and dtype
labels and their order, the token runs' shared row set, and 2-D histograms computed in SQL."""

from __future__ import annotations

import math
import textwrap

import duckdb
import matplotlib

matplotlib.use("Agg")  # no display; Figure objects are drawn by the Agg and PDF backends

import numpy as np
import pandas as pd
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure

from mismatch_lab.analysis import definitions as d
from mismatch_lab.analysis.browse import token_label  # noqa: F401 - the figures' token labels (re-exported)
from mismatch_lab.analysis.relations import Filters, query
from mismatch_lab.analysis.rows import Rows
from mismatch_lab.categories import CATEGORIES
from mismatch_lab.store.schema import TOKEN_FIGURE_KINDS


class Skip(Exception):
    """The store holds no data for this figure; the message says what is missing."""


NX = NY = 60  # 2-D histogram resolution
DTYPE_COLORS = {"bf16": "tab:red", "fp16": "tab:blue", "fp32": "tab:green"}
CAT_COLORS = dict(zip(CATEGORIES, ("tab:gray", "tab:olive", "tab:red", "tab:purple", "tab:orange", "tab:brown", "tab:blue")))
MIN_WIDTH = 7.5  # inches


# -- helpers ---------------------------------------------------------------------------------------
def panel_figure(nrows: int, ncols: int, w: float = 3.0, h: float = 2.4, *, left: float = 0.8, right: float = 0.3,
         top: float = 0.95, bottom: float = 0.6, wgap: float = 0.8, hgap: float = 0.95,
         colorbar: bool = False, **kw) -> tuple[Figure, np.ndarray]:
    """A figure of nrows x ncols panels, each w x h inches, with fixed margins in inches (a fixed layout:
    tight_layout measures every text and costs seconds per figure on a busy 2-core machine). `finish`
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


LINE_STYLES = ("-", "--", ":", "-.")


def line_styles(n: int) -> list[dict]:
    """Distinct plot styles for n lines: the ten tab10 colours, then the same colours dashed, dotted,
    dash-dotted (so an eleventh run is not drawn like the first)."""
    cmap = matplotlib.colormaps["tab10"]
    return [{"color": cmap(i % 10), "ls": LINE_STYLES[(i // 10) % len(LINE_STYLES)]} for i in range(n)]


def panel_grid(n: int, ncols: int = 4, **kw) -> tuple[Figure, list]:
    """A figure with n panels on a grid; the grid's unused cells are removed (no empty panel)."""
    ncols = max(1, min(ncols, n))
    nrows = math.ceil(n / ncols)
    fig, axes = panel_figure(nrows, ncols, **kw)
    flat = list(axes.ravel())
    for ax in flat[n:]:
        ax.remove()
    return fig, flat[:n]


def finish(fig: Figure, title: str, caption: str, mappable=None) -> Figure:
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


def token_run_ids(con: duckdb.DuckDBPyConnection) -> list[str]:
    ids = [r[0] for r in con.execute("SELECT run_id FROM runs WHERE list_contains(?, kind) ORDER BY run_id",
                                     [list(TOKEN_FIGURE_KINDS)]).fetchall()]
    if not ids:
        raise Skip("no collect, recorded or imported runs in this store")
    return ids


def dtype_of(label: str) -> str:
    """The compute dtype of a rollout or scorer label: 'vllm:bf16', 'vllm:bf16-wfp8' (rounded weights) and
    'vllm:bf16-p0.9-processed' (a sampling rule) -> 'bf16'."""
    return label.split(":")[-1].split("-")[0]


def pair_key(rollout: str, scorer: str) -> tuple:
    order = {"bf16": 0, "fp16": 1, "fp32": 2}
    return (order.get(dtype_of(rollout), 9), rollout, scorer.startswith("vllm"), order.get(dtype_of(scorer), 9), scorer)


def sorted_pairs(df: pd.DataFrame) -> list[tuple[str, str]]:
    pairs = {(r, s) for r, s in zip(df["rollout"], df["scorer"])}
    return sorted(pairs, key=lambda p: pair_key(*p))


def one_per_rollout(pairs: list[tuple[str, str]], prefer: str = "same") -> list[tuple[str, str]]:
    """One pair per rollout and scorer family: our HF scorers ('hf:<dtype>') are one family, and so is each
    framework of recorded and imported runs ('<framework>:<dtype>': another framework's trainer is another
    run, which no HF scorer stands for). Within a family, prefer='same': the scorer of the rollout's own
    dtype (the RL setting, both sides at one precision), else the fp32 one (hf:fp32 is the reference
    scorer); prefer='reference': fp32 first (a common trainer, so rollouts differ only in their own dtype),
    then the same-dtype one; else the family's first. vLLM prefill scorers ('vllm:<dtype>') only where a
    rollout has nothing else."""
    out = []
    for rollout in dict.fromkeys(r for r, _ in pairs):
        scorers = [s for r, s in pairs if r == rollout]
        families = dict.fromkeys(s.split(":")[0] for s in scorers if not s.startswith("vllm:"))
        for family in families:
            members = [s for s in scorers if s.split(":")[0] == family]
            same = [s for s in members if dtype_of(s) == dtype_of(rollout)]
            ref = [s for s in members if s == d.REFERENCE_SCORER or family != "hf" and dtype_of(s) == "fp32"]
            order = (same + ref) if prefer == "same" else (ref + same)
            out.append((rollout, (order or members)[0]))
        if not families:
            out.append((rollout, scorers[0]))
    return out


WEIGHTS_NOTE = ("μ and π at identical weights for collect runs; for recorded and imported runs as their framework "
                "took them (an asynchronous run's μ may come from older weights)")
"""What the token figures' captions say of the weights behind μ and π."""
SCORERS_NOTE = ("π from the scorer named in each panel: for collect runs an HF scorer (teacher forcing), for "
                "recorded and imported runs the trainer's own log-probs")
"""What the token figures' captions say of the scorer drawn."""


def pair_label(rollout: str, scorer: str) -> str:
    return f"μ {rollout} vs π {scorer}"


def study_rows(con: duckdb.DuckDBPyConnection, *, materialize: bool = True) -> Rows:
    """The row sets of the token runs (collect, record, import: `schema.TOKEN_FIGURE_KINDS`), joined once
    (materialize) and shared by figures 1-5: pass the result as `rows=` so their analyses reuse each
    other's passes. Raises Skip without such runs."""
    return Rows(con, Filters.make(run_ids=token_run_ids(con)), materialize=materialize)


def token_rows(con: duckdb.DuckDBPyConnection, rows: Rows | None) -> Rows:
    if rows is None:
        rows = study_rows(con, materialize=False)
    if not rows.ok:
        raise Skip("the store has no tokens/scores/runs tables")
    return rows


def hist2d(con, base: str, params: dict, x: str, y: str, xr: tuple, yr: tuple, keys=("rollout", "scorer")) -> pd.DataFrame:
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


def mesh(ax, h: pd.DataFrame, xr, yr, vmax: float):
    grid = np.zeros((NY, NX))
    grid[h["by"].to_numpy(int), h["bx"].to_numpy(int)] = h["c"].to_numpy(float)
    masked = np.ma.masked_equal(grid, 0)
    xs, ys = np.linspace(*xr, NX + 1), np.linspace(*yr, NY + 1)
    return ax.pcolormesh(xs, ys, masked, cmap="viridis", norm=LogNorm(vmin=1, vmax=max(vmax, 2.0)),
                         rasterized=True, shading="flat")

