"""Figure 10, the sampling support: per rollout rule, mean log r against mean log S (the identity line is a
bias that is exactly the support) and, by μ bucket, what remains of log r once the support is accounted for.

Numbers are those of `analysis.support.support_table` (analyze key `support`, docs/analysis.md): log S is the
mass the rollout's sampling rule keeps under π (scores.log_support), log r = log π − log μ, and the residual
is mean(log π restricted and renormalised to the support − log μ). Drawn only where the store holds log S.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import duckdb
import pandas as pd

from mismatch_lab.analysis.rows import Rows

if TYPE_CHECKING:
    from matplotlib.figure import Figure

MODE_MARKERS = {"processed": "o", "raw": "s"}
"""Marker of a rollout's logprobs_mode: filled for processed μ, hollow for raw μ."""


def support_pairs(con: duckdb.DuckDBPyConnection) -> pd.DataFrame:
    """The support table restricted to one scorer per rollout (figures' `one_per_rollout`, same dtype first)."""
    from mismatch_lab.analysis.support import support_table
    from mismatch_lab.figures.base import Skip, one_per_rollout, sorted_pairs

    df = support_table(con)
    if df.empty:
        raise Skip("no log S in this store (collect with --top-p/--sample-top-k/--temperature stores scores.log_support)")
    keep = set(one_per_rollout(sorted_pairs(df), prefer="same"))
    return df[[(r, s) in keep for r, s in zip(df["rollout"], df["scorer"])]].reset_index(drop=True)


def fig10_support(con: duckdb.DuckDBPyConnection, rows: Rows | None = None) -> list[tuple[str, Figure]]:
    """Claim (sampling support, studies/README.md claim 9): with processed log-probs the rollout's log μ is
    renormalised over the kept tokens, so mean log r equals mean log S where the numerics agree (fp32 on both
    sides), and raw log-probs carry no such bias. Left: one point per (rollout, scorer) pair, mean log S
    against mean log r, with the identity line. Right: by μ bucket, the residual mean(log π_S − log μ) of the
    processed rollouts (0 where the bias is exactly the support) and mean log r of the raw ones (0 where there
    is no bias)."""
    from mismatch_lab.figures.base import finish, panel_grid

    df = support_pairs(con)
    pair = df[df["view"] == "pair"]
    fig, (ax_id, ax_mu) = panel_grid(2, ncols=2, w=3.8, h=3.2, left=0.9, wgap=1.2)
    _identity_panel(ax_id, pair)
    _bucket_panel(ax_mu, df[df["view"] == "mu_bucket"])
    n = int(pair["n_tokens"].sum())
    caption = (f"{len(pair)} (rollout, scorer) pairs, one scorer per rollout (its own dtype, else hf:fp32), "
               f"n = {n:,} tokens with log S in all. log S: the probability mass the rollout's sampling rule "
               "(temperature, top-k, top-p, applied in vLLM's order) keeps under π; log r = log π − log μ. Filled "
               "circles: processed μ (renormalised over the kept tokens); hollow squares: raw μ. Right: for processed "
               "rollouts the residual mean(log π_S − log μ), π_S = π restricted and renormalised to the support; for "
               "raw rollouts mean log r. Buckets with fewer than 20 tokens are left out.")
    return [("fig10_sampling_support", finish(fig, "Sampling support: the bias of processed log-probs", caption))]


def _style(rollout: str, mode: str) -> dict:
    from mismatch_lab.figures.base import DTYPE_COLORS, dtype_of

    c = DTYPE_COLORS.get(dtype_of(rollout), "k")
    filled = mode == "processed"
    return {"color": c, "marker": MODE_MARKERS.get(mode, "o"), "markerfacecolor": c if filled else "none",
            "markeredgecolor": c}


def _identity_panel(ax, pair: pd.DataFrame) -> None:
    lo = min(pair["log_s_mean"].min(), pair["dlogp_mean"].min(), 0.0)
    hi = max(pair["log_s_mean"].max(), pair["dlogp_mean"].max(), 0.0)
    pad = 0.05 * (hi - lo or 1.0)
    ax.plot([lo - pad, hi + pad], [lo - pad, hi + pad], color="0.6", lw=0.8, ls="--", label="log r = log S")
    for r in pair.itertuples():
        ax.plot([r.log_s_mean], [r.dlogp_mean], ls="none", ms=6, **_style(r.rollout, r.logprobs_mode))
        ax.annotate(r.rollout.split(":")[-1], (r.log_s_mean, r.dlogp_mean), fontsize=5.5, xytext=(3, -6),
                    textcoords="offset points")
    ax.set_xlabel("mean log S (nats)")
    ax.set_ylabel("mean log r = log π − log μ (nats)")
    ax.set_title("mean log r vs mean log S per pair", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")


MIN_BUCKET_TOKENS = 20
"""Buckets with fewer tokens are not drawn in the right panel (their means are noise)."""


def _bucket_panel(ax, buckets: pd.DataFrame) -> None:
    buckets = buckets[buckets["n_tokens"] >= MIN_BUCKET_TOKENS]
    for (rollout, scorer, mode), g in buckets.groupby(["rollout", "scorer", "logprobs_mode"], sort=False):
        g = g.sort_values("mu_bucket")
        x = [(max(lo, 1e-6) * hi) ** 0.5 for lo, hi in zip(g["mu_lo"], g["mu_hi"])]
        y = g["residual_mean"] if mode == "processed" else g["dlogp_mean"]
        ax.plot(x, y, lw=0.9, ms=4, label=f"{rollout} / {scorer}", **_style(rollout, mode))
    ax.axhline(0.0, color="0.6", lw=0.8, ls="--")
    ax.set_xscale("log")
    ax.set_xlabel("μ (bucket, log scale)")
    ax.set_ylabel("residual (processed) / log r (raw), nats")
    ax.set_title("what remains by μ bucket", fontsize=9)
    ax.legend(fontsize=5, loc="best", ncol=1)
