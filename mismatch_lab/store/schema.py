"""The data contract: DuckDB tables (one database file per study), also read from Parquet shards.

One database file per study. Column names below are fixed; extra columns are allowed. There are no
PRIMARY KEY constraints on the big tables on purpose: DuckDB keeps an ART index per key which costs
memory and slows Arrow bulk inserts by several times on 10M-row tables. Uniqueness is guaranteed by
the writer instead: a unit of work (a chunk of prompts of one run) is written in one transaction
together with its row in `chunks_done`, so a crash leaves either the whole chunk or nothing.
"""

from __future__ import annotations

import math
import re

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
        ("policy_lag", "INTEGER", ("optimizer updates between the weights that sampled the sequence and those pi "
                                   "was computed with (0: same weights); NULL when the run does not say")),
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
        ("log_support", "DOUBLE", ("log S: log of the mass of this scorer's distribution that the rollout's "
                                   "sampling rule (temperature, top-k, top-p; scoring.support) keeps; NULL without one")),
        ("logp_support", "DOUBLE", ("log pi restricted to that support and renormalised, at the sampled token "
                                    "(= logp - log_support at T=1); NULL outside the support or without a rule")),
    ),
    "train_metrics": (
        ("run_id", "VARCHAR", ""),
        ("step", "INTEGER", ""),
        ("name", "VARCHAR", "slash path ending in the reduction, e.g. 'mismatch/abs_dp/mean'"),
        ("value", "DOUBLE", ""),
    ),
    # MoE routing (optional: empty in a DuckDB store without MoE runs, absent from a Parquet store or export
    # without; readers treat absent as "no routing recorded"). One row per (run, sequence, response position,
    # side, MoE layer); docs/moe.md.
    "routing": (
        ("run_id", "VARCHAR", ""),
        ("seq_id", "BIGINT", ""),
        ("pos", "INTEGER", ("response position (= tokens.pos): the routing of the forward position whose output "
                            "distribution gives response token pos (input position prompt_len + pos - 1)")),
        ("side", "VARCHAR", ("'rollout' (the run's rollout engine, labelled by schema.rollout_label_sql) or a scorer "
                             "label as in scores.scorer, e.g. 'hf:fp32', 'hf:fp32-r3'")),
        ("layer", "SMALLINT", "MoE layer index, input to output (0-based among the MoE layers)"),
        ("expert_ids", "SMALLINT[]", "the k chosen experts in rank order (highest router score first)"),
        ("expert_weights", "FLOAT[]", "their weights as the experts received them (same order); NULL where not recorded"),
        ("margin", "FLOAT", ("router's k-th largest logit minus its (k+1)-th (distance to a change of the chosen "
                             "set); NULL where not recorded")),
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
OPTIONAL_TABLES = ("routing",)
"""Tables a store may lack altogether (a Parquet store, an export): read as empty; `export` writes them only
when they hold rows."""
ROUTING_ROLLOUT_SIDE = "rollout"
"""`routing.side` of the run's rollout engine (a scorer's rows carry its `scores.scorer` label)."""

REQUIRED_COLUMNS: dict[str, tuple[str, ...]] = {
    "meta": ("key", "value"),
    "runs": ("run_id", "kind", "engine"),
    "sequences": ("run_id", "seq_id", "step", "response_len"),
    "tokens": ("run_id", "seq_id", "pos", "token_id", "logp_rollout"),
    "scores": ("run_id", "seq_id", "pos", "scorer", "logp", "nonfinite"),
    "train_metrics": ("run_id", "step", "name", "value"),
    "routing": ("run_id", "seq_id", "pos", "side", "layer", "expert_ids"),
}
"""table -> the columns a store must hold wherever it holds the table (docs/design.md, "The data contract"):
`store.reader.open_store` refuses a store that lacks one or holds one of an incompatible type (`type_fits`).
Every other contract column is optional: absent (a Parquet store's reader fills it with NULL) or NULL.
`store.synthetic.REQUIRED_COLUMNS` (what a framework's run holds, for the tests) keeps these and more."""

_TYPE_FAMILIES = {
    "DOUBLE": r"(U?(TINY|SMALL|BIG|HUGE)?INT(EGER)?|FLOAT|DOUBLE|REAL|DECIMAL(\(.*\))?)",
    "BIGINT": r"U?(TINY|SMALL|BIG|HUGE)?INT(EGER)?",
    "SMALLINT": r"U?(TINY|SMALL|BIG|HUGE)?INT(EGER)?",
    "SMALLINT[]": r"U?(TINY|SMALL|BIG|HUGE)?INT(EGER)?\[\]",
    "FLOAT": r"(FLOAT|DOUBLE|REAL)",
    "INTEGER": r"U?(TINY|SMALL|BIG|HUGE)?INT(EGER)?",
    "VARCHAR": r"(VARCHAR|JSON)",
    "JSON": r"(VARCHAR|JSON)",
    "BOOLEAN": r"BOOLEAN",
    "TIMESTAMP": r"(TIMESTAMP.*|DATE)",
}
"""contract type -> the DuckDB types (regex) a store's column may have instead: any number where a DOUBLE is
expected (a framework's float32 log-probs), any integer where an integer is, text or JSON where text is; a
Parquet column of Arrow type null (no value at all) fits any."""


def contract_type(table: str, column: str) -> str:
    """The DuckDB type of a contract column (from `COLUMNS`)."""
    return next(typ for name, typ, _ in COLUMNS[table] if name == column)


def type_fits(found: str, expected: str) -> bool:
    """Whether a column of DuckDB type `found` can be read where the contract declares `expected`."""
    family = _TYPE_FAMILIES.get(expected, re.escape(expected))
    found = found.strip().strip('"').upper()
    return found == "NULL" or re.fullmatch(family, found) is not None  # "NULL": a column holding only NULLs


def not_ours(con) -> str | None:
    """Why the DuckDB database of `con` is not a mismatch-lab store, or None where it is one: it holds a
    `meta` table recording this SCHEMA_VERSION (what `create_schema` writes first), or no table at all (a
    new file). Reads the catalog and one row only; writes nothing."""
    rows = con.execute(
        "SELECT table_name, list(column_name) FROM information_schema.columns WHERE table_schema = 'main' "
        "AND table_catalog = current_database() GROUP BY table_name ORDER BY table_name"
    ).fetchall()
    tables = {name: set(cols) for name, cols in rows}
    if not tables:
        return None
    listed = ", ".join(list(tables)[:8]) + (", ..." if len(tables) > 8 else "")
    if not {"key", "value"} <= tables.get("meta", set()):
        return f"it holds tables ({listed}) but no mismatch-lab meta table with a schema_version"
    row = con.execute("SELECT max(value) FROM meta WHERE key = 'schema_version'").fetchone()
    if row[0] is None:
        return f"its meta table records no schema_version (tables: {listed})"
    if str(row[0]) != SCHEMA_VERSION:
        return f"it records schema_version {row[0]}, this mismatch-lab reads and writes {SCHEMA_VERSION}"
    return None


def create_schema(con) -> None:
    """Create every table of the contract if missing and record the schema version."""
    for stmt in DDL:
        con.execute(stmt)
    have = set(con.execute("SELECT table_name, column_name FROM information_schema.columns WHERE table_schema = "
                           "'main' AND table_catalog = current_database()").fetchall())
    for table, cols in COLUMNS.items():  # a store written before an optional column was added gets it (NULL)
        for name, typ, _ in cols:
            if (table, name) not in have:
                con.execute(f"ALTER TABLE {table} ADD COLUMN {name} {typ}")
    con.execute(
        "INSERT INTO meta VALUES ('schema_version', ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
        [SCHEMA_VERSION],
    )
