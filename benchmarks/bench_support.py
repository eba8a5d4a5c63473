"""What log S costs the scorer: one HF scorer pass with and without a sampling rule, same process, same items.

    python benchmarks/bench_support.py [--model default] [--dtypes fp32,bf16] [--seqs 16] [--len 128] [--repeats 3]

Scores `seqs` sequences of natural text (docs/*.md) of `len` response tokens (after 32 prompt tokens) with the embedded model
(SmolLM2-135M-Instruct, vocabulary 49152) on the CPU (or --device cuda), alternating the plain scorer and
the scorer computing log S (scoring/support.py) for top-p 0.9, top-k 50 and both; prints the best time of
each over `repeats` and its ratio to the plain pass. The rule's share is (ratio - 1).
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
    for _ in range(a.repeats):  # interleaved, so load on the machine hits every variant alike
        for name, rule in rules.items():
            sc.sampling = rule
            t = time.perf_counter()
            sc.score(items)
            best[name] = min(best[name], time.perf_counter() - t)
    n = a.seqs * a.len
    print(f"{device_name(a.device)}, torch {torch.__version__}, {torch.get_num_threads()} threads; scorer {','.join(dtypes)} "
          f"on {os.path.basename(model)}, {a.seqs} x {a.len} = {n:,} tokens, best of {a.repeats}")
    for name, s in best.items():
        print(f"  {name:22s} {s:7.2f} s  {n / s:8,.0f} tok/s  ratio {s / best['plain']:.3f}")


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
