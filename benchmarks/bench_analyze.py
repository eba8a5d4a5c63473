"""Benchmark: the whole `analyze` (run_all) on a synthetic store of 10 million tokens, three pairs.

    .venv/bin/python benchmarks/bench_analyze.py                 # build (once, ~2 min) and measure
    .venv/bin/python benchmarks/bench_analyze.py --tokens 1000000 --repeat 3

The store (`build_benchmark_store`: vllm:bf16 scored by hf:fp32 and hf:bf16, vllm:fp16 by hf:fp32,
top-K of 5, exact TV on the hf:bf16 rows, rewards, a training run's metrics) is written once to
benchmarks/out/ (git-ignored) and reused. Each measurement runs in a fresh subprocess, so neither the
build nor an earlier repeat counts: it opens the store with `open_store`, times `run_all` and the JSON
document `analyze --json` writes, and reports wall seconds and the peak RSS of that process
(getrusage ru_maxrss). Targets on the 2-core development machine: under 60 s and under 4 GiB. The
machine is shared, so the load average before and after each run is printed next to the figures.
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
TARGET_S, TARGET_GIB = 60.0, 4.0


def measure(store: str) -> dict:
    """In this process: open, analyse, serialise; return the figures."""
    from mismatch_lab.analysis import run_all
    from mismatch_lab.analysis.command import to_json
    from mismatch_lab.store.reader import open_store

    t0 = time.perf_counter()
    con = open_store(store)
    steps = {}
    tables = run_all(con, progress=lambda name, s: steps.__setitem__(name, round(s, 2)))
    t_run_all = time.perf_counter() - t0
    doc = json.dumps(to_json(tables), allow_nan=False)
    wall = time.perf_counter() - t0
    rows = {k: len(v) for k, v in tables.items()}
    n_tokens = con.execute("SELECT count(*) FROM tokens").fetchone()[0]
    n_scores = con.execute("SELECT count(*) FROM scores").fetchone()[0]
    return {
        "tokens": n_tokens, "score_rows": n_scores, "run_all_s": round(t_run_all, 2), "analyze_s": round(wall, 2),
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
        "steps_s": steps, "rows": rows, "json_bytes": len(doc),
    }  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=10_000_000)
    p.add_argument("--topk", type=int, default=5, help="K of the stored top-K lists (default 5)")
    p.add_argument("--repeat", type=int, default=1, help="measurements, each in a fresh process")
    p.add_argument("--store", help="use this store instead of benchmarks/out/bench-<tokens>-k<topk>.duckdb")
    p.add_argument("--measure", metavar="STORE", help=argparse.SUPPRESS)  # the child's entry point
    args = p.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure)))
        return 0

    store = Path(args.store) if args.store else OUT / f"bench-{args.tokens}-k{args.topk}.duckdb"
    if not store.exists():
        from mismatch_lab.store.synthetic import build_benchmark_store

        store.parent.mkdir(parents=True, exist_ok=True)
        print(f"building {store} ({args.tokens:,} tokens, top-K {args.topk}) ...", flush=True)
        t0 = time.perf_counter()
        build_benchmark_store(store, args.tokens, topk=args.topk)
        print(f"built in {time.perf_counter() - t0:.0f} s ({store.stat().st_size / 2**30:.2f} GiB on disk)", flush=True)
    worst = 0.0
    for i in range(args.repeat):
        load0 = os.getloadavg()[0]
        child = subprocess.run([sys.executable, __file__, "--measure", str(store)], capture_output=True, text=True, check=False)
        if child.returncode != 0:
            print(child.stderr, file=sys.stderr)
            return child.returncode
        r = json.loads(child.stdout.strip().splitlines()[-1])
        load1 = os.getloadavg()[0]
        worst = max(worst, r["analyze_s"])
        print(
            f"run {i + 1}: {r['tokens']:,} tokens, {r['score_rows']:,} score rows: run_all {r['run_all_s']:.1f} s, "
            f"analyze incl. JSON {r['analyze_s']:.1f} s, peak RSS {r['peak_rss_gib']:.2f} GiB "
            f"(load average {load0:.1f} -> {load1:.1f}; {os.cpu_count()} CPUs)\n  cumulative s: {r['steps_s']}",
            flush=True,
        )
        ok = r["analyze_s"] < TARGET_S and r["peak_rss_gib"] < TARGET_GIB
        print(f"  target < {TARGET_S:.0f} s and < {TARGET_GIB:.0f} GiB: {'met' if ok else 'MISSED'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
