"""MoE routing costs on the tiny MoE (`mismatch-lab model tiny-moe --seed 0`), one run:

    .venv/bin/python benchmarks/bench_routing.py            # ~6 min on 2 loaded cores

1. `collect` with routing capture (--routing on: the rollout engine's prefill of each sampled sequence, the
   scorer's routing of its own forward, the routing rows written) against --routing off: wall time of the whole
   command (engine and model loading included), vLLM bf16 rollout, hf:fp32 scorer, the same prompts and seeds;
   runs alternate, best of --repeat each. Target ratio < 1.10.
2. The R3 scorer (hf:fp32-r3, rollout expert ids forced) against a plain hf:fp32 scorer pass on the same tokens
   (the same loaded fp32 model, routing capture off for both; the forced ids come from an HF bf16 forward, what
   is timed is the scorer), best of --repeat. Target ratio < 1.5.
3. The parts, in one process on one loaded engine (less exposed to the machine's load than two whole commands):
   vLLM bf16 generation of the chunk, the rollout routing capture of the same sequences (one prefill each), and
   the hf:fp32 scorer pass with routing capture on and off; best of --repeat each. The capture's share of the
   chunk's work is (rollout capture + scorer on - scorer off) / (generation + scorer off).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO = Path(__file__).resolve().parents[1]
CLI = str(REPO / ".venv" / "bin" / "mismatch-lab")


def tiny_moe(folder: Path) -> str:
    out = folder / "tiny-moe"
    subprocess.run([CLI, "model", "tiny-moe", "--seed", "0", "--out", str(out)], check=True, capture_output=True)
    return str(out)


def prompts_file(folder: Path, n: int) -> Path:
    lines = (REPO / "data" / "default_prompts.jsonl").read_text().splitlines()[:n]
    path = folder / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def collect_seconds(model: str, prompts: Path, db: Path, routing: str, args) -> float:
    db.unlink(missing_ok=True)
    t0 = time.perf_counter()
    subprocess.run([CLI, "collect", "--model", model, "--prompts", str(prompts), "--db", str(db), "--samples",
                    str(args.samples), "--max-tokens", str(args.max_tokens), "--rollout-dtypes", "bf16",
                    "--scorer-dtypes", "fp32", "--top-k", "0", "--memory-plan", "off", "--routing", routing,
                    "--no-progress"], check=True, capture_output=True)
    return time.perf_counter() - t0


def bench_collect(model: str, folder: Path, args) -> dict:
    prompts = prompts_file(folder, args.prompts)
    times: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(args.repeat):
        for routing in ("off", "on"):
            times[routing].append(collect_seconds(model, prompts, folder / f"{routing}.duckdb", routing, args))
    import duckdb

    con = duckdb.connect(str(folder / "on.duckdb"), read_only=True)
    tokens = con.execute("SELECT count(*) FROM tokens").fetchone()[0]
    con.close()
    best = {k: min(v) for k, v in times.items()}
    return {"tokens": tokens, "seconds": times, "ratio": best["on"] / best["off"]}


def bench_r3(model: str, args) -> dict:
    import torch

    from mismatch_lab.routing.hf import hf_routing, load_hf
    from mismatch_lab.scoring import HFScorer, ScoreItem

    torch.manual_seed(0)
    fp32, bf16 = load_hf(model, "fp32"), load_hf(model, "bf16")
    gen = torch.Generator().manual_seed(0)
    items = []
    for _ in range(args.r3_seqs):
        ids = torch.randint(0, fp32.config.vocab_size, (args.r3_len,), generator=gen).tolist()
        items.append(ScoreItem(ids[:16], ids[16:], rollout_routing=hf_routing(bf16, ids)[0]))
    scorers = {"hf:fp32": HFScorer(model, ["fp32"], device="cpu", top_k=0, models={"fp32": fp32}),
               "hf:fp32-r3": HFScorer(model, ["fp32-r3"], device="cpu", top_k=0, models={"fp32-r3": fp32})}
    times: dict[str, list[float]] = {k: [] for k in scorers}
    for _ in range(args.repeat):
        for name, scorer in scorers.items():
            t0 = time.perf_counter()
            scorer.score(items)
            times[name].append(time.perf_counter() - t0)
    best = {k: min(v) for k, v in times.items()}
    return {"tokens": sum(len(it.response_ids) for it in items), "seconds": times,
            "ratio": best["hf:fp32-r3"] / best["hf:fp32"]}


def bench_parts(model: str, args) -> dict:
    from mismatch_lab.engines.base import GenRequest, make_engine
    from mismatch_lab.routing.record import rollout_routings
    from mismatch_lab.runtime import load_tokenizer
    from mismatch_lab.scoring import HFScorer, ScoreItem

    tok = load_tokenizer(model)[0]
    lines = (REPO / "data" / "default_prompts.jsonl").read_text().splitlines()[:args.prompts]
    prompts = [tok(json.loads(line)["prompt"]).input_ids for line in lines]
    reqs = [GenRequest(prompt_ids=p, seed=i * args.samples + s) for i, p in enumerate(prompts) for s in range(args.samples)]
    engine = make_engine("vllm", model, "bf16", seed=0, max_model_len=512, device="cpu", max_logprobs=20)
    scorers = {r: HFScorer(model, ["fp32"], device="cpu", top_k=0, routing=r) for r in (False, True)}
    times: dict[str, list[float]] = {"generate": [], "rollout_capture": [], "scorer_off": [], "scorer_on": []}
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        samples = engine.generate(reqs, max_tokens=args.max_tokens, top_k=0)
        times["generate"].append(time.perf_counter() - t0)
        seqs = [list(r.prompt_ids) + list(s.token_ids) for r, s in zip(reqs, samples)]
        t0 = time.perf_counter()
        rollout_routings("vllm", engine, seqs)
        times["rollout_capture"].append(time.perf_counter() - t0)
        items = [ScoreItem(r.prompt_ids, s.token_ids) for r, s in zip(reqs, samples)]
        for on, key in ((False, "scorer_off"), (True, "scorer_on")):
            t0 = time.perf_counter()
            scorers[on].score(items)
            times[key].append(time.perf_counter() - t0)
    engine.close()
    b = {k: min(v) for k, v in times.items()}
    share = (b["rollout_capture"] + b["scorer_on"] - b["scorer_off"]) / (b["generate"] + b["scorer_off"])
    return {"tokens": sum(len(s.token_ids) for s in samples), "seconds": times, "capture_share": share}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--r3-seqs", type=int, default=32)
    p.add_argument("--r3-len", type=int, default=96)
    p.add_argument("--skip", choices=["collect", "r3", "parts"], action="append", default=[])
    args = p.parse_args()
    print(f"cpu: {_cpu()}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
    with tempfile.TemporaryDirectory() as d:
        model = tiny_moe(Path(d))
        out = {}
        if "collect" not in args.skip:
            out["collect"] = bench_collect(model, Path(d), args)
            c = out["collect"]
            print(f"collect, {c['tokens']} tokens: routing off {min(c['seconds']['off']):.1f} s, on "
                  f"{min(c['seconds']['on']):.1f} s -> ratio {c['ratio']:.3f} (target < 1.10)", flush=True)
        if "r3" not in args.skip:
            out["r3"] = bench_r3(model, args)
            r = out["r3"]
            print(f"scorer pass, {r['tokens']} tokens: hf:fp32 {min(r['seconds']['hf:fp32']):.2f} s, hf:fp32-r3 "
                  f"{min(r['seconds']['hf:fp32-r3']):.2f} s -> ratio {r['ratio']:.3f} (target < 1.5)", flush=True)
        if "parts" not in args.skip:
            out["parts"] = bench_parts(model, args)
            t = {k: min(v) for k, v in out["parts"]["seconds"].items()}
            print(f"parts, {out['parts']['tokens']} tokens: generate {t['generate']:.2f} s, rollout capture "
                  f"{t['rollout_capture']:.2f} s, scorer {t['scorer_off']:.2f} s off / {t['scorer_on']:.2f} s on "
                  f"-> capture adds {out['parts']['capture_share']:.1%} of the chunk's work", flush=True)
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    print(json.dumps(out))


def _cpu() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
