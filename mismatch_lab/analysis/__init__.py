"""Analyses of a store: pure functions, SQL over a read-only DuckDB connection -> pandas DataFrames.

    definitions.py    every definition and default threshold (probability vs log space, KL estimators)
    relations.py      the joined row sets: (rollout mu, scorer pi) per token; (reference pi, scorer pi)
    rows.py           the GROUP BY passes over them, each run once (additive sums on a fine grid)
    volatility.py     r vs binary TV by mu bucket (DPPO Fig. 2)
    clipping.py       ratio clip vs DPPO masks by category, mu bucket, token string
    precision.py      |dp|, |dlogp|, KL k1/k2/k3, chi2 per pair; sequence drift; scorer noise floor
    violations.py     negative-sample tokens outside the trust region; training-run metric series
    steps.py          the precision metrics per training step of the runs whose sequences carry a step
    staleness.py      the precision metrics per policy lag: numerical mismatch (lag 0) apart from staleness
    nemo_rl_metric.py NeMo-RL's token_mult_prob_error per step of the NeMo-RL runs, as NeMo-RL computes it
    approximation.py  binary / top-K TV against exact full-vocabulary TV
    support.py        log S of a sampling rule's support against log r, per pair and mu bucket
    routing.py        MoE routing: expert-set flips per pair, layer and margin; mismatch with vs without; R3 share
    command.py        `mismatch-lab analyze`

No torch, no vLLM: analysis runs wherever DuckDB does. `run_all` is what `analyze` prints and writes.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import duckdb
import pandas as pd

from mismatch_lab.analysis import (
    approximation,
    clipping,
    nemo_rl_metric,
    precision,
    routing,
    staleness,
    steps,
    support,
    violations,
    volatility,
)
from mismatch_lab.analysis.relations import Filters
from mismatch_lab.analysis.rows import Rows

ANALYSES = ("volatility", "clipping", "precision", "violations", "approximation", "steps", "staleness", "support",
            "token_mult_prob_error", "routing")


def _stack(parts: list[tuple[str, str, pd.DataFrame]]) -> pd.DataFrame:
    """Concatenate sub-tables under a discriminator column (name, value) placed first."""
    # nullable integers, so counts stay integers where another sub-table leaves them empty
    frames = [
        df.assign(**{col: val})[[col, *df.columns]].astype({c: "Int64" for c in df.select_dtypes("integer")})
        for col, val, df in parts
    ]
    columns = list(dict.fromkeys(c for f in frames for c in f.columns))
    filled = [f for f in frames if not f.empty]  # concat of empty frames muddles dtypes
    out = pd.concat(filled, ignore_index=True) if filled else pd.DataFrame()
    return out.reindex(columns=columns)


LABELS = {
    "rollout": ("--rollout", "SELECT DISTINCT {rollout} FROM runs"),
    "scorer": ("--scorer", "SELECT DISTINCT scorer FROM scores"),
    "run_ids": ("--run-id", "SELECT DISTINCT run_id FROM runs"),
}
"""run_all's filters -> (the CLI option, the SQL listing the labels a store holds)."""


def check_labels(con: duckdb.DuckDBPyConnection, wanted: dict, flags: bool = False) -> None:
    """A filter label that matches nothing is a typo, not an empty result: UserError naming what exists.
    `wanted`: filter name (LABELS) -> a label, a list of labels (compared as strings), or None."""
    from mismatch_lab.analysis.definitions import rollout_label_sql
    from mismatch_lab.errors import UserError

    for name, value in wanted.items():
        if not value:
            continue
        flag, sql = LABELS[name]
        have = sorted(str(r[0]) for r in con.execute(sql.format(rollout=rollout_label_sql(None))).fetchall()
                      if r[0] is not None)
        unknown = [str(w) for w in ([value] if isinstance(value, str) else value) if str(w) not in have]
        if unknown:
            raise UserError(f"{f'{flag} ' if flags else f'{name}='}{', '.join(unknown)} is not in this store; "
                            f"it holds: {', '.join(have) or 'nothing'}")


def run_all(
    con: duckdb.DuckDBPyConnection,
    *,
    rollout=None,
    scorer=None,
    run_ids=None,
    top_n: int = 30,
    progress: Callable[[str, float], None] | None = None,
    flags: bool = False,
) -> dict[str, pd.DataFrame]:
    """Every analysis, one long-form DataFrame per key of ANALYSES:

    * volatility:    volatility_table with buckets 'linear' and 'log' (column `scale`)
    * clipping:      column `view` = 'category' | 'mu_bucket' | 'top_token' (clipping_by_category,
                     clipping_by_bucket, top_clipped_tokens)
    * precision:     column `comparison` = 'rollout_vs_scorer' (precision_table, one row per pair) |
                     'scorer_vs_reference' (noise_floor; `reference` names the reference scorer)
    * violations:    column `source` = 'tokens' (violations_table) | 'train_metrics' (train_series)
    * approximation: approximation_table
    * steps:         step_series, one row per (run_id, rollout, scorer, step) of the runs over steps
    * staleness:     staleness_table, one row per (run_id, rollout, scorer, policy_lag) of the runs whose
                     sequences carry a policy lag (empty otherwise)
    * support:       support_table, column `view` = 'pair' | 'mu_bucket': log S against log r of the pairs whose
                     scorer stored log S (a rollout sampling with temperature / top-k / top-p; empty otherwise)
    * token_mult_prob_error: nemo_rl_table, NeMo-RL's metric per (run_id, rollout, scorer, step) of the runs
                     whose scorer is NeMo-RL's (empty otherwise)
    * routing:       routing_table, column `view` = 'pair' | 'layer' | 'margin': MoE expert-set flips of each scorer
                     against the rollout (empty when the store holds no routing rows)
    The store is joined once (rows.Rows, materialized) and every analysis reads that row set.
    `progress(name, seconds since the start)` is called after the join and after each analysis. A rollout,
    scorer or run id the store does not hold is a UserError listing those it holds (named as the CLI's
    options with `flags`)."""
    filters = Filters.make(rollout, scorer, run_ids)  # lists, once (a generator is read here only)
    check_labels(con, {"rollout": filters.rollout, "scorer": filters.scorer, "run_ids": filters.run_ids}, flags)
    t0 = time.perf_counter()
    with Rows(con, filters, materialize=True) as rows:
        if progress is not None:
            progress("join", time.perf_counter() - t0)
        r = {"_rows": rows}
        tables = {
            "volatility": lambda: _stack(
                [("scale", s, volatility.volatility_table(con, buckets=s, **r).drop(columns="scale"))
                 for s in ("linear", "log")]
            ),
            "clipping": lambda: _stack(
                [
                    ("view", "category", clipping.clipping_by_category(con, **r)),
                    ("view", "mu_bucket", clipping.clipping_by_bucket(con, **r)),
                    ("view", "top_token", clipping.top_clipped_tokens(con, top_n, **r)),
                ]
            ),
            "precision": lambda: _stack(
                [
                    ("comparison", "rollout_vs_scorer", precision.precision_table(con, **r)),
                    ("comparison", "scorer_vs_reference", precision.noise_floor(con, **r)),
                ]
            ),
            "violations": lambda: _stack(
                [
                    ("source", "tokens", violations.violations_table(con, **r)),
                    ("source", "train_metrics", violations.train_series(con, run_ids)),
                ]
            ),
            "approximation": lambda: approximation.approximation_table(con, **r),
            "steps": lambda: steps.step_series(con, **r),
            "staleness": lambda: staleness.staleness_table(con, rollout=rollout, scorer=scorer, run_ids=run_ids),
            "support": lambda: support.support_table(con, rollout=rollout, scorer=scorer, run_ids=run_ids),
            "token_mult_prob_error": lambda: nemo_rl_metric.nemo_rl_table(con, rollout=rollout, scorer=scorer,
                                                                          run_ids=run_ids),
            "routing": lambda: routing.routing_table(con, rollout=rollout, scorer=scorer, run_ids=run_ids),
        }
        out = {}
        for name, table in tables.items():
            out[name] = table()
            if progress is not None:
                progress(name, time.perf_counter() - t0)
    return out


__all__ = ["ANALYSES", "run_all"]
