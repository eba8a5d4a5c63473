"""The data contract: DuckDB tables (one database file per study), also read from Parquet shards.

One database file per study. Column names below are fixed; extra columns are allowed. There are no
PRIMARY KEY constraints on the big tables on purpose: DuckDB keeps an ART index per key which costs
memory and slows Arrow bulk inserts by several times on 10M-row tables. Uniqueness is guaranteed by
the writer instead: a unit of work (a chunk of prompts of one run) is written in one transaction
together with its row in `chunks_done`, so a crash leaves either the whole chunk or nothing.
"""

from __future__ import annotations

import math

SCHEMA_VERSION = "1"

RUN_KINDS = ("collect", "train", "record", "import")
"""`runs.kind`: collected by `collect`, trained by `train`, recorded from a user's training loop through
`mismatch_lab.record.Recorder`, or imported from a framework's dump by `mismatch-lab import`."""
TOKEN_FIGURE_KINDS = ("collect", "record", "import")
"""Runs whose tokens the pooled token figures (1-5) read: a fixed rollout/trainer pair per run (collect),
or a user's run where μ and π were taken at the same weights (record, import)."""

# The one declaration of every contract column: table -> ((name, DuckDB type, meaning), ...). The DDL below and
# the Arrow types of the writers (`store.writer.TABLE_TYPES`) are derived from it; rows are built by name.
COLUMNS: dict[str, tuple[tuple[str, str, str], ...]] = {
    "meta": (("key", "VARCHAR", ""), ("value", "VARCHAR", "")),
    "runs": (
        ("run_id", "VARCHAR", ""),
        ("study", "VARCHAR", ""),
        ("kind", "VARCHAR", "schema.RUN_KINDS: 'collect' | 'train' | 'record' | 'import'"),
        ("created_at", "TIMESTAMP", ""),
        ("status", "VARCHAR", "'running' | 'complete' | 'failed'"),
        ("model", "VARCHAR", ""),
        ("weights_sha256", "VARCHAR", ""),
        ("engine", "VARCHAR", "the rollout engine: 'vllm' | 'hf'; as declared for record/import ('sglang', 'unknown')"),
        ("engine_dtype", "VARCHAR", "'bf16' | 'fp16' | 'fp32'; NULL when a recorded/imported run does not say"),
        ("device", "VARCHAR", ""),
        ("versions", "JSON", ""),
        ("config", "JSON", ""),
    ),
    "sequences": (
        ("run_id", "VARCHAR", ""),
        ("seq_id", "BIGINT", ""),
        ("prompt_id", "VARCHAR", ""),
        ("sample_idx", "INTEGER", ""),
        ("step", "INTEGER", "NULL for collect runs, the training step for train runs"),
        ("response_text", "VARCHAR", ""),
        ("response_len", "INTEGER", ""),
        ("finish_reason", "VARCHAR", ""),
        ("reward", "DOUBLE", ""),
        ("advantage", "DOUBLE", ""),
        ("prompt_len", "INTEGER", ""),
    ),
    "tokens": (
        ("run_id", "VARCHAR", ""),
        ("seq_id", "BIGINT", ""),
        ("pos", "INTEGER", "0-based position within the response"),
        ("token_id", "INTEGER", ""),
        ("token_text", "VARCHAR", ""),
        ("category", "VARCHAR", "mismatch_lab.categories.categorize"),
        ("logp_rollout", "DOUBLE", "log mu: rollout engine's log-prob of the sampled token"),
        ("topk_ids_rollout", "INTEGER[]", ""),
        ("topk_logps_rollout", "DOUBLE[]", ""),
    ),
    "scores": (
        ("run_id", "VARCHAR", ""),
        ("seq_id", "BIGINT", ""),
        ("pos", "INTEGER", ""),
        ("scorer", "VARCHAR", "'<engine>:<dtype>', e.g. 'hf:fp32', 'vllm:bf16'; '<framework>:<dtype|trainer>' for record/import"),
        ("logp", "DOUBLE", "log pi of the sampled token; NULL when non-finite"),
        ("entropy", "DOUBLE", "nats, full vocabulary"),
        ("topk_ids", "INTEGER[]", ""),
        ("topk_logps", "DOUBLE[]", ""),
        ("tv_exact_vs_ref", "DOUBLE", "1/2 sum_v |p(v) - p_ref(v)|, ref = the fp32 HF scorer"),
        ("kl_exact_vs_ref", "DOUBLE", "KL(p_ref || p) = sum_v p_ref (log p_ref - log p), nats"),
        ("nonfinite", "BOOLEAN", ""),
        # extra columns (allowed by the contract), aligned element-wise with other tables' id lists:
        ("logps_at_rollout_topk", "DOUBLE[]", "this scorer's log-probs at tokens.topk_ids_rollout (top-K TV/KL vs mu)"),
        ("logps_at_ref_topk", "DOUBLE[]", "this scorer's log-probs at the hf:fp32 scorer's topk_ids"),
    ),
    "train_metrics": (
        ("run_id", "VARCHAR", ""),
        ("step", "INTEGER", ""),
        ("name", "VARCHAR", "slash path ending in the reduction, e.g. 'mismatch/abs_dp/mean'"),
        ("value", "DOUBLE", ""),
    ),
    # Bookkeeping for resume: one row per unit of work committed atomically with its data.
    "chunks_done": (
        ("run_id", "VARCHAR", ""),
        ("chunk", "INTEGER", ""),
        ("n_sequences", "INTEGER", ""),
        ("n_tokens", "BIGINT", ""),
        ("seconds", "DOUBLE", ""),
        ("done_at", "TIMESTAMP", ""),
    ),
    # Prompts skipped because they do not fit the context, reported in the summary.
    "skipped_prompts": (("run_id", "VARCHAR", ""), ("prompt_id", "VARCHAR", ""), ("reason", "VARCHAR", "")),
}
PRIMARY_KEYS = {"meta": "key", "runs": "run_id"}


def _create_table(table: str) -> str:
    key = PRIMARY_KEYS.get(table)
    cols = ",\n        ".join(f"{name} {typ}{' PRIMARY KEY' if name == key else ''}" for name, typ, _ in COLUMNS[table])
    return f"CREATE TABLE IF NOT EXISTS {table}(\n        {cols})"


DDL = [_create_table(t) for t in COLUMNS]


MAX_LOG_RATIO = math.log(1.7976931348623157e308)
"""A (token, scorer) row whose log pi - log mu reaches this counts as non-finite: r = exp() of it overflows a
double (analysis.definitions.finite_sql; the import and Recorder summaries count the same way)."""

REFERENCE_SCORER = "hf:fp32"
"""The scorer `scores.tv_exact_vs_ref` / `kl_exact_vs_ref` are measured against (the HF trainer at fp32)."""


def rollout_label_sql(alias: str | None = "runs") -> str:
    """SQL of a run's rollout label over the `runs` columns of `alias` (None: unqualified): '<engine>:<dtype>',
    e.g. 'vllm:bf16', or just '<engine>' (e.g. 'vllm') where engine_dtype is NULL or empty (a recorded or imported
    run whose framework did not say). The one definition of the label: every query that names a rollout
    builds it here."""
    p = f"{alias}." if alias else ""
    return f"({p}engine || coalesce(':' || nullif({p}engine_dtype, ''), ''))"


TABLES = tuple(COLUMNS)


def create_schema(con) -> None:
    """Create every table of the contract if missing and record the schema version."""
    for stmt in DDL:
        con.execute(stmt)
    con.execute(
        "INSERT INTO meta VALUES ('schema_version', ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
        [SCHEMA_VERSION],
    )
