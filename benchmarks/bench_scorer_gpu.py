"""Scorer throughput and peak GPU memory on CUDA (a lent GPU machine; no vLLM needed).

    MISMATCH_LAB_TINY_MODEL=data/models/tiny-gpu python benchmarks/bench_scorer_gpu.py

Builds a random model with the embedded SmolLM2-135M shapes (576 hidden, 30 layers, 9 heads / 3 KV,
vocab 49152) from the tiny model's config, then scores 64 sequences x 512 tokens: tokens/s per scorer
dtype, the three dtypes in lockstep with exact TV/KL, and peak GPU memory of the chunked scorer vs a
naive full-vocabulary log_softmax of the same batch (torch.cuda.max_memory_allocated, above the weights).
"""

import os
import sys
import tempfile
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from mismatch_lab.scoring import HFScorer, ScoreItem

B, L, P = 64, 512, 64  # sequences, tokens per sequence, prompt tokens


def main() -> None:
    cfg = AutoConfig.from_pretrained(os.environ["MISMATCH_LAB_TINY_MODEL"])
    cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers = 576, 1536, 30
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.max_position_embeddings = 9, 3, 64, 2048
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as d:
        AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, cfg.vocab_size, (B, L), generator=g)
        items = [ScoreItem(r[:P].tolist(), r[P:].tolist()) for r in ids]
        n_tok = B * (L - P)
        for dts in (["fp32"], ["bf16"], ["fp16"], ["fp32", "bf16", "fp16"]):
            sc = HFScorer(d, dts, device="cuda", top_k=20, batch_tokens=16 * L)
            sc.score(items[:4])  # warm-up
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            t = time.perf_counter()
            sc.score(items)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t
            extra = (torch.cuda.max_memory_allocated() - base) / 2**30
            print(f"chunked scorer {'+'.join(dts):15s}: {n_tok / dt:9,.0f} scored tok/s, peak +{extra:.2f} GiB above weights")
            sc.close()
            del sc
            torch.cuda.empty_cache()
        m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).cuda().eval()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t = time.perf_counter()
        with torch.no_grad():
            for s in range(0, B, 16):  # same micro-batch of 16 x 512 as the scorer
                x = ids[s:s + 16].cuda()
                lp = torch.log_softmax(m(x).logits.float(), -1)
                lp[:, P - 1:-1].gather(2, x[:, P:].unsqueeze(-1))
                (-(lp.exp() * lp).sum(-1))
                del lp
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        extra = (torch.cuda.max_memory_allocated() - base) / 2**30
        print(f"naive log_softmax fp32   : {n_tok / dt:9,.0f} scored tok/s, peak +{extra:.2f} GiB above weights")
    print(torch.cuda.get_device_name(0), "torch", torch.__version__)


if __name__ == "__main__":
    main()
