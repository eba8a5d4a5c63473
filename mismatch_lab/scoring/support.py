"""The sampling rule of a rollout (temperature, top-k, top-p) and the support it keeps, under π.

With top-k / top-p (or a temperature), vLLM's `processed_logprobs` are the log-softmax of the logits after
the sampler's processing: log μ_proc(t) = log softmax(z / T)(t) − log S, where S is the probability mass of
softmax(z / T) that the sampler kept (the support). A trainer scoring log π of the raw distribution then sees
log r = log π − log μ_proc biased by log S even where the numerics agree exactly.

The rule, as vLLM 0.32 applies it (vllm/v1/sample/sampler.py `Sampler.sample`, then
vllm/v1/sample/ops/topk_topp_sampler.py `apply_top_k_top_p_pytorch` / `apply_top_k_only`; the CPU build has
no Triton and takes these paths), and as HF transformers' Temperature -> TopK -> TopP warpers apply it:

1. z / T (fp32);
2. top-k: keep every logit >= the k-th largest (ties at the boundary are all kept);
3. top-p over the softmax of what top-k kept: sort ascending, cumulative sum, drop where the cumulative
   sum <= 1 − p, never the largest (ties at the boundary fall by the sort's order).

`support_stats` computes, per row of a scorer's log π, log S under π's own distribution for that rule and
log π restricted to the support and renormalised (−inf for a token outside it).
"""

from __future__ import annotations

from dataclasses import dataclass

LOGPROBS_MODES = ("raw", "processed")
"""--logprobs-mode: 'raw' = log-softmax of the raw logits (vLLM raw_logprobs), 'processed' = of the logits
after temperature / top-k / top-p (vLLM processed_logprobs)."""
SUPPORT_ROWS = 256
"""Rows per sort in `support_stats` (bounds the [rows x vocabulary] sort buffers)."""
CANDIDATES = (64, 1024)
"""Largest logits per row the rule is applied to, in turn, on the rows the previous stage did not decide; a
row none decides is sorted whole."""


@dataclass(frozen=True)
class SamplingRule:
    """How the rollout samples: temperature, top-k (0 = off), top-p (1 = off), and which log-probs it returns."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    logprobs_mode: str = "raw"

    @property
    def restricts(self) -> bool:
        """Whether the sampling distribution differs from softmax(z) (temperature, top-k or top-p set)."""
        return self.temperature != 1.0 or self.top_p < 1.0 or self.top_k > 0

    def label(self) -> str:
        """The rollout label's suffix: '' at the defaults, else e.g. '-t0.7-k50-p0.9-processed'."""
        parts = [f"t{self.temperature:g}" if self.temperature != 1.0 else "",
                 f"k{self.top_k}" if self.top_k > 0 else "", f"p{self.top_p:g}" if self.top_p < 1.0 else "",
                 self.logprobs_mode if self.logprobs_mode != "raw" else ""]
        return "".join(f"-{p}" for p in parts if p)

    def config(self) -> dict:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k or "off",
                "logprobs_mode": self.logprobs_mode}


def support_stats(lp, rule: SamplingRule, targets, rows: int = SUPPORT_ROWS):
    """(log S [N], log π restricted to the support and renormalised at `targets` [N]) for log-probs `lp`
    [N, V] (fp32) under `rule`; −inf where the target is outside the support."""
    import torch

    out_s, out_t = [], []
    for start in range(0, lp.shape[0], rows):
        s, t = _support_rows(lp[start:start + rows], rule, targets[start:start + rows].view(-1))
        out_s.append(s)
        out_t.append(t)
    if not out_s:
        return torch.empty(0), torch.empty(0)
    return torch.cat(out_s), torch.cat(out_t)


def _support_rows(lp, rule: SamplingRule, tgt):
    """(log S, renormalised log π at `tgt`) of rows `lp`: the top-`CANDIDATES` stages where they decide the
    support, the full sort (`_sorted`) for the other rows."""
    import torch

    z = lp / rule.temperature if rule.temperature != 1.0 else lp
    # lp is normalised: at T = 1 its log-sum-exp is 0 up to rounding, a pass over the vocabulary saved
    lse = torch.logsumexp(z, dim=-1) if rule.temperature != 1.0 else torch.zeros(z.shape[0], dtype=z.dtype)
    if rule.top_k <= 0 and rule.top_p >= 1.0:  # temperature alone keeps every token
        kept_lse, at = lse, torch.ones(z.shape[0], dtype=torch.bool)
    else:
        kept_lse, at = torch.empty_like(lse), torch.zeros(z.shape[0], dtype=torch.bool)
        todo = torch.arange(z.shape[0])
        for m in CANDIDATES:  # stages narrower than the vocabulary (else the full sort is as cheap)
            if len(todo) and max(m, rule.top_k + 1) < z.shape[-1]:
                every = len(todo) == z.shape[0]  # no copy of the rows at the first stage
                kept_lse[todo], at[todo], ok = _candidates(z if every else z[todo], lse[todo], rule, tgt[todo], m)
                todo = todo[~ok]
        if len(todo):
            kept_lse[todo], at[todo] = _sorted(z[todo], rule, tgt[todo])
    zt = z.gather(1, tgt.view(-1, 1)).view(-1)
    logp_support = torch.where(at, zt - kept_lse, torch.full_like(zt, float("-inf")))
    return kept_lse - lse, logp_support


def _candidates(z, lse, rule: SamplingRule, tgt, m: int):
    """The rule on each row's `m` largest logits (a top-k of k more: k of them): (log-sum-exp of the
    kept, target kept, whether the candidates decide the row). They do when every token outside them is
    dropped: the top-k boundary (ties included) lies inside, and top-p's cumulative sum below the candidates,
    the mass outside them, is <= 1 - p, so vLLM's ascending cumulative sum drops all of them."""
    import torch

    v = z.shape[-1]
    m = min(v, max(m, rule.top_k + 1))
    vals, idx = z.topk(m, dim=-1)  # descending
    keep = torch.ones_like(vals, dtype=torch.bool)
    ok = torch.ones(z.shape[0], dtype=torch.bool)
    base, outside = lse, None
    if 0 < rule.top_k < v:
        kth = vals[:, rule.top_k - 1:rule.top_k]
        keep = vals >= kth
        ok &= (vals[:, -1:] < kth).view(-1) | (m == v)  # a tie of the k-th running past the candidates
        base = torch.logsumexp(vals.masked_fill(~keep, float("-inf")), dim=-1)  # top-p renormalises over top-k
        outside = torch.zeros_like(base)
    if rule.top_p < 1.0:
        probs = torch.exp(vals - base.view(-1, 1)).masked_fill(~keep, 0.0)
        if outside is None:
            outside = (1.0 - probs.sum(dim=-1)).clamp_min(0.0)
        cum = outside.view(-1, 1) + probs.flip(-1).cumsum(dim=-1).flip(-1)  # vLLM's ascending cumulative sum
        drop = cum <= 1 - rule.top_p
        drop[:, 0] = False
        keep &= ~drop
        ok &= (outside <= 1 - rule.top_p) | (m == v)
    kept_lse = torch.logsumexp(vals.masked_fill(~keep, float("-inf")), dim=-1)
    at = ((idx == tgt.view(-1, 1)) & keep).any(dim=-1)
    return kept_lse, at, ok


def _sorted(z, rule: SamplingRule, tgt):
    """The rule as vLLM runs it: (log-sum-exp of the kept, target kept) from a full ascending sort. Only the
    values are sorted (numpy's vectorised sort, about half of torch's sort with indices on x86): the cumulative
    sum and log-sum-exp run on the same sorted values as before, so they agree bitwise. Whether the target is
    kept follows from its value; a row whose target ties the top-p boundary's value across the cut takes
    torch's sort (`_sorted_by_index`), whose order of the tied decides it."""
    import numpy as np
    import torch

    if z.device.type != "cpu":
        return _sorted_by_index(z, rule, tgt)
    zs = torch.from_numpy(np.sort(z.numpy(), axis=-1))  # ascending, the values torch's sort gives
    _, kept_lse, first = _rule_on_sorted(zs, rule)
    zt = z.gather(1, tgt.view(-1, 1))
    rows = torch.arange(zs.shape[0])
    below, at_cut = zs[rows, (first - 1).clamp_min(0)], zs[rows, first.clamp_max(zs.shape[-1] - 1)]
    at = (zt.view(-1) > below) | (first == 0)
    tie = (zt.view(-1) == below) & (below == at_cut) & (first > 0)
    if tie.any():
        at[tie] = _sorted_by_index(z[tie], rule, tgt[tie])[1]
    return kept_lse, at


def _rule_on_sorted(zs, rule: SamplingRule):
    """(values with the dropped set to −inf (a copy), log-sum-exp of the kept, index of the first kept) of
    ascending rows `zs`: top-k keeps >= the k-th largest, top-p drops where the ascending cumulative sum
    <= 1 − p."""
    import torch

    v = zs.shape[-1]
    if 0 < rule.top_k < v:
        zs = zs.masked_fill(zs < zs[:, v - rule.top_k:v - rule.top_k + 1], float("-inf"))
    if rule.top_p < 1.0:
        drop = zs.softmax(dim=-1).cumsum(dim=-1) <= 1 - rule.top_p
        drop[:, -1] = False
        zs = zs.masked_fill(drop, float("-inf"))
    first = torch.isinf(zs).sum(dim=-1)  # the dropped are a prefix: the cumulative sum never decreases
    return zs, torch.logsumexp(zs, dim=-1), first


def _sorted_by_index(z, rule: SamplingRule, tgt):
    """`_sorted` with torch's sort and its indices: the target's position decides it (ties by the sort's order)."""
    import torch

    zs, idx = z.sort(dim=-1)  # ascending, as vLLM sorts
    zs, kept_lse, _ = _rule_on_sorted(zs, rule)
    pos = (idx == tgt.view(-1, 1)).to(torch.int8).argmax(dim=-1, keepdim=True)
    return kept_lse, torch.isfinite(zs.gather(1, pos)).view(-1)
