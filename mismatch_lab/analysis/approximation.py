"""Approximation quality: how well binary TV and top-K TV stand in for the exact full-vocabulary TV.

Exact TV is only known between two scorers (the store keeps `scores.tv_exact_vs_ref`, each scorer's
full-vocabulary TV against the fp32 reference scorer on the same prefix), so the comparison runs on
scorer pairs: for scorer s and reference scorer ref on the same token,
    binary TV = |p_s(sampled) - p_ref(sampled)|
    top-K TV  = TV on ref's recorded top-K ids + the sampled token + 'other'   (definitions.topk_sql)
Both are lower bounds of the exact TV (TV of a coarsening never exceeds the TV itself), so their mask
errors at delta are misses only. One row per (rollout whose tokens were scored, scorer, reference):
* n_exact: finite rows with a finite exact TV (the denominator of every binary_* column)
* n_topk_exact: those with top-K recorded too (the denominator of every topk_* column)
* *_corr: Pearson correlation with the exact TV; *_mae: mean |approx - exact|
* *_agree: share where (approx > delta) == (exact > delta)
* *_miss: share of rows with exact > delta where approx <= delta (denominator: those rows)
"""

from __future__ import annotations

import duckdb
import pandas as pd

from mismatch_lab.analysis import definitions as d
from mismatch_lab.analysis.relations import Filters, empty
from mismatch_lab.analysis.rows import Rows

APPROXIMATION_COLUMNS = [
    "rollout", "scorer", "reference", "delta_tv", "n_tokens", "n_nonfinite", "n_exact",
    "exact_tv_mean", "frac_exact_gt_delta",
    "binary_tv_mean", "binary_tv_corr", "binary_tv_mae", "binary_tv_agree", "binary_tv_miss",
    "n_topk_exact", "topk_tv_mean", "topk_tv_corr", "topk_tv_mae", "topk_tv_agree", "topk_tv_miss",
]  # fmt: skip


def approximation_sql(delta_tv: float) -> str:
    """The aggregates of APPROXIMATION_COLUMNS (after the keys) over scorer-pair rows with columns
    finite, tv_exact, btv, topk_tv; rows.Rows.scorer_sums runs them in its pass."""
    delta = repr(float(delta_tv))
    ok = "finite AND isfinite(tv_exact)"
    ok_k = f"{ok} AND topk_tv IS NOT NULL"

    def approx(name: str, expr: str, where: str) -> str:
        return f"""
            avg({expr}) FILTER (WHERE {where}) AS {name}_mean,
            corr({expr}, tv_exact) FILTER (WHERE {where}) AS {name}_corr,
            avg(abs({expr} - tv_exact)) FILTER (WHERE {where}) AS {name}_mae,
            avg((({expr} > {delta}) = (tv_exact > {delta}))::DOUBLE) FILTER (WHERE {where}) AS {name}_agree,
            avg(({expr} <= {delta})::DOUBLE) FILTER (WHERE {where} AND tv_exact > {delta}) AS {name}_miss"""

    return f"""{delta} AS delta_tv,
            count(*) AS n_tokens,
            count(*) FILTER (WHERE {ok}) AS n_exact,
            avg(tv_exact) FILTER (WHERE {ok}) AS exact_tv_mean,
            avg((tv_exact > {delta})::DOUBLE) FILTER (WHERE {ok}) AS frac_exact_gt_delta,
            {approx("binary_tv", "btv", ok)},
            count(*) FILTER (WHERE {ok_k}) AS n_topk_exact,
            {approx("topk_tv", "topk_tv", ok_k)}"""


def approximation_table(
    con: duckdb.DuckDBPyConnection,
    *,
    delta_tv: float = d.DELTA_TV,
    rollout=None,
    scorer=None,
    run_ids=None,
    reference: str = d.REFERENCE_SCORER,
    _rows: Rows | None = None,
) -> pd.DataFrame:
    """Binary and top-K TV against the stored exact TV, per (rollout, scorer, reference) (module doc).
    Rows exist wherever a scorer and the reference scored the same tokens; without exact TV the
    binary_*/topk_* columns are empty (NaN) and n_exact = 0."""
    rows = _rows or Rows(con, Filters.make(rollout, scorer, run_ids), reference)  # _rows: run_all's
    if not rows.ok:
        return empty(APPROXIMATION_COLUMNS)
    out = rows.scorer_sums(delta_tv=delta_tv)
    return out.sort_values(["rollout", "scorer", "reference"]).reset_index(drop=True)[APPROXIMATION_COLUMNS]
