"""AReaL's PPO actor loss (inclusionAI/AReaL @4aef98d8, areal/utils/functional/functional.py: ppo_actor_loss_fn,
apply_rejection_sampling; areal/trainer/ppo/actor.py: how π_old and μ reach the loss (compute_advantages,
grpo_loss_fn) and what it logs; areal/api/cli_args.py: PPOActorConfig and RejectionSamplingConfig defaults and
the legacy behave_imp_weight_mode mapping; areal/utils/data.py: KLEstimator._compute_approx_kl).

AReaL's names: `logprobs` = π, `proximal_logprobs` = π_old, `old_logprobs` = μ (the behaviour policy). Which
log-probs play π_old and μ depends on two switches:

  use_decoupled_loss=False, recompute_logprob=False (the dataclass default)  π_old := μ: PPO on π/μ, no IS
  use_decoupled_loss=False, recompute_logprob=True   μ := π_old: PPO on π/π_old, μ never read
  use_decoupled_loss=True  (recompute implied)        PPO on π/π_old; rejection_sampling (only here) on π_old/μ

rejection_sampling {level token|sequence, action mask|clamp, metric ratio|kl_k1|kl_k2|kl_k3, agg sum|mean|max,
upper, lower}: w = π_old/μ computed in float32 (non-finite log-ratios set to 0); at sequence level with the
ratio metric w becomes the sequence's geometric mean and the aggregate is taken in log space; `mask` drops the
out-of-bounds tokens/sequences from the loss mask, `clamp` clamps w to [lower or 0, upper] (at sequence level,
only in out-of-bounds sequences). The PPO term (clip eps_clip / eps_clip_higher, dual clip c_clip when set) is
multiplied by w; loss = Σ over kept tokens / the response-token count BEFORE rejection. Without
rejection_sampling no w multiplies the loss, decoupled or not.

Result.keep: the loss mask after rejection; Result.weight: w on kept tokens, 0 on rejected ones, 1 where no
rejection_sampling applies. Metrics under AReaL's stats_tracker names (without the `update/` scope), one
micro-batch: importance_weight, approx_kl, new_logp, old_logp, actor_loss, clip_ratio, dual_clip_ratio over the
pre-rejection loss mask; behave_imp_weight, behave_approx_kl over unclipped_behave_tokens (w > 0 and kept);
clipped_new_logp, clipped_old_logp over clipped_tokens; each as /avg, /min, /max, left out where its
denominator is empty (AReaL drops None); the counts n_valid_tokens, clipped_tokens, dual_clipped_tokens,
unclipped_behave_tokens; rs_filtered_fraction (float32 scalar). GSPO's sequence ratio (importance_sampling_level)
is reproduced; not reproduced: entropy, version-staleness and proximal-approximation (prox_logp_method
loglinear, per-token `versions`) stats, SAPO, M2PO, distillation terms.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mismatch_lab.corrections.frameworks.base import Preset, Result, Tokens

SOURCE = ("inclusionAI/AReaL @4aef98d8, areal/utils/functional/functional.py (ppo_actor_loss_fn, "
          "apply_rejection_sampling), areal/trainer/ppo/actor.py (grpo_loss_fn), areal/api/cli_args.py")


def _roles(t: Tokens, s: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(proximal_logprobs, old_logprobs) as AReaL's actor hands them to the loss."""
    if s["use_decoupled_loss"]:
        return t.logp_old, t.logp_rollout
    anchor = t.logp_old if s["recompute_logprob"] else t.logp_rollout
    return anchor, anchor


def _in_bounds(metric: torch.Tensor, rs: Mapping[str, Any]) -> torch.Tensor:
    if rs["lower"] is not None:
        return (metric >= rs["lower"]) & (metric <= rs["upper"])
    return metric <= rs["upper"]


def _metric(prox: torch.Tensor, old: torch.Tensor, log_ratio: torch.Tensor, name: str) -> torch.Tensor:
    """The per-token rejection metric (KL estimators in float32, unclamped, as KLEstimator computes them)."""
    d = prox.float() - old.float()
    table = {"ratio": lambda: log_ratio.exp(), "kl_k1": lambda: d, "kl_k2": lambda: d ** 2 / 2.0,
             "kl_k3": lambda: (-d).exp() - 1 - (-d)}
    if name not in table:
        raise ValueError(f"AReaL has no rejection metric {name!r} ({', '.join(table)})")
    return table[name]()


def _sequence_aggregate(values: torch.Tensor, m: torch.Tensor, agg: str) -> torch.Tensor:
    """[B, 1] aggregate of `values` over each sequence's response tokens (max: 0 for an empty sequence)."""
    masked = torch.where(m, values, 0.0)
    if agg == "sum":
        return masked.sum(-1, keepdim=True)
    if agg == "mean":
        return masked.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)
    if agg == "max":
        top = values.masked_fill(~m, float("-inf")).max(-1, keepdim=True)[0]
        return torch.where(m.sum(-1, keepdim=True) == 0, torch.zeros_like(top), top)
    raise ValueError(f"AReaL has no rejection agg {agg!r} (sum, mean, max)")


def rejection(prox: torch.Tensor, old: torch.Tensor, m: torch.Tensor, rs: Mapping[str, Any]):
    """apply_rejection_sampling: (kept mask, behave_imp_weight, filtered_fraction)."""
    log_ratio = prox.detach().float() - old.detach().float()
    log_ratio = torch.where(torch.isfinite(log_ratio), log_ratio, 0.0)
    metric = _metric(prox.detach(), old.detach(), log_ratio, rs["metric"])
    w = raw = log_ratio.exp()
    in_bounds, out = None, None
    if rs["level"] == "sequence":
        log_agg = rs["metric"] == "ratio"
        if log_agg:
            w = raw = _sequence_aggregate(log_ratio, m, "mean").exp().expand_as(log_ratio)
        seq = _sequence_aggregate(log_ratio if log_agg else metric, m, rs["agg"])
        ok = _in_bounds(seq.exp() if log_agg else seq, rs).expand_as(m)
        in_bounds, out = (ok, None) if rs["action"] == "mask" else (None, ~ok)
    elif rs["action"] == "mask":
        in_bounds = _in_bounds(metric, rs)
    if rs["action"] == "clamp":
        clamped = w.clamp(min=rs["lower"] if rs["lower"] is not None else 0.0, max=rs["upper"])
        w = clamped if out is None else torch.where(out, clamped, w)
        kept, changed = m, m & (raw != w)
    else:
        kept, changed = m & in_bounds, m & ~in_bounds
    fraction = changed.sum().item() / max(m.sum().item(), 1)
    return kept, torch.where(kept, w, 0.0), fraction


def _ppo(t: Tokens, prox: torch.Tensor, m: torch.Tensor, s: Mapping[str, Any]):
    """The clipped PPO term per token: (pg_loss, ratio, clip_mask, dual_clip_mask); m the kept tokens."""
    adv = t.advantages
    if s["importance_sampling_level"] == "sequence":
        ratio = _sequence_aggregate(t.logp - prox, m, "mean").exp().expand_as(t.logp)
        ratio = torch.where(m, ratio, 0.0)
        adv = torch.where(m, _sequence_aggregate(adv, m, "mean").expand_as(adv), 0.0)
    else:
        ratio = torch.where(m, torch.exp(t.logp - prox), 0)
    high = s["eps_clip"] if s["eps_clip_higher"] is None else s["eps_clip_higher"]
    loss1, loss2 = -adv * ratio, -adv * ratio.clamp(1.0 - s["eps_clip"], 1.0 + high)
    clip = loss1.detach() < loss2.detach()
    pg = torch.max(loss1, loss2)
    dual = torch.zeros_like(clip)
    if s["c_clip"] is not None:
        loss3 = torch.sign(adv) * s["c_clip"] * adv
        dual = loss3.detach() < pg.detach()
        pg = torch.min(pg, loss3)
    return pg, ratio, clip, dual


def _avg_min_max(name: str, values: torch.Tensor, within: torch.Tensor) -> dict[str, float]:
    """stats_tracker's AVG_MIN_MAX over one micro-batch; a key whose denominator is empty is left out."""
    if not within.any():
        return {}
    v = values.detach()
    return {f"{name}/avg": (torch.where(within, v, 0.0).sum() / within.sum()).item(),
            f"{name}/min": torch.where(within, v, float("inf")).min().item(),
            f"{name}/max": torch.where(within, v, -float("inf")).max().item()}


def ppo_actor_loss(t: Tokens, s: Mapping[str, Any]) -> Result:
    """grpo_loss_fn → ppo_actor_loss_fn for AReaL's PPO actor; formula in the module docstring."""
    prox, old = _roles(t, s)
    m = t.mask
    rs = s["rejection_sampling"] if s["use_decoupled_loss"] else None
    kept, w, fraction = (m, None, 0.0) if rs is None else rejection(prox, old, m, rs)
    pg, ratio, clip, dual = _ppo(t, prox, kept, s)
    if w is not None:
        pg = pg * w
    loss = torch.where(kept, pg, 0).sum() / (int(m.sum()) or 1)
    clip, dual = clip & kept, dual & kept
    metrics: dict[str, float] = {"n_valid_tokens": float(m.sum()), "clipped_tokens": float(clip.sum()),
                                 "dual_clipped_tokens": float(dual.sum())}
    per_token = {"importance_weight": ratio, "approx_kl": t.logp - prox, "new_logp": t.logp, "old_logp": old,
                 "actor_loss": pg, "clip_ratio": clip.to(t.logp.dtype), "dual_clip_ratio": dual.to(t.logp.dtype)}
    for name, values in per_token.items():
        metrics.update(_avg_min_max(name, values, m))
    if w is not None:
        behave = (w > 0) & kept
        metrics["unclipped_behave_tokens"] = float(behave.sum())
        metrics.update(_avg_min_max("behave_imp_weight", w, behave))
        metrics.update(_avg_min_max("behave_approx_kl", torch.where(behave, prox - old, 0.0), behave))
        metrics["rs_filtered_fraction"] = torch.tensor(fraction, dtype=torch.float32).item()
    metrics.update(_avg_min_max("clipped_new_logp", torch.where(clip, t.logp.detach(), 0.0), clip))
    metrics.update(_avg_min_max("clipped_old_logp", torch.where(clip, old, 0.0), clip))
    weight = torch.ones_like(t.logp_old) if w is None else w.to(t.logp_old.dtype)
    return Result(loss, kept, (weight * m).detach(), metrics)


_BASE = {"eps_clip": 0.2, "eps_clip_higher": None, "c_clip": None, "importance_sampling_level": "token",
         "use_decoupled_loss": False, "recompute_logprob": False, "rejection_sampling": None}
"""PPOActorConfig's field defaults for the loss."""
_RS = {"level": "token", "action": "mask", "metric": "ratio", "agg": "mean", "upper": 5.0, "lower": None}
"""RejectionSamplingConfig's field defaults (the legacy behave_imp_weight_cap was 5.0)."""


def _decoupled(**rs: Any) -> dict[str, Any]:
    return {**_BASE, "use_decoupled_loss": True, "recompute_logprob": True,
            "rejection_sampling": None if not rs else {**_RS, **rs}}


PRESETS = (
    Preset("areal/default", "areal", SOURCE,
           "PPO-clip 0.2 on π/μ (π_old := μ: no recompute, no decoupled loss), no IS; Σ / response tokens",
           _BASE, ppo_actor_loss, default=True),
    Preset("areal/recompute_logprob", "areal", SOURCE,
           "PPO-clip 0.2 on π/π_old (μ replaced by the recomputed π_old), no IS; Σ / response tokens",
           {**_BASE, "recompute_logprob": True}, ppo_actor_loss),
    Preset("areal/decoupled", "areal", SOURCE,
           "decoupled PPO-clip 0.2 on π/π_old, rejection_sampling null: no IS weight; Σ / response tokens",
           _decoupled(), ppo_actor_loss),
    Preset("areal/token_mask", "areal", SOURCE,
           "decoupled PPO-clip 0.2 on π/π_old × w = π_old/μ (float32), tokens with w > 5 dropped; "
           "Σ / all response tokens", _decoupled(level="token", action="mask"), ppo_actor_loss),
    Preset("areal/token_truncate", "areal", SOURCE,
           "decoupled PPO-clip 0.2 on π/π_old × min(π_old/μ, 5) per token; Σ / response tokens",
           _decoupled(level="token", action="clamp"), ppo_actor_loss),
    Preset("areal/sequence_mask", "areal", SOURCE,
           "decoupled PPO-clip 0.2 × w = geo-mean π_old/μ per sequence, sequences with w > 5 dropped; "
           "Σ / all response tokens", _decoupled(level="sequence", action="mask"), ppo_actor_loss),
    Preset("areal/sequence_truncate", "areal", SOURCE,
           "decoupled PPO-clip 0.2 × min(geo-mean π_old/μ, 5) per sequence; Σ / response tokens",
           _decoupled(level="sequence", action="clamp"), ppo_actor_loss),
)
