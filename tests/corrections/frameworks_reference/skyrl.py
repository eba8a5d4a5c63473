"""A transcription of SkyRL's policy losses and off-policy correction, statement by statement, for the skyrl/*
preset tests.

Read from NovaSky-AI/SkyRL at commit a9564572eb8e91076be43c1bd5e4615e3de17265:
  skyrl/backends/skyrl_train/utils/ppo_utils.py                    PolicyLossRegistry: ppo_policy_loss (regular,
                                                                   dual_clip), gspo_policy_loss, sapo_policy_loss,
                                                                   compute_policy_loss_cispo, rollout_is_policy_
                                                                   loss, dppo_policy_loss, compute_policy_loss_
                                                                   clip_cov, compute_policy_loss_kl_cov,
                                                                   cross_entropy_loss, importance_sampling_loss;
                                                                   reduce_loss, apply_loss_reduction_to_
                                                                   advantages_minibatch
  skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py  the off-policy correction: skyrl_off_policy.py
  skyrl/backends/skyrl_train/utils/torch_utils.py                  masked_mean, safe_exp_delta (same file)
  skyrl/train/config/config.py                                     OffPolicyCorrectionConfig, DPPOConfig and
                                                                   AlgorithmConfig, SAPOConfig, CISPOConfig,
                                                                   ClipCovConfig, KLCovConfig defaults
  examples/train/algorithms/{dapo,gspo,sapo,drgrpo}, examples/train/fully_async   the named configurations
SkyRL needs Ray and its GPU backends at import time, so its functions cannot be imported here: this module
re-expresses them in the project's code keeping their operations and order, on one mini-batch of one micro-batch
(the reduction's normalisers: that batch's). Each loss also hands back, for the test, the final loss mask, the
mask it applies itself and the weight on μ it applies (`aux`). It shares no code with the preset module.
"""

from __future__ import annotations

import torch

from frameworks_reference.skyrl_off_policy import (
    apply_off_policy_correction,
    masked_mean,
    safe_exp_delta,
)

COMMIT = "a9564572eb8e91076be43c1bd5e4615e3de17265"
OFF_POLICY_CORRECTION = {"tis_ratio_type": None, "token_tis_ratio_clip_high": 2.0,
                         "sequence_tis_ratio_clip_high": 5.0, "sequence_mask_metric": None, "geo_mask_high": 1.01,
                         "geo_mask_low": 0.99, "product_mask_high": 2.0, "product_mask_low": 0.5,
                         "outlier_token_is_threshold_low": None, "outlier_token_is_threshold_high": None,
                         "token_mask_is_threshold_low": None, "token_mask_is_threshold_high": None}
ALGORITHM = {"policy_loss_type": "regular", "loss_reduction": "token_mean", "eps_clip_low": 0.2, "eps_clip_high": 0.2,
             "dppo_type": "binary_tv", "delta_low": 0.2, "delta_high": 0.2, "use_kl_loss": False, "clip_ratio_c": 3.0,
             "tau_pos": 1.0, "tau_neg": 1.05, "cispo_eps_clip_low": 1.0, "cispo_eps_clip_high": 4.0,
             "cispo_anchor": "old", "clip_cov.clip_ratio": 0.0002, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0,
             "kl_cov_frac": 0.2, "ppo_kl_coef": 1.0, "max_seq_len": None}
"""The config defaults; use_kl_loss is True (coefficient 0.001) in SkyRL: False here, a store holds no π_ref."""


def reduce_loss(loss, loss_mask):
    return (loss * loss_mask).sum() if loss_mask is not None else loss.sum()


def _finish(loss, old, rollout, loss_mask, cfg, metrics, gate, weight):
    """The tail every correcting loss shares: apply_off_policy_correction, then reduce_loss."""
    loss, loss_mask, more, tis = apply_off_policy_correction(loss, old, rollout, loss_mask, cfg)
    metrics.update(more)
    weight = weight * tis if tis is not None else weight
    return reduce_loss(loss, loss_mask), metrics, {"loss_mask": loss_mask, "gate": gate, "weight": weight}


def ppo_policy_loss(log_probs, old, advantages, cfg, loss_mask, rollout):
    ratio = safe_exp_delta(log_probs - old, clip=20.0, out_dtype=log_probs.dtype)
    surr1 = ratio * advantages
    surr2 = ratio.clamp(1 - cfg["eps_clip_low"], 1 + cfg["eps_clip_high"]) * advantages
    loss = -torch.min(surr1, surr2)
    clip_ratio = masked_mean((-surr2 > -surr1).float(), loss_mask).mean().detach().item()
    clip_pg_losses1 = loss
    if cfg["policy_loss_type"] == "dual_clip":
        pg_losses3 = -advantages * cfg["clip_ratio_c"]
        clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
        loss = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    ones = torch.ones_like(loss_mask)
    return _finish(loss, old, rollout, loss_mask, cfg, {"clip_ratio": clip_ratio}, ones, ones)


def sapo_policy_loss(log_probs, old, advantages, cfg, loss_mask, rollout):
    tau_pos = torch.as_tensor(cfg["tau_pos"], dtype=advantages.dtype)
    tau_neg = torch.as_tensor(cfg["tau_neg"], dtype=advantages.dtype)

    def gate_function(x, tau):
        return torch.sigmoid(tau * (x - 1.0)) * (4.0 / tau)

    log_ratio = log_probs - old
    log_ratio = torch.clamp(log_ratio, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    taus = torch.where(condition=advantages > 0, input=tau_pos, other=tau_neg)
    gates = gate_function(ratio, taus)
    loss = -gates * advantages
    ones = torch.ones_like(loss_mask)
    return _finish(loss, old, rollout, loss_mask, cfg, {"clip_ratio": 0.0}, ones, ones)


def gspo_policy_loss(log_probs, old, advantages, cfg, loss_mask, rollout):
    log_ratio = log_probs - old
    log_importance_weights = masked_mean(log_ratio, loss_mask, dim=-1).unsqueeze(-1)
    log_token_importance_weights = log_probs - log_probs.detach() + log_importance_weights.detach()
    log_token_importance_weights = torch.clamp(log_token_importance_weights, max=10)
    ratio = torch.exp(log_token_importance_weights)
    surr1 = ratio * advantages
    surr2 = ratio.clamp(1 - cfg["eps_clip_low"], 1 + cfg["eps_clip_high"]) * advantages
    loss = -torch.min(surr1, surr2)
    clip_ratio = masked_mean((-surr2 > -surr1).float(), loss_mask).mean().detach().item()
    ones = torch.ones_like(loss_mask)
    return _finish(loss, old, rollout, loss_mask, cfg, {"clip_ratio": clip_ratio}, ones, ones)


def compute_policy_loss_cispo(log_probs, old, advantages, cfg, loss_mask, rollout):
    anchor = cfg["cispo_anchor"]
    if anchor == "rollout":
        assert rollout is not None
        if cfg["tis_ratio_type"] is not None:
            raise ValueError("cispo_anchor='rollout' with TIS double-counts the correction")
        behavior_log_probs = rollout
    else:
        behavior_log_probs = old
    ratio = safe_exp_delta(log_probs - behavior_log_probs, clip=20.0, out_dtype=log_probs.dtype)
    clamped_ratio = torch.clamp(ratio, 1 - cfg["cispo_eps_clip_low"], 1 + cfg["cispo_eps_clip_high"])
    loss = -advantages * clamped_ratio.detach() * log_probs
    is_clipped = (ratio < 1 - cfg["cispo_eps_clip_low"]) | (ratio > 1 + cfg["cispo_eps_clip_high"])
    clip_ratio = masked_mean(is_clipped.float(), loss_mask).mean().detach().item()
    cispo_ratio_mean = masked_mean(ratio, loss_mask).mean().detach().item()
    cispo_ratio_clamped_mean = masked_mean(clamped_ratio, loss_mask).mean().detach().item()
    if loss_mask is not None and loss_mask.any():
        active_ratio = ratio[loss_mask.bool()]
        cispo_ratio_max = active_ratio.max().detach().item()
        cispo_ratio_min = active_ratio.min().detach().item()
    else:
        cispo_ratio_max = ratio.max().detach().item()
        cispo_ratio_min = ratio.min().detach().item()
    metrics = {"clip_ratio": clip_ratio, "cispo/ratio_mean": cispo_ratio_mean,
               "cispo/ratio_clamped_mean": cispo_ratio_clamped_mean, "cispo/ratio_max": cispo_ratio_max,
               "cispo/ratio_min": cispo_ratio_min}
    ones = torch.ones_like(loss_mask)
    weight = clamped_ratio.detach() if anchor == "rollout" else ones
    return _finish(loss, old, rollout, loss_mask, cfg, metrics, ones, weight)


def rollout_is_policy_loss(log_probs, old, advantages, cfg, loss_mask, rollout):
    assert rollout is not None
    ratio = safe_exp_delta(log_probs - rollout, clip=20.0, out_dtype=log_probs.dtype)
    in_range = (ratio > 1 - cfg["eps_clip_low"]) & (ratio < 1 + cfg["eps_clip_high"])
    calibrated_ratio = torch.where(in_range, ratio, torch.zeros_like(ratio))
    loss = -(calibrated_ratio.detach() * advantages * log_probs)
    clip_ratio = masked_mean((~in_range).float(), loss_mask).mean().detach().item()
    return _finish(loss, old, rollout, loss_mask, cfg, {"clip_ratio": clip_ratio}, in_range.to(loss_mask.dtype),
                   calibrated_ratio.detach())


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
    clip_ratio = masked_mean((mask == 0).float(), loss_mask).mean().detach().item()
    return _finish(loss, old, rollout, loss_mask, cfg, {"clip_ratio": clip_ratio}, mask, ratio.detach())


def compute_policy_loss_clip_cov(log_probs, old, advantages, cfg, loss_mask, rollout):
    clip_cov_ratio, clip_cov_lb, clip_cov_ub = cfg["clip_cov.clip_ratio"], cfg["clip_cov_lb"], cfg["clip_cov_ub"]
    negative_approx_kl = log_probs - old
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - cfg["eps_clip_low"], 1 + cfg["eps_clip_high"])
    clip_by_origin = (pg_losses2 > pg_losses1) & (loss_mask > 0)
    cov_all = (advantages - masked_mean(advantages, loss_mask)) * (
        log_probs - masked_mean(log_probs.detach(), loss_mask))
    cov_all[loss_mask == 0] = -torch.inf
    cov_all[clip_by_origin] = -torch.inf
    clip_num = max(int(clip_cov_ratio * loss_mask.sum().item()), 1)
    top_k_idx = (cov_all < clip_cov_ub) & (cov_all > clip_cov_lb) & (loss_mask > 0)
    top_k_idx = torch.nonzero(top_k_idx)
    if len(top_k_idx) > 0:
        perm = torch.randperm(len(top_k_idx))
        top_k_idx = top_k_idx[perm[: min(clip_num, len(top_k_idx))]]
    else:
        top_k_idx = torch.empty((0, 2), dtype=torch.long)
    corr = torch.ones_like(advantages)
    if len(top_k_idx) > 0:
        corr[top_k_idx[:, 0], top_k_idx[:, 1]] = 0
    clip_frac = masked_mean((corr == 0).float(), loss_mask)
    pg_losses = torch.maximum(pg_losses1, pg_losses2) * corr
    pg_loss = reduce_loss(loss=pg_losses, loss_mask=loss_mask)
    return pg_loss, {"clip_ratio": clip_frac.item()}, {"loss_mask": loss_mask, "gate": corr,
                                                       "weight": torch.ones_like(loss_mask)}


def compute_policy_loss_kl_cov(log_probs, old, advantages, cfg, loss_mask, rollout):
    kl_cov_frac, ppo_kl_coef = cfg["kl_cov_frac"], cfg["ppo_kl_coef"]
    negative_approx_kl = log_probs - old
    abs_kl = negative_approx_kl.abs()
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses_kl = -advantages * ratio + ppo_kl_coef * abs_kl
    pg_losses = pg_losses1.clone()
    all_valid = loss_mask > 0
    all_valid_idx = torch.nonzero(all_valid.reshape(-1), as_tuple=True)[0]
    all_valid_adv = advantages[all_valid].detach().reshape(-1).cpu()
    all_valid_logp = log_probs[all_valid].detach().reshape(-1).cpu()
    if len(all_valid_adv) > 0:
        cov_lst_all = (all_valid_adv - all_valid_adv.mean()) * (all_valid_logp - all_valid_logp.mean())
        k_percent_nums = max(1, int(len(cov_lst_all) * kl_cov_frac))
        if k_percent_nums > 0:
            large_cov_idxs = torch.topk(cov_lst_all, min(k_percent_nums, len(cov_lst_all)), largest=True).indices
            if len(large_cov_idxs) > 0:
                large_cov_idxs = all_valid_idx[large_cov_idxs]
                pg_losses[large_cov_idxs // advantages.shape[1], large_cov_idxs % advantages.shape[1]] = \
                    pg_losses_kl[large_cov_idxs // advantages.shape[1], large_cov_idxs % advantages.shape[1]]
    pg_loss = reduce_loss(loss=pg_losses, loss_mask=loss_mask)
    ones = torch.ones_like(loss_mask)
    return pg_loss, {"clip_ratio": 0.0}, {"loss_mask": loss_mask, "gate": ones, "weight": ones}


def cross_entropy_loss(log_probs, old, advantages, cfg, loss_mask, rollout):
    elementwise_loss = -log_probs
    loss = reduce_loss(elementwise_loss, loss_mask)
    ones = torch.ones_like(loss_mask)
    return loss, {"clip_ratio": 0.0}, {"loss_mask": loss_mask, "gate": ones, "weight": ones}


def importance_sampling_loss(log_probs, old, advantages, cfg, loss_mask, rollout):
    prob_ratio = torch.exp(log_probs - old)
    elementwise_loss = -(prob_ratio * advantages)
    loss = (elementwise_loss * loss_mask).sum()
    mean_ratio = (prob_ratio * loss_mask).sum() / loss_mask.sum()
    ones = torch.ones_like(loss_mask)
    return loss, {"importance_ratio": mean_ratio.item()}, {"loss_mask": loss_mask, "gate": ones, "weight": ones}


REGISTRY = {"regular": ppo_policy_loss, "dual_clip": ppo_policy_loss, "gspo": gspo_policy_loss,
            "cispo": compute_policy_loss_cispo, "clip_cov": compute_policy_loss_clip_cov,
            "kl_cov": compute_policy_loss_kl_cov, "sapo": sapo_policy_loss, "cross_entropy": cross_entropy_loss,
            "importance_sampling": importance_sampling_loss, "dppo": dppo_policy_loss,
            "rollout_is": rollout_is_policy_loss}
"""PolicyLossRegistry.repopulate_registry's built-in entries."""


def apply_loss_reduction_to_advantages_minibatch(advantages, loss_mask, loss_reduction, micro_batch_size,
                                                 max_seq_len):
    batch_size = advantages.shape[0]
    normalized_advantages = torch.zeros_like(advantages)
    if loss_reduction == "token_mean":
        normalized_advantages = advantages / loss_mask.sum().clamp(min=1)
    elif loss_reduction == "token_mean_legacy":
        num_micro_batches = batch_size // micro_batch_size
        for i in range(num_micro_batches):
            start_idx, end_idx = i * micro_batch_size, (i + 1) * micro_batch_size
            mb_advantages = advantages[start_idx:end_idx]
            mb_loss_mask = loss_mask[start_idx:end_idx]
            mb_advantages = mb_advantages / mb_loss_mask.sum().clamp(min=1)
            mb_advantages /= num_micro_batches
            normalized_advantages[start_idx:end_idx] = mb_advantages
    elif loss_reduction == "sequence_mean":
        normalized_advantages = advantages / (batch_size * loss_mask.sum(dim=-1, keepdim=True).clamp(min=1))
    elif loss_reduction == "seq_mean_token_sum_norm":
        normalized_advantages = advantages / (batch_size * max_seq_len)
    else:
        raise ValueError(f"Invalid loss reduction type: {loss_reduction}")
    return normalized_advantages


def skyrl_step(log_probs, old, rollout, advantages, loss_mask, cfg):
    """The trainer's advantage scaling (one mini-batch, one micro-batch), then the registered loss. loss_mask
    float. Returns (loss, metrics, final loss mask, the loss's own mask, weight on μ)."""
    advantages = apply_loss_reduction_to_advantages_minibatch(advantages, loss_mask, cfg["loss_reduction"],
                                                              advantages.shape[0], cfg["max_seq_len"])
    loss, metrics, aux = REGISTRY[cfg["policy_loss_type"]](log_probs, old, advantages, cfg, loss_mask, rollout)
    return loss, metrics, aux["loss_mask"], aux["gate"], aux["weight"]
