"""Browsing queries for the app: runs, sequences, one sequence token by token, training steps.

These are look-ups, not analyses: every function takes an open DuckDB connection (from
`mismatch_lab.store.reader.open_store`), runs parameterised SQL and returns a pandas DataFrame.
No torch, no vLLM, no Streamlit.

Definitions used per token (notation of docs/design.md; one row per token and scorer):

    μ = exp(tokens.logp_rollout)          π = exp(scores.logp)
    Δlogp = log π − log μ                 ratio r = π/μ = exp(Δlogp)
    |Δp| = |π − μ|  (binary total variation of the sampled token)
    PPO clip      : r outside [1 − ε_low, 1 + ε_high]  (ε_low = 0.2, ε_high = 0.28, "clip-higher"), in the
                    advantage's direction as the clipped loss acts — A > 0: r > 1 + ε_high;
                    A < 0: r < 1 − ε_low; A = 0: neither (no gradient); A unknown: either side
    DPPO mask     : binary TV outside δ = 0.15 in the advantage's direction —
                    A > 0: π − μ > δ;  A < 0: μ − π > δ;  A = 0: neither;  A unknown: |π − μ| > δ
                    (DPPO, arXiv 2602.04879: an update is blocked only when it would push π further
                    away from μ; without an advantage both directions count)
    Both rules are `definitions.ppo_clip_sql` / `dppo_tv_sql`, the SQL twins of the registry's `grpo` and
    `dppo_binary_tv` (mismatch_lab/corrections; a test checks they agree).
    advantage A   : sequences.advantage; where only a reward is stored, reward − mean reward of the
                    sequences with the same (run_id, step, prompt_id) (GRPO's group baseline), as in
                    `definitions.ADV_SIGNS`. 0 or NULL has no sign.
Thresholds (ε_low, ε_high, δ) come from `mismatch_lab.analysis.definitions`.
    cum. log-ratio: Σ_{j ≤ pos} Δlogp_j, the log of the sequence-level importance ratio up to pos

A score whose `logp` is non-finite is stored as NULL with `nonfinite = true`; its ratio, |Δp| and
mask decisions are NULL (never zero) and the cumulative log-ratio skips it — callers show the count.

Try it:  python -c "from mismatch_lab.store.reader import open_store; from mismatch_lab.analysis import browse;
         print(browse.list_runs(open_store('studies/default')))"
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from mismatch_lab.analysis import definitions as d
from mismatch_lab.analysis.definitions import (
    DELTA_TV,
    EPS_HIGH,
    EPS_LOW,
    rollout_label_sql,
)
from mismatch_lab.analysis.relations import col, table_columns


def token_label(text, token_id) -> str:
    """A token as shown (app and figures): its string quoted, so a leading space or a lone ' ' stays visible;
    by its id where the store holds no text (recorded without a tokenizer); '∅' with neither."""
    if isinstance(text, str):
        return repr(text)
    return f"id {int(token_id)}" if pd.notna(token_id) else "∅"


def _df(con, sql: str, params: list | None = None) -> pd.DataFrame:
    return con.execute(sql, params or []).df()


def list_runs(con) -> pd.DataFrame:
    """One row per run: identity (model, engine, dtypes, weights hash), size and status.

    Columns: run_id, study, kind, status, model, weights_sha256, rollout ('<engine>:<dtype>', the engine
    alone where the dtype is unknown: definitions.rollout_label_sql),
    engine, engine_dtype, scorers (comma-separated), device, created_at, n_sequences, n_tokens,
    n_scores (token × scorer rows), n_nonfinite (scores with a non-finite log π), n_rewarded
    (sequences carrying a reward), steps (distinct training steps; 0 for collect runs).
    """
    reward = col(table_columns(con, "sequences"), "sequences", "reward", "DOUBLE")
    return _df(
        con,
        f"""
        WITH t AS (SELECT run_id, count(*) AS n_tokens FROM tokens GROUP BY run_id),
             q AS (SELECT run_id, count(*) AS n_sequences, count({reward}) AS n_rewarded,
                          count(DISTINCT step) AS steps
                   FROM sequences GROUP BY run_id),
             s AS (SELECT run_id, scorer, count(*) AS n, count(*) FILTER (WHERE nonfinite) AS n_nonfinite
                   FROM scores GROUP BY run_id, scorer),
             sa AS (SELECT run_id, string_agg(scorer, ', ' ORDER BY scorer) AS scorers,
                           sum(n)::BIGINT AS n_scores, sum(n_nonfinite)::BIGINT AS n_nonfinite
                    FROM s GROUP BY run_id)
        SELECT r.run_id, r.study, r.kind, r.status, r.model, r.weights_sha256,
               {rollout_label_sql("r")} AS rollout, r.engine, r.engine_dtype,
               coalesce(sa.scorers, '') AS scorers, r.device, r.created_at,
               coalesce(q.n_sequences, 0) AS n_sequences, coalesce(t.n_tokens, 0) AS n_tokens,
               coalesce(sa.n_scores, 0) AS n_scores, coalesce(sa.n_nonfinite, 0) AS n_nonfinite,
               coalesce(q.n_rewarded, 0) AS n_rewarded, coalesce(q.steps, 0) AS steps
        FROM runs r
        LEFT JOIN t USING (run_id) LEFT JOIN q USING (run_id) LEFT JOIN sa USING (run_id)
        ORDER BY r.created_at, r.run_id
        """,
    )


def list_pairs(con) -> pd.DataFrame:
    """The (rollout, scorer) pairs present in the store, e.g. ('vllm:bf16', 'hf:fp32'), with token counts."""
    return _df(
        con,
        f"""
        SELECT {rollout_label_sql("r")} AS rollout, s.scorer, sum(s.n)::BIGINT AS n_tokens
        FROM (SELECT run_id, scorer, count(*) AS n FROM scores GROUP BY run_id, scorer) s
        JOIN runs r USING (run_id)
        GROUP BY ALL ORDER BY rollout, scorer
        """,
    )


def list_categories(con) -> list[str]:
    """Token categories present in the store (see mismatch_lab.categories), sorted; a token without one
    (a store recorded without a tokenizer) counts as 'uncategorized', as in the analyses."""
    category = col(table_columns(con, "tokens"), "tokens", "category", "VARCHAR")
    return _df(con, f"SELECT DISTINCT coalesce({category}, 'uncategorized') AS category FROM tokens ORDER BY 1")[
        "category"
    ].tolist()


def list_sequences(con, run_id: str, *, step: int | None = None) -> pd.DataFrame:
    """Sequences of one run (optionally of one training step), ordered by seq_id.

    Columns: seq_id, prompt_id, sample_idx, step, response_len, finish_reason, reward, advantage.
    """
    where, params = "run_id = ?", [run_id]
    if step is not None:
        where += " AND step = ?"
        params.append(int(step))
    return _df(con, sequences_sql(con, where, ["seq_id"]), params)


def sequences_sql(con, where: str, keys: list[str]) -> str:
    """`list_sequences`' query: `keys` (ordered by) and SEQUENCE_COLUMNS of the sequences WHERE `where`."""
    return (f"SELECT {', '.join(keys)}, {_sequence_columns(con, 'sequences')} FROM sequences WHERE {where} "
            f"ORDER BY {', '.join(keys)}")


SEQUENCE_COLUMNS = (("prompt_id", "VARCHAR"), ("sample_idx", "INTEGER"), ("step", "INTEGER"),
                    ("response_len", "INTEGER"), ("finish_reason", "VARCHAR"), ("reward", "DOUBLE"),
                    ("advantage", "DOUBLE"))  # fmt: skip


def _sequence_columns(con, alias: str) -> str:
    """SELECT-list of SEQUENCE_COLUMNS; the ones a store lacks (recorded or imported runs) read as NULL."""
    have = table_columns(con, "sequences")
    return ", ".join(f"{col(have, alias, name, kind)} AS {name}" for name, kind in SEQUENCE_COLUMNS)


def worst_sequences(con, *, run_id: str | None = None, scorer: str | None = None, n: int = 20) -> pd.DataFrame:
    """The n sequences with the largest max |Δp| = max_pos |π − μ| over their tokens (sequences with no
    finite row are not listed).

    The maximum is taken over every scorer unless `scorer` is given; `worst_scorer` and `worst_pos`
    say where it occurs. Non-finite scores do not count (their |Δp| is NULL); `n_nonfinite` counts them.
    Columns: run_id, seq_id, max_abs_dp, worst_scorer, worst_pos, mean_abs_dp, n_tokens, n_nonfinite.
    """
    t_where, s_where, params_t, params_s = [], [], [], []
    if run_id is not None:
        t_where.append("run_id = ?")
        params_t.append(run_id)
        s_where.append("run_id = ?")
        params_s.append(run_id)
    if scorer is not None:
        s_where.append("scorer = ?")
        params_s.append(scorer)
    tw = ("WHERE " + " AND ".join(t_where)) if t_where else ""
    sw = ("WHERE " + " AND ".join(s_where)) if s_where else ""
    return _df(
        con,
        f"""
        WITH t AS (SELECT run_id, seq_id, pos, logp_rollout FROM tokens {tw}),
             s AS (SELECT run_id, seq_id, pos, scorer, logp, nonfinite FROM scores {sw}),
             d AS (SELECT t.run_id, t.seq_id, t.pos, s.scorer, s.nonfinite,
                          abs(exp(s.logp) - exp(t.logp_rollout)) AS abs_dp
                   FROM t JOIN s ON t.run_id = s.run_id AND t.seq_id = s.seq_id AND t.pos = s.pos)
        SELECT run_id, seq_id, max(abs_dp) AS max_abs_dp,
               arg_max(scorer, abs_dp) AS worst_scorer, arg_max(pos, abs_dp) AS worst_pos,
               avg(abs_dp) AS mean_abs_dp, count(DISTINCT pos) AS n_tokens,
               count(*) FILTER (WHERE nonfinite) AS n_nonfinite
        FROM d GROUP BY run_id, seq_id
        HAVING max(abs_dp) IS NOT NULL  -- a sequence without a finite row has no |Δp| to rank by
        ORDER BY max_abs_dp DESC, run_id, seq_id
        LIMIT ?
        """,
        params_t + params_s + [int(n)],
    )


def sequence_scorers(con, run_id: str) -> list[str]:
    """Scorers that scored tokens of this run, sorted."""
    return _df(con, "SELECT DISTINCT scorer FROM scores WHERE run_id = ? ORDER BY 1", [run_id])["scorer"].tolist()


def sequence_tokens(
    con,
    run_id: str,
    seq_id: int,
    *,
    eps_low: float = EPS_LOW,
    eps_high: float = EPS_HIGH,
    delta: float = DELTA_TV,
) -> pd.DataFrame:
    """Every token of one sequence with μ, and π / ratio / masks for every scorer (module docstring).

    One row per (token, scorer), ordered by scorer then pos; a token that no scorer scored appears once
    with scorer NULL. Columns: pos, token_id, token_text, category, logp_rollout, mu, scorer, logp, pi,
    entropy, nonfinite, tv_exact_vs_ref, kl_exact_vs_ref, delta_logp, ratio, abs_dp, advantage,
    ppo_clipped, dppo_masked, cum_log_ratio.
    """
    # Optional columns read as NULL where a store (a partial Parquet export, a recorded or imported run
    # holding only the required columns) lacks them; a token without a category is 'uncategorized'.
    sc, tc = table_columns(con, "scores"), table_columns(con, "tokens")
    optional = ", ".join(
        f"{col(sc, 'scores', name, kind)} AS {name}"
        for name, kind in (("entropy", "DOUBLE"), ("tv_exact_vs_ref", "DOUBLE"), ("kl_exact_vs_ref", "DOUBLE"))
    )
    nonfinite = col(sc, "scores", "nonfinite", "BOOLEAN")
    seqs = f"(SELECT run_id, seq_id, {_sequence_columns(con, 'sequences')} FROM sequences)"
    return _df(
        con,
        f"""
        WITH t AS (SELECT pos, {col(tc, 'tokens', 'token_id', 'INTEGER')} AS token_id,
                          {col(tc, 'tokens', 'token_text', 'VARCHAR')} AS token_text,
                          coalesce({col(tc, 'tokens', 'category', 'VARCHAR')}, 'uncategorized') AS category,
                          logp_rollout
                   FROM tokens WHERE run_id = ? AND seq_id = ?),
             s AS (SELECT pos, scorer, logp, coalesce({nonfinite}, false) AS nonfinite, {optional}
                   FROM scores WHERE run_id = ? AND seq_id = ?),
             g AS (SELECT seq_id, {d.group_advantage_sql("advantage", "reward", "step, prompt_id")} AS advantage
                   FROM {seqs}
                   WHERE run_id = ? AND (step, prompt_id) IS NOT DISTINCT FROM
                         (SELECT (step, prompt_id) FROM {seqs} WHERE run_id = ? AND seq_id = ?)),
             a AS (SELECT max(advantage) AS advantage FROM g WHERE seq_id = ?),
             j AS (SELECT t.pos, t.token_id, t.token_text, t.category, t.logp_rollout,
                          exp(t.logp_rollout) AS mu, s.scorer, s.logp, exp(s.logp) AS pi, s.entropy,
                          s.nonfinite, s.tv_exact_vs_ref, s.kl_exact_vs_ref,
                          s.logp - t.logp_rollout AS delta_logp, a.advantage
                   FROM t LEFT JOIN s ON t.pos = s.pos CROSS JOIN a)
        SELECT *, exp(delta_logp) AS ratio, abs(pi - mu) AS abs_dp,
               {d.ppo_clip_sql("advantage", "exp(delta_logp)", eps_low, eps_high)} AS ppo_clipped,
               {d.dppo_tv_sql("advantage", "pi", "mu", delta)} AS dppo_masked,
               sum(delta_logp) OVER (PARTITION BY scorer ORDER BY pos
                                     ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS cum_log_ratio
        FROM j ORDER BY scorer NULLS LAST, pos
        """,
        [run_id, int(seq_id)] * 2
        + [run_id, run_id, int(seq_id), int(seq_id)],
    )


def token_topk(con, run_id: str, seq_id: int, pos: int) -> pd.DataFrame:
    """The top-K lists stored for one token, long format.

    `list` names whose top-K the row belongs to ('rollout' or a scorer), `by` who gave the
    probability: the rollout's own top-K (list = by = 'rollout'), each scorer's own top-K
    (list = by = scorer) and, when the store has `scores.logps_at_rollout_topk`, each scorer's
    log-prob at the rollout's top-K ids (list = 'rollout', by = scorer).
    Columns: list, by, rank (0 = most likely in that list), token_id, token_text (when the token was
    ever sampled in the store, else NULL), logp, p. Empty when no top-K was stored.
    """
    tc, sc = table_columns(con, "tokens"), table_columns(con, "scores")
    at_rollout = "logps_at_rollout_topk" in sc
    rows: list[tuple] = []
    t = con.execute(
        f"SELECT {col(tc, 'tokens', 'topk_ids_rollout', 'INTEGER[]')}, "
        f"{col(tc, 'tokens', 'topk_logps_rollout', 'DOUBLE[]')} "
        "FROM tokens WHERE run_id = ? AND seq_id = ? AND pos = ?",
        [run_id, int(seq_id), int(pos)],
    ).fetchone()
    rollout_ids = (t[0] if t else None) or []
    if t and t[0] is not None and t[1] is not None:
        rows += [("rollout", "rollout", k, i, lp) for k, (i, lp) in enumerate(zip(t[0], t[1]))]
    extra = ", logps_at_rollout_topk" if at_rollout else ""
    for rec in con.execute(
        f"SELECT scorer, {col(sc, 'scores', 'topk_ids', 'INTEGER[]')}, {col(sc, 'scores', 'topk_logps', 'DOUBLE[]')}"
        f"{extra} FROM scores WHERE run_id = ? AND seq_id = ? AND pos = ? "
        "ORDER BY scorer",
        [run_id, int(seq_id), int(pos)],
    ).fetchall():
        scorer, ids, logps = rec[0], rec[1], rec[2]
        if ids is not None and logps is not None:
            rows += [(scorer, scorer, k, i, lp) for k, (i, lp) in enumerate(zip(ids, logps))]
        if at_rollout and rec[3] is not None and rollout_ids:
            rows += [("rollout", scorer, k, i, lp) for k, (i, lp) in enumerate(zip(rollout_ids, rec[3]))]
    out = pd.DataFrame(rows, columns=["list", "by", "rank", "token_id", "logp"])
    if out.empty:
        return out.assign(token_text=pd.Series(dtype=object), p=pd.Series(dtype=float))[
            ["list", "by", "rank", "token_id", "token_text", "logp", "p"]
        ]
    # Token texts come from sampled tokens: the store has no vocabulary table.
    texts = _df(
        con,
        f"SELECT token_id, any_value({col(tc, 'tokens', 'token_text', 'VARCHAR')}) AS token_text FROM tokens "
        "WHERE token_id IN (SELECT unnest(?::INTEGER[])) GROUP BY token_id",
        [sorted({int(i) for i in out["token_id"]})],
    )
    out = out.merge(texts, on="token_id", how="left")
    out["logp"] = out["logp"].astype(float)  # None (non-finite) becomes NaN, shown as empty
    out["p"] = np.exp(out["logp"])
    return out[["list", "by", "rank", "token_id", "token_text", "logp", "p"]]


def train_runs(con) -> pd.DataFrame:
    """Runs over training steps with their objective (the loss named in the run's config, else the run id),
    model and rollout: `train` runs, and every other run whose sequences carry a step (a run recorded in,
    or imported from, a user's RL framework).

    Columns: run_id, kind, objective, status, model, rollout, created_at, steps, n_sequences.
    """
    return _df(
        con,
        f"""
        SELECT r.run_id, r.kind,
               coalesce(json_extract_string(r.config, '$.loss'), json_extract_string(r.config, '$.objective'),
                        json_extract_string(r.config, '$.train.loss'), r.run_id) AS objective,
               r.status, r.model, {rollout_label_sql("r")} AS rollout, r.created_at,
               count(DISTINCT q.step) AS steps, count(q.seq_id) AS n_sequences
        FROM runs r LEFT JOIN sequences q ON q.run_id = r.run_id
        WHERE r.kind = 'train' OR r.run_id IN (SELECT run_id FROM sequences WHERE step IS NOT NULL)
        GROUP BY ALL ORDER BY r.created_at, r.run_id
        """,
    )


def training_steps(con, run_id: str) -> pd.DataFrame:
    """Per training step of one run: sequence and token counts, reward mean (NULL without rewards).

    Columns: step, n_sequences, n_tokens (sum of response_len), n_rewarded, mean_reward, mean_advantage.
    """
    return _df(con, training_steps_sql(con, "run_id = ?", ["step"]), [run_id])


def training_steps_sql(con, where: str, keys: list[str]) -> str:
    """`training_steps`' query, grouped by `keys` (step, and run_id for every run at once)."""
    by = ", ".join(keys)
    return f"""
        SELECT {by}, count(*) AS n_sequences, sum(response_len)::BIGINT AS n_tokens, count(reward) AS n_rewarded,
               avg(reward) AS mean_reward, avg(advantage) AS mean_advantage
        FROM (SELECT run_id, {_sequence_columns(con, 'sequences')} FROM sequences) WHERE {where} AND step IS NOT NULL
        GROUP BY {by} ORDER BY {by}"""


def train_metric_names(con, run_ids: list[str] | None = None) -> list[str]:
    """Distinct `train_metrics.name`s (slash paths ending in the reduction), optionally of some runs."""
    if run_ids:
        return _df(
            con, "SELECT DISTINCT name FROM train_metrics WHERE list_contains(?, run_id) ORDER BY 1", [list(run_ids)]
        )["name"].tolist()
    return _df(con, "SELECT DISTINCT name FROM train_metrics ORDER BY 1")["name"].tolist()


def study_dir(path: str | Path) -> Path:
    """The study folder of a store path: the folder itself, the parent of `results/`, or of a `.duckdb` file."""
    p = Path(path)
    if p.is_file() or p.name == "results":
        return p.parent
    return p


def study_figures(path: str | Path) -> list[Path]:
    """PNG figures of the study holding this store (`studies/<name>/figures/*.png`), sorted by name."""
    return sorted((study_dir(path) / "figures").glob("*.png"))


def find_stores(root: str | Path) -> list[Path]:
    """Stores in the study folders under `root`: each folder with a `results/` of Parquet files, and each
    `.duckdb` file in a study folder (the live store a collect writes), sorted."""
    root = Path(root)
    if not root.is_dir():
        return []
    found: list[Path] = []
    for study in sorted(p for p in root.iterdir() if p.is_dir()):
        if any((study / "results").glob("*.parquet")) or any((study / "results").glob("*/**/*.parquet")):
            found.append(study)
        found += sorted(study.glob("*.duckdb"))
    return found
