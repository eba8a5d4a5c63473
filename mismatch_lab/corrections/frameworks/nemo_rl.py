"""NeMo-RL's GRPO policy loss (NVIDIA-NeMo/RL @7ea279ab, nemo_rl/algorithms/loss/loss_functions.py:
ClippedPGLossConfig defaults and ClippedPGLossFn.__call__; nemo_rl/algorithms/utils.py: masked_mean,
calculate_kl; nemo_rl/algorithms/grpo.py: compute_and_apply_seq_logprob_error_masking;
examples/configs/grpo_math_1B.yaml and recipes: the values of the named configurations).

With r = π/π_old, w = π_old/μ (detached), A the advantage and mask the response tokens (one rank, one
micro-batch: NeMo-RL's global token count is the batch's):

  ℓ_t   = max(−A·r, −A·clip(r, 1 − 0.2, 1 + 0.2))                                   (PPO clip, no dual clip)
  loss  = Σ w'·ℓ·mask / (N + 1e-8)                                                   (token-level loss)

where w' = 1 unless use_importance_sampling_correction, and then w' = w truncated by
truncated_importance_sampling_type: `tis` clamps w to [min or 0, ratio]; `icepop` zeroes tokens whose w lies
outside [min, ratio]; `seq-mask-tis` zeroes whole sequences whose geometric mean exp(mean log w) lies outside
[min, ratio] and keeps the raw w elsewhere. grpo.seq_logprob_error_threshold (before the loss) drops from the
sample mask every sequence whose mean exp(|log μ − log π_old|) exceeds it.

The reference-policy KL term (reference_policy_kl_penalty, 0.01 by default) reads π_ref, which a store does not
hold: every preset sets it to 0, so `kl_penalty` logs 0 as NeMo-RL does with the penalty off.
Result.keep is the response minus tokens whose w' is zeroed (icepop, seq-mask-tis) and sequences dropped by the
threshold; Result.weight is w' on the response. Metrics under NeMo-RL's names, as ClippedPGLossFn returns them
(token-normalised means with its +1e-8), plus grpo.py's per-sequence mult-prob-error metrics (without
masked_correct_pct, which reads rewards a store does not hold).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mismatch_lab.corrections.frameworks.base import Preset, Result, Tokens

SOURCE = ("NVIDIA-NeMo/RL @7ea279ab, nemo_rl/algorithms/loss/loss_functions.py (ClippedPGLossFn), "
          "nemo_rl/algorithms/utils.py (masked_mean, calculate_kl), nemo_rl/algorithms/grpo.py "
          "(compute_and_apply_seq_logprob_error_masking)")
EPS = 1e-8
"""masked_mean's guard on its denominator."""


def _mean(values: torch.Tensor, mask: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / (total + EPS)


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio.exp() - 1 - log_ratio


def _seq_error(t: Tokens, s: Mapping[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
    """grpo.py's sequence masking: the kept-sequence mask [B] and its metrics."""
    m = t.mask.to(t.logp_old.dtype)
    count = m.sum(-1)
    valid = count > 0
    err = (torch.exp((t.logp_rollout - t.logp_old).abs() * m) * m).sum(-1) / count.clamp(min=1)
    threshold = s["seq_logprob_error_threshold"]
    kept = valid if threshold is None else valid & (err <= threshold)

    def trio(suffix: str, where: torch.Tensor) -> dict[str, float]:
        e = err[where]
        stats = (e.max().item(), e.mean().item(), e.min().item()) if e.numel() else (0.0, 0.0, 0.0)
        return {f"{k}_seq_mult_prob_error{suffix}": v for k, v in zip(("max", "mean", "min"), stats)}

    metrics = {**trio("", valid), **trio("_after_mask", kept), "num_masked_seqs": int((valid & ~kept).sum())}
    return kept, metrics


def _weights(t: Tokens, s: Mapping[str, Any], m: torch.Tensor, seqs: torch.Tensor):
    """w (truncated as configured), the tokens truncation drops [B, T] and the is_oob_ratio metric."""
    log_w = t.logp_old - t.logp_rollout
    w = torch.nan_to_num(log_w.exp(), nan=0.0, posinf=0.0, neginf=0.0)
    kind, hi, lo = (s["truncated_importance_sampling_type"], s["truncated_importance_sampling_ratio"],
                    s["truncated_importance_sampling_ratio_min"])
    none = torch.zeros_like(t.mask)
    if hi is None:
        return w, none, {}
    if kind == "tis":
        lo = 0.0 if lo is None else lo
        oob = (w > hi) | (w < lo)
        return w.clamp(min=lo, max=hi), none, {"is_oob_ratio": _mean(oob.to(w.dtype), m, m.sum()).item()}
    if kind == "icepop":
        inside = (w >= lo) & (w <= hi)
        return torch.where(inside, w, 0.0), ~inside, {"is_oob_ratio": _mean((~inside).to(w.dtype), m, m.sum()).item()}
    geo = _row_log_mean(torch.nan_to_num(log_w, nan=0.0, posinf=0.0, neginf=0.0), t.mask).exp()
    inside = (geo >= lo) & (geo <= hi)
    oob = _mean(1.0 - inside.to(w.dtype), seqs, seqs.sum()).item()
    return w * inside.unsqueeze(-1), ~inside.unsqueeze(-1) & t.mask, {"is_oob_ratio": oob}


def _row_log_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum(-1) / (mask.sum(-1) + EPS)


def _diagnostics(t: Tokens, m: torch.Tensor, n: torch.Tensor) -> dict[str, float]:
    """The mismatch metrics ClippedPGLossFn logs (π_old against μ) and its entropy estimate."""
    prev, gen, curr = t.logp_old, t.logp_rollout, t.logp.detach()
    mix = torch.log(0.5 * prev.exp() + 0.5 * gen.exp())
    js = 0.5 * _k3(prev - mix) + 0.5 * _k3(gen - mix)
    return {"token_mult_prob_error": _mean(torch.exp((gen - prev).abs() * m), m, n).item(),
            "gen_kl_error": _mean(_k3(prev - gen), m, n).item(),
            "policy_kl_error": _mean(_k3(gen - prev), m, n).item(),
            "js_divergence_error": _mean(js, m, n).item(),
            "approx_entropy": -_mean(torch.exp(curr - gen) * curr, m, n).item()}


def _ratio_stats(name: str, values: torch.Tensor, m: torch.Tensor, n: torch.Tensor) -> dict[str, float]:
    inside = values.detach()[m.bool()]
    lo, hi = (inside.min().item(), inside.max().item()) if inside.numel() else (float("inf"), float("-inf"))
    return {name: _mean(values.detach(), m, n).item(), f"{name}_min": lo, f"{name}_max": hi}


def clipped_pg_loss(t: Tokens, s: Mapping[str, Any]) -> Result:
    """ClippedPGLossFn with the settings `s` (formula in the module docstring)."""
    seqs, seq_metrics = _seq_error(t, s)
    m = (t.mask & seqs.unsqueeze(-1)).to(t.logp.dtype)
    n = m.sum()
    ratios = (t.logp - t.logp_old).exp()
    clamped = ratios.clamp(1.0 - s["ratio_clip_min"], 1.0 + s["ratio_clip_max"])
    clip_loss = torch.max(-t.advantages * ratios, -t.advantages * clamped)
    w, dropped, oob = _weights(t, s, m, seqs)
    correct = s["use_importance_sampling_correction"]
    used = w if correct else torch.ones_like(w)
    loss = _mean(used * clip_loss, m, n)
    with torch.no_grad():
        metrics = {"loss": loss.item(), **_ratio_stats("probs_ratio", ratios, m, n),
                   **_ratio_stats("probs_ratio_clamped", clamped, m, n), "kl_penalty": 0,
                   **_diagnostics(t, m, n), "sampling_importance_ratio": _mean(w, m, n).item(),
                   "num_valid_samples": seqs.sum().item(), **oob, "positive_nll_loss": 0.0, **seq_metrics}
    keep = t.mask & seqs.unsqueeze(-1) & ~(dropped if correct else torch.zeros_like(dropped))
    return Result(loss, keep, (used * m).detach(), metrics)


_DEFAULT = {"ratio_clip_min": 0.2, "ratio_clip_max": 0.2, "ratio_clip_c": None, "reference_policy_kl_penalty": 0.0,
            "token_level_loss": True, "use_importance_sampling_correction": False,
            "truncated_importance_sampling_type": None, "truncated_importance_sampling_ratio": None,
            "truncated_importance_sampling_ratio_min": None, "seq_logprob_error_threshold": None}


def _with(**changes: Any) -> dict[str, Any]:
    return {**_DEFAULT, **changes}


_IS = {"use_importance_sampling_correction": True}
PRESETS = (
    Preset("nemo-rl/default", "nemo-rl", SOURCE, "ℓ = max(−A·r, −A·clip(r, 0.8, 1.2)), r = π/π_old, no μ "
           "correction; mean over response tokens", _DEFAULT, clipped_pg_loss, default=True),
    Preset("nemo-rl/importance_sampling", "nemo-rl", SOURCE, "w·ℓ, w = π_old/μ untruncated (async GRPO)",
           _with(**_IS), clipped_pg_loss),
    Preset("nemo-rl/tis", "nemo-rl", SOURCE, "min(w, 2)·ℓ, w = π_old/μ",
           _with(**_IS, truncated_importance_sampling_type="tis", truncated_importance_sampling_ratio=2.0),
           clipped_pg_loss),
    Preset("nemo-rl/icepop", "nemo-rl", SOURCE, "w·ℓ on tokens with w = π_old/μ in [0.5, 5], else dropped",
           _with(**_IS, truncated_importance_sampling_type="icepop", truncated_importance_sampling_ratio=5.0,
                 truncated_importance_sampling_ratio_min=0.5), clipped_pg_loss),
    Preset("nemo-rl/seq-mask-tis", "nemo-rl", SOURCE, "w·ℓ on sequences with geometric-mean w in [0.999, 1.002], "
           "else the sequence is dropped", _with(**_IS, truncated_importance_sampling_type="seq-mask-tis",
                                                 truncated_importance_sampling_ratio=1.002,
                                                 truncated_importance_sampling_ratio_min=0.999), clipped_pg_loss),
    Preset("nemo-rl/seq_logprob_error_threshold", "nemo-rl", SOURCE, "ℓ on sequences whose mean "
           "exp(|log μ − log π_old|) ≤ 2, else the sequence is dropped", _with(seq_logprob_error_threshold=2.0),
           clipped_pg_loss),
)
