"""Divergences between the anchor a and π at one token, on detached tensors (fp32 or wider); shapes
[B, T] or, for top-K, [B, T, K] -> [B, T]. Equation numbers follow v3 of the DPPO paper (arXiv 2602.04879).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from mismatch_lab.corrections.leftover import leftover_floor


@dataclass
class TopK:
    """Per-token top-K log-probs for `dppo_topk_tv` / `dppo_topk_kl` (DPPO Eqs. 15-16).

    The K slots of token (b, t) are the rollout engine's top-K ids at that step with the sampled token
    included (K or K+1 ids; pad to a common width and mark padding with `valid`). Every token outside the
    slots falls into one 'other' bucket: p(other) = 1 − Σ_k p_k, for the anchor and for π alike (two
    leftovers both below leftover.leftover_floor count as equal: rounding, not mass).

        anchor_logps  [B, T, K]  log-probs of the anchor policy at those ids: μ from the rollout engine when
                                 cfg.anchor == 'rollout', π_old recomputed by the trainer when 'old'
        logps         [B, T, K]  log π of the current policy at the same ids (e.g. gathered from the same
                                 log-softmax as `logp`); detached inside, since the mask is a hard gate:
                                 no gradient ever flows through the divergence
        valid         [B, T, K]  bool, False on padding slots (their values are ignored); None = all valid
    A plain dict with these keys is accepted as well.
    """

    anchor_logps: torch.Tensor
    logps: torch.Tensor
    valid: torch.Tensor | None = None

    @classmethod
    def coerce(cls, obj: TopK | Mapping) -> TopK:
        if isinstance(obj, TopK):
            return obj
        if isinstance(obj, Mapping):
            unknown = set(obj) - {"anchor_logps", "logps", "valid"}
            if unknown or "anchor_logps" not in obj or "logps" not in obj:
                raise ValueError(f"topk dict needs keys 'anchor_logps', 'logps' (optional 'valid'); got {sorted(obj)}")
            return cls(obj["anchor_logps"], obj["logps"], obj.get("valid"))
        raise ValueError(f"topk must be a TopK or a dict with anchor_logps/logps/valid, not {type(obj).__name__}")


# ----------------------------------------------------------------------------------------------------
# divergences (on detached tensors, fp32 or wider; shapes [B, T] or [B, T, K] -> [B, T])


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 − exp(x)) for x <= 0, accurate at both ends (x → 0⁻ and x → −inf)."""
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def binary_tv(logp: torch.Tensor, logp_anchor: torch.Tensor) -> torch.Tensor:
    """Binary TV |π − a| of the sampled token (DPPO Eq. 13); [B, T] -> [B, T]."""
    return (logp.exp() - logp_anchor.exp()).abs()


def binary_kl(logp: torch.Tensor, logp_anchor: torch.Tensor) -> torch.Tensor:
    """KL(Bern(a) ‖ Bern(π)) = a log(a/π) + (1−a) log((1−a)/(1−π)) (DPPO Eq. 14), nats; 0·log 0 = 0.

    Log-probs a hair above 0 (engine rounding) are read as 0, where log(1 − p) would otherwise be nan."""
    logp, logp_anchor = logp.clamp(max=0), logp_anchor.clamp(max=0)
    a = logp_anchor.exp()
    head = a * (logp_anchor - logp)
    tail = (1 - a) * (_log1mexp(logp_anchor) - _log1mexp(logp))
    return head + torch.where(a < 1, tail, torch.zeros_like(tail))


def _topk_parts(topk: TopK):
    """(la, lq, p, q, p_other, q_other): slot log-probs and probabilities (0 on padding) of anchor and π,
    and the 'other' bucket's probability for each: 1 − Σ_k p_k clamped at 0 (rounding in the engines can
    push the sum a hair above 1), and 0 on both sides where both lie below leftover.leftover_floor of the
    slot count (rounding, not mass: treated as equal, so the bucket adds nothing to TV or KL)."""
    dt = torch.promote_types(topk.logps.dtype, torch.float32)
    la = topk.anchor_logps.detach().to(dt)
    lq = topk.logps.detach().to(dt)
    p, q = la.exp(), lq.exp()
    n_slots = la.shape[-1]
    if topk.valid is not None:
        zero = torch.zeros((), dtype=dt, device=p.device)
        p, q = torch.where(topk.valid, p, zero), torch.where(topk.valid, q, zero)
        n_slots = topk.valid.sum(-1)
    po, qo = (1 - p.sum(-1)).clamp(min=0), (1 - q.sum(-1)).clamp(min=0)
    floor = leftover_floor(n_slots)
    equal = (po < floor) & (qo < floor)
    return la, lq, p, q, po.masked_fill(equal, 0), qo.masked_fill(equal, 0)


def topk_tv(topk: TopK) -> torch.Tensor:
    """½ Σ_{a ∈ top-K ∪ {other}} |p_anchor(a) − p_π(a)| (DPPO Eq. 15); -> [B, T]. Leftovers both below the
    floor (leftover.py) count as equal."""
    _, _, p, q, po, qo = _topk_parts(topk)
    return 0.5 * ((q - p).abs().sum(-1) + (qo - po).abs())


def topk_kl(topk: TopK) -> torch.Tensor:
    """Σ_{a ∈ top-K ∪ {other}} p_anchor(a) log(p_anchor(a) / p_π(a)) (DPPO Eq. 16), nats; -> [B, T].

    Slots use the given log-probs directly (no exp/log round trip); 0 · log 0 = 0 for empty slots/buckets.
    Leftovers both below the floor (leftover.py) count as equal: the 'other' term is 0 there, not
    a · log(a / 0) = +∞ for a rollout leftover of 1e-9 against a trainer's clamped to 0."""
    la, lq, p, _, po, qo = _topk_parts(topk)
    zero = torch.zeros((), dtype=p.dtype, device=p.device)
    slots = torch.where(p > 0, p * (la - lq), zero).sum(-1)
    other = torch.where(po > 0, po * (po.log() - qo.log()), zero)
    return slots + other
