"""A transcription of prime-rl's RL loss, statement by statement, for the prime-rl/* preset tests.

Read from PrimeIntellect-ai/prime-rl at commit 559b44772e471d1538537b8805cc77f3824a5e64:
  src/prime_rl/trainer/rl/loss.py       default_loss_fn, ipo_loss_fn, _safe_mean,
                                        compute_importance_ratio_and_mismatch_kl, compute_loss (rl part only)
  src/prime_rl/trainer/rl/train.py      rl_scale (the global loss-mask token count, at least 1) and the
                                        mismatch_kl/all tensor (k3 of the trainer's logprobs on the loss mask)
  src/prime_rl/trainer/utils.py         Tensors.compute_stats (mean, median, std, min, max of the concatenation)
  packages/prime-rl-configs/src/prime_rl/configs/trainer.py   DefaultLossConfig, IPOLossConfig defaults
prime-rl is not installable here (GPU-only dependencies), so its functions cannot be imported: this module
re-expresses them in the project's code, one sample at a time as prime-rl loops over packed samples, keeping
their operations and order. It is independent of the preset module (no shared code), so the test compares
two writings of the same source.
"""

from __future__ import annotations

import torch

COMMIT = "559b44772e471d1538537b8805cc77f3824a5e64"
DEFAULT_LOSS = {"type": "default", "dppo_mask_low": 0.2, "dppo_mask_high": 0.2, "adv_tau": 1.0, "kl_tau": 1e-3}
IPO_LOSS = {"type": "ipo", "ipo_threshold": 0.1, "adv_tau": 1.0, "kl_tau": 1e-3}
"""DefaultLossConfig / IPOLossConfig field defaults; `trainer.loss` defaults to DefaultLossConfig()."""


def safe_mean(values, mask):
    return values[mask].sum() / torch.clamp_min(mask.sum(), 1)


def one_sample(trainer_lp, infer_lp, adv, loss_mask, cfg):
    """prime-rl's default_loss_fn / ipo_loss_fn on one sample: (summed loss, metric dict)."""
    log_ratio = trainer_lp - infer_lp
    ratio = torch.exp(log_ratio)
    k3 = ratio - log_ratio - 1
    p_diff = torch.exp(trainer_lp) - torch.exp(infer_lp)
    metrics = {}
    if cfg["type"] == "default":
        too_high = p_diff > cfg["dppo_mask_high"]
        too_low = p_diff < -cfg["dppo_mask_low"]
        pos, neg = adv > 0, adv < 0
        is_masked = torch.where(pos, too_high, too_low)
        metrics["is_masked_low"] = (neg & too_low, loss_mask)
        metrics["is_masked_high"] = (pos & too_high, loss_mask)
    else:
        is_masked = torch.abs(p_diff) > cfg["ipo_threshold"]
    drop = loss_mask & is_masked
    keep = loss_mask & ~is_masked
    pg = keep * (cfg["adv_tau"] * adv) * ratio
    kl = loss_mask * log_ratio ** 2
    loss = (-pg + cfg["kl_tau"] * kl).sum()
    metrics["masked_mismatch_kl"] = (k3, loss_mask & is_masked)
    metrics["unmasked_mismatch_kl"] = (k3, keep)
    metrics["is_masked"] = (is_masked, loss_mask)
    if cfg["type"] == "default":
        metrics["masked_advantage_positive"] = (pos, drop)
        metrics["masked_advantage_negative"] = (neg, drop)
    return loss, {k: safe_mean(v, m) for k, (v, m) in metrics.items()}, keep, ratio


def stats(key, values):
    if values.numel() == 0:
        return {f"{key}/{s}": float("nan") for s in ("mean", "median", "std", "min", "max")}
    return {f"{key}/mean": values.mean().item(), f"{key}/median": torch.median(values).item(),
            f"{key}/std": values.std().item(), f"{key}/min": values.min().item(), f"{key}/max": values.max().item()}


def prime_rl_step(samples, cfg):
    """samples: list of (trainer_lp, infer_lp, adv, loss_mask) 1-D tensors, one per sample (trainer_lp a
    slice of a leaf requiring grad). Returns (loss, metrics, per-sample (keep mask, importance ratio)) as
    prime-rl's trainer would for one micro-batch on one rank."""
    rl_scale = max(sum(int(m.sum()) for *_, m in samples), 1)
    total = samples[0][0].sum() * 0.0
    per_key, keeps, k3_all = {}, [], []
    for trainer_lp, infer_lp, adv, mask in samples:
        loss, metrics, keep, ratio = one_sample(trainer_lp, infer_lp, adv, mask, cfg)
        total = total + loss
        keeps.append((keep, ratio.detach()))
        for k, v in metrics.items():
            per_key.setdefault(k, []).append(v)
        with torch.no_grad():
            lr = trainer_lp - infer_lp
            k3_all.append((torch.exp(lr) - lr - 1)[mask].detach())
    out = {}
    for k, v in per_key.items():
        out.update(stats(k, torch.stack(v)))
    out.update(stats("mismatch_kl/all", torch.cat(k3_all)))
    return total / rl_scale, out, keeps
