"""Chunked full-vocabulary log-softmax and the exact divergences built on it (pure tensor math).

The naive computation this replaces is

    logp = torch.log_softmax((h @ W.T).float(), dim=-1)          # [N, V]: N tokens x V vocabulary

which for N = 32 x 191 tokens and V = 49152 allocates ~1.2 GB per tensor and +2 GiB peak on CPU
(docs/environment.md). Here the rows are processed `chunk_rows` at a time: peak memory is
O(chunk_rows x V), independent of batch x length, and every value equals the naive one because each
row's log-softmax only depends on that row.

Logits are computed in the scorer's dtype (as the trainer's `lm_head` does: bf16 logits are rounded
to bf16 before the softmax), then promoted to fp32 for the log-softmax, the entropy and the divergences.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class RowStats:
    """Per-row results for N scored positions (all fp32 / int64 tensors on CPU).

    logp        [N]        log π(target)
    entropy     [N]        −Σ_v π(v) log π(v), nats
    topk_ids    [N, K+1]   π's top-K ids, then the target id (the sampled token) as column K
    topk_logps  [N, K+1]
    topk_len    [N]        K when the target is already in the top-K (drop column K), else K+1
    at_ids      dict name -> [N, M] log π at caller-given ids (e.g. the rollout's top-K ids)
    at_ref_topk [N, K+1] | None  log π at the reference scorer's `topk_ids` (trim with the ref's topk_len)
    tv          [N] | None  ½ Σ_v |π(v) − π_ref(v)|          (exact, full vocabulary)
    kl          [N] | None  KL(π_ref ‖ π) = Σ_v π_ref(v) (log π_ref(v) − log π(v)), nats
    extra       dict name -> [N] results of the caller's `per_row` functions (e.g. scoring.support)
    """

    logp: torch.Tensor
    entropy: torch.Tensor
    topk_ids: torch.Tensor
    topk_logps: torch.Tensor
    topk_len: torch.Tensor
    at_ids: dict
    at_ref_topk: torch.Tensor | None = None
    tv: torch.Tensor | None = None
    kl: torch.Tensor | None = None
    extra: dict = field(default_factory=dict)


def chunked_row_stats(
    hidden: dict,
    weight: dict,
    targets: torch.Tensor,
    *,
    top_k: int,
    ref: str | None = None,
    gather: dict | None = None,
    chunk_rows: int = 1024,
    per_row: dict | None = None,
) -> dict:
    """Log-softmax statistics for several scorers in lockstep, `chunk_rows` rows at a time.

    hidden:  name -> [N, H] final hidden states (after the last norm) of the positions that predict `targets`
    weight:  name -> [V, H] the lm_head weight of that scorer (same dtype as its hidden states)
    targets: [N] int64 token ids scored at each row
    ref:     name of the reference scorer (fp32); when given, every scorer also gets exact TV and KL vs it
    gather:  name -> [N, M] int64 ids at which log π is also returned (`at_ids[name]`); rows padded
             by repeating a valid id — callers trim.  Gathered for every scorer.
    per_row: name -> fn(lp [rows, V], targets [rows, 1]) -> {key: [rows]}, called on every chunk of every
             scorer; its results are `extra[key]`.
    Returns name -> RowStats.  Chunks of the reference are computed once and shared by all scorers.
    """
    names = list(hidden)
    n = targets.shape[0]
    gather = gather or {}
    out: dict[str, dict[str, list]] = {s: {"logp": [], "entropy": [], "ti": [], "tl": [], "tn": [], "tv": [], "kl": [],
                                          "rt": [], **{f"g:{g}": [] for g in gather}} for s in names}
    per_row = per_row or {}
    extra: dict[str, dict[str, list]] = {s: {} for s in names}
    for start in range(0, n, chunk_rows):
        sl = slice(start, min(n, start + chunk_rows))
        tgt = targets[sl].view(-1, 1)
        ref_lp = ref_ids = None
        if ref is not None:
            ref_lp = _logsoftmax(hidden[ref][sl], weight[ref])
            if top_k > 0:
                ref_ids = _topk_with_target(ref_lp, tgt, top_k)[0]
        for s in names:
            lp = ref_lp if (s == ref and ref_lp is not None) else _logsoftmax(hidden[s][sl], weight[s])
            o = out[s]
            o["logp"].append(lp.gather(1, tgt).view(-1))
            p = lp.exp()
            # 0 * -inf = nan would poison the entropy of rows with exact zeros; xlogy treats 0 log 0 = 0
            o["entropy"].append(-torch.special.xlogy(p, p).sum(-1))
            if top_k > 0:
                ids, lps, k_len = _topk_with_target(lp, tgt, top_k)
                o["ti"].append(ids)
                o["tl"].append(lps)
                o["tn"].append(k_len)
                if ref_ids is not None:
                    o["rt"].append(lp.gather(1, ref_ids))
            for g, ids in gather.items():
                o[f"g:{g}"].append(lp.gather(1, ids[sl]))
            for fn in per_row.values():
                for key, v in fn(lp, tgt).items():
                    extra[s].setdefault(key, []).append(v)
            if ref_lp is not None:
                p_ref = ref_lp.exp()
                o["tv"].append(0.5 * (p - p_ref).abs().sum(-1))
                # terms with p_ref = 0 contribute 0 even where log p = -inf (fp16 underflow)
                cross = torch.where(p_ref > 0, p_ref * lp, torch.zeros((), dtype=lp.dtype)).sum(-1)
                o["kl"].append(torch.special.xlogy(p_ref, p_ref).sum(-1) - cross)
            del lp, p
    res = {}
    for s in names:
        o = out[s]
        cat = lambda key, shape=(0,), o=o: torch.cat(o[key]) if o[key] else torch.empty(shape)
        res[s] = RowStats(
            logp=cat("logp"), entropy=cat("entropy"),
            topk_ids=cat("ti", (0, 0)).long() if top_k > 0 else torch.empty((n, 0), dtype=torch.long),
            topk_logps=cat("tl", (0, 0)) if top_k > 0 else torch.empty((n, 0)),
            topk_len=cat("tn").long() if top_k > 0 else torch.zeros(n, dtype=torch.long),
            at_ids={g: cat(f"g:{g}", (0, 0)) for g in gather},
            at_ref_topk=cat("rt", (0, 0)) if (ref is not None and top_k > 0) else None,
            tv=cat("tv") if ref is not None else None,
            kl=cat("kl") if ref is not None else None,
            extra={k: torch.cat(v) for k, v in extra[s].items()},
        )
    return res


def _topk_with_target(lp: torch.Tensor, tgt: torch.Tensor, k: int):
    """Top-k ids/log-probs of each row with the target appended as column k, and each row's kept length."""
    v, i = lp.topk(min(k, lp.shape[-1]), dim=-1)
    ids = torch.cat([i, tgt], dim=1)
    lps = torch.cat([v, lp.gather(1, tgt)], dim=1)
    k_len = i.shape[1] + (i != tgt).all(dim=1).long()
    return ids, lps, k_len


def _logsoftmax(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """log_softmax over the vocabulary of logits computed in the weights' dtype, promoted to fp32."""
    return torch.log_softmax((h @ w.T).float(), dim=-1)
