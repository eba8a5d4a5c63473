"""The end of a collect run: rewards of prompts with a numeric answer, and the one-screen summary."""

from __future__ import annotations

from pathlib import Path


def fill_rewards(con, run_ids: list[str], prompts: list[dict]) -> int:
    """Set `sequences.reward` (1/0, last number in the reply vs the prompt's numeric "answer") where unset.

    Prompts without an answer keep reward NULL. Idempotent: runs again on resume and on complete runs.
    Advantages stay NULL for collect runs; the analyses use reward minus the prompt group's mean.
    """
    import pyarrow as pa

    from mismatch_lab.rl.tasks.arithmetic import parse_answer, reward

    answers = {p["id"]: p["answer"] for p in prompts if p.get("answer") is not None
               and parse_answer(str(p["answer"])) is not None}
    if not answers or not run_ids:
        return 0
    marks = ",".join("?" * len(run_ids))
    rows = con.execute(f"SELECT run_id, seq_id, prompt_id, response_text FROM sequences WHERE reward IS NULL "
                       f"AND run_id IN ({marks})", run_ids).fetchall()
    upd = [(r, s, reward(t or "", str(answers[p]))) for r, s, p, t in rows if p in answers]
    if upd:
        tbl = pa.table({"run_id": [u[0] for u in upd], "seq_id": [u[1] for u in upd], "reward": [u[2] for u in upd]})
        con.register("_rewards", tbl)
        con.execute("UPDATE sequences SET reward = _rewards.reward FROM _rewards "
                    "WHERE sequences.run_id = _rewards.run_id AND sequences.seq_id = _rewards.seq_id")
        con.unregister("_rewards")
    return len(upd)


def print_summary(con, run_ids: list[str], cfg) -> None:
    """The one-screen summary: per (rollout, scorer) pair the precision figures of these runs."""
    from mismatch_lab.analysis.precision import precision_table

    df = precision_table(con, run_ids=run_ids)
    cols = {"rollout": "rollout", "scorer": "scorer", "n_tokens": "tokens", "abs_dp_mean": "mean|Δp|",
            "abs_dp_max": "max|Δp|", "abs_dlogp_mean": "mean|Δlogp|", "kl_k3": "KL k3",
            "frac_ratio_outside_clip": "r∉[0.8,1.28]", "n_nonfinite": "non-finite"}
    show = df[[c for c in cols if c in df.columns]].rename(columns=cols)
    n_seq, n_tok = con.execute(
        f"SELECT count(*), coalesce(sum(response_len), 0) FROM sequences WHERE run_id IN ({','.join('?' * len(run_ids))})",
        run_ids).fetchone()
    n_skip = con.execute(
        f"SELECT count(*) FROM skipped_prompts WHERE run_id IN ({','.join('?' * len(run_ids))})", run_ids).fetchone()[0]
    print()
    print(f"study {cfg.study}: {len(run_ids)} run(s), {n_seq} sequences, {n_tok} generated tokens -> {cfg.db}")
    print("per token, sampled token only; Δp = π − μ in probability space, Δlogp = log π − log μ, r = π/μ,")
    print("KL k3 = mean(r − log r − 1) (estimates KL(μ‖π) from samples of μ); non-finite rows counted, excluded from means")
    with _pd_options():
        print(show.to_string(index=False, float_format=lambda x: f"{x:.3g}"))
    if n_skip:
        print(f"skipped prompts (longer than the context): {n_skip} (listed in table skipped_prompts)")
    print(f"next: mismatch-lab analyze --db {cfg.db}   |   mismatch-lab app --study {Path(cfg.db).parent}")


def _pd_options():
    import pandas as pd

    return pd.option_context("display.width", 200, "display.max_columns", 20)
