"""verl 0.9.1's actor policy losses (verl/trainer/ppo/core_algos.py, `policy_loss.loss_mode`) and `agg_loss`, on
the Actor's view of a batch (frameworks/verl.py: the sources, the notation and the two modes).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from mismatch_lab.corrections.frameworks.verl_rollout_corr import (
    GUARD,
    SAFETY,
    _item,
    _mean,
    _share,
    _sum,
)

# --------------------------------------------------------------------------- the actor's policy losses

class Actor:
    """What verl's `ppo_loss` hands a policy loss: log π (grad), log π_old, A, the bool response mask the
    actor sees, the rollout IS weights (or None), batch_num_tokens (tokens of the actor's mask before any
    in-loss rejection) and global_batch_size (rows)."""

    def __init__(self, lp, old, adv, m, w, n_tokens: int, n_seqs: int):
        self.lp, self.old, self.adv, self.m, self.w = lp, old, adv, m, w
        self.n_tokens, self.n_seqs = n_tokens, n_seqs

    def weigh(self, losses: torch.Tensor) -> torch.Tensor:
        """The per-token losses times the rollout IS weight, when there is one."""
        return losses if self.w is None else losses * self.w

    def times_w(self, x: torch.Tensor) -> torch.Tensor:
        x = x.detach()
        return x if self.w is None else x * self.w


def aggregate(mat: torch.Tensor, a: Actor, mode: str) -> torch.Tensor:
    """agg_loss: token-mean Σ m·L / batch_num_tokens; token-sum Σ m·L; seq-mean-token-sum Σ_rows (Σ_t m·L) /
    global_batch_size (-norm: also / T, the padded width); seq-mean-token-mean Σ_rows (Σ_t m·L / (n_row +
    1e-8)) / global_batch_size. Rows without tokens add nothing."""
    m = a.m
    if mode == "token-mean":
        return _sum(mat, m) / a.n_tokens
    if mode == "token-sum":
        return _sum(mat, m)
    if mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        rows = torch.sum(mat * m, dim=-1)
        loss = _sum(rows, (torch.sum(m, dim=-1) > 0).float()) / a.n_seqs
        return loss / m.shape[-1] if mode.endswith("-norm") else loss
    if mode == "seq-mean-token-mean":
        count = torch.sum(m, dim=-1)
        rows = torch.sum(mat * m, dim=-1) / (count + GUARD)
        return _sum(rows, (count > 0).float()) / a.n_seqs
    raise ValueError(f"verl has no loss_agg_mode {mode!r}")


def _ratio(a: Actor, clamp: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(ℓ = log π − log π_old, clamped to ±20 unless clamp=False; ρ = e^ℓ)."""
    log_ratio = a.lp - a.old
    if clamp:
        log_ratio = log_ratio.clamp(-SAFETY, SAFETY)
    return log_ratio, torch.exp(log_ratio)


def _pg_metrics(clipfrac, ppo_kl, lower) -> dict[str, float]:
    return {"actor/pg_clipfrac": _item(clipfrac), "actor/ppo_kl": _item(ppo_kl),
            "actor/pg_clipfrac_lower": _item(lower)}


def vanilla(a: Actor, s: Mapping[str, Any]):
    """PPO with dual clip (compute_policy_loss_vanilla): ρ = e^{clamp(ℓ, ±20)},
    L = max(−Aρ, −A·clip(ρ, 1−low, 1+high)); where A < 0 also L ← min(L, −A·c) (c = clip_ratio_c = 3), i.e.
    the loss of a negative-advantage token is capped at 3|A| and its gradient vanishes beyond it. Times w.
    pg_clipfrac: share of tokens where the clipped term is the larger (A = 0 tokens count in the denominator);
    pg_clipfrac_lower: share with A < 0 capped by c; ppo_kl: mean(−ℓ)."""
    log_ratio, ratio = _ratio(a)
    adv, m = a.adv, a.m
    plain = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1 - s["clip_ratio_low"], 1 + s["clip_ratio_high"])
    worst = torch.maximum(plain, clipped)
    cap = -adv * s["clip_ratio_c"]
    capped = torch.min(cap, worst)
    lower = _mean(torch.gt(worst, cap) * (adv < 0).float(), m)
    losses = a.weigh(torch.where(adv < 0, capped, worst))
    metrics = _pg_metrics(_share(torch.gt(clipped, plain), m), _mean(-log_ratio, m), lower)
    return aggregate(losses, a, s["loss_agg_mode"]), a.times_w(ratio), None, metrics


def _dppo(a: Actor, s: Mapping[str, Any], valid_up, valid_down):
    """DPPO's shared part: L = −A·sg(min(ρ, c))·log π·valid, valid = valid_up where A > 0 else valid_down
    (a mask: invalid tokens give no gradient but stay in the denominator). pg_clipfrac = share invalid;
    pg_clipfrac_lower = share valid with ρ > c (truncated)."""
    log_ratio, ratio = _ratio(a)
    c = s["clip_ratio_c"]
    truncated = torch.clamp(ratio, max=c).detach()
    valid = torch.where(a.adv > 0, valid_up, valid_down).detach().float()
    losses = a.weigh(-a.adv * truncated * a.lp * valid)
    metrics = _pg_metrics(_mean((1.0 - valid).float(), a.m), _mean(-log_ratio, a.m),
                          _mean((ratio > c).float() * valid, a.m))
    return aggregate(losses, a, s["loss_agg_mode"]), a.times_w(truncated), valid.bool(), metrics


def dppo_tv(a: Actor, s: Mapping[str, Any]):
    """DPPO-Binary-TV (compute_policy_loss_dppo_tv): with p = π, q = π_old probabilities, a token is valid
    when p − q ≤ clip_ratio_high (A > 0) or p − q ≥ −clip_ratio_low (A ≤ 0); ρ truncated at clip_ratio_c
    (3 through ActorConfig; the function's own fallback 20 never applies)."""
    p, q = torch.exp(a.lp), torch.exp(a.old)
    return _dppo(a, s, (p - q) <= s["clip_ratio_high"], (p - q) >= -s["clip_ratio_low"])


def dppo_kl(a: Actor, s: Mapping[str, Any]):
    """DPPO-Binary-KL (compute_policy_loss_dppo_kl): binary KL D = q(log q − log p) + (1−q)·log((1 − q +
    1e-8)/(1 − p + 1e-8)); valid when D ≤ clip_ratio_high or p ≤ q (A > 0), D ≤ clip_ratio_low or p ≥ q
    (A ≤ 0); ρ truncated at clip_ratio_c."""
    p, q = torch.exp(a.lp), torch.exp(a.old)
    kl = q * (a.old - a.lp) + (1 - q) * torch.log((1.0 - q + 1e-8) / (1.0 - p + 1e-8))
    return _dppo(a, s, (kl <= s["clip_ratio_high"]) | (p <= q), (kl <= s["clip_ratio_low"]) | (p >= q))


def gspo(a: Actor, s: Mapping[str, Any]):
    """GSPO (compute_policy_loss_gspo): per-row s = exp(min(sg(mean_t ℓ) + log π − sg(log π), 10)) (ℓ not
    clamped, the row mean divides by max(n, 1)); L = max(−A·s, −A·clip(s, 1−low, 1+high)), aggregated with
    the actor's loss_agg_mode. pg_clipfrac_lower is always 0."""
    log_ratio = a.lp - a.old
    n = torch.sum(a.m, dim=-1).clamp(min=1)
    row = torch.sum(log_ratio * a.m, dim=-1) / n
    seq_ratio = torch.exp(torch.clamp(a.lp - a.lp.detach() + row.detach().unsqueeze(-1), max=10.0))
    plain = -a.adv * seq_ratio
    clipped = -a.adv * torch.clamp(seq_ratio, 1 - s["clip_ratio_low"], 1 + s["clip_ratio_high"])
    losses = a.weigh(torch.maximum(plain, clipped))
    metrics = _pg_metrics(_share(torch.gt(clipped, plain), a.m), _mean(-log_ratio, a.m), 0.0)
    return aggregate(losses, a, s["loss_agg_mode"]), a.times_w(seq_ratio), None, metrics


def sapo(a: Actor, s: Mapping[str, Any]):
    """SAPO (compute_policy_loss_sapo): soft gate f(ρ) = σ(τ(ρ − 1))·4/τ with τ = tau_pos where A > 0 else
    tau_neg; L = −f(ρ)·A; always aggregated seq-mean-token-mean. pg_clipfrac(_lower) are always 0."""
    log_ratio, ratio = _ratio(a)
    tau = torch.where(a.adv > 0, torch.as_tensor(s["tau_pos"], dtype=a.adv.dtype),
                      torch.as_tensor(s["tau_neg"], dtype=a.adv.dtype))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    losses = a.weigh(-gate * a.adv)
    metrics = _pg_metrics(0.0, _mean(-log_ratio, a.m), 0.0)
    return aggregate(losses, a, "seq-mean-token-mean"), a.times_w(ratio), None, metrics


def gpg(a: Actor, s: Mapping[str, Any]):
    """GPG (compute_policy_loss_gpg): L = −log π·A (times w); logs no metrics of its own."""
    losses = a.weigh(-a.lp * a.adv)
    return aggregate(losses, a, s["loss_agg_mode"]), a.times_w(torch.ones_like(a.lp)), None, {}


def cispo(a: Actor, s: Mapping[str, Any]):
    """CISPO (compute_policy_loss_cispo): L = −sg(clip(ρ, 1−low, 1+high))·A·log π; pg_clipfrac = share with
    ρ clipped; pg_clipfrac_lower always 0."""
    log_ratio, ratio = _ratio(a)
    clipped = torch.clamp(ratio, 1 - s["clip_ratio_low"], 1 + s["clip_ratio_high"])
    losses = a.weigh(-clipped.detach() * a.adv * a.lp)
    metrics = _pg_metrics(_share(ratio != clipped, a.m), _mean(-log_ratio, a.m), 0.0)
    return aggregate(losses, a, s["loss_agg_mode"]), a.times_w(clipped), None, metrics


def geo_mean(a: Actor, s: Mapping[str, Any]):
    """GMPO (compute_policy_loss_geo_mean): ℓ unclamped, clipped per token towards the advantage's sign:
    ℓ' = sgn(A)·min(sgn(A)ℓ, sgn(A)·clamp(ℓ, −low, high)); row ratio R = exp(Σ m ℓ' / (n + 1e-8)), row
    advantage Ā = Σ m A / (n + 1e-8); L_row = −Ā·R (times the rows' geometric mean of w:
    exp(Σ m log(w + 1e-10) / (n + 1e-8))); loss = plain mean over rows (loss_agg_mode unused).
    pg_clipfrac / _lower: share of tokens with ℓ outside [−low, high] and A > 0 / A < 0."""
    log_ratio = a.lp - a.old
    sign = torch.sign(a.adv)
    bounded = torch.clamp(log_ratio, -s["clip_ratio_low"], s["clip_ratio_high"])
    chosen = sign * torch.min(sign * log_ratio, sign * bounded)
    n = a.m.sum(dim=-1)
    ratio = torch.exp((chosen * a.m).sum(dim=-1) / (n + 1e-8))
    adv = (a.adv * a.m).sum(dim=-1) / (n + 1e-8)
    losses = -adv * ratio
    row_w = torch.ones_like(ratio)
    if a.w is not None:
        row_w = torch.exp((torch.log(a.w + 1e-10) * a.m).sum(dim=-1) / (n + 1e-8))
        losses = losses * row_w
    moved = torch.ne(log_ratio, bounded)
    metrics = _pg_metrics(_mean((moved * (a.adv > 0)).float(), a.m), _mean(-log_ratio, a.m),
                          _mean((moved * (a.adv < 0)).float(), a.m))
    weight = (ratio.detach() * row_w).unsqueeze(-1).expand_as(a.lp)
    return torch.mean(losses), weight, None, metrics


def clip_cov(a: Actor, s: Mapping[str, Any]):
    """Clip-Cov (compute_policy_loss_clip_cov): PPO-clip without dual clip and without the ±20 clamp, plus:
    among response tokens the clip left alone whose covariance (A − mean A)(log π − mean log π) lies in
    (clip_cov_lb, clip_cov_ub), max(1, ⌊clip_cov_ratio·n⌋) drawn at random (torch.randperm: the global RNG, as
    verl draws them) lose their loss (a mask). pg_clipfrac = share of those; no pg_clipfrac_lower."""
    log_ratio = a.lp - a.old
    ratio = torch.exp(log_ratio)
    plain = -a.adv * ratio
    clipped = -a.adv * torch.clamp(ratio, 1 - s["clip_ratio_low"], 1 + s["clip_ratio_high"])
    lp = a.lp.detach()
    cov = (a.adv - _mean(a.adv, a.m)) * (lp - _mean(lp, a.m))
    cov = cov.masked_fill(~a.m, -math.inf).masked_fill((clipped > plain) & a.m, -math.inf)
    n_drop = max(int(s["clip_cov_ratio"] * a.m.sum().item()), 1)
    picks = torch.nonzero((cov < s["clip_cov_ub"]) & (cov > s["clip_cov_lb"]) & a.m)
    if len(picks) > 0:
        picks = picks[torch.randperm(len(picks))[: min(n_drop, len(picks))]]
    kept = torch.ones_like(a.adv)
    kept[picks[:, 0], picks[:, 1]] = 0
    losses = a.weigh(torch.maximum(plain, clipped) * kept)
    metrics = {"actor/pg_clipfrac": _item(_share(kept == 0, a.m)), "actor/ppo_kl": _item(_mean(-log_ratio, a.m))}
    return aggregate(losses, a, s["loss_agg_mode"]), a.times_w(ratio), kept != 0, metrics


def kl_cov(a: Actor, s: Mapping[str, Any]):
    """KL-Cov (compute_policy_loss_kl_cov): L = −A·ρ (ρ unclamped, no clip), and on the max(1,
    ⌊kl_cov_ratio·n⌋) response tokens of largest covariance (A − mean A)(log π − mean log π) (plain means over
    the response tokens) L = −A·ρ + ppo_kl_coef·|log ρ|. Logs only ppo_kl = mean |log ρ|."""
    log_ratio = a.lp - a.old
    ratio = torch.exp(log_ratio)
    plain = -a.adv * ratio
    penalised = -a.adv * ratio + s["ppo_kl_coef"] * log_ratio.abs()
    flat = torch.nonzero(a.m.reshape(-1), as_tuple=True)[0]
    adv, lp = a.adv[a.m].detach(), a.lp[a.m].detach()
    chosen = torch.zeros(a.m.numel(), dtype=torch.bool)
    if min(s["kl_cov_ratio"], len(adv)) != 0:
        cov = (adv - adv.mean()) * (lp - lp.mean())
        chosen[flat[torch.topk(cov, max(1, int(len(cov) * s["kl_cov_ratio"])), largest=True).indices]] = True
    losses = a.weigh(torch.where(chosen.view_as(a.m), penalised, plain))
    metrics = {"actor/ppo_kl": _item(_mean(log_ratio.abs(), a.m))}
    return aggregate(losses, a, s["loss_agg_mode"]), a.times_w(ratio), None, metrics


POLICY_LOSSES = {"vanilla": vanilla, "dppo_tv": dppo_tv, "dppo_kl": dppo_kl, "gspo": gspo, "sapo": sapo,
                 "gpg": gpg, "cispo": cispo, "geo_mean": geo_mean, "clip_cov": clip_cov, "kl_cov": kl_cov}
"""policy_loss.loss_mode -> the loss above: (Actor, settings) -> (loss, weight, extra keep mask or None,
metrics)."""
