"""Figure 7, batch invariance of the collect runs, and the run comparisons `doctor` reuses from it."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import duckdb
import numpy as np
import pandas as pd

from mismatch_lab.analysis import definitions as d
from mismatch_lab.analysis.relations import query
from mismatch_lab.analysis.rows import Rows
from mismatch_lab.scoring.hf_scorer import SCORE_BATCH_TOKENS, SCORE_CHUNK_ROWS

if TYPE_CHECKING:  # matplotlib only where a figure is drawn: `doctor` reads the run comparisons in a light install
    from matplotlib.figure import Figure

# -- 7: batch invariance ---------------------------------------------------------------------------
DEFAULT_SCORER_SETTING = (SCORE_BATCH_TOKENS, SCORE_CHUNK_ROWS)  # the scorer's defaults: padded tokens per forward, rows per vocab chunk


def batch_settings(config) -> tuple[int | None, tuple[int, int]]:
    """(generation batch size, (scorer batch tokens, scorer vocab chunk rows)) of a collect run's config;
    a generation batch of 0 means the whole chunk (chunk_prompts x samples requests per engine call)."""
    try:
        cfg = json.loads(config) if isinstance(config, str) else (config or {})
    except ValueError:
        cfg = {}
    cfg = cfg if isinstance(cfg, dict) else {}
    scorer = cfg.get("scorer") if isinstance(cfg.get("scorer"), dict) else {}
    setting = (int(scorer.get("batch_tokens", cfg.get("score_batch_tokens", DEFAULT_SCORER_SETTING[0]))),
               int(scorer.get("chunk_rows", cfg.get("score_chunk_rows", DEFAULT_SCORER_SETTING[1]))))
    v = cfg.get("gen_batch")
    if v is None:
        return None, setting
    v = int(v)
    if v == 0:
        cp, sm = cfg.get("chunk_prompts"), cfg.get("samples")
        v = int(cp) * int(sm) if cp and sm else 0
    return v, setting


SETTING_KEYS = ("gen_batch", "chunk_prompts", "score_batch_tokens", "score_chunk_rows")
"""Config keys a batch-invariance comparison varies (with the scorer's batch_tokens / chunk_rows);
chunk_prompts too: with gen_batch 0 it is the batch size (chunk_prompts × samples), and it schedules
requests without changing prompts or their seeds."""


def _comparable(config, model) -> str:
    """What must be equal for two collect runs to be compared: their config without the batch settings,
    and their model. Runs differing in anything else (seed, temperature, prompts, model) differ for
    reasons batching has nothing to do with."""
    try:
        cfg = json.loads(config) if isinstance(config, str) else dict(config or {})
    except ValueError:
        cfg = {}
    cfg = {k: v for k, v in (cfg if isinstance(cfg, dict) else {}).items() if k not in SETTING_KEYS}
    cfg.setdefault("scorer", None)
    if isinstance(cfg.get("scorer"), dict):  # an empty remainder is as good as no scorer entry
        cfg["scorer"] = {k: v for k, v in cfg["scorer"].items() if k not in ("batch_tokens", "chunk_rows")} or None
    return json.dumps([cfg, model], sort_keys=True, default=str)


def batch_runs(con: duckdb.DuckDBPyConnection) -> pd.DataFrame:
    """The collect runs a batch-invariance comparison may use: run_id, rollout, batch (generation batch),
    setting (scorer batching), default_setting; per rollout only the runs that differ from each other in
    the batch settings alone (`_comparable`; where several such sets exist, the one spanning the most batch
    sizes), default scorer setting first, then by run_id."""
    runs = query(con, f"SELECT run_id, {d.rollout_label_sql(None)} AS rollout, config, model FROM runs "
                      "WHERE kind = 'collect' ORDER BY run_id")
    parsed = [batch_settings(c) for c in runs["config"]]
    runs["batch"] = [b for b, _ in parsed]
    runs["setting"] = [st for _, st in parsed]
    runs["default_setting"] = [st == DEFAULT_SCORER_SETTING for st in runs["setting"]]
    runs["same"] = [_comparable(c, m) for c, m in zip(runs["config"], runs["model"])]
    runs = runs[runs["batch"].notna()]
    if not runs.empty:  # per rollout: the comparable set with the most batch sizes (then settings, then first run)
        spread = runs.groupby(["rollout", "same"]).agg(nb=("batch", "nunique"), ns=("setting", "nunique"),
                                                        first=("run_id", "min")).reset_index()
        best = spread.sort_values(["nb", "ns", "first"], ascending=[False, False, True]).drop_duplicates("rollout")
        runs = runs.merge(best[["rollout", "same"]], on=["rollout", "same"])
    return runs.sort_values(["default_setting", "run_id"], ascending=[False, True]).reset_index(drop=True)


def batch_groups(runs: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """rollout -> one run per generation batch size (the default scorer setting preferred), for rollouts
    measured at two or more batch sizes."""
    per_batch = runs.drop_duplicates(["rollout", "batch"]).sort_values(["batch", "run_id"])
    return {r: g for r, g in per_batch.groupby("rollout") if g["batch"].nunique() > 1}


# token pairs of two runs on the same (prompt_id, sample_idx), kept up to the first differing token
_SHARED_PREFIX = """
    common AS (SELECT prompt_id, sample_idx FROM sequences WHERE run_id = $a
               INTERSECT SELECT prompt_id, sample_idx FROM sequences WHERE run_id = $b),
    a AS (SELECT q.prompt_id, q.sample_idx, t.pos, t.token_id, t.logp_rollout
          FROM sequences q JOIN tokens t USING (run_id, seq_id) JOIN common c USING (prompt_id, sample_idx)
          WHERE q.run_id = $a),
    b AS (SELECT q.prompt_id, q.sample_idx, t.pos, t.token_id, t.logp_rollout
          FROM sequences q JOIN tokens t USING (run_id, seq_id) JOIN common c USING (prompt_id, sample_idx)
          WHERE q.run_id = $b),
    j AS (SELECT coalesce(a.prompt_id, b.prompt_id) AS prompt_id, coalesce(a.sample_idx, b.sample_idx) AS sample_idx,
                 coalesce(a.pos, b.pos) AS pos, coalesce(a.token_id = b.token_id, false) AS same,
                 abs(a.logp_rollout - b.logp_rollout) AS adl
          FROM a FULL OUTER JOIN b ON a.prompt_id = b.prompt_id AND a.sample_idx = b.sample_idx AND a.pos = b.pos),
    first_diff AS (SELECT prompt_id, sample_idx, min(pos) FILTER (WHERE NOT same) AS fd, bool_and(same) AS ident
                   FROM j GROUP BY ALL),
    prefix AS (SELECT j.* FROM j JOIN first_diff f USING (prompt_id, sample_idx) WHERE f.fd IS NULL OR j.pos < f.fd)"""


def rollout_batch_rows(con, groups) -> pd.DataFrame:
    found = []
    for rollout, g in groups.items():
        base_run, b0 = g.iloc[0]["run_id"], int(g.iloc[0]["batch"])
        for _, other in g.iloc[1:].iterrows():
            r = query(con, "WITH " + _SHARED_PREFIX + """
                SELECT count(*) AS n_seq, avg(ident::DOUBLE) AS frac_identical,
                       (SELECT avg(adl) FROM prefix WHERE isfinite(adl)) AS abs_dlogp_mean,
                       (SELECT count(*) FROM prefix WHERE isfinite(adl)) AS n_tok
                FROM first_diff""", {"a": base_run, "b": other["run_id"]}).iloc[0]
            if r["n_seq"]:
                found.append({"rollout": rollout, "b0": b0, "batch": int(other["batch"]), **r.to_dict()})
    return pd.DataFrame(found)


def _scorer_batch_rows(con, groups) -> pd.DataFrame:
    found = []
    for (rollout, batch), g in groups.items():
        base = g.iloc[0]
        for _, other in g.iloc[1:].iterrows():
            r = query(con, "WITH " + _SHARED_PREFIX + """,
                sa AS (SELECT q.prompt_id, q.sample_idx, s.pos, s.scorer, s.logp
                       FROM sequences q JOIN scores s USING (run_id, seq_id) WHERE q.run_id = $a),
                sb AS (SELECT q.prompt_id, q.sample_idx, s.pos, s.scorer, s.logp
                       FROM sequences q JOIN scores s USING (run_id, seq_id) WHERE q.run_id = $b)
                SELECT sa.scorer, count(*) AS n_tok, avg(abs(sa.logp - sb.logp)) AS abs_dlogp_mean,
                       max(abs(sa.logp - sb.logp)) AS abs_dlogp_max, avg((sa.logp = sb.logp)::DOUBLE) AS frac_identical
                FROM prefix JOIN sa USING (prompt_id, sample_idx, pos) JOIN sb USING (prompt_id, sample_idx, pos, scorer)
                WHERE isfinite(sa.logp) AND isfinite(sb.logp)
                GROUP BY sa.scorer ORDER BY sa.scorer""", {"a": base["run_id"], "b": other["run_id"]})
            for rec in r.to_dict("records"):
                found.append({"rollout": rollout, "batch": batch, "base": base["setting"], "setting": other["setting"], **rec})
    return pd.DataFrame(found)


def _setting_label(setting: tuple[int, int]) -> str:
    tokens, rows = setting
    return f"{tokens} tok/fwd, {rows} rows/chunk"


def fig7_batch_invariance(con: duckdb.DuckDBPyConnection, rows: Rows | None = None) -> list[tuple[str, Figure]]:
    """Claim (batch invariance, FP16 study / docs/papers.md): the rollout engine's output
    depends on how many requests share a batch — in bf16 more than in fp32 — and the trainer's scores on
    how sequences are batched and chunked. Rollout panels: for runs of the same rollout (engine, dtype) whose
    `runs.config` has a different `gen_batch` (0 = the whole chunk), identical (prompt_id, sample_idx) are
    compared against the smallest batch size: the share of identical token sequences, and mean |Δ log μ| on
    the shared prefix (positions before the first differing token). Scorer panel: runs of one rollout and
    generation batch that differ only in the scorer's batch composition (`scorer.batch_tokens`, padded
    tokens per forward) or vocabulary chunk (`scorer.chunk_rows`), compared per scorer on the shared
    prefix: mean |Δ log π| and the share of bit-identical log π."""
    from mismatch_lab.figures.base import Skip, finish, panel_grid

    runs = batch_runs(con)
    rollout_groups = batch_groups(runs)
    scorer_groups = {k: g.drop_duplicates("setting") for k, g in runs.groupby(["rollout", "batch"])
                     if g["setting"].nunique() > 1}
    if not rollout_groups and not scorer_groups:
        raise Skip("no two collect runs of one rollout differ in gen_batch or scorer batching (no batch-invariance runs)")
    res = rollout_batch_rows(con, rollout_groups) if rollout_groups else pd.DataFrame()
    sres = _scorer_batch_rows(con, scorer_groups) if scorer_groups else pd.DataFrame()
    if res.empty and sres.empty:
        raise Skip("batch-invariance runs share no (prompt_id, sample_idx)")
    n_panels = (2 if not res.empty else 0) + (1 if not sres.empty else 0)
    fig, axes = panel_grid(n_panels, ncols=3, w=3.6, h=3.0, left=0.9)
    parts = []
    if not res.empty:
        parts.append(_rollout_panels(axes[0], axes[1], res))
    if not sres.empty:
        parts.append(_scorer_panel(axes[-1], sres))
    title = "Batch invariance of the rollout engine and the trainer's scorer"
    return [("fig7_batch_invariance", finish(fig, title, " ".join(parts)))]


def _rollout_panels(ax_share, ax_dlogp, res: pd.DataFrame) -> str:
    """Figure 7's rollout panels (identical sequences, |Δ log μ| by batch size); returns their caption."""
    from mismatch_lab.figures.base import DTYPE_COLORS, dtype_of

    axes = [ax_share, ax_dlogp]
    ticks = set()
    for rollout, g in res.groupby("rollout"):
        g = g.sort_values("batch")
        c = DTYPE_COLORS.get(dtype_of(rollout), "k")
        b0 = int(g["b0"].iloc[0])
        lab = f"{rollout} (vs batch {b0})"
        # the reference run against itself: every sequence identical, no difference (drawn hollow)
        xs = [b0, *g["batch"]]
        axes[0].plot(xs, [100.0, *(100 * g["frac_identical"])], "o-", color=c, label=lab)
        axes[1].plot(xs, [0.0, *g["abs_dlogp_mean"].fillna(0)], "o-", color=c, label=lab)
        for ax in axes:
            ax.plot([b0], [100.0 if ax is axes[0] else 0.0], "o", color="white", ms=3)
        ticks.update(xs)
    axes[0].set_ylim(-3, 103)
    axes[0].set_title("identical token sequences", fontsize=9)
    axes[0].set_ylabel("sequences identical to the small-batch run (%)", fontsize=8)
    axes[1].set_title("rollout log-prob difference on the shared prefix", fontsize=9)
    axes[1].set_ylabel("mean |Δ log μ| (nats)", fontsize=8)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(ticks), [str(t) for t in sorted(ticks)])
        ax.minorticks_off()
        ax.set_xlabel("generation batch size (requests per engine call)", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=7)
    return (
        "Rollout panels: the same prompts and per-request seeds generated at different generation batch sizes "
        "(runs.config gen_batch; 0 = the whole chunk of chunk_prompts × samples requests), compared request "
        "by request on (prompt_id, sample_idx) against the run of the smallest batch size of the same rollout: "
        + "; ".join(f"{r.rollout} batch {r.b0} vs {r.batch}: n = {int(r.n_seq):,} sequences, "
                    f"{100 * r.frac_identical:.0f} % identical, mean |Δ log μ| {r.abs_dlogp_mean:.2g} over "
                    f"{int(r.n_tok or 0):,} prefix tokens" for r in res.itertuples())
        + ". |Δ log μ| is averaged over the positions before the first differing token (identical prefixes); "
        "the hollow point is the reference run itself (100 %, 0 by definition).")


def _scorer_panel(ax, sres: pd.DataFrame) -> str:
    """Figure 7's scorer panel (|Δ log π| per scorer setting); returns its caption."""
    from mismatch_lab.figures.base import DTYPE_COLORS, dtype_of, pair_key

    sres = sres.assign(label=[f"{r.rollout} b{r.batch}: {_setting_label(r.setting)}" for r in sres.itertuples()])
    labels = list(dict.fromkeys(sres["label"]))
    scorers = sorted(sres["scorer"].unique(), key=lambda s: pair_key("", s))
    width = 0.8 / len(scorers)
    for k, sc in enumerate(scorers):
        g = sres[sres["scorer"] == sc].set_index("label").reindex(labels)
        xs = np.arange(len(labels)) + (k - (len(scorers) - 1) / 2) * width
        ax.bar(xs, g["abs_dlogp_mean"].fillna(0), width, color=DTYPE_COLORS.get(dtype_of(sc), "k"), label=sc)
        for x, v, ident in zip(xs, g["abs_dlogp_mean"], g["frac_identical"]):
            if pd.notna(v):
                ax.annotate(f"{100 * ident:.0f}% =", (x, v), ha="center", va="bottom", fontsize=6)
    ax.set_xticks(np.arange(len(labels)), [lab.split(": ", 1)[1] for lab in labels], fontsize=6, rotation=15)
    ax.set_title("trainer scores vs scorer batching", fontsize=9)
    ax.set_ylabel("mean |Δ log π| vs default batching (nats)", fontsize=8)
    ax.set_xlabel("scorer setting compared with 8192 tok/fwd, 1024 rows/chunk (setting)", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=7)
    return (
        "Scorer panel: runs of one rollout and generation batch (same sequences) scored with a different "
        "scorer batch composition (padded tokens per forward; 1 = one sequence per forward) or vocabulary "
        "chunk (rows per chunk), compared per scorer on the shared prefix against the default setting "
        "(8192 tokens per forward, 1024 rows per chunk); the label above a bar is the share of bit-identical "
        "log π: " + "; ".join(f"{r.scorer} {r.rollout} b{r.batch} {_setting_label(r.setting)}: n = "
                              f"{int(r.n_tok):,} tokens, {100 * r.frac_identical:.0f} % bit-identical, mean "
                              f"|Δ log π| {r.abs_dlogp_mean:.2g}, max {r.abs_dlogp_max:.2g}"
                              for r in sres.itertuples()) + ".")
