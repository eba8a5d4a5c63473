"""A transcription of NeMo-RL's clipped policy-gradient loss, statement by statement, for the nemo-rl/* preset tests.

Read from NVIDIA-NeMo/RL at commit 7ea279abfbeb698b092856d0dab61e7cf39bc909:
  nemo_rl/algorithms/loss/loss_functions.py   ClippedPGLossConfig (defaults), ClippedPGLossFn.__call__ — the
                                              branches a preset reaches: no KL penalty, no dual clip, no
                                              CISPO, token-level loss, token-level importance weights
  nemo_rl/algorithms/utils.py                 masked_mean, calculate_kl (k3, no clamps for the error metrics)
  nemo_rl/algorithms/grpo.py                  compute_and_apply_seq_logprob_error_masking (rewards left out)
  examples/configs/grpo_math_1B.yaml          the loss_fn block (defaults); prorlv2.v2.yaml (icepop 0.5–5),
                                              recipes (tis 2, seq_logprob_error_threshold 2), the loss's
                                              comment (seq-mask-tis 0.999–1.002)
NeMo-RL needs Ray, Megatron and vLLM at import time, so its functions cannot be imported here: this module
re-expresses them in the project's code keeping their operations and order, on one micro-batch of one rank
(global_valid_toks / global_valid_seqs = that batch's counts). It shares no code with the preset module.
The batch's leading position NeMo-RL drops ([:, 1:]) is not part of these tensors.
"""

from __future__ import annotations

import torch

COMMIT = "7ea279abfbeb698b092856d0dab61e7cf39bc909"
LOSS_FN = {"ratio_clip_min": 0.2, "ratio_clip_max": 0.2, "ratio_clip_c": None, "reference_policy_kl_penalty": 0.0,
           "token_level_loss": True, "use_importance_sampling_correction": False,
           "truncated_importance_sampling_type": None, "truncated_importance_sampling_ratio": None,
           "truncated_importance_sampling_ratio_min": None, "seq_logprob_error_threshold": None}
"""grpo_math_1B.yaml's loss_fn (reference_policy_kl_penalty 0.01 there: 0 here, no π_ref) and
grpo.seq_logprob_error_threshold (null there)."""


def masked_mean(values, mask, dim=None, global_normalization_factor=None):
    normalization_factor = torch.sum(mask, dim=dim) if global_normalization_factor is None \
        else global_normalization_factor
    return torch.sum(values * mask, dim=dim) / (normalization_factor + 1e-8)


def calculate_kl(logprobs, logprobs_reference):
    logr = logprobs_reference - logprobs
    return torch.exp(logr) - 1 - logr


def seq_logprob_error_masking(data, threshold):
    token_mask, sample_mask = data["token_mask"], data["sample_mask"]
    lp_error = torch.abs(data["generation_logprobs"] - data["prev_logprobs"])
    mask = token_mask * sample_mask.unsqueeze(-1)
    denom = mask.sum(dim=-1)
    valid = denom > 0
    err = torch.zeros_like(denom, dtype=lp_error.dtype)
    num = (torch.exp(lp_error * mask) * mask).sum(dim=-1)
    err[valid] = num[valid] / denom[valid].clamp(min=1)
    out = {"max_seq_mult_prob_error": err[valid].max().item(), "mean_seq_mult_prob_error": err[valid].mean().item(),
           "min_seq_mult_prob_error": err[valid].min().item()}
    after = dict(out)
    num_masked = 0
    if threshold is not None:
        original = sample_mask.clone()
        seq_error_mask = (err <= threshold).float().to(original.dtype) * original
        num_masked = int((original - seq_error_mask).sum().item())
        kept = seq_error_mask.bool() & valid
        if kept.sum() > 0:
            after = {"max_seq_mult_prob_error": err[kept].max().item(),
                     "mean_seq_mult_prob_error": err[kept].mean().item(),
                     "min_seq_mult_prob_error": err[kept].min().item()}
        else:
            after = {k: 0.0 for k in out}
        data["sample_mask"] = seq_error_mask
    out.update({f"{k}_after_mask": v for k, v in after.items()})
    out["num_masked_seqs"] = num_masked
    return out


def clipped_pg_loss(curr_logprobs, data, cfg, global_valid_seqs, global_valid_toks):
    """ClippedPGLossFn.__call__ on the branches the presets reach. Returns (loss, metrics, weights used)."""
    token_mask, sample_mask, advantages = data["token_mask"], data["sample_mask"], data["advantages"]
    prev_logprobs, generation_logprobs = data["prev_logprobs"], data["generation_logprobs"]
    mask = token_mask * sample_mask.unsqueeze(-1)
    lp_error = torch.abs(generation_logprobs - prev_logprobs)
    mult_prob_error = masked_mean(torch.exp(lp_error * mask), mask, global_normalization_factor=global_valid_toks)
    gen_kl = masked_mean(calculate_kl(generation_logprobs, prev_logprobs), mask,
                         global_normalization_factor=global_valid_toks)
    policy_kl = masked_mean(calculate_kl(prev_logprobs, generation_logprobs), mask,
                            global_normalization_factor=global_valid_toks)
    log_mixture = torch.log(0.5 * torch.exp(prev_logprobs) + 0.5 * torch.exp(generation_logprobs))
    kl_prev = torch.exp(prev_logprobs - log_mixture) - (prev_logprobs - log_mixture) - 1
    kl_gen = torch.exp(generation_logprobs - log_mixture) - (generation_logprobs - log_mixture) - 1
    js = masked_mean(0.5 * kl_prev + 0.5 * kl_gen, mask, global_normalization_factor=global_valid_toks)
    kl = torch.tensor(0.0)
    log_ratios = curr_logprobs - prev_logprobs
    ratios = log_ratios.exp()
    ratios_clamped = ratios.clamp(1.0 - cfg["ratio_clip_min"], 1.0 + cfg["ratio_clip_max"])
    loss1 = -advantages * ratios
    loss2 = -advantages * ratios_clamped
    clip_loss = torch.max(loss1, loss2)
    filter_metrics = {}
    w = torch.exp(prev_logprobs - generation_logprobs)
    w = torch.nan_to_num(w, nan=0.0, posinf=0.0, neginf=0.0)
    hi, lo = cfg["truncated_importance_sampling_ratio"], cfg["truncated_importance_sampling_ratio_min"]
    if hi is not None:
        kind = cfg["truncated_importance_sampling_type"]
        if kind == "tis":
            tis_min = 0.0 if lo is None else lo
            oob = (w > hi) | (w < tis_min)
            filter_metrics = {"is_oob_ratio": masked_mean(oob.float().to(w.dtype), mask,
                                                          global_normalization_factor=global_valid_toks).item()}
            w = torch.clamp(w, min=tis_min, max=hi)
        elif kind == "icepop":
            kept = (w >= lo) & (w <= hi)
            filter_metrics = {"is_oob_ratio": masked_mean((~kept).float().to(w.dtype), mask,
                                                          global_normalization_factor=global_valid_toks).item()}
            w = torch.where(kept, w, torch.zeros_like(w))
        else:
            log_is = torch.nan_to_num(prev_logprobs - generation_logprobs, nan=0.0, posinf=0.0, neginf=0.0)
            geo = torch.exp(masked_mean(log_is, token_mask, dim=-1)).detach()
            seq_kept = ((geo >= lo) & (geo <= hi)).float().to(w.dtype)
            filter_metrics = {"is_oob_ratio": masked_mean(1.0 - seq_kept, sample_mask,
                                                          global_normalization_factor=global_valid_seqs).item()}
            w = w * seq_kept.unsqueeze(-1)
    used = w if cfg["use_importance_sampling_correction"] else torch.ones_like(prev_logprobs)
    actor_loss = masked_mean(used * clip_loss, mask, global_normalization_factor=global_valid_toks)
    sample_importance_ratio = masked_mean(w, mask, global_normalization_factor=global_valid_toks)
    with torch.no_grad():
        entropy = -masked_mean(torch.exp(curr_logprobs - generation_logprobs) * curr_logprobs, mask,
                               global_normalization_factor=global_valid_toks)
    nll_loss = torch.tensor(0.0)
    loss = actor_loss + kl + 0.0 * nll_loss
    with torch.no_grad():
        pr = masked_mean(ratios.detach(), mask, global_normalization_factor=global_valid_toks).item()
        prc = masked_mean(ratios_clamped.detach(), mask, global_normalization_factor=global_valid_toks).item()
        mr, mrc = ratios.detach()[mask.bool()], ratios_clamped.detach()[mask.bool()]
        if mr.numel() > 0:
            extremes = (mr.min().item(), mr.max().item(), mrc.min().item(), mrc.max().item())
        else:
            extremes = (float("inf"), float("-inf"), float("inf"), float("-inf"))
    metrics = {"loss": loss.item(), "probs_ratio": pr, "probs_ratio_clamped": prc, "probs_ratio_min": extremes[0],
               "probs_ratio_max": extremes[1], "probs_ratio_clamped_min": extremes[2],
               "probs_ratio_clamped_max": extremes[3], "kl_penalty": 0,
               "token_mult_prob_error": mult_prob_error.item(), "gen_kl_error": gen_kl.item(),
               "policy_kl_error": policy_kl.item(), "js_divergence_error": js.item(),
               "sampling_importance_ratio": sample_importance_ratio.item(),
               "num_valid_samples": sample_mask.sum().item(), "approx_entropy": entropy.item(), **filter_metrics,
               "positive_nll_loss": nll_loss.item()}
    return loss, metrics, used.detach()


def nemo_rl_step(curr, prev, gen, advantages, token_mask, cfg):
    """grpo.py's sequence masking, then the loss on the batch; token_mask float. Returns (loss, metrics,
    weights used, mask the loss reads)."""
    data = {"token_mask": token_mask, "sample_mask": torch.ones(token_mask.shape[0], dtype=token_mask.dtype),
            "prev_logprobs": prev, "generation_logprobs": gen, "advantages": advantages}
    seq_metrics = seq_logprob_error_masking(data, cfg["seq_logprob_error_threshold"])
    mask = data["token_mask"] * data["sample_mask"].unsqueeze(-1)
    loss, metrics, used = clipped_pg_loss(curr, data, cfg, data["sample_mask"].sum(), mask.sum())
    return loss, {**metrics, **seq_metrics}, used, mask
