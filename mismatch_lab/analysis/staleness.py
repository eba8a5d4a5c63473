"""Staleness apart from numerics: μ-vs-π per policy lag, for the runs whose sequences carry one.

An asynchronous run (AReaL, prime-rl async, a Recorder given `policy_lag=`) scores a sequence with trainer
weights some optimizer updates newer than the weights that sampled it: `sequences.policy_lag` (0 = the
same weights). Its μ-vs-π mismatch then mixes two things: the numerical mismatch of engine and trainer
(lag 0: the same weights, so every difference is numerics) and the policy change of the lag. This table
keeps them apart: one row per (run_id, rollout, scorer, policy_lag) over the (token, scorer) rows of the
sequences with that lag (sequences without a lag are left out; a store without any gives no row):
* n_tokens, n_nonfinite, n_finite   as in every table (non-finite rows counted, left out of the means)
* abs_dp_mean      mean |π − μ|                (probability space)
* abs_dlogp_mean   mean |log π − log μ|        (nats)
* kl_k3            mean k3 = r − log r − 1     (token estimate of KL(μ || π), nats)
* frac_ratio_outside_clip  share with r outside [0.8, 1.28]
The lag-0 row is the run's numerical mismatch; a lag-k row minus it is (roughly: the tokens differ) what k
updates of staleness add. The metrics are `precision.token_metrics` of the additive sums of
`rows.sums_sql` over `definitions.token_metrics_sql`: the same definitions as the precision table.
"""

from __future__ import annotations

import duckdb
import pandas as pd

from mismatch_lab.analysis.precision import token_metrics
from mismatch_lab.analysis.relations import (
    Filters,
    empty,
    query,
    rollout_base,
    table_columns,
    with_metrics,
)
from mismatch_lab.analysis.rows import PRECISION_SUMS, Thresholds, sums_sql

KEYS = ["run_id", "rollout", "scorer", "policy_lag"]
METRIC_COLUMNS = ["abs_dp_mean", "abs_dlogp_mean", "kl_k3", "frac_ratio_outside_clip"]
STALENESS_COLUMNS = [*KEYS, "n_tokens", "n_nonfinite", "n_finite", *METRIC_COLUMNS]


def has_lag(con: duckdb.DuckDBPyConnection) -> bool:
    """Whether any sequence of the store carries a policy lag."""
    if "policy_lag" not in table_columns(con, "sequences") or not table_columns(con, "runs"):
        return False
    return con.execute("SELECT EXISTS (SELECT 1 FROM sequences WHERE policy_lag IS NOT NULL)").fetchone()[0]


def staleness_table(con: duckdb.DuckDBPyConnection, *, rollout=None, scorer=None, run_ids=None, _rows=None) -> pd.DataFrame:
    """Per (run_id, rollout, scorer, policy_lag): counts, mean |dp|, mean |dlogp|, mean k3 and the ratio-clip
    share over the finite (token, scorer) rows of the sequences with that lag (module docstring). Ordered
    by the keys; empty (these columns) when no sequence carries a lag. `_rows` (run_all's shared row set)
    is accepted and not used: only a store with lags pays for this pass."""
    if not has_lag(con):
        return empty(STALENESS_COLUMNS)
    base, params = rollout_base(con, Filters.make(rollout, scorer, run_ids), topk=False, advantage=False)
    sql = f"""
        SELECT x.run_id, x.rollout, x.scorer, q.policy_lag, {sums_sql(Thresholds(), only=PRECISION_SUMS)}
        FROM ({with_metrics(base)}) x
        JOIN (SELECT run_id, seq_id, policy_lag FROM sequences WHERE policy_lag IS NOT NULL) q
          ON x.run_id::VARCHAR = q.run_id AND x.seq_id = q.seq_id
        GROUP BY ALL"""
    s = query(con, sql, params)
    if s.empty:
        return empty(STALENESS_COLUMNS)
    out = pd.concat([s[KEYS], token_metrics(s)], axis=1)
    out["policy_lag"] = out["policy_lag"].astype("int64")
    return out.sort_values(KEYS).reset_index(drop=True)[STALENESS_COLUMNS]
