"""The support bias of a sampling rule: log S against log r, per (rollout, scorer) pair and μ bucket.

With top-k / top-p (or a temperature) and processed log-probs, the rollout's log μ is renormalised over the
kept tokens: log μ_proc = log μ_raw(T) − log S_μ, so log r = log π − log μ_proc carries + log S even where
the numerics agree (at T = 1 and identical numerics, mean log r = mean log S ≤ 0). The HF scorers store log S
under π's own distribution (`scores.log_support`) and log π renormalised over that support
(`scores.logp_support`, scoring/support.py). Per row:

    log_s_mean     mean log S                                  over the rows with log S stored and finite
    dlogp_mean     mean log r = mean(log π − log μ)            the same rows
    residual_mean  mean(logp_support − log μ)                  the same rows whose token is inside π's support;
                   = mean(log π − log S − log μ) at T = 1: what remains of log r once the support is
                   accounted for (processed μ; with raw μ the rollout's own log μ is not renormalised and
                   dlogp_mean is the number to read)
    n_outside      rows whose sampled token is outside π's support (logp_support NULL)

With a temperature log S is not the whole bias of a processed μ: the rule's bias per token is
log π − logp_support = log S + (log π − log softmax(z / T)), two-signed; over a pair it is dlogp_mean −
residual_mean. doctor's support_bias check and its support share (doctor/attribution.py `rule_side`) read it.

`view` = 'pair' (every bucket together) | 'mu_bucket' (definitions.bucket_sql on the log scale, with
`mu_lo`, `mu_hi`). A store without `log_support` (or without a value in it) gives an empty table.
"""

from __future__ import annotations

import duckdb
import pandas as pd

from mismatch_lab.analysis import definitions as d
from mismatch_lab.analysis.relations import Filters, table_columns

COLUMNS = ["view", "rollout", "scorer", "logprobs_mode", "mu_bucket", "mu_lo", "mu_hi", "n_tokens", "log_s_mean",
           "dlogp_mean", "residual_mean", "n_outside"]
SCALE = "log"


def support_table(con: duckdb.DuckDBPyConnection, rollout=None, scorer=None, run_ids=None) -> pd.DataFrame:
    """One row per (rollout, scorer) pair ('pair') and per (pair, μ bucket) ('mu_bucket'); see the module."""
    if "log_support" not in table_columns(con, "scores"):
        return pd.DataFrame(columns=COLUMNS)
    filters = Filters.make(rollout, scorer, run_ids)
    rollout_sql = d.rollout_label_sql("runs")
    where, params = filters.where(rollout_sql, "s.scorer", "t.run_id")
    logp_support = "s.logp_support" if "logp_support" in table_columns(con, "scores") else "CAST(NULL AS DOUBLE)"
    nonfinite = "s.nonfinite" if "nonfinite" in table_columns(con, "scores") else None
    df = con.execute(f"""
        WITH j AS (
            SELECT {rollout_sql} AS rollout, s.scorer,
                   coalesce(json_extract_string(runs.config, '$.logprobs_mode'), 'raw') AS logprobs_mode,
                   t.logp_rollout AS lmu, s.logp AS lpi, s.log_support AS log_s, {logp_support} AS lpi_s,
                   {d.bucket_sql(SCALE, lmu='t.logp_rollout')} AS mu_bucket
            FROM tokens t JOIN scores s USING (run_id, seq_id, pos) JOIN runs USING (run_id)
            WHERE {where} AND isfinite(s.log_support) AND {d.finite_sql('t.logp_rollout', 's.logp', nonfinite)}
        )
        SELECT CASE WHEN grouping(mu_bucket) = 1 THEN 'pair' ELSE 'mu_bucket' END AS view,
               rollout, scorer, logprobs_mode, mu_bucket, count(*) AS n_tokens, avg(log_s) AS log_s_mean,
               avg(lpi - lmu) AS dlogp_mean,
               avg(CASE WHEN isfinite(lpi_s) THEN lpi_s - lmu END) AS residual_mean,
               count(*) FILTER (WHERE lpi_s IS NULL OR NOT isfinite(lpi_s)) AS n_outside
        FROM j
        GROUP BY GROUPING SETS ((rollout, scorer, logprobs_mode), (rollout, scorer, logprobs_mode, mu_bucket))
        ORDER BY rollout, scorer, view DESC, mu_bucket""", params).df()
    edges = d.bucket_edges(SCALE)
    df["mu_lo"] = [edges[int(b)][0] if pd.notna(b) else None for b in df["mu_bucket"]]
    df["mu_hi"] = [edges[int(b)][1] if pd.notna(b) else None for b in df["mu_bucket"]]
    df["mu_bucket"] = df["mu_bucket"].astype("Int64")
    return df[COLUMNS]
