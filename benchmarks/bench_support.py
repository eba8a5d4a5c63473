"""What log S costs the scorer: one HF scorer pass with and without a sampling rule, same process, same items.

    python benchmarks/bench_support.py [--model default] [--dtypes fp32,bf16] [--seqs 16] [--len 128] [--repeats 3]

Scores `seqs` sequences of natural text (docs/*.md) of `len` response tokens (after 32 prompt tokens) with the embedded model
(SmolLM2-135M-Instruct, vocabulary 49152) on the CPU (or --device cuda), alternating the plain scorer and
the scorer computing log S (scoring/support.py) for top-p 0.9, top-k 50, both, and T 0.7 with top-p 0.9; prints
the best time of each over `repeats`, its ratio to the plain pass, and the seconds spent inside the log S hook
over the rest of the same pass (robust on a loaded machine, where whole-pass ratios are noise).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

RULES = {"top-p 0.9": {"top_p": 0.9}, "top-k 50": {"top_k": 50}, "top-k 50 + top-p 0.9": {"top_k": 50, "top_p": 0.9},
         "T 0.7 + top-p 0.9": {"temperature": 0.7, "top_p": 0.9}}


def main() -> None:
    import torch

    from mismatch_lab.models import resolve_model
    from mismatch_lab.runtime import device_name
    from mismatch_lab.scoring import HFScorer
    from mismatch_lab.scoring.support import SamplingRule

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtypes", default="fp32")
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    model = resolve_model(a.model)
    items = _text_items(model, a.seqs, 32 + a.len)
    dtypes = a.dtypes.split(",")
    sc = HFScorer(model, dtypes, device=a.device, top_k=20)
    sc.score(items[:2])  # warm-up
    rules = {"plain": None, **{k: SamplingRule(**v) for k, v in RULES.items()}}
    best = {k: float("inf") for k in rules}
    share = {k: float("inf") for k in rules}
    hook = _timed_hook(sc)
    for _ in range(a.repeats):  # interleaved, so load on the machine hits every variant alike
        for name, rule in rules.items():
            sc.sampling = rule
            hook["s"] = 0.0
            t = time.perf_counter()
            sc.score(items)
            total = time.perf_counter() - t
            best[name] = min(best[name], total)
            share[name] = min(share[name], hook["s"] / (total - hook["s"]))
    n = sum(len(it.response_ids) for it in items)
    print(f"{device_name(a.device)}, torch {torch.__version__}, {torch.get_num_threads()} threads; scorer {','.join(dtypes)} "
          f"on {os.path.basename(model)}, {len(items)} x {a.len} = {n:,} tokens, best of {a.repeats}")
    print("  rule                   pass (s)   tok/s  vs plain  log S time / rest of the same pass")
    for name, s in best.items():
        print(f"  {name:22s} {s:8.2f} {n / s:7,.0f}  {s / best['plain']:8.3f}  {share[name]:8.3f}")


def _timed_hook(sc) -> dict:
    """Wrap the scorer's log S hook so each pass also reports the seconds spent inside it (same pass,
    same machine load: the share is robust where whole-pass ratios are not)."""
    clock, original = {"s": 0.0}, sc._support_fn

    def support_fn():
        fn = original()

        def timed(lp, tgt):
            t = time.perf_counter()
            out = fn(lp, tgt)
            clock["s"] += time.perf_counter() - t
            return out

        return timed

    sc._support_fn = support_fn
    return clock


def _text_items(model: str, n: int, length: int):
    """`n` sequences of `length` tokens of natural text (this repository's docs), so π has the peaked and
    flat positions of real text (random ids give flat distributions everywhere)."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from mismatch_lab.scoring import ScoreItem

    text = "\n".join(p.read_text() for p in sorted((Path(__file__).parent.parent / "docs").glob("*.md")))
    ids = AutoTokenizer.from_pretrained(model)(text)["input_ids"]
    return [ScoreItem(ids[i * length:i * length + 32], ids[i * length + 32:(i + 1) * length]) for i in range(n)]


if __name__ == "__main__":
    main()
