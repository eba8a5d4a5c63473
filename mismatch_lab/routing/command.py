"""`mismatch-lab routing`: how vLLM at a dtype routes the tokens HF fp32 routes, and what R3 replay removes.

    mismatch-lab model tiny-moe --out /tmp/moe
    mismatch-lab routing --model /tmp/moe --dtype bf16 [--prompts TEXT ...] [--gen 32] [--json out.json]

Per prompt: vLLM (the rollout, at --dtype) samples --gen tokens (T=1, seeded); then the prompt and those
tokens are teacher-forced through vLLM's prefill and through HF fp32 (the trainer), each capturing its
routing. Printed: flip rate per MoE layer, any_layer_differs, flips by HF's router margin, and the mean
|Δp| = |π − μ| over the next-token probabilities of every position, for HF as it routes itself and for HF
replaying vLLM's expert ids (R3), with and without vLLM's weights. docs/moe.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from mismatch_lab.errors import UserError

DEFAULT_PROMPTS = (
    "The history of the printing press begins",
    "def fibonacci(n):\n    ",
    "Question: what is 17 times 23? Answer:",
    "Les montagnes de la région sont",
)
REPLAYS = {"hf_fp32": None, "hf_fp32_replay_ids": False, "hf_fp32_replay_ids_weights": True}
"""Trainer forwards compared with vLLM: own routing (None), replaying vLLM's ids (weights recomputed), ids and
weights."""


def add_arguments(parser) -> None:
    parser.add_argument("--model", required=True, help="a Qwen3-MoE checkpoint directory (`model tiny-moe`)")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="vLLM's dtype (HF is fp32)")
    parser.add_argument("--prompts", nargs="+", default=list(DEFAULT_PROMPTS), help="prompt texts")
    parser.add_argument("--gen", type=int, default=32, help="tokens vLLM samples after each prompt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the result as JSON to this file")


def check_moe(model_dir: str) -> None:
    """UserError unless `model_dir`'s config declares routed experts (checked before loading anything)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    if not (cfg.get("num_experts") or cfg.get("num_local_experts")):
        raise UserError(f"--model {model_dir}: not an MoE checkpoint (no num_experts or num_local_experts in config.json); "
                        "build one with `mismatch-lab model tiny-moe --out DIR`")


def measure(model_dir: str, dtype: str, prompts: list[str], gen: int, seed: int = 0) -> dict:
    """The comparison `mismatch-lab routing` prints (see the module's doc)."""
    from transformers import AutoTokenizer

    from mismatch_lab.engines.base import GenRequest, make_engine
    from mismatch_lab.routing.compare import compare, concat
    from mismatch_lab.routing.hf import hf_routing, load_hf
    from mismatch_lab.routing.vllm_side import vllm_routing

    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = load_hf(model_dir, "fp32")
    engine = make_engine("vllm", model_dir, dtype, seed=seed, max_model_len=1024, kv_cache_bytes=256 << 20)
    try:
        seqs = []
        for i, text in enumerate(prompts):
            ids = tok(text).input_ids
            out = engine.generate([GenRequest(ids, seed + i)], max_tokens=gen, top_k=0)[0] if gen else None
            seqs.append(ids + (out.token_ids if out else []))
        rollout = [vllm_routing(engine, s) for s in seqs]
    finally:
        engine.close()
    mu = np.exp(np.concatenate([lp for _, lp in rollout]))
    result = {"model": model_dir, "vllm_dtype": dtype, "trainer": "hf fp32", "sequences": len(seqs)}
    for name, weights in REPLAYS.items():
        runs = [hf_routing(hf, s, replay=None if weights is None else r, use_weights=bool(weights))
                for s, (r, _) in zip(seqs, rollout)]
        pi = np.exp(np.concatenate([lp for _, lp in runs]))
        result[name] = {"mean_abs_dp": float(np.mean(np.abs(pi - mu))), "max_abs_dp": float(np.max(np.abs(pi - mu))),
                        "routing_vs_vllm": compare(concat([r for r, _ in runs]), concat([r for r, _ in rollout]))}
    return result


def format_text(result: dict) -> str:
    lines = [(f"routing: vLLM {result['vllm_dtype']} vs {result['trainer']} on {result['sequences']} sequences "
              f"of {result['model']}")]
    own = result["hf_fp32"]["routing_vs_vllm"]
    lines.append(f"  tokens {own['tokens']}, MoE layers {own['layers']}, top-{own['k']}")
    lines.append("  flip rate per layer  " + " ".join(f"{x:.4f}" for x in own["flip_rate_per_layer"]))
    lines.append(f"  any_layer_differs    {own['any_layer_differs']:.4f}   (order-only differences "
                 f"{own['order_only_rate']:.4f})")
    lines.append("  flips by HF margin   " + ", ".join(
        f"[{b['lo']:g},{b['hi']:g}): {b['flips']}/{b['cells']}" for b in own["flips_by_margin"]))
    lines.append(f"  downstream flips     {own['downstream_flips']}/{own['flips']} after a flip in an earlier layer "
                 f"({own['downstream_flips_margin_ge_1']} of them at HF margin >= 1)")
    for name in REPLAYS:
        r = result[name]
        lines.append(f"  {name:<28} mean |dp| {r['mean_abs_dp']:.3e}  max |dp| {r['max_abs_dp']:.3e}  "
                     f"any_layer_differs {r['routing_vs_vllm']['any_layer_differs']:.4f}")
    return "\n".join(lines)


def run(args) -> int:
    from mismatch_lab.cli import json_output
    from mismatch_lab.models import resolve_model

    out = json_output(args.json, "routing.json")
    model_dir = resolve_model(args.model)
    check_moe(model_dir)
    if args.gen < 0:
        raise UserError(f"--gen {args.gen}: pass 0 or more tokens")
    result = measure(model_dir, args.dtype, args.prompts, args.gen, args.seed)
    print(format_text(result))
    if out:
        out.write_text(json.dumps(result, indent=2))
    return 0
