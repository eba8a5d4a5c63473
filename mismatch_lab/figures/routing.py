"""Figure 11, MoE routing: how often each scorer sends a token to another expert set than the rollout did, per
MoE layer and by the rollout router's margin, and the mismatch of the tokens that changed experts against the
tokens that did not.

Numbers are those of `analysis.routing.routing_table` (analyze key `routing`, docs/analysis.md): a (token,
layer) cell flips when the two expert sets differ; the margin is the rollout router's k-th minus (k+1)-th
logit. Drawn only where the store holds routing rows on both sides.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import duckdb
import numpy as np
import pandas as pd

from mismatch_lab.analysis.rows import Rows

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def routing_rows(con: duckdb.DuckDBPyConnection) -> pd.DataFrame:
    """The routing table, or Skip where the store holds no routing."""
    from mismatch_lab.analysis.routing import routing_table
    from mismatch_lab.figures.base import Skip

    df = routing_table(con)
    if df.empty:
        raise Skip("no MoE routing in this store (`mismatch-lab collect` on an MoE model records it; docs/moe.md)")
    return df


def fig11_routing(con: duckdb.DuckDBPyConnection, rows: Rows | None = None) -> list[tuple[str, Figure]]:
    """Claim (docs/moe.md, issue 36): routing flips concentrate where the rollout router's margin is small,
    grow with depth, and the tokens that changed experts carry most of the mismatch, which R3 removes. Left:
    flip rate per MoE layer, one line per (rollout, scorer) pair. Middle: flip rate by rollout margin bucket.
    Right: mean |π − μ| of tokens with a flip in some layer against those without, per pair."""
    from mismatch_lab.figures.base import finish, line_styles, pair_label, panel_grid

    df = routing_rows(con)
    pairs = df[df["view"] == "pair"].reset_index(drop=True)
    styles = dict(zip(zip(pairs["rollout"], pairs["scorer"]), line_styles(len(pairs))))
    fig, (ax_l, ax_m, ax_t) = panel_grid(3, ncols=3, w=3.2, h=2.6, left=0.8)
    for (ro, sc), part in df[df["view"] == "layer"].groupby(["rollout", "scorer"], sort=False):
        ax_l.plot(part["layer"].astype(int), part["flip_rate"], marker="o", ms=3, label=pair_label(ro, sc),
                  **styles[(ro, sc)])
    _layer_axes(ax_l)
    for (ro, sc), part in df[df["view"] == "margin"].groupby(["rollout", "scorer"], sort=False):
        ax_m.plot(np.arange(len(part)), part["flip_rate"], marker="o", ms=3, **styles[(ro, sc)])
    _margin_axes(ax_m, df[df["view"] == "margin"])
    _split_panel(ax_t, pairs)
    ax_l.legend(fontsize=6, loc="upper left")
    caption = (f"{len(pairs)} (rollout, scorer) pairs, n = {int(pairs['tokens'].sum()):,} tokens × MoE layers with "
               "routing on both sides. A (token, layer) cell flips when the scorer's expert set differs from the "
               "rollout's (order within the top-k ignored). Middle: by the rollout router's margin (k-th minus "
               "(k+1)-th logit), buckets [lo, hi). Right: mean |π − μ| of the tokens with a flip in at least one "
               "layer (dark) and without (light); a `-r3` scorer replays the rollout's expert ids and never flips. "
               "The numbers of `analyze` key `routing`.")
    return [("fig11_routing", finish(fig, "MoE routing: expert-set flips and their cost", caption))]


def _layer_axes(ax) -> None:
    ax.set_xlabel("MoE layer (input → output)")
    ax.set_ylabel("flip rate (share of tokens)")
    ax.xaxis.get_major_locator().set_params(integer=True)


def _margin_axes(ax, margins: pd.DataFrame) -> None:
    first = margins.drop_duplicates(["margin_lo"]).sort_values("margin_lo")
    ax.set_xticks(np.arange(len(first)))
    ax.set_xticklabels([f"[{lo:g},{hi:g})" if pd.notna(hi) else f"≥{lo:g}"
                        for lo, hi in zip(first["margin_lo"], first["margin_hi"])], fontsize=6, rotation=30)
    ax.set_xlabel("rollout router margin (logits)")
    ax.set_ylabel("flip rate (share of cells)")


def _split_panel(ax, pairs: pd.DataFrame) -> None:
    from mismatch_lab.figures.base import pair_label

    x = np.arange(len(pairs))
    flip = pairs["abs_dp_mean_flip"].astype(float).fillna(0.0)
    stay = pairs["abs_dp_mean_no_flip"].astype(float).fillna(0.0)
    ax.bar(x - 0.2, flip, 0.4, color="C3", label="flip in ≥ 1 layer")
    ax.bar(x + 0.2, stay, 0.4, color="C3", alpha=0.35, label="no flip")
    ax.set_xticks(x)
    ax.set_xticklabels([pair_label(r, s) for r, s in zip(pairs["rollout"], pairs["scorer"])], fontsize=6,
                       rotation=20)
    ax.set_ylabel("mean |π − μ| (probability)")
    ax.legend(fontsize=6)
