"""verl 0.9.1: the actor's policy losses and the rollout correction, as verl computes them.

Sources (volcengine/verl, PyPI wheel verl==0.9.1):
    verl/trainer/ppo/core_algos.py          the policy losses (`policy_loss.loss_mode`), `agg_loss`
    verl/trainer/ppo/rollout_corr_helper.py IS weights, rejection masks and the `rollout_corr/` metrics
    verl/trainer/config/algorithm.py        RolloutCorrectionConfig and its preset classmethods
    verl/workers/config/actor.py            ActorConfig / PolicyLossConfig defaults
    verl/workers/utils/losses.py            how the actor calls the loss (`ppo_loss`)
    verl/trainer/ppo/ray_trainer.py         where the rollout correction runs (decoupled vs bypass)

Notation: π = Tokens.logp (current policy, gradient), π_old = Tokens.logp_old, μ = Tokens.logp_rollout, m the
response mask, ℓ = log-ratio. Every exponent of a log-ratio is taken after clamping it to ±20 where verl
does (`SAFETY`); every masked mean divides by (count + 1e-8) as verl's `masked_mean` does (`GUARD`).

Two modes (`bypass_mode`):
    decoupled  the trainer runs the correction once on (π_old, μ): IS weight w from ℓ = log π_old − log μ,
               the rejection mask replaces m before the actor sees the batch (so token-mean divides by the
               kept tokens); the actor's loss (loss_mode) then multiplies its per-token loss by w.
    bypass     π_old := μ. The correction runs inside the loss on (π detached, μ); `loss_type` ppo_clip is the
               vanilla loss on π/μ without w, `reinforce` is −A·w·log π (or −A·log π when rollout_is is None);
               rejected tokens leave the numerator but the token-mean still divides by all response tokens
               (the engine counts `batch_num_tokens` before the loss rejects).
A store's tokens are one [B, T] batch per call: `batch_num_tokens` = tokens of the mask given to the actor,
`global_batch_size` = B, one micro-batch (verl averages the actor metrics of micro-batches).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from mismatch_lab.corrections.frameworks.base import Preset, Result, Tokens

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


# --------------------------------------------------------------------------- the two modes

def verl_loss(t: Tokens, settings: Mapping[str, Any]) -> Result:
    """What verl does to the tokens under `settings` (DEFAULTS updated by them): module docstring."""
    s = {**DEFAULTS, **settings}
    m = t.mask.bool()
    if not m.any():
        raise ValueError("verl's rollout correction needs at least one response token")
    if s["bypass_mode"]:
        return _bypass(t, s, m)
    if s["loss_mode"] not in POLICY_LOSSES:
        raise ValueError(f"no verl loss_mode {s['loss_mode']!r} here (known: {', '.join(POLICY_LOSSES)})")
    w, kept, metrics = rollout_correction(t.logp_old, t.logp_rollout, m, s)
    actor = Actor(t.logp, t.logp_old, t.advantages, kept, w, int(kept.sum()), m.shape[0])
    loss, weight, extra, pg = POLICY_LOSSES[s["loss_mode"]](actor, s)
    return _result(loss, kept, extra, w, weight, metrics | pg)


def _bypass(t: Tokens, s: Mapping[str, Any], m: torch.Tensor) -> Result:
    """compute_policy_loss_bypass_mode: π_old := μ; the correction runs on (sg π, μ); `reinforce`:
    L = −A·w·log π (−A·log π without IS), ppo_kl = mean over kept tokens of log μ − log π; `ppo_clip`: the
    vanilla loss on ρ = π/μ without w. Aggregated over the kept tokens, the token-mean dividing by all
    response tokens."""
    w, kept, metrics = rollout_correction(t.logp.detach(), t.logp_rollout, m, s)
    n_tokens = int(m.sum())
    if s["loss_type"] == "reinforce":
        a = Actor(t.logp, t.logp_rollout, t.advantages, kept, w, n_tokens, m.shape[0])
        loss = aggregate(a.weigh(-t.advantages * t.logp), a, s["loss_agg_mode"])
        pg = {"actor/ppo_kl": _item(_mean(-(t.logp - t.logp_rollout), kept))}
        weight = a.times_w(torch.ones_like(t.logp))
    elif s["loss_type"] == "ppo_clip":
        a = Actor(t.logp, t.logp_rollout, t.advantages, kept, None, n_tokens, m.shape[0])
        loss, weight, _, pg = vanilla(a, s)
    else:
        raise ValueError(f"verl has no bypass loss_type {s['loss_type']!r} (reinforce, ppo_clip)")
    return _result(loss, kept, None, w if s["loss_type"] == "reinforce" else None, weight, pg | metrics)


def _result(loss, kept, extra, w, weight, metrics: dict[str, float]) -> Result:
    """keep = the actor's mask, minus the loss's own mask (DPPO validity) and the tokens whose IS weight is 0
    (IcePop outside its band): they stay in the token-mean's denominator but add no gradient."""
    keep = kept if extra is None else kept & extra
    if w is not None:
        keep = keep & (w != 0)
    metrics["actor/pg_loss"] = _item(loss)
    return Result(loss=loss, keep=keep, weight=weight.detach(), metrics=metrics)


# --------------------------------------------------------------------------- presets

_CORE = "verl/trainer/ppo/core_algos.py"
_RC = "verl/trainer/ppo/rollout_corr_helper.py + verl/trainer/config/algorithm.py (RolloutCorrectionConfig.{})"
_PPO = "PPO-clip 0.2 + dual clip c=3 on ρ = π/π_old"
_GEO = {"rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.999_1.001"}
_K3 = {"rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.01}
_BYPASS_PG = {"bypass_mode": True, "loss_type": "reinforce"}
_BYPASS_PPO = {"bypass_mode": True, "loss_type": "ppo_clip"}

_CORRECTIONS: dict[str, tuple[dict[str, Any], str]] = {
    # RolloutCorrectionConfig.<classmethod>() at its default arguments -> (settings, summary)
    "disabled": ({}, f"{_PPO}; rollout_corr/ metrics only"),
    "decoupled_token_is": ({"rollout_is": "token"}, f"{_PPO}, × min(π_old/μ, 2) per token"),
    "decoupled_seq_is": ({"rollout_is": "sequence"}, f"{_PPO}, × min(∏ π_old/μ, 2) per sequence"),
    "decoupled_token_icepop": ({"rollout_is": "token", "rollout_is_threshold": "0.5_5.0"},
                               f"{_PPO}, × π_old/μ, 0 outside [0.5, 5] (token)"),
    "decoupled_seq_is_rs": ({"rollout_is": "sequence", "rollout_rs": "seq_sum_k1", "rollout_rs_threshold": "0.5_2.0"},
                            f"{_PPO}, × min(∏ π_old/μ, 2); drop sequences with ∏ μ/π_old outside [0.5, 2]"),
    "decoupled_geo_rs": (dict(_GEO), f"{_PPO}, no IS; drop sequences with geo-mean μ/π_old outside [0.999, 1.001]"),
    "decoupled_geo_rs_seq_tis": ({"rollout_is": "sequence", **_GEO},
                                 f"{_PPO}, × min(∏ π_old/μ, 2); geo-mean μ/π_old band [0.999, 1.001]"),
    "decoupled_geo_rs_token_tis": ({"rollout_is": "token", **_GEO},
                                   f"{_PPO}, × min(π_old/μ, 2) per token; geo-mean band [0.999, 1.001]"),
    "decoupled_k3_rs": (dict(_K3), f"{_PPO}, no IS; drop sequences with mean k3(π_old/μ) > 0.01"),
    "decoupled_k3_rs_seq_tis": ({"rollout_is": "sequence", **_K3},
                                f"{_PPO}, × min(∏ π_old/μ, 2); drop sequences with mean k3 > 0.01"),
    "decoupled_k3_rs_token_tis": ({"rollout_is": "token", **_K3},
                                  f"{_PPO}, × min(π_old/μ, 2) per token; drop sequences with mean k3 > 0.01"),
    "bypass_ppo_clip": (dict(_BYPASS_PPO), "PPO-clip 0.2 + dual clip 3 on ρ = π/μ (π_old := μ), no IS"),
    "bypass_ppo_clip_geo_rs": ({**_BYPASS_PPO, **_GEO},
                               "PPO-clip on π/μ; drop sequences with geo-mean μ/π outside [0.999, 1.001]"),
    "bypass_ppo_clip_k3_rs": ({**_BYPASS_PPO, **_K3}, "PPO-clip on π/μ; drop sequences with mean k3(π/μ) > 0.01"),
    "bypass_pg_is": ({**_BYPASS_PG, "rollout_is": "sequence"}, "−A·min(∏ sg(π)/μ, 2)·log π (REINFORCE + seq-TIS)"),
    "bypass_pg_token_icepop": ({**_BYPASS_PG, "rollout_is": "token", "rollout_is_threshold": "0.5_5.0"},
                               "−A·w·log π, w = sg(π)/μ, 0 outside [0.5, 5] (token)"),
    "bypass_pg_geo_rs": ({**_BYPASS_PG, **_GEO},
                         "−A·log π (no IS); drop sequences with geo-mean μ/π outside [0.999, 1.001]"),
    "bypass_pg_geo_rs_seq_tis": ({**_BYPASS_PG, "rollout_is": "sequence", **_GEO},
                                 "−A·min(∏ sg(π)/μ, 2)·log π; geo-mean band [0.999, 1.001]"),
    "bypass_pg_geo_rs_token_tis": ({**_BYPASS_PG, "rollout_is": "token", **_GEO},
                                   "−A·min(sg(π)/μ, 2)·log π per token; geo-mean band [0.999, 1.001]"),
}

_LOSSES: dict[str, tuple[dict[str, Any], str]] = {
    # policy_loss.loss_mode=<name>, everything else at verl's defaults -> (settings, summary)
    "dppo_tv": ({"loss_mode": "dppo_tv"},
                "−A·sg(min(π/π_old, 3))·log π, masked where π − π_old moves past ±0.2 with A's sign"),
    "dppo_kl": ({"loss_mode": "dppo_kl"},
                "−A·sg(min(π/π_old, 3))·log π, masked where the binary KL > 0.2 moving with A's sign"),
    "gspo": ({"loss_mode": "gspo"}, "PPO-clip 0.2 on the sequence's geometric-mean ratio (token-mean)"),
    "sapo": ({"loss_mode": "sapo"}, "−A·σ(τ(ρ − 1))·4/τ, τ = 1 (A > 0) / 1.05, seq-mean-token-mean"),
    "gpg": ({"loss_mode": "gpg"}, "−A·log π (no ratio)"),
    "cispo": ({"loss_mode": "cispo"}, "−A·sg(clip(π/π_old, 0.8, 1.2))·log π"),
    "geo_mean": ({"loss_mode": "geo_mean"}, "GMPO: −Ā·exp(mean of sign-clipped log π/π_old) per sequence"),
    "clip_cov": ({"loss_mode": "clip_cov"},
                 "PPO-clip 0.2 (no dual clip); max(1, ⌊2e-4·n⌋) random unclipped tokens, cov(A, log π) in (1, 5), dropped"),
    "kl_cov": ({"loss_mode": "kl_cov"},
               "−A·π/π_old; + 0.1·|log π/π_old| on the max(1, ⌊2e-4·n⌋) tokens of largest cov(A, log π)"),
}


def _preset(name: str, settings: dict[str, Any], summary: str, source: str, default: bool = False) -> Preset:
    return Preset(name=f"verl/{name}", framework="verl", source=SOURCE + source, summary=summary,
                  settings=settings, loss=verl_loss, default=default)


PRESETS: tuple[Preset, ...] = (
    _preset("default", {}, f"{_PPO}, token-mean; rollout_corr/ metrics only (rollout_correction all null)",
            f"{_CORE} compute_policy_loss_vanilla + config/algorithm/rollout_correction.yaml", default=True),
    *(_preset(name, st, summary, _RC.format(name)) for name, (st, summary) in _CORRECTIONS.items()),
    *(_preset(name, st, summary, f"{_CORE} compute_policy_loss_{name}") for name, (st, summary) in _LOSSES.items()),
)
"""verl's out-of-the-box configuration, every RolloutCorrectionConfig preset classmethod of 0.9.1 at its
default arguments, and the policy loss modes (other settings at their defaults)."""
