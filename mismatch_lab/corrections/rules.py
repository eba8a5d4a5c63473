"""Every rule, pure: (Batch, params) -> Decision. Two families (see registry.py for names, defaults and
sources):

* base objectives: the trust region against the anchor a (ρ = π/a) and the weight w they carry, always
  relative to μ (w = r = π/μ when nothing is clipped);
* rollout corrections: what to do with the rollout ratio r_c = π_ref/μ (truncate it, or drop tokens or
  whole sequences); their `weight` is the corrected rollout weight u (u = r_c when nothing changes).

A sign-dependent rule uses A's sign per token (Batch.pos / neg) or per sequence (Batch.seq_pos / seq_neg);
both fire when the advantage is unknown (two-sided). Comparisons are written so that a NaN input is never
silently masked: it flows into the weight and the loss (counted by the metrics, never zeroed).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from mismatch_lab.corrections.batch import (
    Batch,
    Decision,
    seq_any,
    seq_mean,
    seq_sum,
    spread,
)
from mismatch_lab.corrections.divergences import (
    TopK,
    binary_kl,
    binary_tv,
    topk_kl,
    topk_tv,
)

Params = Mapping[str, float]


# -- base objectives --------------------------------------------------------------------------------
def pg_is(b: Batch, p: Params) -> Decision:
    """No trust region: M = 1, w = r."""
    return Decision.masking(b, torch.zeros_like(b.mask), b.r)


def tis(b: Batch, p: Params) -> Decision:
    """Legacy PG-TIS objective: w = min(r, tis_cap) (= pg_is with token_tis at that cap)."""
    return Decision(b.mask, b.r.clamp(max=p["tis_cap"]), b.r > p["tis_cap"])


def grpo(b: Batch, p: Params) -> Decision:
    """PPO clip in the advantage's direction: M = 0 where (A>0, ρ > 1+ε_high) or (A<0, ρ < 1−ε_low); w = r."""
    flagged = (b.pos & (b.rho > 1 + p["eps_high"])) | (b.neg & (b.rho < 1 - p["eps_low"]))
    return Decision.masking(b, flagged, b.r)


def cispo(b: Batch, p: Params) -> Decision:
    """CISPO: M = 1, w = clip(ρ, 1−ε_low, 1+ε_high) · a/μ (every token keeps its gradient)."""
    clipped = b.rho.clamp(min=1 - p["cispo_eps_low"], max=1 + p["cispo_eps_high"])
    weight = clipped if b.la is b.lmu else clipped * (b.la - b.lmu).exp()
    return Decision(b.mask, weight, (clipped != b.rho) & ~b.rho.isnan())  # a NaN ratio is not "clipped"


def _dppo(divergence, delta_key: str = "delta"):
    def rule(b: Batch, p: Params) -> Decision:
        """DPPO (Eq. 12): M = 0 where the token leaves the trust region in its advantage's direction,
        (A>0, ρ>1, D>δ) or (A<0, ρ<1, D>δ); w = r."""
        d = divergence(b)
        flagged = ((b.pos & (b.rho > 1)) | (b.neg & (b.rho < 1))) & (d > p[delta_key])
        out = Decision.masking(b, flagged, b.r)
        out.divergence = d
        return out

    return rule


NEEDS_TOPK = ("needs `topk` (TopK with anchor_logps and logps [B, T, K]); request top-K log-probs "
              "from the rollout engine or use a dppo_binary_* objective")


def _topk(b: Batch) -> TopK:
    if b.topk is None:
        raise ValueError(f"dppo_topk_* {NEEDS_TOPK}")
    return b.topk


dppo_binary_tv = _dppo(lambda b: binary_tv(b.lp, b.la))
dppo_binary_kl = _dppo(lambda b: binary_kl(b.lp, b.la))
dppo_topk_tv = _dppo(lambda b: topk_tv(_topk(b)))
dppo_topk_kl = _dppo(lambda b: topk_kl(_topk(b)))


def gspo(b: Batch, p: Params) -> Decision:
    """GSPO: sequence ratio s = exp(mean_t log ρ); a sequence is masked where (A>0, s > 1+ε_high) or
    (A<0, s < 1−ε_low); w = exp(mean_t log r) on every token of the sequence (the sequence-level gradient
    s · A · mean_t ∇log π, exact with aggregation seq-mean-token-mean)."""
    log_s = seq_mean(b.log_rho, b.mask)
    dropped = (b.seq_pos & (log_s > math.log1p(p["gspo_eps_high"]))) | (
        b.seq_neg & (log_s < math.log1p(-p["gspo_eps_low"])))
    return Decision.dropping_sequences(b, dropped, spread(seq_mean(b.log_r, b.mask).exp(), b.mask))


def gmpo(b: Batch, p: Params) -> Decision:
    """GMPO: per-token log ρ clipped at +ε where the sequence's A > 0 and at −ε where A < 0 (both when A is
    unknown); a clipped token carries no gradient (M = 0); w = exp(mean_t clipped log ρ) · exp(mean_t log a/μ),
    the geometric mean of the clipped ratios, on every token of the sequence."""
    eps = p["gmpo_eps"]
    pos, neg = spread(b.seq_pos, b.mask) & b.mask, spread(b.seq_neg, b.mask) & b.mask
    up, down = pos & (b.log_rho > eps), neg & (b.log_rho < -eps)
    clipped = torch.where(up, eps, torch.where(down, -eps, b.log_rho))
    if b.la is not b.lmu:
        clipped = clipped + (b.la - b.lmu)
    return Decision.masking(b, up | down, spread(seq_mean(clipped, b.mask).exp(), b.mask))


# -- rollout corrections (on r_c = π_ref / μ) -------------------------------------------------------
def none(b: Batch, p: Params) -> Decision:
    """No correction: u = r_c."""
    return Decision.masking(b, torch.zeros_like(b.mask), b.rc)


def token_tis(b: Batch, p: Params) -> Decision:
    """Token TIS: u = min(r_c, C)."""
    return Decision(b.mask, b.rc.clamp(max=p["cap"]), b.mask & (b.rc > p["cap"]))


def seq_tis(b: Batch, p: Params) -> Decision:
    """Sequence TIS: every token weighted min(exp(Σ_t log r_c), C)."""
    log_seq = seq_sum(b.log_rc, b.mask)
    u = spread(log_seq.clamp(max=math.log(p["cap"])).exp(), b.mask)
    return Decision(b.mask, u, b.mask & spread(log_seq > math.log(p["cap"]), b.mask))


def token_mis(b: Batch, p: Params) -> Decision:
    """Token MIS: drop tokens with r_c > C."""
    return Decision.masking(b, b.rc > p["cap"], b.rc)


def icepop(b: Batch, p: Params) -> Decision:
    """IcePop: drop tokens with r_c outside [low, high]."""
    return Decision.masking(b, (b.rc < p["low"]) | (b.rc > p["high"]), b.rc)


def seq_mis(b: Batch, p: Params) -> Decision:
    """Sequence MIS: drop sequences whose product ratio exp(Σ_t log r_c) exceeds C."""
    return Decision.dropping_sequences(b, seq_sum(b.log_rc, b.mask) > math.log(p["cap"]), b.rc)


def geo_mis(b: Batch, p: Params) -> Decision:
    """Geo-RS: drop sequences whose geometric-mean ratio exp(mean_t log r_c) leaves [low, high]."""
    g = seq_mean(b.log_rc, b.mask)
    return Decision.dropping_sequences(b, (g < math.log(p["low"])) | (g > math.log(p["high"])), b.rc)


def k3_rs(b: Batch, p: Params) -> Decision:
    """k3 rejection: drop sequences with mean_t (r_c − log r_c − 1) above the threshold."""
    k3 = torch.where(b.log_rc.isinf(), torch.inf, b.rc - b.log_rc - 1)  # r_c = 0 or inf: k3 = inf, not NaN
    return Decision.dropping_sequences(b, seq_mean(k3, b.mask) > p["threshold"], b.rc)


def veto(b: Batch, p: Params) -> Decision:
    """Veto: drop a sequence with any token r_c below the floor."""
    return Decision.dropping_sequences(b, seq_any(b.log_rc < math.log(p["floor"]), b.mask), b.rc)


def opsm(b: Batch, p: Params) -> Decision:
    """Off-policy sequence masking: drop sequences with A < 0 and mean_t (log μ − log π_ref) > δ."""
    return Decision.dropping_sequences(b, b.seq_neg & (seq_mean(-b.log_rc, b.mask) > p["delta"]), b.rc)


def prime_rl_mask(b: Batch, p: Params) -> Decision:
    """prime-rl's default mask on Δp = π_ref − μ: drop (A>0, Δp > t) and (A<0, Δp < −t)."""
    dp = b.lref.exp() - b.lmu.exp()
    return Decision.masking(b, (b.pos & (dp > p["threshold"])) | (b.neg & (dp < -p["threshold"])), b.rc)
