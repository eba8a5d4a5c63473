"""What `doctor` measures, as DataFrames from SQL over the store. Each measurement runs at most once per
`Measurements` object; the checks (checks.py) read their columns.

The token-level numbers are the analyses' own (`precision.precision_table`, `steps.step_series`, both over
one shared `rows.Rows` row set); the per-sequence numbers are one GROUP BY over the same rollout row set
(`relations.rollout_base` with `definitions.token_metrics_sql`), so every definition is the analyses':

    pairs    one row per (rollout, scorer): n_tokens, n_nonfinite, n_finite, abs_dp_mean, kl_k3, kl_k1,
             chi2, r_mean, ess, frac_ratio_outside_clip (precision_table) and, per sequence:
             seq_n (sequences without a non-finite row), seq_len_mean, seq_abs_dlogp_mean (mean over those
             sequences of the sequence's mean |log π − log μ|), seq_is_mean (mean of exp(Σ log r)),
             seq_product_out / seq_geo_out (share of them whose product ratio exp(Σ log r) / geometric mean
             exp(mean log r) leaves [0.5, 2]), seq_k3_reject (share whose mean k3 exceeds verl's 0.01),
             frac_unequal (share of all (token, scorer) rows, non-finite ones included, with log π != log μ
             or a non-finite side), frac_tv_mask (share of finite rows with |π − μ| > δ_TV = 0.15)
    steps    one row per (run_id, rollout, scorer) of the runs over steps: the OLS slope of the per-step
             mean |π − μ| on the step with its 95 % t-interval, n_steps, first_mean / last_mean (mean of
             the per-step values over the first / last quarter of the steps, at least one step)
    batch    one row per (rollout, other generation batch size) where collect runs of one rollout differ
             only in gen_batch: frac_differ (share of sequences not token-identical to the smallest batch's
             run), abs_dlogp_mean (mean |Δ log μ| on their shared prefix), n_seq, n_tok (figure 7's SQL)
    skipped  one row per rollout: the prompts skipped as longer than the context (skipped_prompts)
    approximation  one row per (rollout, scorer, reference) whose tokens have the scorer's exact TV
             against the reference scorer stored: the analyses' approximation_table (binary and top-K TV
             as mask rules against the exact TV at δ_TV = 0.15: binary_tv_miss, topk_tv_miss, ...)
    corrections  one row per (method, rollout, scorer) for the methods recommend.py may advise:
             `mismatch-lab corrections`' own rows (corrections.compare; frac_seqs_masked, ...)
    scored   one row per (token, scorer): the log-probs attribution.py splits the mismatch with
    support  one row per pair of a processed-μ rollout with log S stored: |mean log S| / mean |Δlogp|
    routing  one row per (rollout, scorer) pair with MoE routing recorded on both sides: the 'pair' rows of
             analyze's routing table (any_layer_differs, flip_rate, tokens, layers, r3_scorer, r3_share, ...)
"""

from __future__ import annotations

import math
from typing import Self

import duckdb
import pandas as pd

from mismatch_lab.analysis import definitions as d
from mismatch_lab.analysis.relations import Filters, query, table_columns
from mismatch_lab.analysis.rows import Rows
from mismatch_lab.doctor import bands as B

LN_LOW, LN_HIGH = math.log(B.IS_WEIGHT_LOW), math.log(B.IS_WEIGHT_HIGH)


class Measurements:
    """The measurements of one store (module doc), computed on first use. Use as a context manager: the
    rollout rows are joined once into a temporary table (`Rows(materialize=True)`), dropped on exit."""

    def __init__(self, con: duckdb.DuckDBPyConnection, *, sample_tokens: int | None = None):
        """`sample_tokens`: measure the corrections' dropped shares on a sample of whole prompt groups of half
        that many to that many tokens (`sample_every`) when the store holds more (the app's views); None: on
        every token (the CLI)."""
        self.con = con
        self.sample_tokens = sample_tokens
        self.rows = Rows(con, Filters(), topk=False, materialize=True)
        self._cache: dict[str, pd.DataFrame] = {}

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.rows.close()

    def get(self, name: str) -> pd.DataFrame:
        if name not in self._cache:
            self._cache[name] = MEASUREMENTS[name](self) if self.rows.ok else pd.DataFrame()
        return self._cache[name]


def _sequence_sql(rel: str) -> str:
    """Per (rollout, scorer) from per-sequence sums over the rollout row set `rel` (module doc)."""
    return f"WITH seq AS ({per_sequence_sql(rel)}) {pair_sequence_sql('seq')}"


PER_SEQUENCE = (
    "bool_and(finite) AS ok", "count(*) AS n_rows",
    "count(*) FILTER (WHERE NOT finite OR dlogp <> 0) AS n_unequal",
    f"count_if(btv > {d.DELTA_TV!r}) AS n_tv", "count(*) FILTER (WHERE finite) AS n_fin",
    "avg(abs(dlogp)) AS abs_dlogp", "sum(dlogp) AS lr_sum", "avg(k3) AS k3_mean",
)
"""The sums `pair_sequence_sql` reads, per sequence of a rollout row set (`relations.with_metrics` columns)."""


def per_sequence_sql(rel: str) -> str:
    """One row per (rollout, scorer, run_id, seq_id) of the rollout row set `rel`: PER_SEQUENCE (every sequence
    lies in one unit of a shard store: `store.units_overview` keeps these rows per unit)."""
    return f"SELECT rollout, scorer, run_id, seq_id, {', '.join(PER_SEQUENCE)} FROM ({rel}) GROUP BY ALL"


def pair_sequence_sql(seq: str) -> str:
    """The per-sequence columns of `pairs` (module doc), per (rollout, scorer), from the rows of `per_sequence_sql`
    in the relation `seq`."""
    return f"""
        SELECT rollout::VARCHAR AS rollout, scorer::VARCHAR AS scorer,
               count(*) FILTER (WHERE ok) AS seq_n,
               avg(n_rows) FILTER (WHERE ok) AS seq_len_mean,
               avg(abs_dlogp) FILTER (WHERE ok) AS seq_abs_dlogp_mean,
               avg(exp(least(lr_sum, 700.0))) FILTER (WHERE ok) AS seq_is_mean,
               avg((lr_sum < {LN_LOW!r} OR lr_sum > {LN_HIGH!r})::DOUBLE) FILTER (WHERE ok) AS seq_product_out,
               avg((lr_sum / n_rows < {LN_LOW!r} OR lr_sum / n_rows > {LN_HIGH!r})::DOUBLE) FILTER (WHERE ok)
                   AS seq_geo_out,
               avg((k3_mean > {B.SEQ_K3_REJECT!r})::DOUBLE) FILTER (WHERE ok) AS seq_k3_reject,
               sum(n_unequal) / sum(n_rows) AS frac_unequal,
               sum(n_tv) / nullif(sum(n_fin), 0) AS frac_tv_mask
        FROM seq GROUP BY ALL"""


def pairs(m: Measurements) -> pd.DataFrame:
    """One row per (rollout, scorer) (module doc)."""
    from mismatch_lab.analysis.precision import precision_table

    tokens = precision_table(m.con, _rows=m.rows)
    if tokens.empty:
        return tokens
    rel, params = m.rows.sql["rollout"]
    return pair_measures(tokens, query(m.con, _sequence_sql(rel), params))


def pair_measures(tokens: pd.DataFrame, seqs: pd.DataFrame) -> pd.DataFrame:
    """`pairs` from the precision table (not empty) and the per-sequence columns (`pair_sequence_sql`)."""
    tokens = tokens.assign(ess=tokens["r_mean"] ** 2 / (tokens["chi2"] + 1.0))  # (Σr)²/(nΣr²) = mean(r)²/mean(r²)
    keep = ["rollout", "scorer", "n_tokens", "n_nonfinite", "n_finite", "abs_dp_mean", "kl_k3", "kl_k1", "chi2",
            "r_mean", "ess", "frac_ratio_outside_clip"]
    out = tokens[keep].merge(seqs, on=["rollout", "scorer"], how="left")
    return out.assign(kl_k1_abs=out["kl_k1"].abs())


def steps(m: Measurements) -> pd.DataFrame:
    """One row per (run_id, rollout, scorer) with at least 3 steps: the growth of mean |π − μ| (module doc)."""
    from mismatch_lab.analysis.steps import growth, step_series

    return growth(step_series(m.con, _rows=m.rows), "abs_dp_mean")


def batch(m: Measurements) -> pd.DataFrame:
    """Generation-batch invariance where the store measured it (module doc), with figure 7's SQL."""
    from mismatch_lab.figures.batch import batch_groups, batch_runs, rollout_batch_rows

    groups = batch_groups(batch_runs(m.con))
    if not groups:
        return pd.DataFrame()
    res = rollout_batch_rows(m.con, groups)
    return res.assign(frac_differ=1.0 - res["frac_identical"]) if not res.empty else res


def skipped(m: Measurements) -> pd.DataFrame:
    """Prompts skipped as longer than the context, per rollout of the collect runs (0 where none; only
    collect skips prompts and writes skipped_prompts); empty where the store has no collect run or no
    skipped_prompts table (a partial export, recorded or imported runs: "not measured", not 0)."""
    if not table_columns(m.con, "skipped_prompts"):
        return pd.DataFrame(columns=["rollout", "n_skipped"])
    return query(m.con, f"""
        SELECT {d.ROLLOUT_LABEL_SQL} AS rollout, count(DISTINCT k.run_id || '/' || k.prompt_id) AS n_skipped
        FROM runs LEFT JOIN skipped_prompts k ON k.run_id = runs.run_id
        WHERE runs.kind = 'collect' GROUP BY ALL ORDER BY rollout""")


def approximation(m: Measurements) -> pd.DataFrame:
    """The approximation table's rows with an exact TV (module doc). Read live, with top-K: the shared
    row set leaves top-K out, and these are scorer pairs, outside it anyway."""
    from mismatch_lab.analysis.approximation import approximation_table

    table = approximation_table(m.con)
    return table[table["n_exact"] > 0].reset_index(drop=True)


def corrections(m: Measurements) -> pd.DataFrame:
    """`mismatch-lab corrections`' main table of the same store (corrections.compare at the published
    defaults: frac_seqs_masked per method and pair), for the methods recommend.py may advise; with
    m.sample_tokens (the app) on a store holding more, of a sample of its prompt groups (column sample_every). Empty without
    torch (the light install): the advice then says each share is not measured."""
    from mismatch_lab.extras import missing

    if missing(("torch",)):
        return pd.DataFrame()
    from mismatch_lab.analysis import sample
    from mismatch_lab.corrections.compare import compare
    from mismatch_lab.doctor.recommend import ADVISABLE

    # in the app a large store is compared on a sample of whole prompt groups (1 in `every`, a power of two:
    # `sample_every`; the Corrections page keeps its own stride, so its sample may be another): a sequence rule
    # decides each kept sequence exactly as on the whole store
    every = 1 if m.sample_tokens is None else sample_every(sample.sample_size(m.con)["tokens"], m.sample_tokens)
    con = m.con if every == 1 else sample.sampled(m.con.cursor(), every)
    table = compare(con, methods=ADVISABLE)["corrections"]
    return table.assign(sample_every=every)


def sample_every(n_tokens: int, target: int) -> int:
    """The stride of the prompt groups the app's doctor compares the corrections on: `sample.stride` rounded up
    to a power of two, so that it changes only when the store doubles (a store being written keeps the dropped
    shares of its finished steps, `store.units_overview`, until then); a sample of target / 2 to target tokens."""
    from mismatch_lab.analysis.sample import stride

    return 1 << (stride(n_tokens, target) - 1).bit_length()


def scored(m: Measurements) -> pd.DataFrame:
    """One row per (token, scorer) for attribution.py: rollout, run_id, seq_id, pos, scorer, lmu, lpi, finite
    (definitions.finite_sql), log_s / lp_s (scores.log_support / logp_support) and lag
    (sequences.policy_lag), NULL where the store lacks the column."""
    scols, qcols = table_columns(m.con, "scores"), table_columns(m.con, "sequences")
    opt = lambda col, have, alias: f"{alias}.{col}" if col in have else "NULL::DOUBLE"
    return query(m.con, f"""
        SELECT {d.ROLLOUT_LABEL_SQL} AS rollout, t.run_id, t.seq_id, t.pos, s.scorer, t.logp_rollout AS lmu,
               s.logp AS lpi, {d.finite_sql('t.logp_rollout', 's.logp', 's.nonfinite')} AS finite,
               {opt('log_support', scols, 's')} AS log_s, {opt('logp_support', scols, 's')} AS lp_s,
               {opt('policy_lag', qcols, 'q')} AS lag
        FROM tokens t JOIN scores s USING (run_id, seq_id, pos) JOIN runs USING (run_id)
             LEFT JOIN sequences q USING (run_id, seq_id)""")


def support(m: Measurements) -> pd.DataFrame:
    """One row per pair whose μ is processed and whose log S is stored (attribution.support_table); empty
    without reading the tokens where the store has no log_support column."""
    from mismatch_lab.doctor.attribution import support_table

    if "log_support" not in table_columns(m.con, "scores"):
        return support_table(pd.DataFrame(columns=["rollout", "scorer", "lmu", "lpi", "finite", "log_s"]))
    return support_table(m.get("scored"))


def nemo_rl(m: Measurements) -> pd.DataFrame:
    """One row per NeMo-RL (rollout, scorer): its token_mult_prob_error steps (analysis/nemo_rl_metric.py)."""
    from mismatch_lab.analysis.nemo_rl_metric import nemo_rl_table, pair_summary

    return pair_summary(nemo_rl_table(m.con))


def routing(m: Measurements) -> pd.DataFrame:
    """One row per pair of analyze's routing table (empty where the store holds no routing rows)."""
    from mismatch_lab.analysis.routing import routing_table

    t = routing_table(m.con)
    return t[t["view"] == "pair"].reset_index(drop=True)


class Measured:
    """Measurements merged from parts instead of measured on a connection (`store.units_overview`: a shard
    store's Overview per unit): name -> a function giving its frame, called on first use, as `Measurements`;
    `incomplete` is `report._incomplete`'s map of the same store."""

    def __init__(self, frames: dict, incomplete: dict[str, list[str]]):
        self._frames, self.incomplete = frames, incomplete
        self._cache: dict[str, pd.DataFrame] = {}

    def get(self, name: str) -> pd.DataFrame:
        if name not in self._cache:
            self._cache[name] = self._frames[name]()
        return self._cache[name]


MEASUREMENTS = {"pairs": pairs, "steps": steps, "batch": batch, "skipped": skipped, "approximation": approximation,
                "corrections": corrections, "scored": scored, "support": support, "nemo_rl": nemo_rl,
                "routing": routing}

__all__ = ["MEASUREMENTS", "Measured", "Measurements"]
