"""The passes over the row sets of `relations`, shared by every analysis and run at most once each.

A pass is one GROUP BY over the joined rows. Most statistics are additive (counts, sums, maxima), so
one pass on a fine grid -- (pair, run, step, advantage sign, category, linear mu bucket, log mu bucket)
-- serves volatility, clipping, precision, violations and the per-step series at once; pandas then rolls
the grid up. What is not additive gets a pass of its own: the quantiles per mu bucket (both scales in
one pass after a sample: analysis.quantiles), the per-sequence sums, and per token id the ratio-clip
counts that rank the token strings (read from the clipped rows alone; every sum of the tokens that can
reach the top then reads their rows).

`Rows(con, filters)` reads the store live (a standalone analysis call). `Rows(..., materialize=True)`
(what `run_all` uses) first joins tokens and scores once into a temporary table (by position where a
shard store offers row-aligned slices, store.aligned; on keys otherwise), label columns as
1-byte ENUMs and the default mu buckets as 1-byte columns, and every rollout-side pass reads that: the
join of 10^7 tokens is the expensive part. Optional columns the store lacks are constants, neither stored
nor aggregated; labels with one value in the whole store (a recorded run's run id, rollout and scorer)
are constants added after the join, neither stored nor group keys (each pass adds them to its result). The scorer side (scorer vs
reference) stays live: it has two passes, one of them without top-K, and none where the materialised
labels show no reference-scorer row.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Self

import duckdb
import numpy as np
import pandas as pd

from mismatch_lab.analysis import definitions as d
from mismatch_lab.analysis.quantiles import SEED as SAMPLE_SEED
from mismatch_lab.analysis.quantiles import Wanted, exact_quantiles
from mismatch_lab.analysis.relations import (
    STORED_METRICS,
    TOPK_STORED,
    Filters,
    _used,
    has_tables,
    metrics_sql,
    query,
    rollout_base,
    scorer_base,
    table_columns,
    typed_null,
    with_metrics,
)
from mismatch_lab.store.aligned import MISALIGNED
from mismatch_lab.store.aligned import parts as aligned_parts


@dataclass(frozen=True)
class Thresholds:
    """The rules a pass counts: ratio clip range [clip_low, clip_high], TV and KL radii."""

    clip_low: float = d.CLIP_LOW
    clip_high: float = d.CLIP_HIGH
    delta_tv: float = d.DELTA_TV
    delta_kl: float = d.DELTA_KL


def sums_sql(t: Thresholds, only: tuple[str, ...] | None = None, absent: Iterable[str] = ()) -> str:
    """`sums_parts` as one select list."""
    return ",\n            ".join(sums_parts(t, only, absent))


def sums_parts(t: Thresholds, only: tuple[str, ...] | None = None, absent: Iterable[str] = ()) -> list[str]:
    """The additive statistics of one group of rows (metric columns of relations.with_metrics).
    Prefixes: n_ row counts, s_ sums, x_ maxima, c_ counts of a rule firing. Rules: 'hi' r > clip_high,
    'lo' r < clip_low, 'tv' btv > delta_tv, 'kl' bkl > delta_kl, 'ktv'/'kkl' the top-K versions;
    '_up' / '_down' the same restricted to r > 1 / r < 1 (pi above / below mu). `absent`: columns known
    to be NULL on every row (ABSENT_READS keys): the statistics reading them are written as the constants
    they would aggregate to (counts 0, sums and maxima NULL) instead of being computed row by row."""
    lo, hi, dtv, dkl = (repr(float(x)) for x in (t.clip_low, t.clip_high, t.delta_tv, t.delta_kl))
    rules = {"tv": f"btv > {dtv}", "kl": f"bkl > {dkl}", "ktv": f"topk_tv > {dtv}", "kkl": f"topk_kl > {dkl}"}
    out = [
        "count(*) FILTER (WHERE finite) AS n",
        "count(*) FILTER (WHERE NOT finite) AS n_nonfinite",
        "sum(mu) AS s_mu", "sum(r - 1.0) AS s_r1", "sum((r - 1.0) * (r - 1.0)) AS s_r1sq", "sum(r * r) AS s_r2",
        "sum(dp) AS s_dp", "sum(btv) AS s_btv", "max(btv) AS x_btv",
        "sum(abs(dlogp)) AS s_adlogp", "max(abs(dlogp)) AS x_adlogp", "sum(dlogp) AS s_dlogp",
        "sum(k2) AS s_k2", "sum(k3) AS s_k3", "sum(bkl) AS s_bkl",
        f"count_if(abs(r - 1.0) > {d.R_DEVIATION!r}) AS c_dev",
        f"count_if(btv > {d.BIG_DP!r}) AS c_bigdp",
        f"count_if(r > {hi}) AS c_hi", f"count_if(r < {lo}) AS c_lo",
        f"coalesce(sum(mu) FILTER (WHERE r > {hi}), 0) AS s_mu_hi",
        f"coalesce(sum(mu) FILTER (WHERE r < {lo}), 0) AS s_mu_lo",
        f"count_if(r > {hi} AND NOT btv > {dtv}) AS c_hi_keep",  # clipped although inside the TV region
        f"count_if(r < {lo} AND NOT btv > {dtv}) AS c_lo_keep",
        f"count_if(btv > {dtv} AND r >= {lo} AND r <= {hi}) AS c_tv_inside",  # TV masks, clip keeps
        f"count_if(btv > {dtv} AND r > 1.0 AND r <= {hi}) AS c_tv_up_inside",
        f"count_if(btv > {dtv} AND r < 1.0 AND r >= {lo}) AS c_tv_down_inside",
        "count(topk_tv) AS n_topk", "sum(topk_tv) AS s_ktv",
        "count(entropy) FILTER (WHERE finite AND isfinite(entropy)) AS n_ent",
        "sum(entropy) FILTER (WHERE finite AND isfinite(entropy)) AS s_ent",
        "count(*) FILTER (WHERE finite AND isfinite(tv_exact)) AS n_exact",
        "sum(tv_exact) FILTER (WHERE finite AND isfinite(tv_exact)) AS s_exact",
    ]  # fmt: skip
    for name, rule in rules.items():
        out += [f"count_if({rule}) AS c_{name}", f"count_if(r > 1.0 AND {rule}) AS c_{name}_up",
                f"count_if(r < 1.0 AND {rule}) AS c_{name}_down"]  # fmt: skip
    if only is not None:  # a pass that needs fewer statistics should not pay for the rest
        out = [part for part in out if column_name(part) in only]
    reads = [c for a in absent for c in ABSENT_READS[a]]
    return [_constant(part) if any(c in part for c in reads) else part for part in out]


ABSENT_READS = {"topk": ("topk_tv", "topk_kl"), "entropy": ("entropy",), "tv_exact": ("tv_exact",)}
"""Optional per-token columns a row set may hold as NULL constants -> the metric columns read from them."""


def _constant(part: str) -> str:
    """'<aggregate> AS <name>' of sums_sql as the constant it gives over rows where its input is NULL."""
    name = column_name(part)
    return f"{'0::BIGINT' if name[0] in 'nc' else 'CAST(NULL AS DOUBLE)'} AS {name}"


def column_name(part: str) -> str:
    """The name of one '<expression> AS <name>' of a select list (sums_parts, SEQUENCE_SUMS)."""
    return part.rsplit(" AS ", 1)[1]


SUM_COLUMNS = [column_name(part) for part in sums_parts(Thresholds())]
PRECISION_SUMS = ("n", "n_nonfinite", "s_btv", "x_btv", "s_dp", "s_adlogp", "x_adlogp", "s_dlogp", "s_k2", "s_k3",
                  "s_r2", "s_r1", "s_bkl", "c_hi", "c_lo", "c_dev", "c_bigdp")  # fmt: skip
"""What precision.token_metrics reads: all the scorer-vs-reference pass computes."""


def rollup(grid: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Sum a sums-grid over every key not in `keys` (x_ maxima by max). NULL keys form their own group."""
    columns = [c for c in SUM_COLUMNS if c in grid.columns]
    maxima = [c for c in columns if c.startswith("x_")]
    g = grid.groupby(keys, dropna=False, sort=False)
    out = g[[c for c in columns if c not in maxima]].sum()  # (one call for every column: a dict of them cost
    if maxima:  # ~0.3 ms a column)
        out = out.join(g[maxima].max())
    return out[columns].reset_index()


TOKEN_KEYS = ["rollout", "scorer", "token_text", "token_id", "category"]
"""The keys of `Rows.token_sums`: a token string (or the id of a token the store holds no text for) by category."""
TOKEN_ID_KEYS = ("rollout", "scorer", "run_id", "token_id", "category")
"""The keys of `Rows.token_sums`' pass: ids are cheap to group; they are named afterwards (`named_token_sums`)."""


def token_names(con, keys: tuple[str, ...] = ("run_id", "token_id")) -> pd.DataFrame:
    """(*keys, token_text): the least text of each token id of a run the store names (empty without texts);
    `keys` may add the sequence's `step` (a shard unit's names, whose least over the units is the store's)."""
    if "token_text" not in table_columns(con, "tokens"):
        return query(con, f"SELECT {', '.join(f'NULL AS {k}' for k in keys)}, NULL AS token_text WHERE false")
    join = " JOIN sequences q USING (run_id, seq_id)" if "step" in keys else ""
    return query(con, f"SELECT {', '.join(keys)}, min(token_text) AS token_text FROM tokens{join} GROUP BY ALL")


def token_ids_of(tokens: pd.DataFrame, names: pd.DataFrame) -> list[int]:
    """The token ids behind (token_text, token_id) keys `tokens`, given each id's text `names` (`token_names`): the
    id itself, or every id named by the text."""
    named = names.loc[names["token_text"].isin(tokens["token_text"].dropna()), "token_id"]
    return sorted({int(i) for i in [*tokens["token_id"].dropna(), *named.dropna()]})


def named_token_sums(by_id: pd.DataFrame, names: pd.DataFrame) -> pd.DataFrame:
    """Sums per TOKEN_KEYS from sums per (.., run_id, token_id, ..) `by_id` and each id's text `names` (run_id,
    token_id, token_text): a named id stands under its text (token_id NULL), an unnamed one under its id."""
    named = by_id.merge(names, on=["run_id", "token_id"], how="left")
    named["token_id"] = named["token_id"].astype("Int64").where(named["token_text"].isna())
    return rollup(named, TOKEN_KEYS)


SEQUENCE_SUMS = (
    "count(*) AS response_len", "count(*) FILTER (WHERE NOT finite) AS n_nonfinite",
    "CASE WHEN bool_and(finite) THEN sum(dlogp) END AS logratio_sum",
    "CASE WHEN bool_and(finite) THEN sum(k1) END AS seq_kl_k1",
    "CASE WHEN bool_and(finite) THEN sum(k3) END AS seq_kl_k3",
)
"""`Rows.sequences`' columns, per sequence of a row set (sums NULL when the sequence holds a non-finite row)."""

DEFAULT_BUCKETS = (("linear", d.N_LINEAR_BUCKETS), ("log", d.N_LOG_BUCKETS))
"""The mu buckets (scale, count) every analysis of run_all reads: a materialised row set stores them."""

R_QUANTILE_COLUMNS = [f"r_p{round(q * 100):02d}" for q in d.RATIO_QUANTILES]  # r_p01 r_p05 r_p50 r_p95 r_p99
QUANTILE_COLUMNS = [*R_QUANTILE_COLUMNS, "binary_tv_p99", "topk_tv_p99", "tv_exact_vs_ref_p99"]
"""The statistics of Rows.quantiles (besides its keys rollout, scorer, bucket)."""


class Rows:
    """Both row sets of one filter set and the cached passes over them (module docstring)."""

    def __init__(
        self,
        con: duckdb.DuckDBPyConnection,
        filters: Filters | None = None,
        reference: str = d.REFERENCE_SCORER,
        *,
        materialize: bool = False,
        topk: bool = True,
    ):
        self.con, self.filters = con, filters or Filters()
        self.ok = has_tables(con, "tokens", "scores", "runs")
        self._cache: dict = {}
        self._tables: list[str] = []
        self._const: dict[str, str] = {}  # rollout-side columns the store lacks: name -> SQL constant
        self._buckets: dict[tuple[str, int], str] = {}  # (scale, n) -> column of the materialised row set
        self._sample_rel: str | None = None  # the rollout row set read from a sample of the temp table
        self._fixed: dict[str, str] = {}  # label -> SQL constant: its value on every materialised row
        if not self.ok:
            return
        tcols, scols = table_columns(con, "tokens"), table_columns(con, "scores")
        # top-K work only where the store holds top-K lists (recorded runs usually do not)
        rollout_topk = topk and {"topk_ids_rollout", "topk_logps_rollout"} <= tcols and "logps_at_rollout_topk" in scols
        scorer_topk = topk and {"topk_ids", "topk_logps", "logps_at_ref_topk"} <= scols
        self._const = {name: typed_null("DOUBLE") for name, src in (("entropy", "entropy"), ("tv_exact", "tv_exact_vs_ref"))
                       if src not in scols} | ({} if rollout_topk else {"topk": typed_null("STRUCT(tv DOUBLE, kl DOUBLE)")})
        enums = self._enums() if materialize else None
        # the scorer side (scorer vs reference) is read live: two passes cost less than materialising it; its
        # SQL is written when a pass first reads it (the per-step series reads the rollout side alone)
        self.sql = _Built({
            "scorer": lambda: self._scorer_sql(reference, scorer_topk),
            "scorer_plain": lambda: self._scorer_sql(reference, False),  # for the per-sequence pass: no top-K
        })
        if materialize:
            # columns the store lacks are constants: added after the join instead of stored per row
            self._fixed = ({} if "category" in tcols else {"category": "'uncategorized'"}) | self._single()
            table = self._materialize_rollout(rollout_topk, enums, self._const | self._fixed)
            self.sql["rollout"] = (with_metrics(table, STORED_METRICS), {})
        else:
            sql, params = rollout_base(con, self.filters, topk=rollout_topk)
            stored = ()
            if not rollout_topk:  # the top-K metric is the NULL it would compute, not a list lambda to plan
                sql, stored = f"SELECT *, {self._const['topk']} AS topk FROM ({sql})", STORED_METRICS
            self.sql["rollout"] = (with_metrics(sql, stored), params)

    @property
    def absent(self) -> dict[str, str]:
        """The rollout-side columns the store lacks (name -> the SQL constant they read as): `sums_sql`'s
        `absent` for a pass over this row set."""
        return self._const

    def _scorer_sql(self, reference: str, topk: bool) -> tuple[str, dict]:
        sql, params = scorer_base(self.con, self.filters, reference, topk=topk)
        return self._unless_absent(with_metrics(sql), reference), params

    def _unless_absent(self, rel: str, reference: str) -> str:
        """`rel`, or no rows without reading the store where the labels read for the ENUMs (a
        materialised row set) show that no score row is the reference scorer's."""
        scorers = self._cache.get("labels", {}).get("scorer")
        return rel if scorers is None or reference in scorers else f"SELECT * FROM ({rel}) WHERE false"

    # -- materialisation ------------------------------------------------------------------------------
    def _materialize_rollout(self, topk: bool, enums: dict[str, str], const: dict[str, str]) -> str:
        """The rollout row set joined once into a temp table (_materialize). A store of one scorer whose
        shards come in row-aligned slices (store.aligned) is paired by position, the key join's rows without
        its hash table; where a pair's keys differ, it is joined on keys after all."""
        scorers, nulls = self._cache["labels"].get("scorer", []), self._cache["nulls"]
        slices = aligned_parts(self.con) if len(scorers) == 1 and "scorer" not in nulls else []
        if slices:
            sql, params = rollout_base(self.con, self.filters, topk=topk, enums=enums, aligned=slices)
            try:
                return self._materialize("rollout", sql, params, const)
            except duckdb.InvalidInputException as exc:
                if MISALIGNED not in str(exc):
                    raise
        sql, params = rollout_base(self.con, self.filters, topk=topk, enums=enums)
        return self._materialize("rollout", sql, params, const)

    def _materialize(self, side: str, base: str, params: dict, const: dict[str, str]) -> str:
        """Join once into a temp table: base columns (labels already ENUMs) and STORED_METRICS, without
        the top-K parts they were computed from; `const` (name -> SQL expression) columns are constants
        added to the result instead of stored."""
        table = f"_ml_{side}_{uuid.uuid4().hex[:10]}"
        names = [r[0] for r in self.con.execute(f"DESCRIBE {base}", _used(base, params)).fetchall()]
        stored = metrics_sql()
        buckets = {(scale, n): f"mu_bucket_{scale}" for scale, n in DEFAULT_BUCKETS}
        select = ", ".join([n for n in names if n not in TOPK_STORED and n not in const]
                           + [f"{stored[m]} AS {m}" for m in STORED_METRICS if m not in const]
                           + [f"{self._bucket(*key)}::TINYINT AS {c}" for key, c in buckets.items()])
        with _settings(self.con, **WRITE_SETTINGS):
            self.con.execute(f"CREATE TEMP TABLE {table} AS SELECT {select} FROM ({base})", _used(base, params))
        self._tables.append(table)
        self._buckets |= buckets
        added = "".join(f", {expr} AS {name}" for name, expr in const.items())
        # the quantiles' sample is drawn from the stored rows, before any metric is computed: a row is kept
        # when the hash of its row id falls in the sampled share of the hash range (a filter both threads
        # run, where a Bernoulli draw runs on one)
        keep = f"WHERE hash(rowid, {SAMPLE_SEED}) < {{share}} * {2.0**64!r}"
        self._sample_rel = with_metrics(f"SELECT *{added} FROM temp.{table} {keep}", STORED_METRICS)
        return f"SELECT *{added} FROM temp.{table}"

    def _bucket(self, scale: str, n_buckets: int) -> str:
        """SQL: a row's mu bucket (definitions.bucket_sql), -1 where log mu is not finite; the stored
        column of a materialised row set for the default bucket counts."""
        return self._buckets.get((scale, n_buckets)) or f"coalesce({d.bucket_sql(scale, n_buckets)}, -1)"

    def _enums(self) -> dict[str, str]:
        """ENUM types for the label columns: one byte a row instead of a string."""
        if "enums" in self._cache:
            return self._cache["enums"]
        con = self.con
        values = {
            "rollout": f"SELECT DISTINCT {d.ROLLOUT_LABEL_SQL} FROM runs",
            "run_id": "SELECT DISTINCT run_id FROM runs",
            "scorer": "SELECT DISTINCT scorer FROM scores",
        }
        if "category" in table_columns(con, "tokens"):
            values["category"] = "SELECT DISTINCT coalesce(category, 'uncategorized') FROM tokens"
        out, labels, nulls = {}, {}, set()
        for name, sql in values.items():
            got = con.execute(sql).fetchall()
            nulls |= {name} if any(r[0] is None for r in got) else set()
            vals = sorted({str(r[0]) for r in got if r[0] is not None} | (
                {"uncategorized"} if name == "category" else set()))  # fmt: skip
            labels[name] = vals
            if vals:
                out[name] = "ENUM(" + ", ".join(_quote(v) for v in vals) + ")"
        out["adv_sign"] = "ENUM('positive', 'negative')"
        self._cache["enums"], self._cache["labels"], self._cache["nulls"] = out, labels, nulls
        return out

    def _single(self) -> dict[str, str]:
        """Label columns that hold one value on every row of the store (no NULL), as ENUM constants: a
        materialised row set adds them to the result instead of storing one byte a row (a recorded run
        has one run, one rollout and one scorer)."""
        enums, labels, nulls = self._enums(), self._cache["labels"], self._cache["nulls"]
        return {name: f"{_quote(vals[0])}::{enums[name]}" for name, vals in labels.items()
                if len(vals) == 1 and name not in nulls}  # fmt: skip

    def close(self) -> None:
        for t in self._tables:
            self.con.execute(f"DROP TABLE IF EXISTS temp.{t}")
        self._tables = []

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- passes ---------------------------------------------------------------------------------------
    def _run(self, key, sql_of) -> pd.DataFrame:
        if key not in self._cache:
            self._cache[key] = sql_of()
        return self._cache[key].copy()

    def _free(self, keys: list[str]) -> list[str]:
        """The group keys of a pass that vary: a label with one value on every row (_fixed) is no key
        worth hashing 10^7 times."""
        return [k for k in keys if k not in self._fixed]

    def _refill(self, sql: str, keys: list[str], order: bool = False) -> str:
        """SQL: the result of `sql` (a pass grouped by _free(keys)) with `keys` first, the fixed labels
        among them as the constants they are (so typed as a pass grouping by them would return them);
        `order`: sorted by the keys."""
        free = self._free(keys)
        order_by = f" ORDER BY {', '.join(free)}" if order else ""
        if free == keys:
            return sql + order_by
        cols = ", ".join(f"{self._fixed[k]} AS {k}" if k in self._fixed else k for k in keys)
        rest = f"* EXCLUDE ({', '.join(free)})" if free else "*"
        return f"SELECT {cols}, {rest} FROM ({sql}){order_by}"

    def grid(self, t: Thresholds, n_linear: int = d.N_LINEAR_BUCKETS, n_log: int = d.N_LOG_BUCKETS) -> pd.DataFrame:
        """Sums per (rollout, scorer, run_id, step, adv_sign, category, lb, gb) of the rollout rows; lb / gb
        are the linear / log mu buckets (-1 where log mu is not finite), step the sequence's training step
        (NULL for collect runs). Every sums-based table (the per-step series too) is a rollup of it."""

        def run():
            rel, params = self.sql["rollout"]
            lb, gb = self._bucket("linear", n_linear), self._bucket("log", n_log)
            keys = ["rollout", "scorer", "run_id", "step", "adv_sign", "category"]
            sql = f"""
                SELECT {', '.join(self._free(keys))}, {lb} AS lb, {gb} AS gb,
                    {sums_sql(t, absent=self._const)}
                FROM ({rel}) GROUP BY ALL"""
            return query(self.con, self._refill(sql, keys), params)

        return self._run(("grid", t, n_linear, n_log), run)

    def step_sums(self, t: Thresholds) -> pd.DataFrame:
        """PRECISION_SUMS per (rollout, scorer, run_id, step) of the rollout rows with a step, in a pass of its
        own: what a per-step series alone needs (a refresh's few new steps: the grid's plan, with its other
        keys and sums, took ~20 ms of CPU before any row was read). `run_all` rolls up its grid instead."""

        def run():
            rel, params = self.sql["rollout"]
            keys = ["rollout", "scorer", "run_id", "step"]
            sql = f"""
                SELECT {', '.join(self._free(keys))}, {sums_sql(t, PRECISION_SUMS, absent=self._const)}
                FROM ({rel}) WHERE step IS NOT NULL GROUP BY ALL"""
            return query(self.con, self._refill(sql, keys), params)

        return self._run(("step_sums", t), run)

    def scorer_sums(self, t: Thresholds = Thresholds(), delta_tv: float = d.DELTA_TV) -> pd.DataFrame:
        """Per (rollout, scorer, reference) of the scorer-vs-reference rows: the PRECISION_SUMS (for the
        noise floor) and the approximation aggregates at delta_tv, in one pass."""

        def run():
            from mismatch_lab.analysis.approximation import approximation_sql

            rel, params = self.sql["scorer"]
            sql = f"""SELECT rollout, scorer, reference, {sums_sql(t, PRECISION_SUMS)}, {approximation_sql(delta_tv)}
                      FROM ({rel}) GROUP BY ALL"""
            return query(self.con, sql, params)

        return self._run(("scorer_sums", t, float(delta_tv)), run)

    def token_sums(
        self,
        t: Thresholds,
        only: tuple[str, ...] | None = None,
        tokens: pd.DataFrame | None = None,
        *,
        clipped: bool = False,
    ) -> pd.DataFrame:
        """Sums per TOKEN_KEYS (rollout, scorer, token string, token_id, category) of the rollout rows: the sums
        per id (`sums_by(TOKEN_ID_KEYS)`) named by the store's texts (`named_token_sums`). A token the store holds no
        text for (recorded without a tokenizer) keeps its id as its key (token_text NULL); a named token has
        token_id NULL, its string standing for every id that decodes to it. `only`: the sums to compute
        (default all): the pass groups ~10^5 keys, each sum costs. `tokens`: (token_text, token_id) keys as
        returned here: the pass then reads only the rows of their ids (the sums of those keys are complete;
        other keys sharing an id may appear, partially summed). `clipped`: only the rows the ratio clip of `t`
        drops (r > clip_high or r < clip_low): the counts c_hi / c_lo of every key are still complete, the
        other sums cover those rows alone."""
        ids = None if tokens is None else self._token_ids(tokens)
        return self._run(("token_sums", t, only, None if ids is None else tuple(ids), clipped),
                         lambda: named_token_sums(self.sums_by(TOKEN_ID_KEYS, t, only, ids, clipped=clipped),
                                                  self._token_names()))

    def sums_by(self, keys: tuple[str, ...], t: Thresholds, only: tuple[str, ...] | None = None,
                ids: list[int] | None = None, *, clipped: bool = False) -> pd.DataFrame:
        """Sums `only` (default all) per `keys` of the rollout rows (e.g. TOKEN_ID_KEYS: a token id of a run, not
        yet named), of the ids `ids` only where given, of the clipped rows only where `clipped` (`token_sums`)."""
        rel, params = self.sql["rollout"]
        where = ["true"] if ids is None else ["token_id IN (SELECT unnest($tok_ids))"]
        if clipped:  # r is NULL on non-finite rows, which count_if(r > ...) does not count either
            where.append(f"(r > {float(t.clip_high)!r} OR r < {float(t.clip_low)!r})")
        sql = f"""
            SELECT {', '.join(self._free(list(keys)))}, {sums_sql(t, only, absent=self._const)}
            FROM ({rel}) WHERE {' AND '.join(where)} GROUP BY ALL"""
        return query(self.con, self._refill(sql, list(keys)), params | {"tok_ids": ids})

    def sums_by_sets(self, t: Thresholds, sets: dict[str, tuple[tuple[str, ...], tuple[str, ...]]]
                     ) -> dict[str, pd.DataFrame]:
        """name -> `sums_by(keys, t, only)` for each (keys, only) of `sets`, in one pass over the rollout rows (GROUPING
        SETS: one join of tokens and scores for several tables of sums). Not on a materialised row set."""
        assert not self._fixed, "sums_by_sets reads a live row set"
        keys = list(dict.fromkeys(k for ks, _ in sets.values() for k in ks))
        only = tuple(dict.fromkeys(c for _, cs in sets.values() for c in cs))
        rel, params = self.sql["rollout"]
        groups = ", ".join(f"({', '.join(ks)})" for ks, _ in sets.values())
        found = query(self.con, f"""
            SELECT {', '.join(keys)}, GROUPING({', '.join(keys)}) AS _set, {sums_sql(t, only, absent=self._const)}
            FROM ({rel}) GROUP BY GROUPING SETS ({groups})""", params)
        out = {}
        for name, (ks, cs) in sets.items():  # GROUPING's bit of a key is 1 where the set leaves it out
            mask = sum(1 << (len(keys) - 1 - i) for i, k in enumerate(keys) if k not in ks)
            out[name] = found.loc[found["_set"] == mask, [*ks, *cs]].reset_index(drop=True)
        return out

    def _token_names(self) -> pd.DataFrame:
        """(run_id, token_id, token_text): the text of each id the store names (empty without texts)."""
        if "token_names" not in self._cache:
            self._cache["token_names"] = token_names(self.con)
        return self._cache["token_names"]

    def _token_ids(self, tokens: pd.DataFrame) -> list[int]:
        return token_ids_of(tokens, self._token_names())

    def quantiles(self, scale: str, n_buckets: int) -> pd.DataFrame:
        """Per (rollout, scorer, mu bucket of `scale`): quantiles of r (definitions.RATIO_QUANTILES) and the
        99th percentiles of binary TV, top-K TV and the stored exact TV, over finite rows. On a
        materialised row set a default scale is computed together with the other default scale (one
        pass: analysis.quantiles), as run_all reads both."""
        key = ("quantiles", scale, n_buckets)
        if key not in self._cache:
            scales = [(scale, n_buckets)]
            if self._tables and scales[0] in DEFAULT_BUCKETS:
                scales += [s for s in DEFAULT_BUCKETS if s != scales[0]]
            for s, frame in zip(scales, self._quantile_passes(scales), strict=True):
                self._cache[("quantiles", *s)] = frame
        return self._cache[key].copy()

    def _quantile_passes(self, scales: list[tuple[str, int]]) -> list[pd.DataFrame]:
        """quantiles() for each (scale, n_buckets), all in one pass (analysis.quantiles: exact, without
        holding every value; a random sample places the brackets)."""
        ok = "finite AND isfinite(tv_exact)"
        wanted = [
            Wanted("r", "r", tuple(d.RATIO_QUANTILES)),
            Wanted("binary_tv_p99", "btv", (0.99,)),
            Wanted("topk_tv_p99", "topk_tv", (0.99,)),
            Wanted("tv_exact_vs_ref_p99", "tv_exact", (0.99,), where=ok),
        ]
        constant = {"topk_tv_p99": "topk", "tv_exact_vs_ref_p99": "tv_exact"}  # NULL where not stored
        live = [w for w in wanted if constant.get(w.name) not in self._const]
        rel, params = self.sql["rollout"]
        cols = [f"b{i}" for i in range(len(scales))]
        buckets = ", ".join(f"{self._bucket(s, n)} AS {c}" for c, (s, n) in zip(cols, scales, strict=True))
        sample = f"SELECT *, {buckets} FROM ({self._sample_rel})" if self._sample_rel else None  # else rel sampled
        by_set = exact_quantiles(
            self.con, f"SELECT *, {buckets} FROM ({rel})", params,
            {c: [*self._free(["rollout", "scorer"]), c] for c in cols}, live, sample_rel=sample,
            row_bound=self._row_bound(),
        )  # fmt: skip
        names = dict(zip(wanted[0].columns(), R_QUANTILE_COLUMNS, strict=True)) | {f"{w.name}_0": w.name for w in live[1:]}
        frames = []
        for col in cols:
            q = by_set[col].rename(columns={col: "bucket", **names})
            for label in ("rollout", "scorer"):  # a fixed label was no key of the pass: its one value
                if label in self._fixed:
                    q[label] = pd.Series(self._cache["labels"][label][0], index=q.index, dtype=object)
            for name in set(QUANTILE_COLUMNS) - set(q.columns):
                q[name] = np.nan
            frames.append(q[["rollout", "scorer", "bucket", *QUANTILE_COLUMNS]].astype(dict.fromkeys(QUANTILE_COLUMNS, "float64")))
        return frames

    def _row_bound(self) -> int:
        """An upper bound of the rollout row set's rows: the materialised rows, else the store's score rows
        (one per token and scorer). Read from table or Parquet metadata, so it costs no pass over the
        (possibly live) join."""
        if "row_bound" not in self._cache:
            table = f"temp.{self._tables[0]}" if self._tables else "scores"
            self._cache["row_bound"] = int(self.con.execute(f"SELECT count(*) FROM {table}").fetchone()[0])
        return self._cache["row_bound"]

    def sequences(self, side: str) -> pd.DataFrame:
        """One row per (pair, sequence): response_len (rows of the sequence in this pair), n_nonfinite,
        logratio_sum = sum(log pi - log mu), seq_kl_k1 = sum(k1), seq_kl_k3 = sum(k3) (sums NULL when
        the sequence holds a non-finite row); adv_sign on the rollout side."""

        def run():
            rel, params = self.sql["scorer_plain" if side == "scorer" else side]
            names = ["rollout", "scorer", "run_id", "seq_id"] + (["reference"] if side == "scorer" else [])
            keys = ", ".join(self._free(names) if side == "rollout" else names)  # the scorer side is live
            sign = ", any_value(adv_sign) AS adv_sign" if side == "rollout" else ""
            sql = f"SELECT {keys}, {', '.join(SEQUENCE_SUMS)}{sign} FROM ({rel}) GROUP BY {keys}"
            return query(self.con, self._refill(sql, names, order=True) if side == "rollout" else f"{sql} ORDER BY {keys}", params)

        return self._run(("sequences", side), run)


class _Built(dict):
    """`Rows.sql`: name -> (SQL, params) of a row set, written at its first look-up by the builder given."""

    def __init__(self, builders: dict):
        super().__init__()
        self._builders = builders

    def __missing__(self, name: str) -> tuple[str, dict]:
        self[name] = self._builders[name]()
        return self[name]


WRITE_SETTINGS = {"preserve_insertion_order": "false", "disabled_optimizers": "build_side_probe_side"}
"""DuckDB settings while the row set is written. Row order is irrelevant to every pass; not keeping it lets
DuckDB write in parallel. The joins keep the build side as written (the small one, right of each LEFT JOIN):
DuckDB estimates a positional join's rows as 0 and would otherwise build its hash table on the 10^7
positional rows instead of the 10^4 sequences (about 0.6 s at 10^7 tokens)."""


ADDED_SETTINGS = ("disabled_optimizers",)
"""Settings holding a comma-separated list: _settings adds its values to the list instead of replacing it."""


@contextmanager
def _settings(con: duckdb.DuckDBPyConnection, **values: str):
    """DuckDB settings `values` (name -> value) inside the block, restored after it (those of ADDED_SETTINGS
    extended, not replaced); a setting this DuckDB does not know is left alone (it only makes a query
    slower). A failed restore does not hide the block's own error."""
    saved = {}
    for name, value in values.items():
        try:
            (saved[name],) = con.execute(f"SELECT current_setting('{name}')::VARCHAR").fetchone()
            if name in ADDED_SETTINGS and saved[name]:
                value = f"{saved[name]},{value}"
            con.execute(f"SET {name} = {_quote(value)}")
        except duckdb.Error:
            saved.pop(name, None)
    failed = False
    try:
        yield
    except BaseException:
        failed = True
        raise
    finally:
        for name, value in saved.items():
            try:
                con.execute(f"SET {name} = {_quote(value)}")
            except duckdb.Error:
                if not failed:
                    raise


def _quote(value: str) -> str:
    """A SQL string literal of `value`."""
    return "'" + value.replace("'", "''") + "'"
