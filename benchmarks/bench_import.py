"""Benchmark: `mismatch-lab import prime-rl` of a synthetic prime-rl token export, 10 M response tokens.

    .venv/bin/python benchmarks/bench_import.py                  # 10 M response tokens (2.8 GiB of JSON)
    .venv/bin/python benchmarks/bench_import.py --tokens 1000000 --keep benchmarks/out/import

The export is written the way prime-rl's TokenExporter writes it (schema_version 1, compact JSON, every
field of a line, float32 values as Python floats, prompt positions with loss_mask false and
inference_logprobs 0.0, non-finite values null, one STABLE marker per step): step folders of --ranks rank
files of 256 lines, one sample per line (prompt 256 tokens, response 200-1800 tokens), every 8th line
packing two samples. To write 2.8 GiB quickly, the per-position arrays of a pool of 512 distinct lines
are reused under each line's own header (step, rank, indices): the importer parses every byte of every
line all the same.

The import runs as the real command in a fresh process (`python -m mismatch_lab.cli import prime-rl`),
timed from start to exit: tokens/s and the figure against the goal of 10 M tokens in under 60 s on the
2-core development machine, and the CPU seconds the process used (user + sys of all its threads). The
CPU model (/proc/cpuinfo), the core count and the load average before and after are printed next to
the figures: the machine is shared, and other work on it stretches the wall time, not the CPU time.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

GOAL_S = 60.0
PROMPT = 256
POOL = 512


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def _floats(a: np.ndarray) -> list:
    return [None if not np.isfinite(x) else x for x in a.astype(np.float32).astype(np.float64).tolist()]


def _sample(rng, response: int) -> dict:
    T = PROMPT + response
    mu = np.concatenate([np.zeros(PROMPT), -rng.exponential(0.6, response)])
    pi = mu + np.concatenate([np.zeros(PROMPT), rng.normal(0, 0.02, response)])
    if rng.random() < 0.02:
        pi[PROMPT + int(rng.integers(response))] = np.nan  # a few non-finite values, as null
    adv = np.full(T, rng.normal(), dtype=np.float32)
    reward = float(rng.integers(0, 2))
    mask = [False] * PROMPT + [True] * response
    return {
        "token_ids": rng.integers(0, 151_000, T).tolist(), "position_ids": list(range(T)), "loss_mask": mask,
        "advantages": _floats(adv), "losses": [{"rl": {"advantage": a, "mask": m}} for a, m in zip(_floats(adv), mask)],
        "rewards": [reward] * T, "inference_logprobs": _floats(mu), "trainer_logprobs": _floats(pi),
        "entropy": _floats(rng.exponential(1.0, T)), "mismatch_kl": _floats(rng.normal(0, 1e-3, T)),
        "log_importance_ratio": _floats(pi - mu), "importance_ratio": _floats(np.exp(pi - mu)),
        "prob_delta": _floats(np.exp(pi) - np.exp(mu)),
        "is_masked": [False] * T, "is_masked_high": [False] * T, "is_masked_low": [False] * T,
    }  # fmt: skip


def _pool(rng) -> list[tuple[str, int]]:
    """(the per-position part of a line as JSON text, its response tokens), POOL of them."""
    out = []
    for i in range(POOL):
        parts = [_sample(rng, int(rng.integers(200, 1800))) for _ in range(2 if i % 8 == 7 else 1)]
        cols = {k: [v for p in parts for v in p[k]] for k in parts[0]}
        body = json.dumps(cols, separators=(",", ":"), allow_nan=False)[1:]  # without the opening brace
        out.append((body, sum(cols["loss_mask"])))
    return out


def write_export(out: Path, tokens: int, ranks: int, seed: int = 0) -> tuple[int, int, int]:
    """Write the export under out/token_exports; returns (response tokens, lines, bytes)."""
    rng = np.random.default_rng(seed)
    pool = _pool(rng)
    per_line = sum(n for _, n in pool) / len(pool)
    lines_total = max(ranks, round(tokens / per_line))
    lines_per_file = 256
    files = max(ranks, -(-lines_total // lines_per_file))
    steps = -(-files // ranks)
    written = n_lines = size = 0
    k = 0
    for step in range(steps):
        d = out / "token_exports" / f"step_{step}"
        d.mkdir(parents=True, exist_ok=True)
        for rank in range(ranks):
            with open(d / f"rank_{rank}.jsonl", "w") as fh:
                for idx in range(lines_per_file):
                    if written >= tokens:
                        break
                    body, n = pool[k % len(pool)]
                    k += 1
                    head = (f'{{"schema_version":1,"step":{step},"export_step":{step},"rank":{rank},'
                            f'"micro_step":{idx // 8},"micro_sequence_idx":{idx % 8},"export_sequence_idx":{idx},'
                            f'"run_id":null,"env_name":"bench",')
                    line = head + body + "\n"
                    fh.write(line)
                    written += n
                    n_lines += 1
                    size += len(line)
        (d / "STABLE").touch()
    return written, n_lines, size


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=10_000_000, help="response tokens to export (default 10 M)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--keep", metavar="DIR", help="write the export and the store here and keep them")
    args = p.parse_args()
    base = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-import-"))
    base.mkdir(parents=True, exist_ok=True)
    export, store = base / "prime-out", base / "store"
    shutil.rmtree(store, ignore_errors=True)
    try:
        if not (export / "token_exports").is_dir():
            t0 = time.perf_counter()
            tokens, lines, size = write_export(export, args.tokens, args.ranks)
            print(f"export: {tokens:,} response tokens, {lines:,} lines, {size / 2**30:.2f} GiB of JSON, "
                  f"written in {time.perf_counter() - t0:.0f} s", flush=True)
        load0 = os.getloadavg()
        cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "mismatch_lab.cli", "import", "prime-rl", str(export), "--out", str(store),
               "--rollout-engine", "vllm", "--rollout-dtype", "bf16", "--trainer-dtype", "bf16"]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        wall = time.perf_counter() - t0
        cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
        load1 = os.getloadavg()
        if done.returncode != 0:
            print(done.stdout, done.stderr, file=sys.stderr)
            return done.returncode
        print(done.stdout)
        stored = next(int(x.split()[1].replace(",", "")) for x in done.stdout.splitlines() if x.strip().startswith("tokens"))
        verdict = "within" if wall < GOAL_S and stored >= 10_000_000 else "NOT within" if stored >= 10_000_000 else "scaled:"
        print(f"import wall time: {wall:.1f} s for {stored:,} tokens = {stored / wall / 1e6:.2f} M tokens/s")
        print(f"goal: 10 M tokens in < {GOAL_S:.0f} s -> {verdict} "
              f"(10 M at this rate: {10_000_000 / (stored / wall):.1f} s)")
        print(f"cpu time of the import process: {cpu:.1f} s (user + sys, all its threads; independent of the "
              f"machine's load, unlike the wall time)")
        print(f"cpu: {cpu_model()}, {os.cpu_count()} cores; load average before {load0[0]:.2f}, after {load1[0]:.2f}")
        print(f"store: {sum(f.stat().st_size for f in store.rglob('*') if f.is_file()) / 2**20:.0f} MiB")
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
