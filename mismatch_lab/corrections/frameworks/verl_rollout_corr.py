"""verl 0.9.1's rollout correction (verl/trainer/ppo/rollout_corr_helper.py): IS weights, rejection masks and the
`rollout_corr/` metrics, with the shared constants and masked reductions of the verl presets (frameworks/verl.py:
the sources, the notation and the two modes).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

SOURCE = "volcengine/verl 0.9.1 (PyPI wheel): "
SAFETY = 20.0
"""verl's SAFETY_BOUND: log-ratios are clamped to ±20 before exp (rollout_corr_helper.py, core_algos.py)."""
GUARD = 1e-8
"""verl_F.masked_mean's denominator guard: mean = Σ m·x / (Σ m + 1e-8)."""
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
              "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")

DEFAULTS: dict[str, Any] = {
    # ActorConfig / PolicyLossConfig (verl/workers/config/actor.py) as the generated ppo_trainer.yaml sets them
    "loss_mode": "vanilla", "loss_agg_mode": "token-mean", "clip_ratio_low": 0.2, "clip_ratio_high": 0.2,
    "clip_ratio_c": 3.0, "tau_pos": 1.0, "tau_neg": 1.05, "clip_cov_ratio": 0.0002, "clip_cov_lb": 1.0,
    "clip_cov_ub": 5.0, "kl_cov_ratio": 0.0002, "ppo_kl_coef": 0.1,
    # algorithm.rollout_correction (config/algorithm/rollout_correction.yaml: everything off, metrics only)
    "rollout_is": None, "rollout_is_threshold": 2.0, "rollout_is_batch_normalize": False, "rollout_rs": None,
    "rollout_rs_threshold": None, "bypass_mode": False, "loss_type": "ppo_clip",
}
"""Every setting the loss reads, at verl's out-of-the-box values; a preset's `settings` override some."""


def _sum(x: torch.Tensor, m: torch.Tensor, dim=None) -> torch.Tensor:
    """Σ over m (m float); entries outside m are replaced by 0 first, as verl's masked_sum does."""
    picked = torch.where(m.bool(), x, torch.zeros((), dtype=x.dtype))
    return (picked * m).sum() if dim is None else (picked * m).sum(dim=dim)


def _mean(x: torch.Tensor, m: torch.Tensor, dim=None) -> torch.Tensor:
    """Masked mean with verl's guard: Σ m·x / (Σ m + 1e-8)."""
    count = m.sum() if dim is None else m.sum(dim=dim)
    return _sum(x, m, dim) / (count + GUARD)


def _item(x) -> float:
    return float(x.detach().item()) if isinstance(x, torch.Tensor) else float(x)


def _share(cond: torch.Tensor, m: torch.Tensor | None = None, dim=None) -> torch.Tensor:
    """The share of True in `cond` (over m when given) in float32: verl takes these shares of `.float()`
    tensors, so they carry float32 rounding (e.g. 1/3 → 0.3333333432674408)."""
    f = cond.to(torch.float32)
    return f.mean() if m is None else _mean(f, m, dim)


def _f32_log(x: float) -> float:
    """log x computed in float32: verl builds the IS metrics' log thresholds with torch.tensor(x) (float32)."""
    return float(torch.log(torch.tensor(x, dtype=torch.float32)))


# --------------------------------------------------------------------------- rollout correction: IS weights

def _is_bounds(spec) -> tuple[float, float | None]:
    """rollout_is_threshold -> (upper, lower or None): a number is a TIS cap, 'lo_hi' an IcePop band."""
    if isinstance(spec, str) and "_" in spec:
        lo, hi = spec.split("_", 1)
        return float(hi), float(lo)
    return float(spec), None


def is_weights(lr: torch.Tensor, m: torch.Tensor, s: Mapping[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's IS weight for log-ratio ℓ [B, T] (float mask m), detached, with its metrics.

    token     w_t = exp(clamp(ℓ_t, ±20))·m_t;  sequence: w = exp(clamp(Σ_t m_t ℓ_t, ±20)) on every token.
    TIS       w ← min(w, upper);  IcePop ('lo_hi'): w ← w·[lo ≤ w ≤ hi] (zero outside the band).
    batch normalize (rollout_is_batch_normalize): w ← w / mean (token: masked mean of w; sequence: mean over
              non-empty rows of each row's masked mean), only when that mean > 1e-8; metrics are of w before.
    """
    upper, lower = _is_bounds(s["rollout_is_threshold"])
    level = s["rollout_is"]
    if level == "token":
        log_for_metrics = lr
        raw = torch.exp(lr.clamp(-SAFETY, SAFETY)) * m
    else:
        log_for_metrics = _sum(lr, m, -1).unsqueeze(-1)
        raw = torch.exp(log_for_metrics.clamp(-SAFETY, SAFETY)).expand_as(lr) * m
    if lower is None:
        w = raw.clamp(max=upper)
    else:
        w = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    metrics = _is_metrics(w, raw, log_for_metrics, m, level, upper, lower)
    if lower is not None:
        metrics["rollout_is_oob_ratio"] = _item(_share((raw < lower) | (raw > upper), m))
    w = w.detach()
    if s["rollout_is_batch_normalize"]:
        w, metrics["rollout_is_batch_norm_factor"] = _batch_normalize(w, m, level)
    return w, metrics


def _batch_normalize(w: torch.Tensor, m: torch.Tensor, level: str) -> tuple[torch.Tensor, float]:
    if level == "token":
        mean = _mean(w, m)
    else:
        rows = (m.sum(-1) > 0).to(w.dtype)
        mean = (_mean(w, m, -1) * rows).sum() / rows.sum().clamp_min(GUARD)
    return (w / mean, _item(mean)) if mean > GUARD else (w, 1.0)


def _is_metrics(w, raw, log_for_metrics, m, level: str, upper: float, lower: float | None) -> dict[str, float]:
    """rollout_is_* (rollout_corr_helper.compute_is_metrics): mean of w; high/low shares (sequence level: of
    the unclamped Σℓ against log bounds, over all rows; token level: of the raw weights); max/min; std and
    ESS = 1/mean((w'/mean w')²) with w' = clamp(w, 0, upper); per-row mean statistics."""
    lo = 1.0 / upper if lower is None else lower
    out: dict[str, float] = {}
    if level == "sequence":
        out["rollout_is_max"] = _item(torch.exp(log_for_metrics.max().clamp(max=SAFETY)))
        out["rollout_is_min"] = _item(torch.exp(log_for_metrics.min()))
        out["rollout_is_mean"] = _item(_mean(w, m))
        out["rollout_is_ratio_fraction_high"] = _item(_share(log_for_metrics > _f32_log(upper)))
        out["rollout_is_ratio_fraction_low"] = _item(_share(log_for_metrics < _f32_log(lo)))
    else:
        out["rollout_is_mean"] = _item(_mean(w, m))
        out["rollout_is_ratio_fraction_high"] = _item(_share(raw > upper, m))
        out["rollout_is_ratio_fraction_low"] = _item(_share(raw < lo, m))
        out["rollout_is_max"] = _item(w.masked_fill(~m.bool(), -math.inf).max())
        out["rollout_is_min"] = _item(w.masked_fill(~m.bool(), math.inf).min())
    capped = w.clamp(min=0.0, max=upper)
    out["rollout_is_std"] = _std(capped, m)
    normed = capped / (_mean(capped, m) + GUARD)
    out["rollout_is_eff_sample_size"] = 1.0 / _item(_mean(normed.square(), m))
    rows = _mean(w, m, -1)
    out |= _row_stats("rollout_is_seq", rows, 1.0)
    raw_rows = _mean(raw, m, -1)
    out["rollout_is_seq_fraction_high"] = _item(_share(raw_rows > upper))
    out["rollout_is_seq_fraction_low"] = _item(_share(raw_rows < lo))
    return out


def _std(x: torch.Tensor, m: torch.Tensor) -> float:
    """sqrt(max(mean(x²) − mean(x)², 0)) over m, 0 for fewer than two tokens (verl's clamped std)."""
    if not m.sum() > 1:
        return 0.0
    mean = _mean(x, m)
    return _item(torch.sqrt(torch.clamp(_mean(x.square(), m) - mean.square(), min=0.0)))


def _row_stats(prefix: str, rows: torch.Tensor, ideal: float) -> dict[str, float]:
    """mean / std (unbiased, 0 for one row) / max / min / max |row − ideal| of per-row values."""
    return {f"{prefix}_mean": _item(rows.mean()),
            f"{prefix}_std": _item(rows.std()) if rows.numel() > 1 else 0.0,
            f"{prefix}_max": _item(rows.max()), f"{prefix}_min": _item(rows.min()),
            f"{prefix}_max_deviation": _item((rows - ideal).abs().max())}


# --------------------------------------------------------------------------- rollout correction: rejection

def _rs_bounds(options: list[str], spec) -> dict[str, tuple[float | None, float]]:
    """rollout_rs_threshold -> {option: (lower, upper)}: one entry per option or one shared by all. k1
    options take a ratio band 'lo_hi' (a single number u means [1/u, u]); k2/k3 options an upper bound."""
    parts = [p.strip() for p in str(spec).split(",") if p.strip()] if isinstance(spec, str) else [str(spec)]
    if len(parts) == 1:
        parts = parts * len(options)
    out = {}
    for option, part in zip(options, parts, strict=True):
        if option.endswith("k1"):
            lo, hi = part.split("_", 1) if "_" in part else (str(1.0 / float(part)), part)
            out[option] = (float(lo), float(hi))
        else:
            out[option] = (None, float(part))
    return out


def _statistic(option: str, lr: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(per-token statistic [B, T], per-row statistic [B] or None) of a rejection option, on ℓ clamped to ±20:
    k1 = −ℓ, k2 = ℓ²/2, k3 = e^ℓ − 1 − ℓ; token_* per token, seq_sum_* Σ_t, seq_mean_* masked mean,
    seq_max_* the masked maximum (0 for an empty row). A row statistic is broadcast over the row."""
    safe = lr.clamp(-SAFETY, SAFETY)
    k = {"k1": -safe, "k2": 0.5 * safe ** 2, "k3": torch.exp(safe) - 1.0 - safe}[option[-2:]]
    if option.startswith("token_"):
        return k, None
    if option.startswith("seq_sum_"):
        rows = _sum(k, m, -1)
    elif option.startswith("seq_mean_"):
        rows = _mean(k, m, -1)
    else:
        top = k.masked_fill(~m.bool(), -math.inf).max(dim=-1).values
        rows = torch.where(top == -math.inf, torch.zeros_like(top), top)
    return rows.unsqueeze(-1).expand_as(m), rows


def rejection(lr: torch.Tensor, m: torch.Tensor, s: Mapping[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's rejection mask (bool [B, T], m with the rejected tokens removed) and its rollout_rs_* metrics.

    Every option of the comma-separated `rollout_rs` must pass: k1 options keep log lo ≤ stat ≤ log hi, the
    others keep stat ≤ upper (boundaries kept). Options repeat at most once (duplicates dropped).
    """
    options = list(dict.fromkeys(o.strip() for o in s["rollout_rs"].split(",") if o.strip()))
    unknown = [o for o in options if o not in RS_OPTIONS]
    if unknown:
        raise ValueError(f"verl has no rollout_rs option {unknown[0]!r} (options: {', '.join(RS_OPTIONS)})")
    bounds = _rs_bounds(options, s["rollout_rs_threshold"])
    keep_all = torch.ones_like(lr)
    valid_rows = m.sum(-1) > 0
    metrics: dict[str, float] = {}
    for option in options:
        lo, hi = bounds[option]
        stat, rows = _statistic(option, lr, m)
        if lo is not None:
            lo, hi = math.log(lo), math.log(hi)
            keep = (stat >= lo) & (stat <= hi)
        else:
            keep = stat <= hi
        keep_all = keep_all * keep.to(lr.dtype)
        metrics |= _rs_metrics(option, stat, rows, m, valid_rows, hi, lo)
        metrics[f"rollout_rs_{option}_masked_fraction"] = _item(_mean(1 - keep.to(lr.dtype), m))
        row_kept = (~(~keep & m.bool())).all(dim=-1).to(lr.dtype)
        n_valid = valid_rows.to(torch.float32)
        metrics[f"rollout_rs_{option}_seq_masked_fraction"] = (
            _item(((1.0 - row_kept) * n_valid).sum() / n_valid.sum()) if n_valid.sum() > 0 else 0.0)
    metrics["rollout_rs_masked_fraction"] = _item(_mean(1 - keep_all, m))
    kept = (keep_all > 0.5) & m.bool()
    metrics["rollout_rs_seq_masked_fraction"] = _item(_share((~kept & m.bool()).any(dim=-1)))
    return kept, metrics


def _rs_metrics(option, stat, rows, m, valid_rows, hi: float, lo: float | None) -> dict[str, float]:
    """rollout_rs_<option>_* (compute_rs_metrics): mean of the statistic over tokens; max/min and the shares
    above hi / below lo over rows (sequence options) or tokens (token options); std of the statistic clamped
    to [lo or 0, hi]; per-row statistics (token options: the row means)."""
    p, mb = f"rollout_rs_{option}", m.bool()
    valid = (rows if rows is not None else _mean(stat, m, -1))[valid_rows]
    by_rows = rows is not None and valid.numel() > 0
    out = {f"{p}_mean": _item(_mean(stat, m))}
    if by_rows:
        out[f"{p}_max"], out[f"{p}_min"] = _item(valid.max()), _item(valid.min())
        out[f"{p}_fraction_high"] = _item(_share(valid > hi))
        out[f"{p}_fraction_low"] = _item(_share(valid < lo)) if lo is not None else 0.0
    else:
        out[f"{p}_max"] = _item(stat.masked_fill(~mb, -math.inf).max())
        out[f"{p}_min"] = _item(stat.masked_fill(~mb, math.inf).min())
        out[f"{p}_fraction_high"] = _item(_share(stat > hi, m))
        out[f"{p}_fraction_low"] = _item(_share(stat < lo, m)) if lo is not None else 0.0
    out[f"{p}_std"] = _std(stat.clamp(min=lo if lo is not None else 0.0, max=hi), m)
    if valid.numel() == 0:
        return out | {f"{p}_seq_{k}": 0.0 for k in
                      ("mean", "std", "max", "min", "max_deviation", "fraction_high", "fraction_low")}
    out |= _row_stats(f"{p}_seq", valid, 0.0)
    out[f"{p}_seq_fraction_high"] = _item(_share(valid > hi))
    if lo is not None:
        out[f"{p}_seq_fraction_low"] = _item(_share(valid < lo))
    return out


# --------------------------------------------------------------------------- rollout correction: diagnostics

def offpolicy_metrics(lp: torch.Tensor, lmu: torch.Tensor, m: torch.Tensor) -> dict[str, float]:
    """compute_offpolicy_metrics, π' = the trainer's side (π_old decoupled, π bypass), ℓ = log π' − log μ:
    training/rollout ppl = mean over rows of exp(−row mean log-prob) (and the log versions); kl = mean(−ℓ);
    k3_kl = mean(e^ℓ − ℓ − 1) (ℓ unclamped); log_ppl_diff = row mean of −ℓ (mean, |·| mean, max, min);
    ppl_ratio = mean exp(log_ppl_diff); chi2_token = mean(e^{2 clamp ℓ}) − 1; chi2_seq = mean over rows of
    e^{2 clamp Σℓ} − 1 (clamps at ±20)."""
    row_lp, row_mu = _mean(lp, m, -1), _mean(lmu, m, -1)
    lr = lp - lmu
    diff = row_mu - row_lp
    out = {"training_ppl": torch.exp(-row_lp).mean(), "training_log_ppl": (-row_lp).mean(),
           "kl": _mean(lmu - lp, m), "k3_kl": _mean(torch.exp(lr) - lr - 1, m),
           "rollout_ppl": torch.exp(-row_mu).mean(), "rollout_log_ppl": (-row_mu).mean(),
           "log_ppl_diff": diff.mean(), "log_ppl_abs_diff": diff.abs().mean(), "log_ppl_diff_max": diff.max(),
           "log_ppl_diff_min": diff.min(), "ppl_ratio": torch.exp(diff).mean(),
           "chi2_token": _mean(torch.exp(lr.clamp(-SAFETY, SAFETY)).square(), m) - 1.0,
           "chi2_seq": torch.exp(2.0 * _sum(lr, m, -1).clamp(-SAFETY, SAFETY)).mean() - 1.0}
    return {k: _item(v) for k, v in out.items()}


def rollout_correction(lp: torch.Tensor, lmu: torch.Tensor, m: torch.Tensor, s: Mapping[str, Any]):
    """compute_rollout_correction_and_rejection_mask on (π', μ): (IS weights or None, kept mask, metrics under
    `rollout_corr/`). IS when rollout_is is set, rejection when rollout_rs is set, diagnostics always."""
    lr = lp - lmu
    metrics: dict[str, float] = {}
    w = None
    if s["rollout_is"] is not None and s["rollout_is_threshold"] is not None:
        w, is_m = is_weights(lr, m, s)
        metrics |= is_m
    kept = m.bool()
    if s["rollout_rs"] is not None:
        kept, rs_m = rejection(lr, m, s)
        metrics |= rs_m
    metrics |= offpolicy_metrics(lp, lmu, m)
    return w, kept, {f"rollout_corr/{k}": v for k, v in metrics.items()}
