"""The end of a collect run: rewards of prompts with a numeric answer, and the one-screen summary."""

from __future__ import annotations


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
    """The one-screen summary: per (rollout, scorer) pair the key numbers of these runs (the table `analyze`
    prints, analysis/summary.py), the doctor's one-line verdict per pair and what to change (doctor/report.py,
    over the whole store: what `doctor --db` prints), and the next commands, printed so that they run as shown."""
    from mismatch_lab.analysis.precision import precision_table
    from mismatch_lab.analysis.summary import LEGEND, pair_table

    marks = ",".join("?" * len(run_ids))
    n_seq, n_tok = con.execute(f"SELECT count(*), coalesce(sum(response_len), 0) FROM sequences "
                               f"WHERE run_id IN ({marks})", run_ids).fetchone()
    n_skip = con.execute(f"SELECT count(*) FROM skipped_prompts WHERE run_id IN ({marks})", run_ids).fetchone()[0]
    print()
    print(f"study {cfg.study}: {len(run_ids)} run(s), {n_seq:,} sequences, {n_tok:,} generated tokens -> {cfg.db}")
    print(LEGEND)
    print("\n".join(pair_table(precision_table(con, run_ids=run_ids))))
    if n_skip:
        print(f"skipped prompts (longer than the context): {n_skip} (listed in table skipped_prompts)")
    print("\n".join(["", *doctor_lines(con)]))
    print("\n".join(["", *next_lines(cfg.db)]))


MAX_ADVICE = 3
"""The most recommendations the summary names (without their numbers); `doctor` prints every one in full."""


def doctor_lines(con) -> list[str]:
    """The doctor's verdict per pair and its advice, as `doctor` defines them (doctor/report.py)."""
    from mismatch_lab.analysis.summary import WIDTH
    from mismatch_lab.doctor.report import (
        VERDICT_KEY,
        advice_lines,
        diagnose,
        verdict_lines,
    )

    dx = diagnose(con)
    verdicts = verdict_lines(dx)
    if not verdicts:
        return ["doctor: no (rollout, scorer) pair with scored tokens to judge"]
    lines = ["doctor, per pair against the frameworks' published bands (docs/doctor.md):", f"  {VERDICT_KEY}"]
    lines += [f"  {v}" for v in verdicts]
    advice = advice_lines(dx, WIDTH, limit=MAX_ADVICE, because=False)
    return lines + (["what to change (the numbers behind each: `doctor`):", *advice] if advice else [])


NEXT = (("doctor", "--db", "every check, band and source; what to change; a CI gate"),
        ("analyze", "--db", "every analysis (--table NAME, --all, --json FILE)"),
        ("app", "--study", "the app, down to a single token"))
"""The commands the summary ends with: (subcommand, the option naming the store, what it gives)."""


def next_lines(db) -> list[str]:
    """`next:` and one command per line, each runnable as printed from the directory collect ran in: the
    store is named by the DuckDB file itself, which every one of them opens."""
    from mismatch_lab.analysis.summary import command

    cmds = [command(sub, opt, db) for sub, opt, _ in NEXT]
    width = max(map(len, cmds))
    return ["next:", *(f"  {c:<{width}}  # {why}" for c, (_, _, why) in zip(cmds, NEXT))]
