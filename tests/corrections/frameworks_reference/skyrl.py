"""A transcription of SkyRL's policy losses and off-policy correction, statement by statement, for the skyrl/*
preset tests.

Read from NovaSky-AI/SkyRL at commit a9564572eb8e91076be43c1bd5e4615e3de17265:
  skyrl/backends/skyrl_train/utils/ppo_utils.py                    ppo_policy_loss (regular), dppo_policy_loss,
                                                                   reduce_loss, apply_loss_reduction_to_
                                                                   advantages_minibatch (token_mean)
  skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py  compute_tis_ratio, compute_outlier_token_mask,
                                                                   compute_token_mask, compute_sequence_mask,
                                                                   compute_off_policy_correction
  skyrl/backends/skyrl_train/utils/torch_utils.py                  masked_mean, safe_exp_delta
  skyrl/train/config/config.py                                     OffPolicyCorrectionConfig, DPPOConfig and
                                                                   AlgorithmConfig defaults
SkyRL needs Ray and its GPU backends at import time, so its functions cannot be imported here: this module
re-expresses them in the project's code keeping their operations and order, on one mini-batch (the token_mean
normaliser: that batch's response tokens). It shares no code with the preset module.
"""

from __future__ import annotations

import torch

COMMIT = "a9564572eb8e91076be43c1bd5e4615e3de17265"
OFF_POLICY_CORRECTION = {"tis_ratio_type": None, "token_tis_ratio_clip_high": 2.0,
                         "sequence_tis_ratio_clip_high": 5.0, "sequence_mask_metric": None, "geo_mask_high": 1.01,
                         "geo_mask_low": 0.99, "product_mask_high": 2.0, "product_mask_low": 0.5,
                         "outlier_token_is_threshold_low": None, "outlier_token_is_threshold_high": None,
                         "token_mask_is_threshold_low": None, "token_mask_is_threshold_high": None}
ALGORITHM = {"policy_loss_type": "regular", "loss_reduction": "token_mean", "eps_clip_low": 0.2, "eps_clip_high": 0.2,
             "dppo_type": "binary_tv", "delta_low": 0.2, "delta_high": 0.2, "use_kl_loss": False}
"""The config defaults; use_kl_loss is True (coefficient 0.001) in SkyRL: False here, a store holds no π_ref."""


def masked_mean(tensor, mask, dim=None):
    return (tensor * mask).sum(axis=dim) / mask.sum(axis=dim).clamp(min=1.0)


def safe_exp_delta(delta, clip=20.0, out_dtype=None):
    y = torch.clamp(delta.to(torch.float32), -clip, clip).exp()
    return y.to(out_dtype or delta.dtype)


def compute_tis_ratio(old, rollout, loss_mask, kind, c):
    log_r = old - rollout
    r = safe_exp_delta(log_r, clip=20.0, out_dtype=old.dtype)
    if kind == "token":
        capped = (r > c["token_tis_ratio_clip_high"]) & (loss_mask > 0)
        total = (loss_mask > 0).sum()
        return (torch.clamp(r, max=c["token_tis_ratio_clip_high"]).detach(),
                {"tis_token_clip_high_ratio": (capped.sum() / total.clamp(min=1)).item()})
    seq_r = safe_exp_delta((log_r * loss_mask).sum(dim=-1, keepdim=True), clip=20.0, out_dtype=old.dtype)
    n = seq_r.shape[0]
    return (torch.clamp(seq_r, max=c["sequence_tis_ratio_clip_high"]).detach(),
            {"tis_seq_clip_high_ratio": ((seq_r > c["sequence_tis_ratio_clip_high"]).sum() / n).item()})


def compute_outlier_token_mask(old, rollout, loss_mask, c):
    r = safe_exp_delta(old - rollout, clip=20.0, out_dtype=old.dtype)
    low, high = c["outlier_token_is_threshold_low"], c["outlier_token_is_threshold_high"]
    over = (r > high) & (loss_mask > 0) if high is not None else torch.zeros_like(loss_mask, dtype=torch.bool)
    under = (r < low) & (loss_mask > 0) if low is not None else torch.zeros_like(loss_mask, dtype=torch.bool)
    in_bounds = ~over & ~under
    valid = (in_bounds | (loss_mask == 0)).all(dim=-1, keepdim=True)
    n = float(valid.shape[0])
    return valid.float(), {"outlier_seq_masked_ratio": ((~valid.squeeze(-1)).sum() / n).item(),
                           "outlier_seq_over_high_ratio": (over.any(dim=-1).sum() / n).item(),
                           "outlier_seq_under_low_ratio": (under.any(dim=-1).sum() / n).item()}


def compute_token_mask(old, rollout, loss_mask, c):
    r = safe_exp_delta(old - rollout, clip=20.0, out_dtype=old.dtype)
    in_bounds = (r >= c["token_mask_is_threshold_low"]) & (r <= c["token_mask_is_threshold_high"])
    token_mask = (in_bounds | (loss_mask == 0)).float()
    valid = (loss_mask > 0).sum().clamp(min=1)
    masked = ((~in_bounds) & (loss_mask > 0)).sum()
    return token_mask, {"token_mask_ratio": (masked / valid).item()}


def compute_sequence_mask(old, rollout, loss_mask, metric, c):
    log_r = old - rollout
    seq_log = (log_r * loss_mask).sum(dim=-1, keepdim=True)
    if metric == "geometric":
        num_tokens = loss_mask.sum(dim=-1, keepdim=True).clamp(min=1.0)
        value = safe_exp_delta(seq_log / num_tokens, clip=20.0, out_dtype=old.dtype)
        high, low, prefix = c["geo_mask_high"], c["geo_mask_low"], "geo_sequence_mask"
    else:
        value = safe_exp_delta(seq_log, clip=20.0, out_dtype=old.dtype)
        high, low, prefix = c["product_mask_high"], c["product_mask_low"], "product_sequence_mask"
    over, under = value > high, value < low
    inside = ~over & ~under
    n = float(value.shape[0])
    return inside.float(), {f"{prefix}_masked_ratio": ((~inside).sum() / n).item(),
                            f"{prefix}_over_high_ratio": (over.sum() / n).item(),
                            f"{prefix}_under_low_ratio": (under.sum() / n).item()}


def compute_off_policy_correction(old, rollout, loss_mask, c):
    apply_tis = c["tis_ratio_type"] is not None
    apply_seq = c["sequence_mask_metric"] is not None
    apply_outlier = c["outlier_token_is_threshold_low"] is not None or c["outlier_token_is_threshold_high"] is not None
    apply_token = c["token_mask_is_threshold_low"] is not None and c["token_mask_is_threshold_high"] is not None
    if not (apply_tis or apply_seq or apply_outlier or apply_token):
        return None, {}, loss_mask
    r = safe_exp_delta(old - rollout, clip=20.0, out_dtype=old.dtype)
    metrics = {"is_ratio_mean": masked_mean(r, loss_mask).mean().item(), "is_ratio_std": (r * loss_mask).std().item(),
               "is_ratio_max": (r * loss_mask).max().item(), "is_ratio_min": (r * loss_mask).min().item()}
    if apply_outlier:
        outlier_mask, m = compute_outlier_token_mask(old, rollout, loss_mask, c)
        loss_mask = loss_mask * outlier_mask
        metrics.update(m)
    if apply_token:
        token_mask, m = compute_token_mask(old, rollout, loss_mask, c)
        loss_mask = loss_mask * token_mask
        metrics.update(m)
    tis = None
    if apply_tis:
        tis, m = compute_tis_ratio(old, rollout, loss_mask, c["tis_ratio_type"], c)
        metrics.update(m)
    if apply_seq:
        seq_mask, m = compute_sequence_mask(old, rollout, loss_mask, c["sequence_mask_metric"], c)
        loss_mask = loss_mask * seq_mask
        metrics.update(m)
    return tis, metrics, loss_mask


def ppo_policy_loss(log_probs, old, advantages, cfg, loss_mask, rollout):
    ratio = safe_exp_delta(log_probs - old, clip=20.0, out_dtype=log_probs.dtype)
    surr1 = ratio * advantages
    surr2 = ratio.clamp(1 - cfg["eps_clip_low"], 1 + cfg["eps_clip_high"]) * advantages
    loss = -torch.min(surr1, surr2)
    metrics = {"clip_ratio": masked_mean((-surr2 > -surr1).float().to(loss_mask.dtype), loss_mask).mean().item()}
    return loss, metrics, torch.ones_like(loss_mask), torch.ones_like(loss_mask)


def dppo_policy_loss(log_probs, old, advantages, cfg, loss_mask, rollout):
    mu = rollout if rollout is not None else old
    ratio = safe_exp_delta(log_probs - mu, clip=20.0, out_dtype=log_probs.dtype)
    with torch.no_grad():
        cur_p, mu_p = torch.exp(log_probs), torch.exp(mu)
        diff = cur_p - mu_p
        mask = torch.ones_like(advantages)
        if cfg["dppo_type"] == "binary_tv":
            mask[(advantages > 0) & (diff > cfg["delta_high"])] = 0.0
            mask[(advantages < 0) & (-diff > cfg["delta_low"])] = 0.0
        else:
            eps = 1e-8
            bkl = mu_p * (mu - log_probs) + (1 - mu_p) * torch.log((1 - mu_p + eps) / (1 - cur_p + eps))
            mask[(advantages > 0) & (diff > 0) & (bkl > cfg["delta_high"])] = 0.0
            mask[(advantages < 0) & (diff < 0) & (bkl > cfg["delta_low"])] = 0.0
    loss = -(ratio * advantages * mask)
    metrics = {"clip_ratio": masked_mean((mask == 0).float().to(loss_mask.dtype), loss_mask).mean().item()}
    return loss, metrics, mask, ratio.detach()


def skyrl_step(log_probs, old, rollout, advantages, loss_mask, cfg):
    """token_mean advantages, the policy loss, the off-policy correction, reduce_loss. loss_mask float.
    Returns (loss, metrics, final loss mask, DPPO mask (ones for PPO), weight: TIS · (DPPO: its ratio))."""
    advantages = advantages / loss_mask.sum().clamp(min=1)
    fn = dppo_policy_loss if cfg["policy_loss_type"] == "dppo" else ppo_policy_loss
    loss, metrics, gate, weight = fn(log_probs, old, advantages, cfg, loss_mask, rollout)
    tis, more, loss_mask = compute_off_policy_correction(old, rollout, loss_mask, cfg)
    if tis is not None:
        loss = loss * tis
        weight = weight * tis
    metrics.update(more)
    return (loss * loss_mask).sum(), metrics, loss_mask, gate, weight
