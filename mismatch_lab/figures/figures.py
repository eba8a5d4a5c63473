"""The paper-style figures, one function per figure, each reading a store (any `open_store` connection).

Every function takes a read-only DuckDB connection (and optionally the shared `Rows` of `study_rows`) and
returns `[(file stem, matplotlib Figure), ...]`,
or raises `Skip(reason)` when the store lacks what the figure needs (no training run, no batch-size
variation, no exact TV): a figure is never drawn empty. Each figure has a title, axes labelled with their
units, and a caption at the bottom saying what was measured, on what, with n. Densities are computed in
SQL (2-D histograms, GROUP BY) and only the grid reaches matplotlib; per-sequence scatters draw one point
per sequence. Figures 1-5 read the token runs, the kinds of `schema.TOKEN_FIGURE_KINDS` (collect, and
runs recorded or imported from a user's RL framework: μ and π as it took them, base.WEIGHTS_NOTE); figure 7
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
    8 fig8_corrections                  each correction method's masked / dropped / reweighted shares, ESS
    9 fig9_mismatch_over_steps          mean |dp| and k3 per training step per run and pair
   10 fig10_sampling_support            mean log r vs mean log S per rollout rule; residual by mu bucket
   11 fig11_routing                     MoE expert-set flips per layer and rollout margin; mismatch with vs without

Where they live: tokens.py (1-5), training.py (6, 9), batch.py (7), corrections.py (8), support.py (10), routing.py (11);
base.py holds what they share (Skip, the panel layout and caption, pair labels, the token runs' row set, SQL histograms).
"""

from __future__ import annotations

from collections.abc import Callable

import duckdb
from matplotlib.figure import Figure

from mismatch_lab.figures.base import Skip, study_rows
from mismatch_lab.figures.batch import fig7_batch_invariance
from mismatch_lab.figures.corrections import fig8_corrections
from mismatch_lab.figures.routing import fig11_routing
from mismatch_lab.figures.support import fig10_support
from mismatch_lab.figures.tokens import (
    fig1_volatility,
    fig2_precision_scatter,
    fig3_precision_summary,
    fig4_clipping,
    fig5_approximation,
)
from mismatch_lab.figures.training import fig6_training, fig9_steps

__all__ = ["FIGURES", "Skip", "study_rows"]

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
    "10": fig10_support,
    "11": fig11_routing,
}
"""Figure number -> function; the command draws them in this order."""
