"""prime-rl's RL losses (PrimeIntellect-ai/prime-rl @559b4477, src/prime_rl/trainer/rl/loss.py: the default
DPPO+KL loss and the `ipo` loss; packages/prime-rl-configs/.../configs/trainer.py: their defaults;
src/prime_rl/trainer/rl/train.py and trainer/utils.py: how the loss is normalized and its metrics logged).

prime-rl keeps no π_old: both losses read the trainer's current π against the rollout's μ, with r = π/μ
(not detached, not truncated) and Δp = π − μ:

  default   M = 1 where (A > 0 and Δp > dppo_mask_high) or (A ≤ 0 and Δp < −dppo_mask_low) — a token with
            A = 0 is tested on the low side, so it can be masked (and counted in is_masked);
  ipo       M = 1 where |Δp| > ipo_threshold, whatever A;
  both      ℓ_t = −(1 − M_t)·adv_tau·A_t·r_t + kl_tau·(log r_t)² on response tokens;
            loss = Σ_{b,t} ℓ / max(N, 1), N the batch's response tokens (one rank, one micro-batch).

The (log r)² term reads the current π, so it pulls on every response token, masked or not.
Result.weight is r on the response tokens; Result.keep is the response minus M.
Metrics under prime-rl's names, as its Tensors.compute_stats logs them (mean, median, std, min, max):
per sequence masked_mismatch_kl, unmasked_mismatch_kl (k3 = r − log r − 1 over the masked / kept tokens),
is_masked (and, default loss only, is_masked_low, is_masked_high, masked_advantage_positive,
masked_advantage_negative) — each a fraction of that sequence's tokens, 0 when the set is empty, the fractions
of bool sets in float32 as prime-rl divides them; and per token mismatch_kl/all (k3 on every response token).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mismatch_lab.corrections.frameworks.base import Preset, Result, Tokens

SOURCE = ("PrimeIntellect-ai/prime-rl @559b4477, src/prime_rl/trainer/rl/loss.py (default_loss_fn, ipo_loss_fn, "
          "compute_loss), trainer/rl/train.py, trainer/utils.py (Tensors.compute_stats)")
STATS = ("mean", "median", "std", "min", "max")


def _safe_fraction(values: torch.Tensor, within: torch.Tensor) -> torch.Tensor:
    """Per sequence: Σ values over `within` / max(|within|, 1) (a bool's count divides in float32, as prime-rl)."""
    total = torch.where(within, values, torch.zeros((), dtype=values.dtype)).sum(-1)
    return total / within.sum(-1).clamp(min=1)


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    """prime-rl's compute_stats on a 1-D tensor (median: the lower middle value, std: unbiased)."""
    if values.numel() == 0:
        return {f"{prefix}/{s}": float("nan") for s in STATS}
    return {f"{prefix}/mean": values.mean().item(), f"{prefix}/median": values.median().item(),
            f"{prefix}/std": values.std().item() if values.numel() > 1 else float("nan"),  # torch: NaN + a warning
            f"{prefix}/min": values.min().item(),
            f"{prefix}/max": values.max().item()}


def _masked(t: Tokens, s: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The masked tokens M and, for the default loss, its low / high parts ([B, T] bool, not yet ∩ response)."""
    dp = t.logp.detach().exp() - t.logp_rollout.exp()
    if s["type"] == "ipo":
        return {"is_masked": dp.abs() > s["ipo_threshold"]}
    high, low = dp > s["dppo_mask_high"], dp < -s["dppo_mask_low"]
    up = t.advantages > 0
    return {"is_masked": torch.where(up, high, low), "is_masked_low": (t.advantages < 0) & low,
            "is_masked_high": up & high}


def rl_loss(t: Tokens, s: Mapping[str, Any]) -> Result:
    """prime-rl's default or ipo loss (settings['type']); formula in the module docstring."""
    log_r = t.logp - t.logp_rollout
    r = log_r.exp()
    parts = _masked(t, s)
    masked = parts["is_masked"]
    keep, dropped = t.mask & ~masked, t.mask & masked
    per_token = -(keep * (s["adv_tau"] * t.advantages) * r) + s["kl_tau"] * (t.mask * log_r ** 2)
    loss = per_token.sum() / t.mask.sum().clamp(min=1)
    with torch.no_grad():
        k3 = r - log_r - 1
        per_seq = {"masked_mismatch_kl": _safe_fraction(k3, dropped),
                   "unmasked_mismatch_kl": _safe_fraction(k3, keep)}
        per_seq.update({name: _safe_fraction(part, t.mask) for name, part in parts.items()})
        if s["type"] == "default":
            per_seq["masked_advantage_positive"] = _safe_fraction(t.advantages > 0, dropped)
            per_seq["masked_advantage_negative"] = _safe_fraction(t.advantages < 0, dropped)
        metrics = {k: v for name, x in per_seq.items() for k, v in _stats(name, x).items()}
        metrics.update(_stats("mismatch_kl/all", k3[t.mask]))
    return Result(loss, keep, (r * t.mask).detach(), metrics)


_DEFAULT = {"type": "default", "dppo_mask_low": 0.2, "dppo_mask_high": 0.2, "adv_tau": 1.0, "kl_tau": 1e-3}
_IPO = {"type": "ipo", "ipo_threshold": 0.1, "adv_tau": 1.0, "kl_tau": 1e-3}

PRESETS = (
    Preset("prime-rl/default", "prime-rl", SOURCE,
           "M where (A>0, π − μ > 0.2) or (A≤0, π − μ < −0.2); ℓ = −(1−M)·A·π/μ + 1e-3·(log π/μ)², "
           "summed / response tokens", _DEFAULT, rl_loss, default=True),
    Preset("prime-rl/ipo", "prime-rl", SOURCE,
           "M where |π − μ| > 0.1; ℓ = −(1−M)·A·π/μ + 1e-3·(log π/μ)², summed / response tokens", _IPO, rl_loss),
)
