"""ROLL's RLVR actor loss with its train-infer correction (alibaba/ROLL @8eb27cc2, roll/pipeline/rlvr/actor_worker.py
ActorWorker.loss_func; roll/utils/train_infer_corrections.py compute_train_infer_correction; roll/utils/functionals.py
agg_loss, masked_mean, masked_sum, compute_approx_kl; roll/pipeline/agentic/utils.py compute_segment_masked_mean;
roll/configs/base_config.py TrainInferCorrectionConfig and PPOConfig defaults; roll/pipeline/rlvr/rlvr_config.py).

ROLL's names: log_probs = π, old_log_probs = π_old, infer_logprobs = μ. Per token r = π_old/μ and d = π_old − μ,
and their aggregates per sequence: `geometric` exp(masked mean log r) and mean d, `sequence` exp(Σ log r) and Σ d,
`segment` the geometric mean over each contiguous run of response tokens (one run per sequence here).

  is_weight  (enabled false by default) w = r at weight_type, clamped to [0, upper_bound = 1.2], detached
  filters    (none by default) each drops tokens whose r at agg_type lies outside [ratio_low 0.8, ratio_high 1.2]
             and, with diff_enabled, whose d lies outside [diff_low −0.2, diff_high 0.2]
  loss       −min(ρA, clip(ρ, 1 ± pg_clip 0.2)A) · w on ρ = π/π_old (token, or importance_sampling seq: the
             geometric mean), dual clip when dual_clip_loss; agg_loss seq-mean-token-mean (PPOConfig default):
             per sequence the mean over kept tokens (+1e-8), summed and divided by the sequences that had
             response tokens before filtering (+1e-8) — a fully filtered sequence adds 0 but still counts.

Result.keep: response minus the filters; Result.weight: w on response tokens (1 with is_weight off).
Metrics under ROLL's names (one rank, one micro-batch; @sum/@max/@min are ROLL's reduce suffixes):
actor/pg_loss, weighted_pg_loss, total_loss, approxkl, policykl, clipfrac, ppo_ratio_{high,low,}_clipfrac,
ratio_mean, ratio_max, ratio_min, valid_samples, total_samples, valid_sample_ratio, and the train-infer ones:
train_infer_{ratio,diff}_{token,geometric,sequence,segment}_mean, is_weight_clipfrac,
train_infer_{agg}_{ratio,diff}_mask_mean, train_infer_final_mask_mean. ROLL's `token-mean` sums the whole
[B, T] grid without the mask (is_weight_clipfrac and the filter pass rates: padding counts where a
sequence-level value broadcasts onto it, or r = 1 passes a filter there); reproduced on the batch as given.
loss_agg_mode `token-mean` (the roll/token-mean* presets): agg_loss sums the whole loss grid over the
unfiltered response-token count without reading the mask, so the filters drop nothing from the loss (Result.keep
is the whole response there); padding adds 0 because compute_advantage multiplies A by the response mask (A
outside the mask is taken as 0 here, whatever the batch holds). clipfrac, approxkl and policykl follow the mode.
Not reproduced: kl_loss (needs π_ref; use_kl_loss is off by default), entropy, sample weights (1 by default),
the seq-mean-token-sum(-norm) modes, use_pg_clip_range (off by default).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mismatch_lab.corrections.frameworks.base import Preset, Result, Tokens

SOURCE = ("alibaba/ROLL @8eb27cc2, roll/pipeline/rlvr/actor_worker.py (ActorWorker.loss_func), "
          "roll/utils/train_infer_corrections.py, roll/utils/functionals.py (agg_loss)")
AGGS = ("token", "geometric", "sequence", "segment")
EPS = 1e-8


def _mean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """masked_mean over the last dim ([B]; 0 for an empty row) with an integer mask m: ROLL's count + 1e-8 is
    a float32 tensor (torch's default dtype), so the 1e-8 is lost to float32 rounding as in ROLL."""
    n = m.sum(-1)
    return torch.where(n > 0, (x * m).sum(-1) / (n + EPS), torch.zeros_like(n))


def _segment_mean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """compute_segment_masked_mean: each contiguous run of m's ones gets its masked mean; 0 elsewhere."""
    start = (m == 1) & (torch.diff(m, dim=-1, prepend=torch.zeros_like(m[:, :1])) == 1)
    run = torch.cumsum(start.long(), -1) * m
    out = torch.zeros_like(x)
    for k in range(1, int(run.max()) + 1 if run.numel() else 1):
        inside = (run == k).long()
        out = out + _mean(x, inside).unsqueeze(-1) * inside
    return out


def _granular(t: Tokens, m: torch.Tensor) -> dict[str, dict[str, torch.Tensor]]:
    """_compute_all_granularity: r and d at the four granularities ([B, T] each)."""
    log_r = t.logp_old - t.logp_rollout
    d = t.logp_old.exp() - t.logp_rollout.exp()
    return {"ratio": {"token": log_r.exp(), "geometric": _mean(log_r, m).exp().unsqueeze(-1).expand_as(log_r),
                      "sequence": torch.where(m.sum(-1) > 0, (log_r * m).sum(-1), 0.0).exp()
                      .unsqueeze(-1).expand_as(log_r),
                      "segment": _segment_mean(log_r, m).exp()},
            "diff": {"token": d, "geometric": _mean(d, m).unsqueeze(-1).expand_as(d),
                     "sequence": torch.where(m.sum(-1) > 0, (d * m).sum(-1), 0.0).unsqueeze(-1).expand_as(d),
                     "segment": _segment_mean(d, m)}}


def _seq_mean_token_mean(x: torch.Tensor, m: torch.Tensor, n_seqs: float) -> torch.Tensor:
    valid = (m > 0).any(-1).float()
    return (_mean(x, m) * torch.ones(m.shape[0]) * valid).sum() / (n_seqs + EPS)


def _grid_mean(x: torch.Tensor, n_tokens: float) -> float:
    """agg_loss 'token-mean' with no weights: the whole float32 grid summed / the token count (the mask is not
    read)."""
    return (x.float().sum() / n_tokens).item()


def train_infer_correction(t: Tokens, m: torch.Tensor, cfg: Mapping[str, Any], n_seqs: float, n_tokens: float):
    """compute_train_infer_correction: (is_weight, filter mask [B, T] as float, metrics)."""
    g = _granular(t, m)
    metrics = {f"actor/train_infer_{kind}_{agg}_mean@sum": _seq_mean_token_mean(g[kind][agg], m, n_seqs).item()
               for agg in AGGS for kind in ("ratio", "diff")}
    w = torch.ones_like(g["ratio"]["token"])
    iw = cfg["is_weight"]
    if iw["enabled"]:
        w = g["ratio"][iw["weight_type"]]
        if iw["upper_bound"] is not None:
            metrics["actor/is_weight_clipfrac@sum"] = _grid_mean(w > iw["upper_bound"], n_tokens)
            w = w.clamp(min=0.0, max=iw["upper_bound"])
    keep = torch.ones_like(m)
    for f in (f for f in cfg["filters"] if f["enabled"]):
        agg = f["agg_type"]
        for kind in ("ratio", "diff"):
            if f[f"{kind}_enabled"]:
                v = g[kind][agg]
                passed = (v >= f[f"{kind}_low"]).float() * (v <= f[f"{kind}_high"]).float()
                metrics[f"actor/train_infer_{agg}_{kind}_mask_mean@sum"] = _grid_mean(passed, n_tokens)
                keep = keep * passed
    if cfg["filters"]:
        metrics["actor/train_infer_final_mask_mean"] = ((m * keep.float() * m).sum() / (m.sum() + EPS)).item()
    return w.detach(), keep, metrics


def _ratio(t: Tokens, m: torch.Tensor, s: Mapping[str, Any]) -> torch.Tensor:
    if s["importance_sampling"] == "token":
        return (t.logp - t.logp_old).exp()
    if s["importance_sampling"] == "seq":
        log_r = t.logp - t.logp_old
        return _mean(log_r, m).exp().unsqueeze(-1).expand_as(log_r)
    raise ValueError(f"ROLL has no importance_sampling {s['importance_sampling']!r} (token, seq)")


def _token_mean(x: torch.Tensor, m: torch.Tensor, n_tokens: float) -> torch.Tensor:
    """agg_loss 'token-mean' of a loss matrix: the grid's sum over the unfiltered token count, the mask not read
    (padding adds 0: compute_advantage leaves A = 0 there, so every term of the loss is 0)."""
    return torch.where(m.bool(), x, 0.0).sum() / n_tokens


AGG_LOSS = {"seq-mean-token-mean": lambda x, m, keep, n_seqs, n_tokens: _seq_mean_token_mean(x, m * keep, n_seqs),
            "token-mean": lambda x, m, keep, n_seqs, n_tokens: _token_mean(x, m, n_tokens)}
"""loss_agg_mode → agg_loss of the [B, T] loss (response mask m, filter keep): the modes reproduced."""


def actor_loss(t: Tokens, s: Mapping[str, Any]) -> Result:
    """ActorWorker.loss_func's PPO loss with the train-infer correction; formula in the module docstring."""
    if s["loss_agg_mode"] not in AGG_LOSS:
        raise ValueError(f"loss_agg_mode {s['loss_agg_mode']!r} is not reproduced ({', '.join(AGG_LOSS)})")
    agg = AGG_LOSS[s["loss_agg_mode"]]
    m0 = t.mask.long()
    n_seqs, n_tokens = max(float((m0.sum(-1) > 0).sum()), 1.0), max(float(m0.sum()), 1.0)
    w, keep, metrics = train_infer_correction(t, m0, s["train_infer_correction"], n_seqs, n_tokens)
    m = m0 * keep.long()
    ratio = _ratio(t, m, s)
    a, clip = t.advantages * m0, s["pg_clip"]
    surr1, surr2 = ratio * a, ratio.clamp(1 - clip, 1 + clip) * a
    loss = -torch.min(surr1, surr2)
    if s["dual_clip_loss"]:
        loss = torch.where(a < 0, -torch.max(-loss, (1 + clip * 2) * a), loss)
    if s["train_infer_correction"]["is_weight"]["enabled"]:
        loss = loss * w
    pg = agg(loss, m0, keep.long(), n_seqs, n_tokens)
    log_r = t.logp - t.logp_old
    with torch.no_grad():
        high, low = (ratio > 1 + clip).float(), (ratio < 1 - clip).float()
        valid = (m > 0).any(-1).float()
        metrics |= {"actor/pg_loss@sum": pg.item(), "actor/weighted_pg_loss@sum": pg.item(),
                    "actor/total_loss@sum": pg.item(),
                    "actor/approxkl@sum": agg(0.5 * log_r.square() * m, m0, keep.long(), n_seqs, n_tokens).item(),
                    "actor/policykl@sum": agg(log_r * m, m0, keep.long(), n_seqs, n_tokens).item(),
                    "actor/valid_samples@sum": valid.sum().item(), "actor/total_samples@sum": float(m.shape[0]),
                    "actor/valid_sample_ratio@sum": (valid.sum() / n_seqs).item(),
                    "actor/ppo_ratio_high_clipfrac@sum": _grid_mean(high, n_tokens),
                    "actor/ppo_ratio_low_clipfrac@sum": _grid_mean(low, n_tokens),
                    "actor/ppo_ratio_clipfrac@sum": _grid_mean(high + low, n_tokens),
                    "actor/ratio_mean@sum": _seq_mean_token_mean(ratio, m, n_seqs).item(),
                    "actor/ratio_max@max": (ratio * m).max().item(),
                    "actor/ratio_min@min": (ratio * m + (1 - m) * 1e10).min().item(),
                    "actor/clipfrac@sum": agg(torch.lt(surr2, surr1).float(), m0, keep.long(), n_seqs,
                                              n_tokens).item()}
    in_loss = keep.bool() if s["loss_agg_mode"] == "seq-mean-token-mean" else torch.ones_like(t.mask)
    return Result(pg * s["rl_loss_coef"], in_loss & t.mask, (w * m0).detach(), metrics)


_IS = {"enabled": False, "weight_type": "token", "upper_bound": 1.2, "detach": True}
_FILTER = {"enabled": True, "agg_type": "token", "ratio_enabled": True, "ratio_low": 0.8, "ratio_high": 1.2,
           "diff_enabled": False, "diff_low": -0.2, "diff_high": 0.2}
_BASE = {"pg_clip": 0.2, "dual_clip_loss": False, "importance_sampling": "token",
         "loss_agg_mode": "seq-mean-token-mean", "rl_loss_coef": 1.0,
         "train_infer_correction": {"is_weight": _IS, "filters": []}}
"""PPOConfig / RLVRConfig / TrainInferCorrectionConfig field defaults (a filter's own `enabled` defaults to false)."""


def _with(is_weight: bool = False, **filt: Any) -> dict[str, Any]:
    filters = [{**_FILTER, **filt}] if filt else []
    return {**_BASE, "train_infer_correction": {"is_weight": {**_IS, "enabled": is_weight}, "filters": filters}}


PRESETS = (
    Preset("roll/default", "roll", SOURCE,
           "PPO-clip 0.2 on π/π_old, no IS, no filter; seq-mean-token-mean; train_infer_* metrics only",
           _BASE, actor_loss, default=True),
    Preset("roll/is_weight", "roll", SOURCE, "PPO-clip 0.2 on π/π_old × min(π_old/μ, 1.2) per token",
           _with(is_weight=True), actor_loss),
    Preset("roll/filter-token-ratio", "roll", SOURCE,
           "PPO-clip 0.2 on π/π_old; tokens with π_old/μ outside [0.8, 1.2] dropped",
           _with(agg_type="token"), actor_loss),
    Preset("roll/token-mean", "roll", SOURCE,
           "PPO-clip 0.2 on π/π_old, no IS; loss_agg_mode token-mean: Σ over the batch / its response tokens",
           {**_BASE, "loss_agg_mode": "token-mean"}, actor_loss),
    Preset("roll/token-mean-filter-token-ratio", "roll", SOURCE,
           "token-mean with the token ratio filter: the filter drops nothing from the loss (token-mean does not "
           "read the mask), only from approxkl/policykl and the ratio metrics",
           {**_with(agg_type="token"), "loss_agg_mode": "token-mean"}, actor_loss),
    Preset("roll/filter-token-diff", "roll", SOURCE,
           "PPO-clip 0.2; tokens with π_old − μ outside [−0.2, 0.2] dropped (the Δp filter alone: "
           "ratio_enabled false, diff_enabled true)", _with(agg_type="token", ratio_enabled=False, diff_enabled=True),
           actor_loss),
    Preset("roll/filter-token-ratio-diff", "roll", SOURCE,
           "PPO-clip 0.2; tokens with π_old/μ outside [0.8, 1.2] or π_old − μ outside [−0.2, 0.2] dropped",
           _with(agg_type="token", diff_enabled=True), actor_loss),
    Preset("roll/filter-segment-ratio-diff", "roll", SOURCE,
           "PPO-clip 0.2; segments with geo-mean π_old/μ outside [0.8, 1.2] or mean π_old − μ outside "
           "[−0.2, 0.2] dropped", _with(agg_type="segment", diff_enabled=True), actor_loss),
    Preset("roll/is_weight-filter-token-ratio", "roll", SOURCE,
           "PPO-clip 0.2 × min(π_old/μ, 1.2); tokens with π_old/μ outside [0.8, 1.2] dropped",
           _with(is_weight=True, agg_type="token"), actor_loss),
)
