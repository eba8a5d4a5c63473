"""A transcription of ROLL's RLVR actor loss and train-infer correction, statement by statement, for the roll/*
preset tests.

Read from alibaba/ROLL at commit 8eb27cc2dc34c4d1310b169d9b86d339004d811a:
  roll/pipeline/rlvr/actor_worker.py        ActorWorker.loss_func (PPO branch; kl_loss, entropy and sample
                                            weights left out: off / 1 by default)
  roll/utils/train_infer_corrections.py     _compute_all_granularity, compute_train_infer_correction
  roll/utils/functionals.py                 masked_mean, masked_sum, agg_loss, compute_approx_kl
  roll/pipeline/agentic/utils.py            compute_segment_masked_mean (its per-sample loop over runs of ones)
  roll/configs/base_config.py               TrainInferISWeightConfig, TrainInferFilterConfig, PPOConfig defaults
ROLL needs ray and its GPU strategies to import, so its functions are re-expressed here in the project's code,
keeping their operations and order; global_valid_samples / batch_num_tokens are those of one rank and one
micro-batch, counted on the unfiltered response mask. Independent of the preset module (no shared code).
"""

from __future__ import annotations

import torch

COMMIT = "8eb27cc2dc34c4d1310b169d9b86d339004d811a"
IS_WEIGHT = {"enabled": False, "weight_type": "token", "upper_bound": 1.2, "detach": True}
FILTER = {"enabled": False, "agg_type": "token", "ratio_enabled": True, "ratio_low": 0.8, "ratio_high": 1.2,
          "diff_enabled": False, "diff_low": -0.2, "diff_high": 0.2}
PPO = {"pg_clip": 0.2, "dual_clip_loss": False, "importance_sampling": "token",
       "loss_agg_mode": "seq-mean-token-mean", "rl_loss_coef": 1.0}


def masked_mean(tensor, mask, dim=None):
    if dim is not None:
        mask_sum = mask.sum(axis=dim)
        return torch.where(mask_sum > 0, (tensor * mask).sum(axis=dim) / (mask_sum + 1e-8), torch.zeros_like(mask_sum))
    return (tensor * mask).sum() / (mask.sum() + 1e-8)


def masked_sum(tensor, mask, dim):
    mask_sum = mask.sum(axis=dim)
    return torch.where(mask_sum > 0, (tensor * mask).sum(axis=dim), torch.zeros_like(mask_sum))


def segment_masked_mean(tensor, mask):
    batch_size, seq_len = mask.shape
    result = torch.zeros_like(tensor)
    for b in range(batch_size):
        sm, st = mask[b], tensor[b]
        diff = torch.diff(sm, prepend=torch.tensor([0]))
        starts = torch.where(diff == 1)[0]
        ends = torch.where(diff == -1)[0]
        if sm[-1] == 1:
            ends = torch.cat([ends, torch.tensor([seq_len])])
        n = min(len(starts), len(ends))
        for start, end in zip(starts[:n], ends[:n]):
            idx = torch.arange(start, end)
            seg_m, seg_t = sm[idx], st[idx]
            if seg_m.sum() > 0:
                result[b, idx] = (seg_t * seg_m).sum() / (seg_m.sum() + 1e-8) * seg_m
    return result


def agg_loss(loss_mat, loss_mask, loss_agg_mode, batch_num_tokens=None, global_valid_samples=None):
    if batch_num_tokens is None:
        batch_num_tokens = loss_mask.sum()
    if global_valid_samples is None:
        global_valid_samples = loss_mat.size(0)
    weights = torch.ones(loss_mask.shape[0])
    if loss_agg_mode == "token-mean":
        return (loss_mat * weights.unsqueeze(-1)).sum() / batch_num_tokens
    seq = masked_mean(loss_mat, loss_mask, dim=-1)
    valid = torch.any(loss_mask > 0, dim=-1).float()
    return (seq * weights * valid).sum() / (global_valid_samples + 1e-8)


def all_granularity(old, infer, mask):
    mask = mask.long()
    log_ratio = old - infer
    ratio_token, diff_token = log_ratio.exp(), old.exp() - infer.exp()
    return {"ratio": {"token": ratio_token,
                      "geometric": masked_mean(log_ratio, mask, dim=-1).exp().unsqueeze(-1).expand_as(ratio_token),
                      "sequence": masked_sum(log_ratio, mask, dim=-1).exp().unsqueeze(-1).expand_as(ratio_token),
                      "segment": segment_masked_mean(log_ratio, mask).exp()},
            "diff": {"token": diff_token,
                     "geometric": masked_mean(diff_token, mask, dim=-1).unsqueeze(-1).expand_as(diff_token),
                     "sequence": masked_sum(diff_token, mask, dim=-1).unsqueeze(-1).expand_as(diff_token),
                     "segment": segment_masked_mean(diff_token, mask)}}


def train_infer_correction(cfg, response_mask, old, infer, gvs, gvt):
    metrics = {}
    base = response_mask.long()
    stats = all_granularity(old, infer, base)
    ratio, diff = stats["ratio"], stats["diff"]
    for agg in ["token", "geometric", "sequence", "segment"]:
        metrics[f"actor/train_infer_ratio_{agg}_mean@sum"] = agg_loss(ratio[agg], base, "seq-mean-token-mean",
                                                                       global_valid_samples=gvs).item()
        metrics[f"actor/train_infer_diff_{agg}_mean@sum"] = agg_loss(diff[agg], base, "seq-mean-token-mean",
                                                                      global_valid_samples=gvs).item()
    if cfg["is_weight"]["enabled"]:
        is_weight = ratio[cfg["is_weight"]["weight_type"]]
        ub = cfg["is_weight"]["upper_bound"]
        if ub is not None:
            metrics["actor/is_weight_clipfrac@sum"] = agg_loss((is_weight > ub).float(), base, "token-mean",
                                                               batch_num_tokens=gvt, global_valid_samples=gvs).item()
            is_weight = is_weight.clamp(min=0.0, max=ub)
        is_weight = is_weight.detach()
    else:
        is_weight = torch.ones_like(ratio["token"]).detach()
    filter_mask = torch.ones_like(base)
    for f in cfg["filters"]:
        if not f["enabled"]:
            continue
        agg = f["agg_type"]
        if f["ratio_enabled"]:
            m = (ratio[agg] >= f["ratio_low"]).float() * (ratio[agg] <= f["ratio_high"]).float()
            metrics[f"actor/train_infer_{agg}_ratio_mask_mean@sum"] = agg_loss(m, base, "token-mean",
                                                                               batch_num_tokens=gvt).item()
            filter_mask = filter_mask * m
        if f["diff_enabled"]:
            m = (diff[agg] >= f["diff_low"]).float() * (diff[agg] <= f["diff_high"]).float()
            metrics[f"actor/train_infer_{agg}_diff_mask_mean@sum"] = agg_loss(m, base, "token-mean",
                                                                              batch_num_tokens=gvt).item()
            filter_mask = filter_mask * m
    if cfg["filters"]:
        metrics["actor/train_infer_final_mask_mean"] = masked_mean(base * filter_mask.float(), base).item()
    return is_weight, filter_mask, metrics


def loss_func(log_probs, old_log_probs, infer_log_probs, advantages, mask, cfg):
    """ActorWorker.loss_func: (total_loss, is_weight, the positions agg_loss reads (token-mean: the whole grid,
    its mask unread; else the filtered response mask), metrics). `advantages` as compute_advantage leaves them:
    multiplied by the response mask."""
    response_mask = mask.long()
    gvs = max(float((response_mask.sum(dim=-1) > 0).float().sum()), 1.0)  # counted before the filter
    gvt = max(float(response_mask.float().sum()), 1.0)
    tic = cfg["train_infer_correction"]
    is_w, filter_mask, ti = train_infer_correction(tic, response_mask, old_log_probs, infer_log_probs, gvs, gvt)
    response_mask = response_mask.long() * filter_mask.long()
    final_response_mask = response_mask
    valid_samples = torch.any(final_response_mask > 0, dim=1).float()
    approxkl = 0.5 * (log_probs - old_log_probs).square() * response_mask
    policykl = (log_probs - old_log_probs) * response_mask
    if cfg["importance_sampling"] == "token":
        ratio = (log_probs - old_log_probs).exp()
    else:
        lr = log_probs - old_log_probs
        ratio = masked_mean(lr, final_response_mask, dim=-1).exp().unsqueeze(-1).expand_as(lr)
    clip = cfg["pg_clip"]
    surr1 = ratio * advantages
    surr2 = ratio.clamp(1 - clip, 1 + clip) * advantages
    loss = -torch.min(surr1, surr2)
    if cfg["dual_clip_loss"]:
        dual = -torch.max(-loss, (1 + clip * 2) * advantages)
        loss = torch.where(advantages < 0, dual, loss)
    if tic["is_weight"]["enabled"]:
        loss = loss * is_w
    mode = cfg["loss_agg_mode"]
    weighted = agg_loss(loss, final_response_mask, mode, batch_num_tokens=gvt, global_valid_samples=gvs)
    original = agg_loss(loss, final_response_mask, mode, batch_num_tokens=gvt, global_valid_samples=gvs)
    low, high = (ratio < 1 - clip).float(), (ratio > 1 + clip).float()
    total = weighted * cfg["rl_loss_coef"]
    metrics = {
        "actor/ppo_ratio_high_clipfrac@sum": agg_loss(high, final_response_mask, "token-mean", batch_num_tokens=gvt).item(),
        "actor/ppo_ratio_low_clipfrac@sum": agg_loss(low, final_response_mask, "token-mean", batch_num_tokens=gvt).item(),
        "actor/ppo_ratio_clipfrac@sum": agg_loss((low + high).float(), final_response_mask, "token-mean",
                                                 batch_num_tokens=gvt).item(),
        "actor/ratio_mean@sum": agg_loss(ratio, response_mask, "seq-mean-token-mean", global_valid_samples=gvs).item(),
        "actor/ratio_max@max": torch.max(ratio * response_mask).item(),
        "actor/ratio_min@min": torch.min(ratio * response_mask + (1 - response_mask) * 1e10).item(),
        "actor/clipfrac@sum": agg_loss(torch.lt(surr2, surr1).float(), response_mask, mode, batch_num_tokens=gvt,
                                       global_valid_samples=gvs).item(),
        "actor/pg_loss@sum": original.item(), "actor/weighted_pg_loss@sum": weighted.item(),
        "actor/total_loss@sum": total.item(),
        "actor/approxkl@sum": agg_loss(approxkl, response_mask, mode, gvt, gvs).item(),
        "actor/policykl@sum": agg_loss(policykl, response_mask, mode, gvt, gvs).item(),
        "actor/valid_samples@sum": valid_samples.sum().item(), "actor/total_samples@sum": float(valid_samples.size(0)),
        "actor/valid_sample_ratio@sum": (valid_samples.sum() / gvs).item(),
        **ti,
    }
    in_loss = torch.ones_like(final_response_mask) if mode == "token-mean" else final_response_mask
    return total, is_w, in_loss, metrics
