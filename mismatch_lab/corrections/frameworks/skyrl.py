"""SkyRL's policy losses and off-policy correction (NovaSky-AI/SkyRL @a9564572,
skyrl/backends/skyrl_train/utils/ppo_utils.py: PolicyLossRegistry and its functions (skyrl_losses.py), reduce_loss,
apply_loss_reduction_to_advantages_minibatch; utils/off_policy_correction_utils.py: compute_off_policy_correction
and its parts; utils/torch_utils.py: masked_mean, safe_exp_delta; skyrl/train/config/config.py: the defaults;
docs/content/docs/algorithms/off_policy_correction.mdx and examples/train: the named configurations).

SkyRL folds its loss reduction into the advantages (A' below) and sums the per-token loss over the final loss
mask: token_mean A' = A / N (N the response tokens before any mask; token_mean_legacy the same on one
micro-batch), sequence_mean A' = A / (B·n_i), seq_mean_token_sum_norm A' = A / (B·max_seq_len). Most ratios go
through safe_exp_delta: the log ratio is cast to float32, clamped to ±20 and exponentiated, then cast back — so
those weights carry float32 rounding (gspo, sapo, clip_cov, kl_cov and importance_sampling exponentiate in the
tokens' dtype).

  regular    ℓ = −min(r·A', clip(r, 0.8, 1.2)·A'), r = π/π_old;   dual_clip: then min(ℓ, −c·A') where A' < 0
  gspo       the same on r = exp(log π − sg(log π) + sg(mean_t log π/π_old)), its log capped at 10
  sapo       ℓ = −σ(τ(r − 1))·4/τ·A', τ = 1 where A' > 0, else 1.05
  cispo      ℓ = −A'·sg(clip(π/π_b, 0, 5))·log π, π_b = π_old (cispo_anchor old) or μ (rollout)
  rollout_is ℓ = −A'·sg(r·1[0.8 < r < 1.2])·log π, r = π/μ
  dppo       ℓ = −r·A'·M, r = π/μ, M = 0 where (A > 0, π − μ > δ_high) or (A < 0, μ − π > δ_low) (binary_tv), or
             where the binary KL of μ against π exceeds δ on the side A pushes (binary_kl); δ = 0.2
  clip_cov   PPO's loss, with max(1, 0.0002·N) of the unclipped tokens whose covariance lies in (1, 5) drawn at
             random and zeroed;   kl_cov: −A'·r plus |log r| on the 20 % of tokens of largest covariance
  importance_sampling  ℓ = −A'·π/π_old;   cross_entropy: ℓ = −log π
clip_cov, kl_cov, importance_sampling and cross_entropy apply no off-policy correction (their SkyRL functions
do not call it). Elsewhere the correction reads w = π_old/μ: outlier tokens (w < low or > high) drop their whole
sequence; the token mask drops tokens with w ∉ [low, high]; TIS multiplies ℓ by min(w, 2) per token or,
`sequence`, by min(Π w, 5) per sequence (the product over the mask left so far); the sequence mask drops
sequences whose geometric mean (over the mask left so far) ∉ [0.99, 1.01] or whose product ∉ [0.5, 2].

SkyRL's KL loss to π_ref (use_kl_loss, 0.001) reads a reference policy a store does not hold: it is left out,
and so is the prompt_mean reduction (it needs prompt groups). Result.keep is the final loss mask less the tokens
the loss itself zeroes (DPPO's M, rollout_is's out-of-band tokens, clip_cov's drawn ones); Result.weight is the
weight on μ: the TIS factor times, for dppo, r, for rollout_is its calibrated r, for cispo on the rollout its
clamped π/μ (1 elsewhere). Metrics under SkyRL's names: clip_ratio (importance_ratio for importance_sampling,
plus cispo/ratio_* for cispo) and, with a correction on, is_ratio_* and each filter's ratios.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mismatch_lab.corrections.frameworks.base import Preset, Result, Tokens
from mismatch_lab.corrections.frameworks.skyrl_losses import LOSSES, mean, safe_exp

SOURCE = "NovaSky-AI/SkyRL @a9564572, skyrl/backends/skyrl_train/utils/ppo_utils.py"
"""Each preset's source names SkyRL's function for its loss after this (skyrl_losses.Loss.source)."""


def _bounds(prefix: str, value: torch.Tensor, low: float | None, high: float | None):
    """(in-bounds, metrics) for a per-sequence value [B]: SkyRL's masked / over_high / under_low ratios."""
    over = value > high if high is not None else torch.zeros_like(value, dtype=torch.bool)
    under = value < low if low is not None else torch.zeros_like(value, dtype=torch.bool)
    inside = ~over & ~under
    n = float(value.shape[0])
    return inside, {f"{prefix}_masked_ratio": ((~inside).sum() / n).item(),
                    f"{prefix}_over_high_ratio": (over.sum() / n).item(),
                    f"{prefix}_under_low_ratio": (under.sum() / n).item()}


def _sequence_mask(log_w: torch.Tensor, m: torch.Tensor, s: Mapping[str, Any]):
    total = (log_w * m).sum(-1)
    if s["sequence_mask_metric"] == "geometric":
        return _bounds("geo_sequence_mask", safe_exp(total / m.sum(-1).clamp(min=1.0)), s["geo_mask_low"],
                       s["geo_mask_high"])
    return _bounds("product_sequence_mask", safe_exp(total), s["product_mask_low"], s["product_mask_high"])


def _tis(log_w: torch.Tensor, w: torch.Tensor, m: torch.Tensor, s: Mapping[str, Any]):
    if s["tis_ratio_type"] == "token":
        cap = s["token_tis_ratio_clip_high"]
        share = (((w > cap) & (m > 0)).sum() / (m > 0).sum().clamp(min=1)).item()
        return w.clamp(max=cap), {"tis_token_clip_high_ratio": share}
    product = safe_exp((log_w * m).sum(-1, keepdim=True))
    cap = s["sequence_tis_ratio_clip_high"]
    return product.clamp(max=cap), {"tis_seq_clip_high_ratio": ((product > cap).sum() / product.shape[0]).item()}


def _outliers(w: torch.Tensor, m: torch.Tensor, s: Mapping[str, Any]):
    low, high = s["outlier_token_is_threshold_low"], s["outlier_token_is_threshold_high"]
    valid = m > 0
    over = (w > high) & valid if high is not None else torch.zeros_like(valid)
    under = (w < low) & valid if low is not None else torch.zeros_like(valid)
    n = float(w.shape[0])
    kept = ~(over | under).any(-1)
    return kept, {"outlier_seq_masked_ratio": ((~kept).sum() / n).item(),
                  "outlier_seq_over_high_ratio": (over.any(-1).sum() / n).item(),
                  "outlier_seq_under_low_ratio": (under.any(-1).sum() / n).item()}


def _enabled(s: Mapping[str, Any]) -> bool:
    return (s["tis_ratio_type"] is not None or s["sequence_mask_metric"] is not None
            or s["outlier_token_is_threshold_low"] is not None or s["outlier_token_is_threshold_high"] is not None
            or (s["token_mask_is_threshold_low"] is not None and s["token_mask_is_threshold_high"] is not None))


def off_policy_correction(t: Tokens, m: torch.Tensor, s: Mapping[str, Any]):
    """(TIS factor or None, loss mask after the masks, metrics): compute_off_policy_correction."""
    if not _enabled(s):
        return None, m, {}
    log_w = t.logp_old - t.logp_rollout
    w = safe_exp(log_w)
    metrics = {"is_ratio_mean": mean(w, m), "is_ratio_std": (w * m).std().item(),
               "is_ratio_max": (w * m).max().item(), "is_ratio_min": (w * m).min().item()}
    if s["outlier_token_is_threshold_low"] is not None or s["outlier_token_is_threshold_high"] is not None:
        kept, more = _outliers(w, m, s)
        m = m * kept.unsqueeze(-1).to(m.dtype)
        metrics.update(more)
    if s["token_mask_is_threshold_low"] is not None and s["token_mask_is_threshold_high"] is not None:
        inside = (w >= s["token_mask_is_threshold_low"]) & (w <= s["token_mask_is_threshold_high"])
        metrics["token_mask_ratio"] = ((~inside & (m > 0)).sum() / (m > 0).sum().clamp(min=1)).item()
        m = m * (inside | (m == 0)).to(m.dtype)
    tis = None
    if s["tis_ratio_type"] is not None:
        tis, more = _tis(log_w, w, m, s)
        metrics.update(more)
    if s["sequence_mask_metric"] is not None:
        kept, more = _sequence_mask(log_w, m, s)
        m = m * kept.unsqueeze(-1).to(m.dtype)
        metrics.update(more)
    return tis, m, metrics


def _token_mean(a: torch.Tensor, m: torch.Tensor, s: Mapping[str, Any]) -> torch.Tensor:
    return a / m.sum().clamp(min=1)


REDUCTIONS = {
    "token_mean": _token_mean,
    "token_mean_legacy": _token_mean,  # per micro-batch, then averaged over them: one micro-batch here
    "sequence_mean": lambda a, m, s: a / (a.shape[0] * m.sum(-1, keepdim=True).clamp(min=1)),
    "seq_mean_token_sum_norm": lambda a, m, s: a / (a.shape[0] * s["max_seq_len"]),
}
"""apply_loss_reduction_to_advantages_minibatch: A' = A scaled so that the summed loss is the reduction
(prompt_mean needs prompt groups a store does not hold)."""


def policy_loss(t: Tokens, s: Mapping[str, Any]) -> Result:
    """SkyRL's policy loss `policy_loss_type` with its loss reduction and off-policy correction (module
    docstring)."""
    m = t.mask.to(t.logp.dtype)
    a = REDUCTIONS[s["loss_reduction"]](t.advantages, m, s)
    loss = LOSSES[s["policy_loss_type"]]
    term = loss.fn(t, a, m, s)
    per_token, weight, metrics = term.loss, term.weight, dict(term.metrics)
    tis, m_final = None, m
    if loss.corrects:
        tis, m_final, more = off_policy_correction(t, m, s)
        metrics.update(more)
    if tis is not None:
        per_token, weight = per_token * tis, weight * tis
    keep = (m_final > 0) & (term.gate > 0)
    return Result((per_token * m_final).sum(), keep, (weight * t.mask).detach(), metrics)


_CORRECTION_OFF = {"tis_ratio_type": None, "token_tis_ratio_clip_high": 2.0, "sequence_tis_ratio_clip_high": 5.0,
                   "sequence_mask_metric": None, "geo_mask_high": 1.01, "geo_mask_low": 0.99,
                   "product_mask_high": 2.0, "product_mask_low": 0.5, "outlier_token_is_threshold_low": None,
                   "outlier_token_is_threshold_high": None, "token_mask_is_threshold_low": None,
                   "token_mask_is_threshold_high": None}
_LOSS_OPTIONS = {"clip_ratio_c": 3.0, "tau_pos": 1.0, "tau_neg": 1.05, "cispo_eps_clip_low": 1.0,
                 "cispo_eps_clip_high": 4.0, "cispo_anchor": "old", "clip_cov.clip_ratio": 0.0002, "clip_cov_lb": 1.0,
                 "clip_cov_ub": 5.0, "kl_cov_frac": 0.2, "ppo_kl_coef": 1.0, "max_seq_len": None}
"""AlgorithmConfig's clip_ratio_c and max_seq_len, and its sapo, cispo, clip_cov and kl_cov blocks (the one
clip_cov option whose leaf name alone would mislead keeps its block)."""
_DEFAULT = {"policy_loss_type": "regular", "loss_reduction": "token_mean", "eps_clip_low": 0.2, "eps_clip_high": 0.2,
            "dppo_type": "binary_tv", "delta_low": 0.2, "delta_high": 0.2, "use_kl_loss": False, **_LOSS_OPTIONS,
            **_CORRECTION_OFF}


def _with(**changes: Any) -> dict[str, Any]:
    return {**_DEFAULT, **changes}


_TOKEN_TIS = {"tis_ratio_type": "token"}
_GEO = {"sequence_mask_metric": "geometric"}
_TOKEN_MASK = {"token_mask_is_threshold_low": 0.5, "token_mask_is_threshold_high": 2.0}
_OUTLIER = {"outlier_token_is_threshold_low": 1e-4, "outlier_token_is_threshold_high": 100.0}


def _preset(name: str, summary: str, settings: dict[str, Any], default: bool = False) -> Preset:
    loss = LOSSES[settings["policy_loss_type"]]
    source = (f"{SOURCE} ({loss.source}, reduce_loss, apply_loss_reduction_to_advantages_minibatch)"
              + (", utils/off_policy_correction_utils.py" if loss.corrects else ""))
    return Preset(f"skyrl/{name}", "skyrl", source, summary, settings, policy_loss, default)


PRESETS = (
    _preset("default", "regular: ℓ = −min(r·A, clip(r, 0.8, 1.2)·A), r = π/π_old; summed / response tokens; no μ "
            "correction", _DEFAULT, default=True),
    _preset("token_tis", "PPO clip · min(π_old/μ, 2) per token", _with(**_TOKEN_TIS)),
    _preset("sequence_tis", "PPO clip · min(Π π_old/μ, 5) per sequence", _with(tis_ratio_type="sequence")),
    _preset("geometric_mask", "PPO clip; sequences with geometric-mean π_old/μ ∉ [0.99, 1.01] dropped", _with(**_GEO)),
    _preset("product_mask", "PPO clip; sequences with Π π_old/μ ∉ [0.5, 2] dropped",
            _with(sequence_mask_metric="product")),
    _preset("token_mask", "PPO clip; tokens with π_old/μ ∉ [0.5, 2] dropped", _with(**_TOKEN_MASK)),
    _preset("outlier_token_mask", "PPO clip; a sequence with a token π_old/μ < 1e-4 or > 100 dropped",
            _with(**_OUTLIER)),
    _preset("recommended", "the docs' TLDR stack: outlier sequences, tokens ∉ [0.5, 2], then min(π_old/μ, 2) "
            "per token, then geometric mask [0.99, 1.01]", _with(**_GEO, **_TOKEN_TIS, **_TOKEN_MASK, **_OUTLIER)),
    _preset("dppo-binary_tv", "ℓ = −M·A·π/μ, M = 0 where (A>0, π − μ > 0.2) or (A<0, μ − π > 0.2)",
            _with(policy_loss_type="dppo")),
    _preset("dppo-binary_kl", "ℓ = −M·A·π/μ, M = 0 where the binary KL(μ‖π) > 0.2 on the side A pushes",
            _with(policy_loss_type="dppo", dppo_type="binary_kl")),
    _preset("dual_clip", "PPO clip, then min(ℓ, −3A) where A < 0", _with(policy_loss_type="dual_clip")),
    _preset("dapo", "dual_clip with clip [0.8, 1.28] and c = 10, token_mean_legacy (the DAPO examples)",
            _with(policy_loss_type="dual_clip", eps_clip_high=0.28, clip_ratio_c=10.0,
                  loss_reduction="token_mean_legacy")),
    _preset("gspo", "PPO clip on r = π/sg(π)·sg(exp(mean_t log π/π_old)); sequence_mean",
            _with(policy_loss_type="gspo", loss_reduction="sequence_mean")),
    _preset("sapo", "ℓ = −σ(τ(r − 1))·4/τ·A, τ = 1 (A > 0) / 1.05, r = π/π_old; sequence_mean",
            _with(policy_loss_type="sapo", loss_reduction="sequence_mean")),
    _preset("cispo", "ℓ = −A·sg(clip(π/π_old, 0, 5))·log π", _with(policy_loss_type="cispo")),
    _preset("cispo-rollout", "ℓ = −A·sg(clip(π/μ, 0, 5))·log π (cispo_anchor rollout)",
            _with(policy_loss_type="cispo", cispo_anchor="rollout")),
    _preset("rollout_is", "ℓ = −A·sg(π/μ)·log π where π/μ ∈ (0.8, 1.2), else 0", _with(policy_loss_type="rollout_is")),
    _preset("rollout_is-geometric_mask", "rollout_is; sequences with geometric-mean π_old/μ ∉ [0.99, 1.01] dropped "
            "(the fully async example)", _with(policy_loss_type="rollout_is", **_GEO)),
    _preset("clip_cov", "PPO clip; of the unclipped tokens with covariance (A − Ā)(log π − mean) in (1, 5), "
            "max(1, 0.0002·N) drawn at random get no gradient", _with(policy_loss_type="clip_cov")),
    _preset("kl_cov", "ℓ = −A·r, plus |log r| on the 20 % of tokens with the largest covariance "
            "(A − Ā)(log π − mean)", _with(policy_loss_type="kl_cov")),
    _preset("importance_sampling", "ℓ = −A·π/π_old, unclipped (Tinker's importance_sampling)",
            _with(policy_loss_type="importance_sampling")),
    _preset("cross_entropy", "ℓ = −log π summed over the response (SFT)", _with(policy_loss_type="cross_entropy")),
    _preset("sequence_mean", "regular, each sequence's token mean averaged over sequences",
            _with(loss_reduction="sequence_mean")),
    _preset("seq_mean_token_sum_norm", "regular, summed / (B · 1536) (Dr. GRPO example: max_seq_len 512 + 1024)",
            _with(loss_reduction="seq_mean_token_sum_norm", max_seq_len=1536)),
)
