"""Benchmark: `mismatch-lab import nemo-rl` (and the other framework importers) of synthetic dumps, 10 M
response tokens each.

    .venv/bin/python benchmarks/bench_import_frameworks.py                          # nemo-rl, 10 M tokens
    .venv/bin/python benchmarks/bench_import_frameworks.py --format nemo-rl --tokens 1000000 --keep benchmarks/out/nemo
    .venv/bin/python benchmarks/bench_import_frameworks.py --format skyrl                 # SkyRL pickles, 10 M tokens
    .venv/bin/python benchmarks/bench_import_frameworks.py --format miles                 # miles per-rank dumps, 10 M tokens

nemo-rl: `train_data_step<N>.jsonl` files written the way NeMo-RL's Logger writes them
(tests/importers/framework_writers/nemo_rl.py: one line per sample, every value wrapped in a list once
more, `json.dumps` default separators, float32 values as Python floats): GRPO steps of 512 samples
(32 prompts x 16 generations), prompt 256 tokens, response 200-1800 tokens, every sample right padded to
the step's longest (2056 positions: token_ids, token_loss_mask, advantages, generation_logprobs,
prev_logprobs), a few NaN log-probs. To write the JSON quickly the lines of a pool of 256 distinct samples
are reused (in an order shifted per step) under each line's own `idx`: the importer parses every byte of every line all the same.

skyrl: `global_step_<N>_training_input.pkl` pickles written by tests/importers/framework_writers/skyrl.py
(SkyRL's TrainingInputBatch serialization): steps of 512 samples, prompt 256, response 200-1800 tokens,
[512, 2056] sequences and [512, 1800] response-level float32 tensors.

miles: `train_data/<rollout_id>_<rank>.pt` written by tests/importers/framework_writers/miles.py (miles'
save_debug_train_data_for_rank): rollouts of 512 samples over 2 data-parallel ranks, per-sample tensors.

The import runs as the real command in a fresh process (`python -m mismatch_lab.cli import FORMAT`),
timed from start to exit; printed: tokens/s, the figure against the goal of 10 M tokens in under 60 s,
the CPU seconds of the process (user + sys, all threads), the CPU model (/proc/cpuinfo), the core count
and the load average before and after (the machine is shared: load stretches the wall time, not the CPU
time).
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
PROMPT, RESPONSE = 256, (200, 1800)
POOL = 256
GROUP = 512


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def _nemo_line(rng, T: int) -> tuple[str, int]:
    """One NeMo-RL logger line without its idx (JSON text ending before the closing brace), its response tokens."""
    R = int(rng.integers(*RESPONSE))
    L = PROMPT + R
    ids = np.zeros(T, dtype=np.int64)
    ids[:L] = rng.integers(1, 151_000, L)
    mask = np.zeros(T, dtype=np.int64)
    mask[PROMPT:L] = 1
    mu = np.zeros(T, dtype=np.float32)
    mu[PROMPT:L] = -rng.exponential(0.6, R)
    pi = np.zeros(T, dtype=np.float32)
    pi[1:L] = -rng.exponential(0.6, L - 1)
    pi[PROMPT:L] = np.minimum(mu[PROMPT:L] + rng.normal(0, 0.02, R), 0)
    if rng.random() < 0.02:
        mu[PROMPT + int(rng.integers(R))] = np.nan
    adv = np.zeros(T, dtype=np.float32)
    adv[:L] = rng.normal()
    sample = {"content": [["a prompt", "a response"]], "rewards": [float(rng.integers(0, 2))], "input_lengths": [L],
              "token_ids": [ids.tolist()], "token_loss_mask": [mask.tolist()], "sample_loss_mask": [1.0],
              "advantages": [adv.tolist()], "generation_logprobs": [mu.tolist()], "prev_logprobs": [pi.tolist()]}
    return json.dumps(sample)[:-1], R


def write_nemo(out: Path, tokens: int, seed: int = 0) -> tuple[int, int, int]:
    """LOG_DIR/exp_001/train_data_step<N>.jsonl; returns (response tokens, lines, bytes)."""
    rng = np.random.default_rng(seed)
    T = PROMPT + RESPONSE[1]
    pool = [_nemo_line(rng, T) for _ in range(POOL)]
    written = lines = size = 0
    step = 0
    d = out / "exp_001"
    d.mkdir(parents=True, exist_ok=True)
    while written < tokens:
        step += 1
        with open(d / f"train_data_step{step}.jsonl", "w") as fh:
            for idx in range(GROUP):
                body, n = pool[(idx + step) % POOL]  # shifted per step: no two files hold the same bytes
                line = f'{body}, "idx": {idx}}}\n'
                fh.write(line)
                written, lines, size = written + n, lines + 1, size + len(line)
    return written, lines, size


def write_skyrl(out: Path, tokens: int, seed: int = 0) -> tuple[int, int, int]:
    """EXPORT/dumped_data/global_step_<N>_training_input.pkl, pickled as SkyRL's TrainingInputBatch.save
    does (tests/importers/framework_writers/skyrl.py); returns (response tokens, samples, bytes)."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "importers"))
    from framework_writers.skyrl import save

    rng = np.random.default_rng(seed)
    written = samples = size = step = 0
    T = PROMPT + RESPONSE[1]
    while written < tokens:
        step += 1
        R = rng.integers(*RESPONSE, size=GROUP)
        col = np.arange(RESPONSE[1])
        resp = (col[None, :] >= (RESPONSE[1] - R)[:, None]).astype(np.int64)
        mu = np.where(resp > 0, -rng.exponential(0.6, resp.shape), 0).astype(np.float32)
        pi = np.where(resp > 0, np.minimum(mu + rng.normal(0, 0.02, resp.shape), 0), 0).astype(np.float32)
        seqs = rng.integers(1, 151_000, size=(GROUP, T))
        attn = (np.arange(T)[None, :] >= (T - PROMPT - R)[:, None]).astype(np.int64)
        fields = {"sequences": seqs, "attention_mask": attn, "response_mask": resp, "loss_mask": resp.astype(np.float32),
                  "rollout_logprobs": mu, "action_log_probs": pi, "base_action_log_probs": pi,
                  "advantages": np.where(resp > 0, rng.normal(size=(GROUP, 1)), 0).astype(np.float32)}
        path = save({k: torch.from_numpy(v) for k, v in fields.items()}, {"pad_size": 0},
                    out / "dumped_data" / f"global_step_{step}_training_input.pkl")
        written, samples, size = written + int(R.sum()), samples + GROUP, size + path.stat().st_size
    return written, samples, size


def write_miles(out: Path, tokens: int, seed: int = 0) -> tuple[int, int, int]:
    """DIR/train_data/<rollout_id>_<rank>.pt as miles' --dump-details writes them
    (tests/importers/framework_writers/miles.py), 2 data-parallel ranks; returns (tokens, samples, bytes)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "importers"))
    from framework_writers.miles import write_rollout

    rng = np.random.default_rng(seed)
    written = n = size = rid = 0
    while written < tokens:
        samples = []
        for i in range(GROUP):
            R = int(rng.integers(*RESPONSE))
            mu = (-rng.exponential(0.6, R)).astype(np.float32)
            samples.append({"sample_index": rid * GROUP + i, "tokens": rng.integers(1, 151_000, PROMPT + R),
                            "loss_mask": np.ones(R, dtype=np.int32), "mu": mu,
                            "pi": np.minimum(mu + rng.normal(0, 0.02, R), 0).astype(np.float32),
                            "adv": np.full(R, rng.normal(), dtype=np.float32), "reward": 1.0, "P": PROMPT, "R": R})
            written += R
        paths = write_rollout(out, rid, samples, dp=2, pp=1)
        n, size, rid = n + GROUP, size + sum(p.stat().st_size for p in paths), rid + 1
    return written, n, size


WRITERS = {"nemo-rl": (write_nemo, []), "skyrl": (write_skyrl, ["--trust-pickle"]),
           "miles": (write_miles, ["--trust-pickle"])}
"""format -> (writer of the dump, extra import arguments)."""


def run_import(fmt: str, dump: Path, store: Path, extra: list[str]) -> int:
    load0 = os.getloadavg()
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "mismatch_lab.cli", "import", fmt, str(dump), "--out", str(store),
           "--rollout-engine", "vllm", "--rollout-dtype", "bf16", "--trainer-dtype", "bf16", *extra]
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
    print(f"{fmt}: import wall time {wall:.1f} s for {stored:,} tokens = {stored / wall / 1e6:.2f} M tokens/s")
    print(f"goal: 10 M tokens in < {GOAL_S:.0f} s -> {verdict} (10 M at this rate: {10_000_000 / (stored / wall):.1f} s)")
    print(f"cpu time of the import process: {cpu:.1f} s (user + sys, all its threads)")
    print(f"cpu: {cpu_model()}, {os.cpu_count()} cores; load average before {load0[0]:.2f}, after {load1[0]:.2f}")
    print(f"store: {sum(f.stat().st_size for f in store.rglob('*') if f.is_file()) / 2**20:.0f} MiB")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--format", choices=list(WRITERS), default="nemo-rl")
    p.add_argument("--tokens", type=int, default=10_000_000, help="response tokens to write (default 10 M)")
    p.add_argument("--keep", metavar="DIR", help="write the dump and the store here and keep them")
    args = p.parse_args()
    base = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-import-fw-"))
    base.mkdir(parents=True, exist_ok=True)
    write, extra = WRITERS[args.format]
    dump, store = base / f"{args.format}-dump", base / "store"
    shutil.rmtree(store, ignore_errors=True)
    try:
        if not dump.is_dir():
            t0 = time.perf_counter()
            tokens, lines, size = write(dump, args.tokens)
            print(f"dump: {tokens:,} response tokens, {lines:,} samples, {size / 2**30:.2f} GiB, written in "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
        return run_import(args.format, dump, store, extra)
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
