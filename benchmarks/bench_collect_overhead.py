"""Collector overhead over the bare work, and scorer tokens/s before and after the Arrow path (same run).

    .venv/bin/python benchmarks/bench_collect_overhead.py                      # embedded model, ~4 min on 2 cores
    .venv/bin/python benchmarks/bench_collect_overhead.py --prompts 4 --max-tokens 16   # quicker

1. Overhead: wall time of `collect` (one vLLM bf16 rollout, HF scorers fp32+bf16 with top-K 20 and exact
   TV/KL, DuckDB writes, model loading) against the bare work it wraps, measured right after it in the
   same process: vLLM generation of the same requests + a plain batched HF forward / full log_softmax /
   gather of the same tokens at each scorer dtype, in forwards of the scorer's padded-token budget (model
   loading included on both sides). Overhead = collect / bare - 1.
2. Scorer: tokens/s of the former path (tests/collect/lockstep_reference.py: every dtype in lockstep,
   Python lists per sequence, lists -> Arrow) and of the current one (each dtype's decoder in turn, numpy
   buffers -> Arrow with validity masks and list offsets) on the same items; best of `--repeat` runs each.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "collect"))  # the former scorer, kept as the tests' reference
SCORERS = ["fp32", "bf16"]


def _rows(n_prompts: int) -> list[dict]:
    from mismatch_lab.collect import read_prompts

    return read_prompts(str(REPO / "data" / "default_prompts.jsonl"))[:n_prompts]


def bench_overhead(model: str, n_prompts: int, samples: int, max_tokens: int, repeat: int) -> dict:
    """Best of `repeat` rounds of (collect, bare work), after one untimed bare generation that fills the
    caches both sides share (vLLM's compiled graphs, the weights in the page cache): measured first, either
    side would otherwise pay them alone."""
    from mismatch_lab.collect import CollectConfig, collect

    rows = _rows(n_prompts)
    _bare_generate(model, rows, samples, max_tokens)
    t_collect, t_gen, t_score = [], [], []
    for _ in range(repeat):
        with tempfile.TemporaryDirectory() as d:
            pfile = Path(d) / "p.jsonl"
            pfile.write_text("".join(json.dumps(r) + "\n" for r in rows))
            cfg = CollectConfig(model=model, prompts=str(pfile), samples=samples, max_tokens=max_tokens,
                                rollout_dtypes=["bf16"], scorer_dtypes=SCORERS, db=str(Path(d) / "b.duckdb"),
                                chunk_prompts=n_prompts)
            t0 = time.perf_counter()
            collect(cfg, progress=False)
            t_collect.append(time.perf_counter() - t0)
        t, reqs, outs = _bare_generate(model, rows, samples, max_tokens)
        t_gen.append(t)
        t_score.append(_bare_score(model, reqs, outs))
    bare = min(g + s for g, s in zip(t_gen, t_score))
    return {"tokens": sum(len(o.token_ids) for o in outs), "collect_s": min(t_collect), "bare_generate_s": min(t_gen),
            "bare_score_s": min(t_score), "rounds": list(zip(t_collect, t_gen, t_score)),
            "overhead": min(t_collect) / bare - 1}


def _bare_generate(model, rows, samples, max_tokens):
    from transformers import AutoTokenizer

    from mismatch_lab.collect import encode_prompts, sample_seed
    from mismatch_lab.engines.base import GenRequest, make_engine

    t0 = time.perf_counter()
    ids, _ = encode_prompts(AutoTokenizer.from_pretrained(model), rows)
    eng = make_engine("vllm", model, "bf16", seed=0, max_model_len=2048)
    reqs = [GenRequest(ids[i], sample_seed(0, i, s)) for i in range(len(rows)) for s in range(samples)]
    outs = eng.generate(reqs, max_tokens=max_tokens, top_k=20)
    t = time.perf_counter() - t0
    eng.close()
    return t, reqs, outs


def _bare_score(model, reqs, outs) -> float:
    """A plain batched HF scorer: sequences right-padded into forwards of at most SCORE_BATCH_TOKENS padded
    tokens (collect's scorer budget), full log_softmax in fp32, gather of the sampled tokens; per dtype."""
    import torch
    from transformers import AutoModelForCausalLM

    from mismatch_lab.scoring import SCORE_BATCH_TOKENS

    seqs = [(r.prompt_ids + o.token_ids, len(r.prompt_ids)) for r, o in zip(reqs, outs)]
    batches, cur = [], []
    for seq in sorted(seqs, key=lambda x: len(x[0])):
        if cur and (len(cur) + 1) * len(seq[0]) > SCORE_BATCH_TOKENS:
            batches.append(cur)
            cur = []
        cur.append(seq)
    batches += [cur] if cur else []
    t0 = time.perf_counter()
    for dt in SCORERS:
        m = AutoModelForCausalLM.from_pretrained(model, dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[dt]).eval()
        with torch.no_grad():
            for batch in batches:
                width = max(len(ids) for ids, _ in batch)
                ids = torch.zeros(len(batch), width, dtype=torch.long)
                attn = torch.zeros_like(ids)
                for i, (seq, _) in enumerate(batch):
                    ids[i, :len(seq)], attn[i, :len(seq)] = torch.tensor(seq), 1
                lp = torch.log_softmax(m(input_ids=ids, attention_mask=attn).logits.float(), -1)
                for i, (seq, n_prompt) in enumerate(batch):
                    lp[i, n_prompt - 1:len(seq) - 1].gather(1, torch.tensor(seq[n_prompt:]).view(-1, 1))
        del m
    return time.perf_counter() - t0


def bench_scorer(model: str, n_seq: int, prompt: int, response: int, repeat: int) -> dict:
    import torch
    from lockstep_reference import LockstepScorer

    from mismatch_lab.scoring import HFScorer, ScoreItem

    g = torch.Generator().manual_seed(0)
    items = [ScoreItem(torch.randint(0, 49152, (prompt,), generator=g).tolist(),
                       torch.randint(0, 49152, (response,), generator=g).tolist(),
                       [torch.randint(0, 49152, (21,), generator=g).tolist() for _ in range(response)])
             for _ in range(n_seq)]
    old, new = LockstepScorer(model, SCORERS, top_k=20), HFScorer(model, SCORERS, top_k=20)
    t_old = min(_timed(lambda: _old_tables(old.score(items))) for _ in range(repeat))
    t_new = min(_timed(lambda: _new_tables(new.score(items))) for _ in range(repeat))
    n_tok = n_seq * response
    return {"tokens": n_tok, "before_tok_s": n_tok / t_old, "after_tok_s": n_tok / t_new, "ratio": t_old / t_new}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _old_tables(scored) -> None:
    """The former path: per-sequence Python lists extended into columns, then pa.array per column."""
    from mismatch_lab.store.writer import to_arrow

    for name, per_seq in scored.items():
        cols = {k: [] for k in ("logp", "entropy", "nonfinite", "topk_ids", "topk_logps", "tv_exact_vs_ref",
                                "kl_exact_vs_ref", "logps_at_rollout_topk", "logps_at_ref_topk")}
        for sc in per_seq:
            for k, values in cols.items():
                values.extend(getattr(sc, k) or [None] * len(sc.logp))
        to_arrow("scores", {**cols, "scorer": [name] * len(cols["logp"])})


def _new_tables(scored) -> None:
    import pyarrow as pa

    from mismatch_lab.collect.tables import _scores

    for name, sc in scored.items():
        n = len(sc.logp)
        _scores("r", name, sc, {"seq_id": pa.array([0] * n, pa.int64()), "pos": pa.array([0] * n, pa.int32())})


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--skip", nargs="*", default=[], choices=["overhead", "scorer"])
    args = ap.parse_args()
    from mismatch_lab.models import resolve_model

    model = resolve_model(args.model)
    print(f"CPU: {_cpu()}")
    if "overhead" not in args.skip:
        o = bench_overhead(model, args.prompts, args.samples, args.max_tokens, args.repeat)
        bare = o["bare_generate_s"] + o["bare_score_s"]
        for i, (c, g, sc) in enumerate(o["rounds"]):
            print(f"  round {i + 1}: collect {c:.1f} s, bare generate {g:.1f} s, bare score {sc:.1f} s")
        print(f"[overhead] {o['tokens']} tokens (vLLM bf16 rollout, HF fp32+bf16 scorers, top-K 20, exact TV/KL): "
              f"best collect {o['collect_s']:.1f} s vs best bare generate {o['bare_generate_s']:.1f} s + bare score "
              f"{o['bare_score_s']:.1f} s = {bare:.1f} s -> overhead {100 * o['overhead']:+.1f} % (target < 10 %)")
    if "scorer" not in args.skip:
        s = bench_scorer(model, 16, 32, args.max_tokens * 2, args.repeat)
        print(f"[scorer] {s['tokens']} tokens, fp32+bf16, top-K 20, exact TV/KL, to Arrow: before (lockstep, lists) "
              f"{s['before_tok_s']:.0f} tok/s, after (in turn, numpy -> Arrow) {s['after_tok_s']:.0f} tok/s "
              f"-> {s['ratio']:.2f}x")


if __name__ == "__main__":
    main()
