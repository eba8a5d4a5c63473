"""TRL's GRPOTrainer policy loss with its vLLM importance-sampling correction (TRL 1.16.0,
trl/trainer/grpo_trainer.py: `_generate_and_score_completions` builds the correction, `_compute_loss` the loss).

What TRL does, in the project's notation (μ the rollout engine, π_old the trainer at the rollout's weights, π the
trainer now; ρ = π/π_old; w the rollout IS weight; m the response mask; A one advantage per sequence):

  correction   d_t = (log π_old − log μ)·m_t with NaN set to 0. Token modes: w_t = exp(d_t); sequence modes:
               one w = exp(Σ_t d_t) per sequence (the product ratio, not a per-token ratio).
               *_truncate: w ← clamp(w, clip_min, clip_max) (no lower bound when clip_min is None);
               *_mask: w ← 0 where w < clip_min or w > clip_max (a missing bound is no bound) — the kept
               tokens keep w itself, so sequence_mask weights a kept sequence by its product ratio.
  ratio        ρ = exp(log π − log π_old) per token, or per sequence exp(mean_t (log π − log π_old)) when
               importance_sampling_level = 'sequence' (GSPO).
  per token    grpo/bnpo/dr_grpo/dapo: ℓ = −min(ρ' A, clip(ρ, 1−ε, 1+ε_high) A) with ρ' = min(ρ, δ) when delta is
               set (two-sided clip), ρ' = ρ otherwise; cispo: ℓ = −sg(min(ρ, ε_high)) A log π;
               sapo: ℓ = −σ(τ(ρ − 1))·4/τ · A with τ = τ_pos where A > 0, τ_neg otherwise.
               OPSM (off_policy_mask_threshold δ_o): ℓ ← 0 on a sequence with A < 0 and
               mean_t (log μ − log π) > δ_o (TRL compares μ with the current π, not π_old).
               Then ℓ ← ℓ · w (the correction above; w = 0 drops the token).
  loss         grpo, sapo: mean over sequences of Σ_t ℓ m / max(Σ_t m, 1); bnpo: Σ ℓ m / max(Σ m, 1);
               dr_grpo: Σ ℓ m / (B · max_completion_length); dapo, cispo: Σ ℓ m / max(N, 1), N the batch's
               response tokens (one process, gradient accumulation 1).

Result.weight is w on the response tokens (the ratio ρ lives in the loss and its gradient).
Result.keep drops the tokens w masks and the sequences OPSM masks; PPO clipping is not a mask.
Metrics under TRL's names: sampling/sampling_logp_difference/{mean,max} (|log π_old − log μ| over response
tokens, NaN left out), sampling/importance_sampling_ratio/{min,mean,max} (w after truncation or masking; per
sequence in sequence modes, per response token otherwise), clip_ratio/* (grpo family; TRL counts them in
float32) and cispo_clip_ratio.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from mismatch_lab.corrections.frameworks.base import Preset, Result, Tokens

SOURCE = "huggingface/trl 1.16.0, trl/trainer/grpo_trainer.py (_generate_and_score_completions, _compute_loss)"

DEFAULTS: dict[str, Any] = {
    "loss_type": "dapo", "importance_sampling_level": "token", "epsilon": 0.2, "epsilon_high": 0.2,
    "delta": None, "vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": "sequence_mask",
    "vllm_importance_sampling_clip_min": None, "vllm_importance_sampling_clip_max": 3.0,
    "off_policy_mask_threshold": None, "max_completion_length": 512, "sapo_temperature_pos": 1.0,
    "sapo_temperature_neg": 1.05,
}
"""GRPOConfig's defaults in TRL 1.16.0 (epsilon_high None there means ε_high = epsilon, written out here)."""

MODES = ("sequence_mask", "sequence_truncate", "token_mask", "token_truncate")
LOSS_TYPES = ("dapo", "grpo", "bnpo", "dr_grpo", "cispo", "sapo")
PPO_FAMILY = ("grpo", "bnpo", "dr_grpo", "dapo")


def _per_sequence(t: Tokens) -> tuple[torch.Tensor, torch.Tensor]:
    """(m as the logp dtype, A as [B, 1]: the advantage at each sequence's first response token)."""
    m = t.mask.to(t.logp.dtype)
    first = t.mask.long().argmax(dim=-1, keepdim=True)
    return m, t.advantages.gather(1, first)


def rollout_ratio(t: Tokens, s: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's vLLM IS ratio ρ ([B, 1] in sequence modes, [B, T] in token modes) and where it keeps tokens."""
    m, _ = _per_sequence(t)
    d = torch.nan_to_num((t.logp_old - t.logp_rollout) * m, nan=0.0)
    mode = s["vllm_importance_sampling_mode"]
    if mode.startswith("sequence_"):
        d = d.sum(dim=-1, keepdim=True)
    rho = d.exp()
    lo, hi = s["vllm_importance_sampling_clip_min"], s["vllm_importance_sampling_clip_max"]
    if mode.endswith("_truncate"):
        return rho.clamp(min=lo, max=hi), torch.ones_like(rho, dtype=torch.bool)
    out = (rho < (-math.inf if lo is None else lo)) | (rho > (math.inf if hi is None else hi))
    return rho.masked_fill(out, 0.0), ~out


def policy_ratio(t: Tokens, s: Mapping[str, Any]) -> torch.Tensor:
    """c = π/π_old per token, or per sequence (geometric mean over the response) at level 'sequence'."""
    m, _ = _per_sequence(t)
    log_c = t.logp - t.logp_old
    if s["importance_sampling_level"] == "sequence":
        log_c = ((log_c * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    return log_c.exp()


def opsm_keep(t: Tokens, s: Mapping[str, Any]) -> torch.Tensor:
    """[B, 1] bool: TRL's off-policy sequence mask keeps A ≥ 0 or mean_t (log μ − log π) ≤ threshold."""
    m, a = _per_sequence(t)
    gap = torch.nan_to_num(t.logp_rollout - t.logp.detach(), nan=0.0)
    mean_gap = (gap * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1.0)
    return (a >= 0) | (mean_gap <= s["off_policy_mask_threshold"])


def _per_token_loss(t: Tokens, s: Mapping[str, Any], c: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    kind = s["loss_type"]
    if kind == "cispo":
        return -c.clamp(max=s["epsilon_high"]).detach() * a * t.logp
    if kind == "sapo":
        tau = torch.where(a > 0, s["sapo_temperature_pos"], s["sapo_temperature_neg"])
        return -(torch.sigmoid(tau * (c - 1)) * 4 / tau) * a
    clipped = c.clamp(1 - s["epsilon"], 1 + s["epsilon_high"])
    unclipped = c if s["delta"] is None else c.clamp(max=s["delta"])
    return -torch.min(unclipped * a, clipped * a)


def _aggregate(per_token: torch.Tensor, m: torch.Tensor, s: Mapping[str, Any]) -> torch.Tensor:
    kind, total = s["loss_type"], per_token * m
    if kind in ("grpo", "sapo"):
        return (total.sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    if kind == "bnpo":
        return total.sum() / m.sum().clamp(min=1.0)
    if kind == "dr_grpo":
        return total.sum() / (per_token.size(0) * s["max_completion_length"])
    return total.sum() / m.sum().clamp(min=1.0)  # dapo, cispo: the batch's response-token count


def _sampling_metrics(t: Tokens, s: Mapping[str, Any], rho: torch.Tensor) -> dict[str, float]:
    gap = (t.logp_old - t.logp_rollout).abs()
    gap = gap[t.mask & ~gap.isnan()]
    flat = rho.flatten() if s["vllm_importance_sampling_mode"].startswith("sequence_") else rho[t.mask]

    def stat(x: torch.Tensor, f) -> float:
        return f(x).item() if x.numel() else 0.0

    return {"sampling/sampling_logp_difference/mean": stat(gap, torch.mean),
            "sampling/sampling_logp_difference/max": stat(gap, torch.max),
            "sampling/importance_sampling_ratio/min": stat(flat, torch.min),
            "sampling/importance_sampling_ratio/mean": stat(flat, torch.mean),
            "sampling/importance_sampling_ratio/max": stat(flat, torch.max)}


def _nan_extreme(x: torch.Tensor, f) -> float:
    """min/max ignoring NaN; NaN when every value is NaN (TRL's nanmin / nanmax)."""
    finite = x[~x.isnan()]
    return f(finite).item() if finite.numel() else math.nan


def _clip_metrics(t: Tokens, s: Mapping[str, Any], c: torch.Tensor, a: torch.Tensor) -> dict[str, float]:
    """TRL's clip fractions: over response tokens, or over sequences when c is one value per sequence;
    computed in float32 as TRL does (bool.float())."""
    m = t.mask.long()

    def over_batch(x: torch.Tensor) -> float:
        x = x.float()
        if x.shape[1] == 1:
            return (x.sum() / max(float(x.shape[0]), 1.0)).item()
        return ((x * m).sum() / (m.sum().float()).clamp(min=1.0)).item()

    def per_sequence(x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return x.squeeze(1) if x.shape[1] == 1 else (x * m).sum(-1) / m.sum(-1)

    if s["loss_type"] == "cispo":
        return {"cispo_clip_ratio": over_batch((c > s["epsilon_high"]) & (a > 0))}
    if s["loss_type"] not in PPO_FAMILY:
        return {}
    low, high = (c < 1 - s["epsilon"]) & (a < 0), (c > 1 + s["epsilon_high"]) & (a > 0)
    return {"clip_ratio/low_mean": over_batch(low), "clip_ratio/high_mean": over_batch(high),
            "clip_ratio/region_mean": over_batch(low | high),
            "clip_ratio/low_min": _nan_extreme(per_sequence(low), torch.min),
            "clip_ratio/high_max": _nan_extreme(per_sequence(high), torch.max)}


def grpo_loss(t: Tokens, s: Mapping[str, Any]) -> Result:
    """TRL's GRPOTrainer loss with vllm_importance_sampling_correction=True (formula: module docstring)."""
    m, a = _per_sequence(t)
    rho, kept = rollout_ratio(t, s)
    c = policy_ratio(t, s)
    per_token = _per_token_loss(t, s, c, a)
    keep = t.mask & kept
    if s["off_policy_mask_threshold"] is not None:
        opsm = opsm_keep(t, s)
        per_token = per_token * opsm.to(per_token.dtype)
        keep = keep & opsm
    per_token = per_token * rho
    if s["loss_type"] in PPO_FAMILY and s["delta"] is not None:
        c = c.clamp(max=s["delta"])  # TRL's clip metrics read the ratio after the two-sided clip
    metrics = {**_sampling_metrics(t, s, rho), **_clip_metrics(t, s, c.detach(), a)}
    weight = (rho * m).detach()
    return Result(_aggregate(per_token, m, s), keep, weight, metrics)


def _mode_summary(mode: str) -> str:
    unit = "w = exp(Σ log π_old/μ) per sequence" if mode.startswith("sequence_") else "w = π_old/μ per token"
    how = "truncated at 3" if mode.endswith("_truncate") else "0 above 3 (kept tokens keep w)"
    return f"{unit}, {how}"


def _preset(name: str, summary: str, default: bool = False, **settings: Any) -> Preset:
    return Preset(f"trl/{name}", "trl", SOURCE, summary, {**DEFAULTS, **settings}, grpo_loss, default)


_LOSS_SUMMARY = {
    "dapo": "−min(ρA, clip(ρ, 1±0.2)A)·w summed over the batch's response tokens / their count",
    "grpo": "−min(ρA, clip(ρ, 1±0.2)A)·w, token mean per sequence, then mean over sequences",
    "bnpo": "−min(ρA, clip(ρ, 1±0.2)A)·w, token mean over the batch",
    "dr_grpo": "−min(ρA, clip(ρ, 1±0.2)A)·w summed / (B · max_completion_length)",
    "cispo": "−sg(min(ρ, 5))·A·log π·w summed / token count",
    "sapo": "−σ(τ(ρ − 1))·4/τ·A·w, τ = 1 (A > 0) / 1.05, token mean per sequence, then mean over sequences",
}
_LOSS_SETTINGS: dict[str, dict[str, Any]] = {"cispo": {"epsilon_high": 5.0}}
"""cispo: TRL's documented recommendation ε_high = 5 (its default, ε_high = ε = 0.2, would cap c at 0.2)."""


def _presets() -> tuple[Preset, ...]:
    out = []
    for mode in MODES:
        for kind in LOSS_TYPES:
            out.append(_preset(f"{kind}-{mode}", f"{_LOSS_SUMMARY[kind]}; {_mode_summary(mode)}",
                               default=(kind, mode) == ("dapo", "sequence_mask"), loss_type=kind,
                               vllm_importance_sampling_mode=mode, **_LOSS_SETTINGS.get(kind, {})))
        out.append(_preset(f"gspo-{mode}", "GSPO: ρ = exp(mean_t log π/π_old) per sequence, clip [1 − 3e-4, "
                           f"1 + 4e-4], × w; {_mode_summary(mode)}", loss_type="grpo",
                           importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4,
                           vllm_importance_sampling_mode=mode))
    out.append(_preset("dapo-sequence_mask-opsm", "the default plus OPSM: a sequence with A < 0 and "
                       "mean(log μ − log π) > 0.5 is dropped (TRL's documented example value)",
                       off_policy_mask_threshold=0.5))
    out.append(_preset("dapo-token_mask-band", "the default loss with w = π_old/μ per token, 0 outside [0.5, 5] "
                       "(clip_min 0.5, clip_max 5: IcePop's band)",
                       vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_min=0.5,
                       vllm_importance_sampling_clip_max=5.0))
    out.append(_preset("dapo-sequence_mask-two_sided", "the default with the two-sided clip: the unclipped ρ "
                       "capped at δ = 4, which binds where A < 0 (INTELLECT-2's value)", delta=4.0))
    return tuple(out)


PRESETS = _presets()
