"""A deterministic sample of a store's prompt groups, as views on a DuckDB cursor: what the app's Corrections
page and doctor's dropped-sequence shares read when a store is too large to compare every token at once.

A prompt group is (run, step, prompt id): the partition of the derived group advantage, so a sample that keeps
whole groups changes no sequence's advantage, and a per-sequence rule (geo_mis, seq_mis, ...) decides each kept
sequence exactly as on the whole store. The sample keeps the groups whose hash falls in 1 of `every`.
"""

from __future__ import annotations

import math

SAMPLE_TOKENS = 50_000
"""Tokens a sample aims at: every method of the corrections registry on 1 M tokens and 3 pairs costs ~50 CPU
seconds on a 2-core EPYC; on a sample of this size about 1 s per pair."""


def sampled(cur, every: int, pair: tuple[str, str] | None = None):
    """`cur` with temporary views `sequences`, `tokens`, `scores` that keep the prompt groups whose hash falls
    in 1 of `every`, with all their sequences, tokens and scores; with `pair` (rollout, scorer) also `runs` and
    `scores` of that pair only. The views live with the cursor (use a fresh cursor per sample)."""
    from mismatch_lab.store.schema import rollout_label_sql

    db = cur.execute("SELECT current_database()").fetchone()[0].replace('"', '""')
    key = group_key_sql(cur)
    cur.execute(f'CREATE TEMP VIEW sequences AS SELECT q.* FROM "{db}".main.sequences q WHERE {key} % {int(every)} = 0')
    rollout, scorer = ("'" + str(x).replace("'", "''") + "'" for x in pair) if pair else (None, None)  # SQL literals
    for table in ("tokens", "scores"):
        only = f" WHERE x.scorer = {scorer}" if table == "scores" and pair else ""
        cur.execute(f'CREATE TEMP VIEW {table} AS SELECT x.* FROM "{db}".main.{table} x '
                    f"SEMI JOIN sequences q ON q.run_id = x.run_id AND q.seq_id = x.seq_id{only}")
    if pair:
        cur.execute(f'CREATE TEMP VIEW runs AS SELECT runs.* FROM "{db}".main.runs runs '
                    f"WHERE {rollout_label_sql('runs')} = {rollout}")
    return cur


def group_key_sql(cur) -> str:
    """SQL: the hash of a sequence's (alias q) prompt group, (run_id, step, prompt_id); `sampled` keeps the groups
    whose hash is 0 modulo its stride."""
    from mismatch_lab.analysis.relations import col, table_columns

    qc = table_columns(cur, "sequences")
    return f"hash(q.run_id, {col(qc, 'q', 'step', 'INTEGER')}, {col(qc, 'q', 'prompt_id', 'VARCHAR')})"


def sample_size(con) -> dict:
    """Sequences and tokens on `con` (the whole store, or a sample of `sampled`)."""
    n_seqs, n_tokens = con.execute("SELECT (SELECT count(*) FROM sequences), (SELECT count(*) FROM tokens)").fetchone()
    return {"sequences": int(n_seqs), "tokens": int(n_tokens)}


def stride(n_tokens: int, target: int = SAMPLE_TOKENS) -> int:
    """1 for a store of at most `target` tokens, else the sampling stride of its prompt groups."""
    return max(1, math.ceil(n_tokens / target))
