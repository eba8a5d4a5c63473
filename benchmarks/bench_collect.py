"""Collector benchmark: DuckDB ingest rate, scorer peak memory (the collector's overhead over the bare
work: benchmarks/bench_collect_overhead.py).

    .venv/bin/python benchmarks/bench_collect.py            # embedded model, ~2 min on 2 cores

1. DuckDB ingest: rows/s of `StoreWriter.write_chunk` (Arrow bulk insert, one transaction per chunk) for
   token + score rows with top-K lists of 20.
2. Scorer peak memory: peak RSS of the chunked scorer vs a naive full-vocabulary log_softmax on the
   same 32 x 192-token batch at fp32, each in a fresh subprocess (ru_maxrss), minus the RSS after loading.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO = Path(__file__).resolve().parents[1]


def bench_ingest(n_seq: int = 400, length: int = 256, k: int = 20) -> dict:
    import numpy as np

    from mismatch_lab.store.writer import StoreWriter, to_arrow

    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as d:
        w = StoreWriter(Path(d) / "ingest.duckdb")
        total_rows, t_total = 0, 0.0
        for chunk in range(4):
            n = n_seq * length
            seq_ids = np.repeat(np.arange(chunk * n_seq, (chunk + 1) * n_seq), length)
            pos = np.tile(np.arange(length), n_seq)
            topk = rng.integers(0, 49152, (n, k)).tolist()
            lps = rng.normal(-3, 1, (n, k)).tolist()
            toks = to_arrow("tokens", {"run_id": ["r"] * n, "seq_id": seq_ids.tolist(), "pos": pos.tolist(),
                                       "token_id": rng.integers(0, 49152, n).tolist(), "token_text": ["x"] * n,
                                       "category": ["word"] * n, "logp_rollout": rng.normal(-1, 1, n).tolist(),
                                       "topk_ids_rollout": topk, "topk_logps_rollout": lps})
            scs = to_arrow("scores", {"run_id": ["r"] * n, "seq_id": seq_ids.tolist(), "pos": pos.tolist(),
                                      "scorer": ["hf:fp32"] * n, "logp": rng.normal(-1, 1, n).tolist(),
                                      "nonfinite": [False] * n, "topk_ids": topk, "topk_logps": lps})
            seqs = to_arrow("sequences", {"run_id": ["r"] * n_seq, "seq_id": list(range(chunk * n_seq, (chunk + 1) * n_seq))})
            t0 = time.perf_counter()
            w.write_chunk("r", chunk, sequences=seqs, tokens=toks, scores=scs, seconds=0.0)
            t_total += time.perf_counter() - t0
            total_rows += toks.num_rows + scs.num_rows
        w.close()
    return {"rows": total_rows, "seconds": t_total, "rows_per_s": total_rows / t_total}


_MEM_CHILD = r"""
import resource, sys, torch
from transformers import AutoModelForCausalLM
mode, model = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
ids = torch.randint(0, m.config.vocab_size, (32, 192))
targets = ids[:, 1:]
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
with torch.no_grad():
    if mode == "naive":
        lp = torch.log_softmax(m(ids).logits.float(), -1)[:, :-1]
        out = lp.gather(2, targets.unsqueeze(-1))
        ent = -(lp.exp() * lp).sum(-1)
    else:
        from mismatch_lab.scoring import HFScorer, ScoreItem
        sc = HFScorer(model, ["fp32"], top_k=20, models={"fp32": m}, batch_tokens=32 * 192)
        sc.score([ScoreItem(row[:1].tolist(), row[1:].tolist()) for row in ids])
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((peak - base) * 1024)
"""


def bench_memory(model: str) -> dict:
    out = {}
    for mode in ("naive", "chunked"):
        r = subprocess.run([sys.executable, "-c", _MEM_CHILD, mode, model], capture_output=True, text=True, check=True)
        out[mode + "_extra_peak_bytes"] = int(r.stdout.strip().splitlines()[-1])
    out["ratio"] = out["chunked_extra_peak_bytes"] / out["naive_extra_peak_bytes"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--skip", nargs="*", default=[], choices=["ingest", "memory"])
    args = ap.parse_args()
    from mismatch_lab.models import resolve_model

    model = resolve_model(args.model)
    if "ingest" not in args.skip:
        g = bench_ingest()
        print(f"[ingest] {g['rows']:,} token+score rows (top-K 20 lists) in {g['seconds']:.1f} s -> {g['rows_per_s']:,.0f} rows/s")
    if "memory" not in args.skip:
        m = bench_memory(model)
        print(f"[memory] 32x192 tokens, fp32, V=49152: extra peak RSS naive log_softmax {m['naive_extra_peak_bytes'] / 2**30:.2f} GiB, "
              f"chunked scorer {m['chunked_extra_peak_bytes'] / 2**30:.2f} GiB (ratio {m['ratio']:.2f})")
    print(f"peak RSS of this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")


if __name__ == "__main__":
    main()
