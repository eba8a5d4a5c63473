"""`collect` with the HF engine at real model sizes: peak memory per phase against the memory plan, and speed.

    python benchmarks/bench_collect_gpu.py --shape qwen2.5-1.5b            # a lent GPU machine (no vLLM needed)
    python benchmarks/bench_collect_gpu.py --shape llama-3.1-8b --max-tokens 256 --gen-batch 8
    python benchmarks/bench_collect_gpu.py --shape tiny-wide --device cpu --prompts 4 --max-tokens 8   # a check

First collect's memory plan for the shape and options, from the config alone (a plan that cannot fit is
refused with its fix before any weight is built: the HF engine keeps every sequence's logits of a call, so
--gen-batch is the lever at 8B). Then a random-weight checkpoint of the shape (`collect.real_shapes`, bf16
safetensors under --work, re-used), and `collect` with `engine = "hf"` at the rollout dtypes against the
scorer dtypes (default bf16, fp16, fp32 on both sides), the plan printed as collect prints it. All generate
calls of one rollout dtype form one phase, all scorer calls another: before each call the device's peak
counter is reset and after it read (`torch.cuda.max_memory_allocated` of the device: tensors only, not the
CUDA context or the allocator's cache; resident models count; on a CPU peaks read n/a); a phase's peak is
its calls' largest. Printed per phase: the peak next to the plan's device total, seconds, and tokens/s =
response tokens per second of the phase (generated; for the score phase each token counted once although
every scorer dtype scores it; the first phase includes the device's warm-up). Then the store's size. The
figures go to docs/benchmarks.md with the GPU model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def _peak_bytes(device: str) -> int | None:
    import torch

    return torch.cuda.max_memory_allocated(device) if device.startswith("cuda") else None


def _reset_peak(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def instrument(device: str, phases: dict) -> None:
    """Wrap HFEngine.generate and HFScorer.score: per phase, its peak device bytes, seconds and tokens."""
    from mismatch_lab.engines.hf_engine import HFEngine
    from mismatch_lab.scoring import HFScorer

    generate, score = HFEngine.generate, HFScorer.score

    def timed(name: str, fn, count):
        _reset_peak(device)
        t0 = time.perf_counter()
        out = fn()
        if device.startswith("cuda"):
            import torch

            torch.cuda.synchronize(device)
        p = phases[name]
        p["seconds"] += time.perf_counter() - t0
        p["tokens"] += count(out)
        peak = _peak_bytes(device)
        p["peak"] = None if peak is None else max(p["peak"] or 0, peak)
        return out

    def generate_timed(self, requests, **kw):
        return timed(f"generate hf:{self.dtype}", lambda: generate(self, requests, **kw),
                     lambda out: sum(len(s.token_ids) for s in out))

    def score_timed(self, items):
        return timed(f"score {'+'.join(self.dtypes)}", lambda: score(self, items),
                     lambda out: sum(len(it.response_ids) for it in items))

    HFEngine.generate, HFScorer.score = generate_timed, score_timed


def main(argv: list[str] | None = None) -> dict:
    from mismatch_lab.collect import CollectConfig, collect
    from mismatch_lab.collect.job import memory_plan, prepare
    from mismatch_lab.collect.real_shapes import (
        REAL_SHAPES,
        build_random_model,
        write_config,
    )

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(REAL_SHAPES), required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--work", default="bench-collect-gpu", help="folder for the checkpoint and the store")
    ap.add_argument("--prompts", type=int, default=64, help="prompts of data/default_prompts.jsonl to use")
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rollout-dtypes", default="bf16,fp16,fp32")
    ap.add_argument("--scorer-dtypes", default="bf16,fp16,fp32")
    ap.add_argument("--gen-batch", type=int, default=16, help="sequences per HF generate call (collect --gen-batch)")
    ap.add_argument("--score-batch-tokens", type=int, default=0, help="collect --score-batch-tokens (0: its default)")
    ap.add_argument("--chunk-tokens", type=int, default=0, help="collect --chunk-tokens (0: by device)")
    ap.add_argument("--json", help="also write the figures to this JSON file")
    args = ap.parse_args(argv)

    work = Path(args.work)
    model = work / f"model-{args.shape}"
    root = Path(__file__).resolve().parent.parent
    lines = (root / "data" / "default_prompts.jsonl").read_text().splitlines()[: args.prompts]
    work.mkdir(parents=True, exist_ok=True)
    prompts = work / "prompts.jsonl"
    prompts.write_text("\n".join(lines) + "\n")
    db = work / f"{args.shape}.duckdb"
    db.unlink(missing_ok=True)
    extra = {k: v for k, v in (("score_batch_tokens", args.score_batch_tokens), ("chunk_tokens", args.chunk_tokens)) if v}
    cfg = CollectConfig(model=str(model), prompts=str(prompts), samples=args.samples, max_tokens=args.max_tokens,
                        engine="hf", rollout_dtypes=args.rollout_dtypes.split(","),
                        scorer_dtypes=args.scorer_dtypes.split(","), top_k=20, db=str(db), study="bench-gpu",
                        device=args.device, gen_batch=args.gen_batch, **extra)
    if not (model / ".complete").is_file():
        write_config(model, args.shape)  # the plan reads the config: refused here, before 16 GB of weights
    memory_plan(prepare(cfg, weights=False))
    t0 = time.perf_counter()
    build_random_model(model, args.shape, device=args.device)
    print(f"checkpoint {model} ({time.perf_counter() - t0:.1f} s)", flush=True)
    phases: dict = defaultdict(lambda: {"seconds": 0.0, "tokens": 0, "peak": None})
    instrument(args.device, phases)
    t1 = time.perf_counter()
    collect(cfg, progress=False)
    wall = time.perf_counter() - t1
    import duckdb

    con = duckdb.connect(str(db), read_only=True)
    plan = json.loads(con.execute("SELECT config FROM runs LIMIT 1").fetchone()[0]).get("memory_plan") or []
    n_tokens = con.execute("SELECT count(*) FROM tokens").fetchone()[0]
    con.close()
    planned = next((line for line in plan if "total on the device" in line), "(no plan)")
    print(f"\n{args.shape} on {args.device}: {n_tokens:,} response tokens stored, collect {wall:.1f} s")
    print(f"plan: {planned.strip()}")
    print(f"{'phase':<28s} {'peak GiB':>9s} {'seconds':>8s} {'tokens/s':>10s}")
    for name, p in phases.items():
        peak = "n/a" if p["peak"] is None else f"{p['peak'] / 2**30:.2f}"
        print(f"{name:<28s} {peak:>9s} {p['seconds']:>8.1f} {p['tokens'] / max(p['seconds'], 1e-9):>10.0f}")
    size = db.stat().st_size
    print(f"store {db}: {size / 2**20:.1f} MiB")
    result = {"store_bytes": size, "shape": args.shape, "device": args.device, "tokens": n_tokens, "collect_seconds": wall,
              "plan": plan, "phases": dict(phases)}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    from mismatch_lab.errors import UserError

    try:
        main()
    except UserError as exc:  # e.g. a memory plan that cannot fit: one line with its fix, no traceback
        sys.exit(f"bench_collect_gpu: {exc}")
