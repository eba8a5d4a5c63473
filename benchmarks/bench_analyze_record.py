"""Benchmark: `analyze` on a recorded run of N tokens (a shard store written through the Recorder), against
a single-pass DuckDB aggregate over the same joined rows, measured in the same run.

    .venv/bin/python benchmarks/bench_analyze_record.py --tokens 10000000       # ~10 M: ratio to one pass
    .venv/bin/python benchmarks/bench_analyze_record.py --tokens 100000000      # 100 M: time and peak RSS

The store is a synthetic recorded GRPO-like run (two ranks, steps of 64 sequences x 1024 response tokens
per rank, log mu from a long-tailed distribution, log pi = log mu + noise, per-sequence advantages and
rewards, no top-K / entropy / categories: what a framework's recorder gives) written once to
benchmarks/out/record-<N> (git-ignored) and reused. Each measurement runs in a fresh subprocess and reports
wall seconds, CPU seconds (user + system, all threads: less sensitive than wall time to other processes
on a shared machine) and its peak RSS (getrusage ru_maxrss). The clock starts after the imports (pandas
and the analyses for analyze, ~0.5 s that does not depend on the data; printed) and includes opening
the store:
  * analyze    run_all (every analysis, the per-step series included) + the JSON `analyze --json` writes;
  * one pass   one GROUP BY (rollout, scorer, step) over tokens JOIN scores JOIN sequences computing the
               token means the per-step series reports (mean |dp|, |dlogp|, k3, clipped share): the floor
               for reading every token once, joined as a user would write it (USING run_id, seq_id, pos);
  * one pass-run  the same query joined the way analyze joins the rows of one run (both sides restricted
               to the run, joined on seq_id, pos): the baseline that reads the rows as analyze reads them,
               so the fair one for the ratio (analyze gains nothing from joining differently);
  * one pass-aligned  the same query reading the rows as analyze reads this store: its row-aligned slices
               paired by position (store.aligned), each pair's (seq_id, pos) compared, no hash join of the
               tokens: the cheapest single pass over these rows that we know of;
  * keyjoin    (only with --keyjoin) analyze with the store's aligned slices ignored: tokens and scores
               hash-joined on their keys, as analyze read every store before store.aligned;
  * noquant    (only with --floor) a diagnostic, not a mode of analyze: analyze with the per-bucket
               quantile pass replaced by an empty table (every quantile NaN), i.e. what analyze would
               cost with quantiles for free: a floor for any quantile method on this layout.
  * fused-*    (only with --fused) a diagnostic lower bound for any layout of analyze's passes, not a
               mode of analyze: one statement reading the join once (a MATERIALIZED common table
               expression) and computing from it the grid of sums, the per-sequence sums and the clipped
               rows' token counts (UNION ALL BY NAME), with the per-bucket quantiles of both scales
               exact (quantile_cont: the values analyze computes, by DuckDB's own exact aggregate
               rather than analyze's bracketing), sampled (reservoir_quantile, DuckDB's
               default sample of 8,192 values a group: an approximation analyze does not use) or left
               out; the pandas roll-ups and the JSON that analyze adds (~0.4 s at 10 M) are not counted.
Targets (issue): 100 M tokens under 5 minutes and 8 GiB on 2 cores, memory not growing with the token
count; 10 M tokens within 2x of the one-pass aggregate. The CPU model and load are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out"
B, T = 64, 1024
FUSED = ("fused-exact", "fused-reservoir", "fused-none")
BASES = ("onepass", "onepass-run", "onepass-aligned")
"""The one-pass baselines, each measured in every round (docstring)."""

MEANS = """
    SELECT r.engine AS rollout, s.scorer, q.step, count(*) AS n,
           avg(abs(exp(s.logp) - exp(t.logp_rollout))) AS abs_dp, avg(abs(s.logp - t.logp_rollout)) AS abs_dlogp,
           avg(exp(s.logp - t.logp_rollout) - (s.logp - t.logp_rollout) - 1) AS k3,
           avg(CASE WHEN exp(s.logp - t.logp_rollout) NOT BETWEEN 0.8 AND 1.28 THEN 1.0 ELSE 0.0 END) AS clipped"""
"""The token means both one-pass baselines compute, per (rollout, scorer, step)."""
ONE_PASS = MEANS + """
    FROM tokens t JOIN scores s USING (run_id, seq_id, pos) JOIN sequences q USING (run_id, seq_id)
    JOIN runs r USING (run_id)
    GROUP BY ALL"""
ONE_RUN = MEANS + """
    FROM (FROM tokens WHERE run_id = $run) t JOIN (FROM scores WHERE run_id = $run) s USING (seq_id, pos)
    JOIN (FROM sequences WHERE run_id = $run) q USING (seq_id) JOIN (FROM runs WHERE run_id = $run) r ON true
    GROUP BY ALL"""
"""ONE_PASS as it reads a store of one run joined on keys the way analyze joins a store that offers no
aligned slices (relations._one_run): both sides restricted to the run, joined on (seq_id, pos) without the
run id string."""


def one_aligned(con) -> tuple[str, dict]:
    """ONE_PASS reading the rows as analyze reads a recorded store of one run: the store's row-aligned
    slices (store.aligned) paired by position, each pair's (seq_id, pos) compared, the sequences and the
    runs row joined once."""
    from mismatch_lab.store.aligned import parts

    slices = parts(con)
    assert slices and len({run for run, _, _ in slices}) == 1, "the benchmark's store holds one run"
    pairs = " UNION ALL ".join(
        f"SELECT t.seq_id, t.logp_rollout AS lmu, s.logp AS lpi, s.scorer FROM {ts} t POSITIONAL JOIN {ss} s "
        "WHERE t.seq_id = s.seq_id AND t.pos = s.pos" for _, ts, ss in slices)
    means = MEANS.replace("t.logp_rollout", "p.lmu").replace("s.logp", "p.lpi").replace("s.scorer", "p.scorer")
    return means + f"""
    FROM ({pairs}) p JOIN (FROM sequences WHERE run_id = $run) q USING (seq_id)
    JOIN (FROM runs WHERE run_id = $run) r ON true
    GROUP BY ALL""", {"run": slices[0][0]}


def cpu_model() -> str:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "unknown")
    flags = sorted({f for f in ("avx512_bf16", "avx512_fp16", "amx_bf16") if f in text.split()})
    return f"{name} ({os.cpu_count()} cores; {', '.join(flags) or 'no avx512_bf16/avx512_fp16/amx_bf16'})"


def build(path: Path, n_tokens: int) -> None:
    import numpy as np

    from mismatch_lab.record import Recorder

    steps = max(1, n_tokens // (2 * B * T))
    t0 = time.perf_counter()
    recs = [Recorder(path, "bench", framework="trl", rollout_engine="vllm", trainer_dtype="fp32",
                     rollout_dtype="bf16", rank=r) for r in (0, 1)]
    for step in range(steps):
        for rank, rec in enumerate(recs):
            rng = np.random.default_rng(step * 2 + rank)
            lmu = -rng.exponential(1.0, (B, T)) * (rng.random((B, T)) < 0.5)  # half the tokens near mu = 1
            lpi = np.minimum(lmu + rng.normal(0.0, 0.03, (B, T)), 0.0)
            rewards = (rng.random(B) < 0.4).astype(float)
            rec.log_step(step, rng.integers(0, 49152, (B, T)), np.ones((B, T), bool), lmu, lpi,
                         advantages=rewards - rewards.mean(), rewards=rewards)
        if step % 50 == 0 or step == steps - 1:
            done = (step + 1) * 2 * B * T
            print(f"  built {done:,} tokens ({done / (time.perf_counter() - t0):,.0f} tok/s)", flush=True)
    for rec in recs:
        rec.close()


def cpu_seconds() -> float:
    """User + system CPU seconds of this process (its DuckDB threads included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(store: str, what: str) -> dict:
    t0 = time.perf_counter()
    from mismatch_lab.store.reader import open_store

    if not what.startswith("onepass"):  # imported before the clock starts: pandas and the analyses, a fixed cost
        from mismatch_lab.analysis import run_all
        from mismatch_lab.analysis.command import to_json
    if what == "keyjoin":  # analyze as it was before the aligned slices: tokens and scores joined on keys
        from mismatch_lab.analysis import rows

        rows.aligned_parts = lambda con: []
    if what == "noquant":
        free_quantiles()
    if what.startswith("fused-"):
        from mismatch_lab.analysis.command import to_json  # the same imports as analyze
    imports = time.perf_counter() - t0

    t0, c0 = time.perf_counter(), cpu_seconds()
    con = open_store(store)
    if what.startswith("fused-"):
        rows = con.execute(*fused_sql(con, what.split("-", 1)[1])).fetchall()
        extra = {"groups": len(rows)}
    elif what == "onepass-run":
        (run,) = con.execute("SELECT run_id FROM runs").fetchone()  # the benchmark's store holds one run
        rows = con.execute(ONE_RUN, {"run": run}).fetchall()
        extra = {"groups": len(rows)}
    elif what == "onepass-aligned":  # the build sides as analyze keeps them (rows.WRITE_SETTINGS)
        con.execute("SET disabled_optimizers = 'build_side_probe_side'")
        rows = con.execute(*one_aligned(con)).fetchall()
        extra = {"groups": len(rows)}
    elif what == "onepass":
        rows = con.execute(ONE_PASS).fetchall()
        extra = {"groups": len(rows)}
    else:
        steps = {}
        tables = run_all(con, progress=lambda name, s: steps.__setitem__(name, round(s, 1)))
        json.dumps(to_json(tables), allow_nan=False)
        extra = {"phases": steps}
    seconds, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    con.close()
    return {"seconds": seconds, "cpu_s": cpu, "import_s": imports,
            "peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, **extra}


def free_quantiles() -> None:
    """Replace Rows.quantiles by an empty table of its columns (the --floor diagnostic)."""
    import pandas as pd

    from mismatch_lab.analysis import rows

    names = rows.QUANTILE_COLUMNS

    def empty(self, scale, n_buckets):
        keys = {"rollout": object, "scorer": object, "bucket": "int64"}
        return pd.DataFrame({c: pd.Series(dtype=t) for c, t in (keys | dict.fromkeys(names, float)).items()})

    rows.Rows.quantiles = empty


def fused_sql(con, quantiles: str) -> tuple[str, dict]:
    """The --fused diagnostic's one statement: the rows analyze materialises (the same join or aligned slices, labels, mu
    buckets and constants for the columns the store lacks) as a MATERIALIZED common table expression, and
    the union of analyze's grid of sums, its per-sequence sums, the token counts of the ratio-clipped rows
    and (quantiles 'exact' / 'reservoir' / 'none') the per-bucket quantiles of r and binary TV."""
    from mismatch_lab.analysis import definitions as d
    from mismatch_lab.analysis.relations import (
        STORED_METRICS,
        TOPK_STORED,
        Filters,
        rollout_base,
        table_columns,
        typed_null,
        with_metrics,
    )
    from mismatch_lab.analysis.rows import DEFAULT_BUCKETS, Rows, Thresholds, sums_sql

    rows = Rows(con)  # live: only its enums and the constants of absent columns are used
    from mismatch_lab.store.aligned import parts

    con.execute("SET disabled_optimizers = 'build_side_probe_side'")  # as analyze writes its rows (WRITE_SETTINGS)
    base, params = rollout_base(con, Filters(), topk=False, enums=rows._enums(), aligned=parts(con))  # as analyze reads
    assert not any(k.startswith("f_") for k in params), "the diagnostic reads the whole store (no filters)"
    # the base is read without top-K (topk=False above): its divergences are NULL whatever the store holds
    const = rows._const | {"topk": typed_null("STRUCT(tv DOUBLE, kl DOUBLE)")} | (
        {} if "category" in table_columns(con, "tokens") else {"category": "'uncategorized'"})
    drop = ", ".join([*TOPK_STORED, *(c for c in const if c != "topk")])
    buckets = ", ".join(f"coalesce({d.bucket_sql(s, n)}, -1)::TINYINT AS b_{s}" for s, n in DEFAULT_BUCKETS)
    added = "".join(f", {expr} AS {name}" for name, expr in const.items())
    rel = with_metrics(f"SELECT *{added} FROM j", STORED_METRICS)
    t = Thresholds()
    parts = [
        f"""SELECT 'grid' AS part, rollout, scorer, run_id, step, adv_sign, category, b_linear, b_log,
                   {sums_sql(t, absent=rows._const)} FROM ({rel}) GROUP BY ALL""",
        f"""SELECT 'seq' AS part, rollout, scorer, run_id, seq_id, count(*) AS response_len,
                   count(*) FILTER (WHERE NOT finite) AS n_nonfinite,
                   CASE WHEN bool_and(finite) THEN sum(dlogp) END AS logratio_sum,
                   CASE WHEN bool_and(finite) THEN sum(k1) END AS seq_kl_k1,
                   CASE WHEN bool_and(finite) THEN sum(k3) END AS seq_kl_k3, any_value(adv_sign) AS adv_sign
            FROM ({rel}) GROUP BY rollout, scorer, run_id, seq_id""",
        f"""SELECT 'tok' AS part, rollout, scorer, run_id, token_id, category, {sums_sql(t, ("c_hi", "c_lo"))}
            FROM ({rel}) WHERE r > {t.clip_high!r} OR r < {t.clip_low!r} GROUP BY ALL""",
    ]
    if quantiles != "none":
        agg = {"exact": "quantile_cont", "reservoir": "reservoir_quantile"}[quantiles]
        parts.append(f"""SELECT 'q' AS part, rollout, scorer, b_linear, b_log,
                   {agg}(r, {list(d.RATIO_QUANTILES)}) AS r_q, {agg}(btv, 0.99) AS binary_tv_p99
            FROM ({rel}) GROUP BY GROUPING SETS ((rollout, scorer, b_linear), (rollout, scorer, b_log))""")
    union = " UNION ALL BY NAME ".join(f"({p})" for p in parts)
    return f"WITH j AS MATERIALIZED (SELECT * EXCLUDE ({drop}), {buckets} FROM ({base})) SELECT * FROM {union}", params


def run_child(store: Path, what: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", what, "--store", str(store)], check=False,
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{what} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=10_000_000)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--skip", nargs="*", default=[], choices=["analyze", *BASES])
    ap.add_argument("--keyjoin", action="store_true",
                    help="also run analyze joining tokens and scores on keys, as before the aligned slices")
    ap.add_argument("--floor", action="store_true",
                    help="also run analyze with the quantile pass replaced by an empty table (a diagnostic)")
    ap.add_argument("--fused", action="store_true",
                    help="also run the one-statement lower bound with exact, sampled and no quantiles (a diagnostic)")
    ap.add_argument("--child", choices=["analyze", *BASES, "keyjoin", "noquant", *FUSED], help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.store, args.child)))
        return 0
    store = OUT / f"record-{args.tokens}"
    if not (store / "sequences").is_dir():
        print(f"building {store} ({args.tokens:,} tokens through the Recorder)", flush=True)
        build(store, args.tokens)
    from mismatch_lab.store.reader import open_store

    n = open_store(store).execute("SELECT count(*) FROM tokens").fetchone()[0]
    size = sum(p.stat().st_size for p in store.rglob("*.parquet")) / 2**30
    print(f"store: {n:,} tokens, {size:.2f} GiB of Parquet; CPU: {cpu_model()}")
    for i in range(args.repeat):
        res = {}
        for what in (*BASES, "analyze", *(["keyjoin"] if args.keyjoin else []), *(["noquant"] if args.floor else []),
                     *(FUSED if args.fused else [])):
            if what in args.skip:
                continue
            load = os.getloadavg()[0]
            res[what] = run_child(store, what)
            r = res[what]
            print(f"  [{i + 1}] {what:<8} {r['seconds']:7.2f} s  ({r['cpu_s']:.2f} s CPU)  peak RSS {r['peak_gib']:.2f} GiB  "
                  f"(imports before the clock {r['import_s']:.2f} s; load before {load:.1f}) {r.get('phases', '')}", flush=True)
        for what in ("analyze", "keyjoin", "noquant", *FUSED):
            for base in BASES:
                if what in res and base in res:
                    wall, cpu = (res[what][k] / res[base][k] for k in ("seconds", "cpu_s"))
                    print(f"  [{i + 1}] {what} / {base.replace('onepass', 'one pass')} = {wall:.2f}x wall ({cpu:.2f}x CPU time)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
