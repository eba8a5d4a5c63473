"""Cost of each policy objective's forward + backward (metrics included), and of each rollout correction
applied on top of `grpo`, against plain `grpo`, in one run.

    .venv/bin/python benchmarks/bench_losses.py                      # B=64, T=512, K=20 on CPU
    .venv/bin/python benchmarks/bench_losses.py --step-ms 13000      # also: extra time as a share of a step
    python3 benchmarks/bench_losses.py --device cuda --repeats 300 --model-step --model-dtype bf16   # GPU box
    python3 benchmarks/bench_losses.py --device cuda --repeats 300 --model-step --micro-batch 16      # fp32

What is timed: `policy_loss(...)` + `loss.backward()` on realistic shapes — log-probs [B, T] with ragged
response lengths, per-sequence advantages, top-K tensors [B, T, K+1] (the anchor's top-K plus the sampled
token) — exactly what the training loop calls once per micro-batch. What is not timed: the model's
forward/backward and the log-softmax that produces these log-probs (the same for every objective; the
top-K variants additionally gather K+1 values per token from it, which the scorer does anyway).

The objectives are timed round-robin (one call each per round) so that machine noise hits all of them
alike; the median over rounds is reported. The ratio to grpo is a *loss-only* ratio: the loss is a
few element-wise ops, so +50 % of almost nothing can still be a negligible share of a training step.
Pass the measured step time with --step-ms to see that share (the DPPO paper's target: binary < 2 %,
top-K < 10 % of a step).

--model-step also times whole training steps on a randomly initialised model shaped like the embedded
SmolLM2-135M (30 layers, hidden 576, vocabulary 49152): forward, fp32 log-softmax over the vocabulary,
gather of the sampled tokens (and of the K+1 top-K ids for the top-K objectives), the loss, backward and
an AdamW step, at the same B and T. Meant for a GPU; on this repo's 2-core CPU use a small -B/-T.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from mismatch_lab.corrections.registry import CORRECTIONS
from mismatch_lab.rl.losses import OBJECTIVES, LossConfig, TopK, policy_loss

COMPARED = ("dppo_binary_tv", "dppo_binary_kl", "dppo_topk_tv", "dppo_topk_kl")


def make_inputs(B: int, T: int, K: int, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    vocab = 4 * (K + 1)  # enough tail mass for a realistic 'other' bucket
    logits = torch.randn(B, T, vocab, generator=g) * 3
    logp_full = torch.log_softmax(logits, -1)
    logmu_full = torch.log_softmax(logits + 0.05 * torch.randn(B, T, vocab, generator=g), -1)  # bf16-like mismatch
    # the sampled token sits among the anchor's top-K + 1 slots
    top = logmu_full.topk(K + 1, dim=-1).indices
    sampled = top.gather(-1, torch.randint(0, K + 1, (B, T, 1), generator=g)).squeeze(-1)
    logp = logp_full.gather(-1, sampled[..., None]).squeeze(-1)
    logp_rollout = logmu_full.gather(-1, sampled[..., None]).squeeze(-1)
    lengths = torch.randint(T // 4, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    advantages = torch.randn(B, generator=g)
    topk = TopK(anchor_logps=logmu_full.gather(-1, top).to(device), logps=logp_full.gather(-1, top).to(device),
                valid=torch.ones(B, T, K + 1, dtype=torch.bool, device=device))
    return logp.to(device), logp_rollout.to(device), advantages.to(device), mask.to(device), topk


SMOLLM2_135M = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                    "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "rms_norm_eps": 1e-5,
                    "max_position_embeddings": 8192, "tie_word_embeddings": True}


def model_steps(names, B, T, K, device, dtype, repeats, warmup, micro):
    """Median ms of one full training step per objective (see the module docstring); the batch is run in
    micro-batches of `micro` rows with gradient accumulation, the loss divided by the whole batch's tokens."""
    from transformers import (  # heavy; only for --model-step
        LlamaConfig,
        LlamaForCausalLM,
    )

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).to(device=device, dtype=dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SMOLLM2_135M["vocab_size"], (B, T + 1), generator=g).to(device)
    topk_ids = torch.randint(0, SMOLLM2_135M["vocab_size"], (B, T, K + 1), generator=g).to(device)
    lengths = torch.randint(T // 4, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(device)
    adv = torch.randn(B, generator=g).to(device)
    cfg = LossConfig(topk=K)

    n_tokens = float(mask.sum())

    def step(name: str) -> float:
        sync(device)
        t0 = time.perf_counter()
        for rows in torch.arange(B).split(micro):
            logp_full = torch.log_softmax(model(ids[rows, :-1]).logits.float(), -1)
            logp = logp_full.gather(-1, ids[rows, 1:, None]).squeeze(-1)
            logp_rollout = (logp.detach() + 0.01 * torch.randn_like(logp)).clamp(max=0)
            topk = None
            if "topk" in name:
                at = logp_full.gather(-1, topk_ids[rows])
                topk = TopK(anchor_logps=(at.detach() + 0.01 * torch.randn_like(at)).clamp(max=0), logps=at)
            loss, _ = policy_loss(name, logp, logp_rollout, adv[rows], mask[rows], cfg=cfg, topk=topk,
                                  denominator=n_tokens)
            loss.backward()
            del logp_full, logp, topk, loss
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        return time.perf_counter() - t0

    for _ in range(warmup):
        for name in names:
            step(name)
    times = {name: [] for name in names}
    for i in range(repeats):
        for name in names:
            times[name].append(step(name))
        print(f"  model-step round {i + 1}/{repeats}", file=sys.stderr, flush=True)
    return {n: statistics.median(v) * 1e3 for n, v in times.items()}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", "-B", type=int, default=64)
    ap.add_argument("--tokens", "-T", type=int, default=512)
    ap.add_argument("--topk", "-K", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=60, help="timed rounds (each objective once per round)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--step-ms", type=float, default=None, help="a measured training-step time, to express the extra cost as a share")
    ap.add_argument("--model-step", action="store_true", help="also time full steps of a SmolLM2-135M-shaped model")
    ap.add_argument("--model-dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--model-repeats", type=int, default=10)
    ap.add_argument("--micro-batch", type=int, default=None, help="rows per forward/backward in --model-step (default: B)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench_losses: error: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2

    logp0, logp_rollout, adv, mask, topk = make_inputs(args.batch, args.tokens, args.topk, args.device)
    # label -> (objective, config): every objective alone, then grpo with each rollout correction on top
    runs = {n: (n, LossConfig(topk=args.topk)) for n in ("grpo", *(o for o in OBJECTIVES if o != "grpo"))}
    runs |= {f"grpo+{c}": ("grpo", LossConfig(topk=args.topk, correction=c)) for c in CORRECTIONS if c != "none"}
    names = tuple(runs)
    leaf = logp0.clone().requires_grad_(True)

    def once(label: str) -> float:
        name, cfg = runs[label]
        leaf.grad = None
        sync(args.device)
        t0 = time.perf_counter()
        loss, _metrics = policy_loss(name, leaf, logp_rollout, adv, mask, cfg=cfg, topk=topk)
        loss.backward()
        sync(args.device)
        return time.perf_counter() - t0

    for _ in range(args.warmup):
        for name in names:
            once(name)
    times = {name: [] for name in names}
    t_start = time.perf_counter()
    for i in range(args.repeats):
        for name in names:
            times[name].append(once(name))
        if (i + 1) % max(1, args.repeats // 4) == 0:
            print(f"  round {i + 1}/{args.repeats}  ({time.perf_counter() - t_start:.1f} s)", file=sys.stderr, flush=True)

    med = {n: statistics.median(v) * 1e3 for n, v in times.items()}
    q = {n: statistics.quantiles(v, n=4) for n, v in times.items()}
    base = med["grpo"]
    print(f"\npolicy_loss forward+backward incl. metrics; B={args.batch} T={args.tokens} K={args.topk} (+1 sampled), "
          f"{int(mask.sum())} response tokens, device={args.device}, threads={torch.get_num_threads()}, "
          f"torch {torch.__version__}, median of {args.repeats} rounds")
    header = f"{'objective':22s} {'median ms':>10s} {'IQR ms':>15s} {'vs grpo':>9s} {'extra ms':>9s}"
    if args.step_ms:
        header += f" {'extra/step':>11s}"
    print(header)
    for n in names:
        iqr = f"{q[n][0] * 1e3:.2f}-{q[n][2] * 1e3:.2f}"
        line = f"{n:22s} {med[n]:10.2f} {iqr:>15s} {med[n] / base:8.2f}x {med[n] - base:+9.2f}"
        if args.step_ms:
            line += f" {100 * (med[n] - base) / args.step_ms:+10.3f}%"
        print(line)
    step_ms = args.step_ms
    calls = 1  # loss calls per step: one per micro-batch
    if args.model_step:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.model_dtype]
        micro = args.micro_batch or args.batch
        calls = -(-args.batch // micro)
        steps = model_steps(("grpo",) + COMPARED, args.batch, args.tokens, args.topk, args.device, dtype,
                            args.model_repeats, warmup=2, micro=micro)
        step_ms = step_ms or steps["grpo"]
        print(f"\nfull training step, SmolLM2-135M-shaped random model, {args.model_dtype}, B={args.batch} T={args.tokens} "
              f"in micro-batches of {micro}, median of {args.model_repeats} rounds (forward, fp32 log-softmax, gathers, "
              "loss, backward per micro-batch; one AdamW step)")
        for n, v in steps.items():
            print(f"  {n:16s} {v:10.1f} ms   {100 * (v / steps['grpo'] - 1):+6.2f} % vs grpo (measured, noisy)")
    print("\nloss-only overhead vs grpo" + ("" if step_ms else " (the full-step share needs the step time: --step-ms or --model-step)") + ":")
    if calls > 1:
        print(f"  (the step calls the loss {calls} times, once per micro-batch; the share below counts the full-batch "
              f"extra {calls} times: an upper bound, since each call is smaller)")
    for n in COMPARED:
        share = f"; {100 * calls * (med[n] - base) / step_ms:+.3f} % of a {step_ms:.0f} ms step" if step_ms else ""
        print(f"  {n:16s} {100 * (med[n] / base - 1):+7.1f} % of grpo's loss time ({med[n] - base:+.2f} ms){share}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
