"""NeMo-RL's GRPO policy loss (NVIDIA-NeMo/RL @7ea279ab, nemo_rl/algorithms/loss/loss_functions.py:
ClippedPGLossConfig defaults and ClippedPGLossFn.__call__; nemo_rl/algorithms/utils.py: masked_mean,
calculate_kl; nemo_rl/algorithms/grpo.py: compute_and_apply_seq_logprob_error_masking and the prev-logprob skip
of force_on_policy_ratio; examples/configs/grpo_math_1B.yaml, docs/guides and recipes: the named configurations).

With r = π/π_old, w = π_old/μ (detached), A the advantage and mask the response tokens (one rank, one
micro-batch: NeMo-RL's global token and sequence counts are the batch's):

  ℓ_t   = max(−A·r, −A·clip(r, 1 − 0.2, 1 + 0.2))                                   (PPO clip)
  loss  = Σ w'·ℓ·mask / (N + 1e-8)                                                   (token_level_loss)

Options, each as ClippedPGLossFn reads it:
  ratio_clip_c                     dual clip: ℓ = min(ℓ, −c·A) where A < 0
  use_cispo                        ℓ = −A·sg(clip(r, 1 − ε_low, 1 + ε_high))·log π
  sequence_level_importance_ratios GSPO: r = exp(mean_t log π/π_old) per sequence; w = exp(Σ_t log π_old/μ) per
                                   sequence; with token_level_loss false: loss = mean over sequences of
                                   Σ_t w'·ℓ / (n + 1e-8)
  disable_ppo_ratio                REINFORCE: r = log π, ℓ = −A·log π
  force_on_policy_ratio            π_old := sg(π): r = exp(log π − sg(log π)) = 1, unclipped, w = π/μ; grpo.py
                                   then skips π_old and logs its sequence metrics as 0
  use_importance_sampling_correction  w' = w truncated by truncated_importance_sampling_type: `tis` clamps w to
                                   [min or 0, ratio]; `icepop` zeroes tokens whose w lies outside [min, ratio];
                                   `seq-mask-tis` zeroes sequences whose exp(mean log w) lies outside [min, ratio]
grpo.seq_logprob_error_threshold (before the loss) drops from the sample mask every sequence whose mean
exp(|log μ − log π_old|) exceeds it.

The reference-policy KL term (reference_policy_kl_penalty, 0.01 by default) reads π_ref and the VAPO NLL term
(positive_example_nll_weight, 0 by default) reads rewards, neither of which a store holds: both are 0 here, so
`kl_penalty` and `positive_nll_loss` log 0 as NeMo-RL does with them off. Result.keep is the response minus
tokens whose w' is zeroed (icepop, seq-mask-tis) and sequences dropped by the threshold; Result.weight is w' on
the response. Metrics under NeMo-RL's names, as ClippedPGLossFn returns them (masked means with its +1e-8), plus
grpo.py's per-sequence mult-prob-error metrics under the names it logs (without masked_correct_pct, which reads
rewards).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mismatch_lab.corrections.frameworks.base import Preset, Result, Tokens

SOURCE = ("NVIDIA-NeMo/RL @7ea279ab, nemo_rl/algorithms/loss/loss_functions.py (ClippedPGLossConfig, "
          "ClippedPGLossFn), nemo_rl/algorithms/utils.py (masked_mean, calculate_kl), nemo_rl/algorithms/grpo.py "
          "(compute_and_apply_seq_logprob_error_masking, _resolve_logprob_skip_flags)")
EPS = 1e-8
"""masked_mean's guard on its denominator."""
SEQ_ERROR = ("max_seq_mult_prob_error", "mean_seq_mult_prob_error", "min_seq_mult_prob_error")
"""grpo.py's per-sequence error metrics (each also logged with the suffix `_after_mask`)."""


def _mean(values: torch.Tensor, mask: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / (total + EPS)


def _row_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(values.dtype)  # a bool mask's count would add EPS in float32
    return (values * mask).sum(-1) / (mask.sum(-1) + EPS)


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio.exp() - 1 - log_ratio


def _seq_error(t: Tokens, s: Mapping[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
    """grpo.py's sequence masking: the sample mask [B] after it and its metrics (zeros where grpo.py skips π_old)."""
    threshold = s["seq_logprob_error_threshold"]
    if s["force_on_policy_ratio"] and threshold is None:
        zeros = {name: 0.0 for name in SEQ_ERROR} | {f"{name}_after_mask": 0.0 for name in SEQ_ERROR}
        return torch.ones_like(t.mask[:, 0]), {**zeros, "num_masked_seqs_by_logprob_error": 0}
    m = t.mask.to(t.logp_old.dtype)
    count = m.sum(-1)
    valid = count > 0
    err = torch.where(valid, (torch.exp((t.logp_rollout - t.logp_old).abs() * m) * m).sum(-1) / count.clamp(min=1),
                      0.0)
    kept = torch.ones_like(valid) if threshold is None else err <= threshold

    def trio(suffix: str, where: torch.Tensor) -> dict[str, float]:
        e = err[where]
        stats = (e.max().item(), e.mean().item(), e.min().item()) if e.numel() else (0.0, 0.0, 0.0)
        return {f"{name}{suffix}": v for name, v in zip(SEQ_ERROR, stats)}

    return kept, {**trio("", valid), **trio("_after_mask", kept & valid),
                  "num_masked_seqs_by_logprob_error": int((~kept).sum())}


def _ratios(t: Tokens, s: Mapping[str, Any], prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ratios, ratios_clamped) as ClippedPGLossFn forms them."""
    if s["force_on_policy_ratio"]:
        ratios = (t.logp - t.logp.detach()).exp()
        return ratios, ratios
    if s["disable_ppo_ratio"]:
        return t.logp, t.logp
    log_ratios = t.logp - prev
    if s["sequence_level_importance_ratios"]:
        ratios = _row_mean(log_ratios, t.mask).unsqueeze(-1).exp().expand_as(log_ratios)
    else:
        ratios = log_ratios.exp()
    return ratios, ratios.clamp(1.0 - s["ratio_clip_min"], 1.0 + s["ratio_clip_max"])


def _surrogate(t: Tokens, s: Mapping[str, Any], ratios: torch.Tensor, clamped: torch.Tensor) -> torch.Tensor:
    """The per-token clip loss: PPO's max, or CISPO's; then the dual clip where A < 0."""
    a = t.advantages
    loss = -a * clamped.detach() * t.logp if s["use_cispo"] else torch.max(-a * ratios, -a * clamped)
    if s["ratio_clip_c"] is not None:
        loss = torch.where(a < 0, torch.min(loss, -a * s["ratio_clip_c"]), loss)
    return loss


def _weights(t: Tokens, s: Mapping[str, Any], prev: torch.Tensor, m: torch.Tensor, seqs: torch.Tensor):
    """w ([B, T], or [B, 1] at sequence level) truncated as configured, the tokens truncation zeroes and the
    is_oob_ratio metric."""
    if s["sequence_level_importance_ratios"]:
        w = torch.nan_to_num(torch.exp(((prev - t.logp_rollout) * m).sum(-1)), nan=0.0, posinf=0.0,
                             neginf=0.0).unsqueeze(-1)
    else:
        w = torch.nan_to_num(torch.exp(prev - t.logp_rollout), nan=0.0, posinf=0.0, neginf=0.0)
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
        return (torch.where(inside, w, 0.0), ~inside & t.mask,
                {"is_oob_ratio": _mean((~inside).to(w.dtype), m, m.sum()).item()})
    log_w = torch.nan_to_num(prev - t.logp_rollout, nan=0.0, posinf=0.0, neginf=0.0)
    geo = _row_mean(log_w, t.mask).exp()
    inside = (geo >= lo) & (geo <= hi)
    oob = _mean(1.0 - inside.to(w.dtype), seqs, seqs.sum()).item()
    return w * inside.unsqueeze(-1), ~inside.unsqueeze(-1) & t.mask, {"is_oob_ratio": oob}


def _reduce(values: torch.Tensor, t: Tokens, s: Mapping[str, Any], m: torch.Tensor,
            seqs: torch.Tensor) -> torch.Tensor:
    """token_level_loss: a mean over the kept tokens; else each sequence's token mean, averaged over sequences."""
    if s["token_level_loss"]:
        return _mean(values, m, m.sum())
    return _mean(_row_mean(values, t.mask), seqs, seqs.sum())


def _diagnostics(t: Tokens, prev: torch.Tensor, m: torch.Tensor, n: torch.Tensor) -> dict[str, float]:
    """The mismatch metrics ClippedPGLossFn logs (π_old against μ) and its entropy estimate."""
    gen, curr = t.logp_rollout, t.logp.detach()
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


def _sampling_ratio(s: Mapping[str, Any], w: torch.Tensor, m: torch.Tensor, seqs: torch.Tensor) -> float:
    """sampling_importance_ratio. At sequence level NeMo-RL takes masked_mean of the [B, 1] weights with the [B]
    sample mask, which broadcasts to [B, B]: Σ_i w_i · Σ_j s_j / (Σ_j s_j + 1e-8), kept as it computes it."""
    if s["sequence_level_importance_ratios"]:
        return _mean(w, seqs, seqs.sum()).item()
    return _mean(w, m, m.sum()).item()


def clipped_pg_loss(t: Tokens, s: Mapping[str, Any]) -> Result:
    """ClippedPGLossFn with the settings `s` (formula in the module docstring)."""
    kept, seq_metrics = _seq_error(t, s)
    seqs = kept.to(t.logp.dtype)
    m = t.mask * seqs.unsqueeze(-1)
    n = m.sum()
    prev = t.logp.detach() if s["force_on_policy_ratio"] else t.logp_old
    ratios, clamped = _ratios(t, s, prev)
    clip_loss = _surrogate(t, s, ratios, clamped)
    w, dropped, oob = _weights(t, s, prev, m, seqs)
    correct = s["use_importance_sampling_correction"]
    used = w if correct else torch.ones_like(t.logp_old)
    loss = _reduce(used * clip_loss, t, s, m, seqs)
    with torch.no_grad():
        metrics = {"loss": loss.item(), **_ratio_stats("probs_ratio", ratios, m, n),
                   **_ratio_stats("probs_ratio_clamped", clamped, m, n), "kl_penalty": 0,
                   **_diagnostics(t, prev, m, n), "sampling_importance_ratio": _sampling_ratio(s, w, m, seqs),
                   "num_valid_samples": seqs.sum().item(), **oob, "positive_nll_loss": 0.0, **seq_metrics}
    keep = t.mask & kept.unsqueeze(-1) & ~(dropped if correct else torch.zeros_like(dropped))
    return Result(loss, keep, (used * m).detach(), metrics)


_DEFAULT = {"ratio_clip_min": 0.2, "ratio_clip_max": 0.2, "ratio_clip_c": None, "reference_policy_kl_penalty": 0.0,
            "token_level_loss": True, "sequence_level_importance_ratios": False, "disable_ppo_ratio": False,
            "force_on_policy_ratio": False, "use_cispo": False, "positive_example_nll_weight": 0.0,
            "use_importance_sampling_correction": False, "truncated_importance_sampling_type": None,
            "truncated_importance_sampling_ratio": None, "truncated_importance_sampling_ratio_min": None,
            "seq_logprob_error_threshold": None}


def _with(**changes: Any) -> dict[str, Any]:
    return {**_DEFAULT, **changes}


def _preset(name: str, summary: str, settings: dict[str, Any], default: bool = False) -> Preset:
    return Preset(f"nemo-rl/{name}", "nemo-rl", SOURCE, summary, settings, clipped_pg_loss, default)


_IS = {"use_importance_sampling_correction": True}
_SEQ_MASK_TIS = {"truncated_importance_sampling_type": "seq-mask-tis", "truncated_importance_sampling_ratio": 1.002,
                 "truncated_importance_sampling_ratio_min": 0.999}
_CISPO = {"use_cispo": True, "ratio_clip_min": 1.0, "ratio_clip_max": 5.0}
_GSPO = {"sequence_level_importance_ratios": True, "token_level_loss": False}
PRESETS = (
    _preset("default", "ℓ = max(−A·r, −A·clip(r, 0.8, 1.2)), r = π/π_old, no μ correction; mean over response "
            "tokens", _DEFAULT, default=True),
    _preset("importance_sampling", "w·ℓ, w = π_old/μ untruncated (async GRPO)", _with(**_IS)),
    _preset("tis", "min(w, 2)·ℓ, w = π_old/μ", _with(**_IS, truncated_importance_sampling_type="tis",
                                                      truncated_importance_sampling_ratio=2.0)),
    _preset("icepop", "w·ℓ on tokens with w = π_old/μ in [0.5, 5], else dropped",
            _with(**_IS, truncated_importance_sampling_type="icepop", truncated_importance_sampling_ratio=5.0,
                  truncated_importance_sampling_ratio_min=0.5)),
    _preset("seq-mask-tis", "w·ℓ on sequences with geometric-mean w in [0.999, 1.002], else the sequence is "
            "dropped", _with(**_IS, **_SEQ_MASK_TIS)),
    _preset("seq_logprob_error_threshold", "ℓ on sequences whose mean exp(|log μ − log π_old|) ≤ 2, else the "
            "sequence is dropped", _with(seq_logprob_error_threshold=2.0)),
    _preset("dual_clip", "PPO clip, then min(ℓ, −3A) where A < 0 (ratio_clip_c 3, the value its docs give)",
            _with(ratio_clip_c=3.0)),
    _preset("dapo", "PPO clip at [0.8, 1.28], then min(ℓ, −10A) where A < 0 (the DAPO recipes)",
            _with(ratio_clip_max=0.28, ratio_clip_c=10.0)),
    _preset("cispo", "ℓ = −A·sg(clip(r, 0, 6))·log π (docs/guides/cispo.md)", _with(**_CISPO)),
    _preset("cispo-importance_sampling", "CISPO · w, w = π_old/μ untruncated (the async CISPO recipe)",
            _with(**_CISPO, **_IS)),
    _preset("gspo", "PPO clip on r = exp(mean_t log π/π_old) per sequence; token mean per sequence, then mean over "
            "sequences", _with(**_GSPO)),
    _preset("gspo-importance_sampling", "GSPO · w, w = exp(Σ_t log π_old/μ) per sequence, untruncated",
            _with(**_GSPO, **_IS)),
    _preset("reinforce", "ℓ = −A·log π (disable_ppo_ratio), no μ correction", _with(disable_ppo_ratio=True)),
    _preset("force_on_policy_ratio", "ℓ = −A·exp(log π − sg(log π)): r = 1 unclipped, π_old := π",
            _with(force_on_policy_ratio=True)),
    _preset("prorlv2_1", "r = 1 (force_on_policy_ratio) · w = π/μ on sequences with geometric-mean w in "
            "[0.999, 1.002], else dropped (prorlv2_1_moe.v2.yaml)",
            _with(**_IS, **_SEQ_MASK_TIS, force_on_policy_ratio=True, ratio_clip_max=0.27)),
)
