"""SkyRL's registered policy losses (NovaSky-AI/SkyRL @a9564572, skyrl/backends/skyrl_train/utils/ppo_utils.py:
PolicyLossRegistry and the function each name maps to), one function per loss on the tokens, for skyrl.py.

Each function takes the tokens, the advantages after SkyRL's loss-reduction scaling (A', see skyrl.REDUCTIONS),
the response mask as floats and the preset's settings, and returns a Term: the per-token loss before the
off-policy correction and the sum over the loss mask, a gate ([B, T], 0 where the loss itself zeroes a token:
DPPO's mask, rollout_is's out-of-range tokens, clip_cov's drawn tokens), the weight on μ it applies itself
(π/μ for dppo, the calibrated or clamped π/μ for rollout_is and cispo anchored on the rollout; 1 otherwise) and
its metrics under SkyRL's names. Ratios go through safe_exp_delta (float32, ±20) where SkyRL's code does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from mismatch_lab.corrections.frameworks.base import Tokens

CLIP = 20.0
"""safe_exp_delta's clamp on a log ratio."""


class Term(NamedTuple):
    loss: torch.Tensor
    gate: torch.Tensor
    weight: torch.Tensor
    metrics: dict[str, float]


def safe_exp(delta: torch.Tensor) -> torch.Tensor:
    """safe_exp_delta: exp of the log ratio clamped to ±20, computed in float32."""
    return delta.to(torch.float32).clamp(-CLIP, CLIP).exp().to(delta.dtype)


def mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    """masked_mean(values, mask).item(): Σ values·mask / max(Σ mask, 1)."""
    return ((values * mask).sum() / mask.sum().clamp(min=1.0)).item()


def _ones(m: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(m)


def _clipped(ratio: torch.Tensor, a: torch.Tensor, m: torch.Tensor, s: Mapping[str, Any]):
    """PPO's −min(r·A', clip(r)·A') and its clip_ratio."""
    surr1, surr2 = ratio * a, ratio.clamp(1 - s["eps_clip_low"], 1 + s["eps_clip_high"]) * a
    return -torch.min(surr1, surr2), {"clip_ratio": mean((-surr2 > -surr1).to(m.dtype), m)}


def ppo(t: Tokens, a: torch.Tensor, m: torch.Tensor, s: Mapping[str, Any]) -> Term:
    """regular and dual_clip: ppo_policy_loss (dual clip: min(ℓ, −c·A') where A' < 0)."""
    loss, metrics = _clipped(safe_exp(t.logp - t.logp_old), a, m, s)
    if s["policy_loss_type"] == "dual_clip":
        loss = torch.where(a < 0, torch.min(-a * s["clip_ratio_c"], loss), loss)
    return Term(loss, _ones(m), _ones(m), metrics)


def gspo(t: Tokens, a: torch.Tensor, m: torch.Tensor, s: Mapping[str, Any]) -> Term:
    """gspo_policy_loss (GSPO-token): r = exp(log π − sg(log π) + sg(mean_t log π/π_old)), log capped at 10."""
    seq = ((t.logp - t.logp_old) * m).sum(-1) / m.sum(-1).clamp(min=1.0)
    log_ratio = (t.logp - t.logp.detach() + seq.unsqueeze(-1).detach()).clamp(max=10)
    loss, metrics = _clipped(torch.exp(log_ratio), a, m, s)
    return Term(loss, _ones(m), _ones(m), metrics)


def sapo(t: Tokens, a: torch.Tensor, m: torch.Tensor, s: Mapping[str, Any]) -> Term:
    """sapo_policy_loss: ℓ = −σ(τ(r − 1))·4/τ·A', τ = tau_pos where A' > 0, else tau_neg."""
    ratio = torch.exp(torch.clamp(t.logp - t.logp_old, min=-CLIP, max=CLIP))
    taus = torch.where(a > 0, torch.as_tensor(s["tau_pos"], dtype=a.dtype),
                       torch.as_tensor(s["tau_neg"], dtype=a.dtype))
    gates = torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)
    return Term(-gates * a, _ones(m), _ones(m), {"clip_ratio": 0.0})


def cispo(t: Tokens, a: torch.Tensor, m: torch.Tensor, s: Mapping[str, Any]) -> Term:
    """compute_policy_loss_cispo: ℓ = −A'·sg(clip(π/π_b, 1 − low, 1 + high))·log π, π_b = π_old or μ."""
    rollout = s["cispo_anchor"] == "rollout"
    ratio = safe_exp(t.logp - (t.logp_rollout if rollout else t.logp_old)).detach()
    low, high = 1 - s["cispo_eps_clip_low"], 1 + s["cispo_eps_clip_high"]
    clamped = ratio.clamp(low, high)
    active = ratio[m.bool()] if m.any() else ratio
    metrics = {"clip_ratio": mean(((ratio < low) | (ratio > high)).to(m.dtype), m),
               "cispo/ratio_mean": mean(ratio, m), "cispo/ratio_clamped_mean": mean(clamped, m),
               "cispo/ratio_max": active.max().item(), "cispo/ratio_min": active.min().item()}
    return Term(-a * clamped * t.logp, _ones(m), clamped if rollout else _ones(m), metrics)


def rollout_is(t: Tokens, a: torch.Tensor, m: torch.Tensor, s: Mapping[str, Any]) -> Term:
    """rollout_is_policy_loss: ℓ = −sg(r·1[1 − low < r < 1 + high])·A'·log π, r = π/μ."""
    ratio = safe_exp(t.logp - t.logp_rollout).detach()
    inside = (ratio > 1 - s["eps_clip_low"]) & (ratio < 1 + s["eps_clip_high"])
    calibrated = torch.where(inside, ratio, 0.0)
    return Term(-(calibrated * a * t.logp), inside.to(m.dtype), calibrated,
                {"clip_ratio": mean((~inside).to(m.dtype), m)})


def dppo(t: Tokens, a: torch.Tensor, m: torch.Tensor, s: Mapping[str, Any]) -> Term:
    """dppo_policy_loss: ℓ = −r·A'·M, r = π/μ, M the binary TV or KL mask."""
    ratio = safe_exp(t.logp - t.logp_rollout)
    gate = _dppo_mask(t, s)
    return Term(-(ratio * a * gate), gate, ratio.detach(), {"clip_ratio": mean((gate == 0).to(m.dtype), m)})


def _dppo_mask(t: Tokens, s: Mapping[str, Any]) -> torch.Tensor:
    """DPPO's M ([B, T], 1 kept / 0 masked) on π against μ."""
    lp, lmu, a = t.logp.detach(), t.logp_rollout, t.advantages
    p, mu = lp.exp(), lmu.exp()
    diff = p - mu
    if s["dppo_type"] == "binary_tv":
        out = ((a > 0) & (diff > s["delta_high"])) | ((a < 0) & (-diff > s["delta_low"]))
    else:
        kl = mu * (lmu - lp) + (1 - mu) * torch.log((1 - mu + 1e-8) / (1 - p + 1e-8))
        out = (((a > 0) & (diff > 0) & (kl > s["delta_high"]))
               | ((a < 0) & (diff < 0) & (kl > s["delta_low"])))
    return (~out).to(a.dtype)


def clip_cov(t: Tokens, a: torch.Tensor, m: torch.Tensor, s: Mapping[str, Any]) -> Term:
    """compute_policy_loss_clip_cov: PPO's max, with up to clip_ratio·N tokens whose covariance
    (A' − mean A')(log π − mean log π) lies in (lb, ub) and that PPO did not clip, drawn at random with torch's
    global generator as SkyRL does, zeroed."""
    ratio = torch.exp(t.logp - t.logp_old)
    pg1, pg2 = -a * ratio, -a * ratio.clamp(1 - s["eps_clip_low"], 1 + s["eps_clip_high"])
    cov = ((a - (a * m).sum() / m.sum().clamp(min=1.0))
           * (t.logp.detach() - (t.logp.detach() * m).sum() / m.sum().clamp(min=1.0)))
    eligible = (m > 0) & ~(pg2 > pg1) & (cov < s["clip_cov_ub"]) & (cov > s["clip_cov_lb"])
    picked = torch.nonzero(eligible)
    if len(picked) > 0:
        count = max(int(s["clip_cov.clip_ratio"] * m.sum().item()), 1)
        picked = picked[torch.randperm(len(picked))[:min(count, len(picked))]]
    corr = torch.ones_like(a)
    corr[picked[:, 0], picked[:, 1]] = 0
    return Term(torch.maximum(pg1, pg2) * corr, corr, _ones(m), {"clip_ratio": mean((corr == 0).to(m.dtype), m)})


def kl_cov(t: Tokens, a: torch.Tensor, m: torch.Tensor, s: Mapping[str, Any]) -> Term:
    """compute_policy_loss_kl_cov: −A'·r, plus ppo_kl_coef·|log r| on the kl_cov_frac of response tokens with the
    largest covariance (A' − mean)(log π − mean) (torch.topk over the response tokens in row-major order)."""
    log_ratio = t.logp - t.logp_old
    ratio = torch.exp(log_ratio)
    valid = m > 0
    adv, logp = a[valid].detach(), t.logp[valid].detach()
    selected = torch.zeros_like(valid)
    if len(adv) > 0:
        cov = (adv - adv.mean()) * (logp - logp.mean())
        k = max(1, int(len(cov) * s["kl_cov_frac"]))
        rows = torch.nonzero(valid.reshape(-1), as_tuple=True)[0][torch.topk(cov, min(k, len(cov))).indices]
        selected.view(-1)[rows] = True
    loss = torch.where(selected, -a * ratio + s["ppo_kl_coef"] * log_ratio.abs(), -a * ratio)
    return Term(loss, _ones(m), _ones(m), {"clip_ratio": 0.0})


def cross_entropy(t: Tokens, a: torch.Tensor, m: torch.Tensor, s: Mapping[str, Any]) -> Term:
    """cross_entropy_loss (SFT): ℓ = −log π; advantages unused."""
    return Term(-t.logp, _ones(m), _ones(m), {"clip_ratio": 0.0})


def importance_sampling(t: Tokens, a: torch.Tensor, m: torch.Tensor, s: Mapping[str, Any]) -> Term:
    """importance_sampling_loss (Tinker's): ℓ = −(π/π_old)·A', unclipped; logs importance_ratio."""
    ratio = torch.exp(t.logp - t.logp_old)
    return Term(-(ratio * a), _ones(m), _ones(m),
                {"importance_ratio": ((ratio.detach() * m).sum() / m.sum()).item()})


@dataclass(frozen=True)
class Loss:
    fn: Callable[[Tokens, torch.Tensor, torch.Tensor, Mapping[str, Any]], Term]
    source: str
    """SkyRL's function in ppo_utils.py."""
    corrects: bool
    """True where SkyRL's function calls apply_off_policy_correction."""


LOSSES = {"regular": Loss(ppo, "ppo_policy_loss", True), "dual_clip": Loss(ppo, "ppo_policy_loss", True),
          "gspo": Loss(gspo, "gspo_policy_loss", True), "cispo": Loss(cispo, "compute_policy_loss_cispo", True),
          "clip_cov": Loss(clip_cov, "compute_policy_loss_clip_cov", False),
          "kl_cov": Loss(kl_cov, "compute_policy_loss_kl_cov", False), "sapo": Loss(sapo, "sapo_policy_loss", True),
          "cross_entropy": Loss(cross_entropy, "cross_entropy_loss", False),
          "importance_sampling": Loss(importance_sampling, "importance_sampling_loss", False),
          "dppo": Loss(dppo, "dppo_policy_loss", True), "rollout_is": Loss(rollout_is, "rollout_is_policy_loss", True)}
"""PolicyLossRegistry's built-in entries (policy_loss_type → function)."""
