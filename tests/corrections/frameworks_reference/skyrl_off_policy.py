"""SkyRL's off-policy correction, transcribed statement by statement for the skyrl/* preset tests (see skyrl.py in
this folder for what is read where).

Read from NovaSky-AI/SkyRL at commit a9564572eb8e91076be43c1bd5e4615e3de17265:
  skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py  compute_tis_ratio, compute_outlier_token_mask,
                                                                   compute_token_mask, compute_sequence_mask,
                                                                   compute_off_policy_correction,
                                                                   apply_off_policy_correction
  skyrl/backends/skyrl_train/utils/torch_utils.py                  masked_mean, safe_exp_delta
It shares no code with the preset modules.
"""

from __future__ import annotations

import torch


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


def apply_off_policy_correction(loss, old, rollout, loss_mask, c):
    metrics = {}
    tis = None
    if rollout is not None:
        tis, more, loss_mask = compute_off_policy_correction(old, rollout, loss_mask, c)
        if tis is not None:
            loss = loss * tis
        metrics.update(more)
    return loss, loss_mask, metrics, tis
