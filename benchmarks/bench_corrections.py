"""Benchmark: `mismatch-lab corrections` (every method of the registry) on a store of N tokens.

    .venv/bin/python benchmarks/bench_corrections.py --tokens 10000000

The store is the analyses' benchmark store (mismatch_lab.store.synthetic.build_benchmark_store: two collect
runs, three (rollout, scorer) pairs, so ~1.5 N scored rows; sequence lengths uniform on [1, 1023]; top-K of
5; rewards without advantages, so the group baseline is computed), written once to
benchmarks/out/corrections-<N>.duckdb (git-ignored) and reused. The comparison runs in a fresh subprocess
that reports wall seconds, rows and its peak RSS (getrusage ru_maxrss); `--chunk-tokens` bounds memory.
Target (issue): all methods on 10 M tokens in under 60 s with bounded memory. The CPU model and the load
average are printed next to the figures.
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


def child(path: str, chunk_tokens: int) -> None:
    from mismatch_lab.corrections.compare import compare, variants
    from mismatch_lab.store.reader import open_store

    con = open_store(path)
    t0 = time.perf_counter()
    tables = compare(con, chunk_tokens=chunk_tokens)
    seconds = time.perf_counter() - t0
    main = tables["corrections"]
    rows = int(main.groupby(["rollout", "scorer"])["n_tokens"].max().sum())
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"seconds": seconds, "cpu_seconds": usage.ru_utime + usage.ru_stime, "rows": rows,
                      "methods": len(variants()), "pairs": int(main.rollout.size // len(variants())),
                      "peak_rss_gib": usage.ru_maxrss / 2**20}))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=10_000_000)
    ap.add_argument("--chunk-tokens", type=int, default=1 << 20)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child, args.chunk_tokens)
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_analyze_record import cpu_model

    from mismatch_lab.store.synthetic import build_benchmark_store

    OUT.mkdir(exist_ok=True)
    path = OUT / f"corrections-{args.tokens}.duckdb"
    if not path.exists():
        t0 = time.perf_counter()
        build_benchmark_store(path, args.tokens)
        print(f"built {path} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    proc = subprocess.run([sys.executable, __file__, "--child", str(path), "--chunk-tokens", str(args.chunk_tokens)],
                          capture_output=True, text=True, check=True)
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"CPU: {cpu_model()}; load average (1 min) at the end: {os.getloadavg()[0]:.1f} "
          "(other processes share the cores: the CPU seconds bound what an idle machine needs)")
    print(f"corrections on {args.tokens:,} tokens ({r['rows']:,} (token, scorer) rows, {r['pairs']} pairs, "
          f"{r['methods']} methods, chunks of {args.chunk_tokens:,} tokens): {r['seconds']:.1f} s wall, "
          f"{r['cpu_seconds']:.1f} CPU s (whole process), "
          f"peak RSS {r['peak_rss_gib']:.2f} GiB  (target: under 60 s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
