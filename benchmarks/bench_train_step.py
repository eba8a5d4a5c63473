"""Training-step time split by phase, and the objective's share of a step (DPPO binary / top-K vs GRPO).

    # run the loop for each objective on the same data and print the phase split (fresh DB under benchmarks/out/)
    .venv/bin/python benchmarks/bench_train_step.py --model default --steps 3
    .venv/bin/python benchmarks/bench_train_step.py --model /tmp/tiny --steps 3 --rollout-dtype fp32
    # or read the time/* metrics an existing training store already holds (no compute)
    .venv/bin/python benchmarks/bench_train_step.py --from-db studies/dppo-sanity/dppo-sanity.duckdb

Phases are the loop's own `time/*/seconds` metrics: rollout (vLLM generate), score (trainer forward with
gradients, gathers and policy_loss), loss (policy_loss alone, part of score), update (backward, clip,
AdamW), rescore (no-grad forward for the bad-update metrics), sync (weight push into vLLM), step (wall
time of the whole step including the store write). Medians over steps 2.. (step 1 pays warm-up) when
there are at least two steps. The "share" column is loss / step; "Δstep vs grpo" compares whole steps,
which on a shared 2-core machine is dominated by noise — the loss share is the robust figure.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

PHASES = ("rollout", "score", "loss", "update", "rescore", "sync", "step")
OBJECTIVES = ("grpo", "dppo_binary_tv", "dppo_binary_kl", "dppo_topk_tv")


def phase_table(con, run_ids: list[str] | None = None) -> list[dict]:
    """One dict per train run: objective, steps, median seconds per phase."""
    where = "" if run_ids is None else f"AND r.run_id IN ({','.join('?' * len(run_ids))})"
    rows = con.execute(
        "SELECT r.run_id, json_extract_string(r.config, '$.loss'), m.step, m.name, m.value FROM train_metrics m "
        f"JOIN runs r USING (run_id) WHERE r.kind = 'train' AND m.name LIKE 'time/%' {where} ORDER BY 1, 3",
        run_ids or []).fetchall()
    runs: dict[str, dict] = {}
    for run_id, loss, step, name, value in rows:
        d = runs.setdefault(run_id, {"run_id": run_id, "objective": loss, "per": {}})
        d["per"].setdefault(name.split("/")[1], {})[step] = value
    out = []
    for d in runs.values():
        row = {"run_id": d["run_id"], "objective": d["objective"]}
        for ph in PHASES:
            vals = d["per"].get(ph, {})
            keep = [v for s, v in sorted(vals.items()) if s > 1] or list(vals.values())
            row[ph] = statistics.median(keep) if keep else float("nan")
        row["steps"] = len(d["per"].get("step", {}))
        out.append(row)
    return out


def print_table(rows: list[dict]) -> None:
    base = next((r["step"] for r in rows if r["objective"] == "grpo"), None)
    head = f"{'objective':18s} {'steps':>5s} " + " ".join(f"{p:>8s}" for p in PHASES) + f" {'loss/step':>9s} {'Δstep vs grpo':>13s}"
    print("median seconds per phase")
    print(head)
    for r in rows:
        share = r["loss"] / r["step"] if r["step"] > 0 else float("nan")  # nan when the run predates time/loss
        delta = f"{(r['step'] / base - 1) * 100:+.1f} %" if base else "n/a"
        print(f"{r['objective']:18s} {r['steps']:5d} " + " ".join(f"{r[p]:8.3f}" for p in PHASES)
              + f" {share * 100:8.2f}% {delta:>13s}")


def run_loop(args) -> list[dict]:
    from mismatch_lab.rl.loop import TrainConfig, train

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    db = out / "bench_train_step.duckdb"
    for f in (db, Path(str(db) + ".wal")):
        f.unlink(missing_ok=True)
    run_ids = []
    for loss in args.objectives.split(","):
        cfg = TrainConfig(model=args.model, loss=loss, steps=args.steps, prompts_per_step=args.prompts,
                          samples_per_prompt=args.samples, max_tokens=args.max_tokens, lr=args.lr,
                          rollout_dtype=args.rollout_dtype, trainer_dtype=args.trainer_dtype,
                          checkpoint_every=10_000, db=str(db), out=str(out / "runs"), study="bench", seed=args.seed)
        print(f"running {loss} ...", file=sys.stderr)
        run_ids.append(train(cfg, progress=False))
    from mismatch_lab.store.reader import open_store

    con = open_store(db)
    try:
        return phase_table(con, run_ids)
    finally:
        con.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--from-db", help="read time/* metrics of the train runs in this store instead of running")
    ap.add_argument("--model", default="default")
    ap.add_argument("--objectives", default=",".join(OBJECTIVES))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rollout-dtype", default="bf16")
    ap.add_argument("--trainer-dtype", default="fp32")
    ap.add_argument("--out", default="benchmarks/out/train_step")
    args = ap.parse_args(argv)
    if args.from_db:
        from mismatch_lab.store.reader import open_store

        con = open_store(args.from_db)  # reads a snapshot when a training run still holds the file
        try:
            rows = phase_table(con)
        finally:
            con.close()
    else:
        rows = run_loop(args)
    if not rows:
        print("no train runs with time/* metrics found")
        return 1
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
