"""A transcription of NeMo-RL's clipped policy-gradient loss, statement by statement, for the nemo-rl/* preset tests.

Read from NVIDIA-NeMo/RL at commit 7ea279abfbeb698b092856d0dab61e7cf39bc909:
  nemo_rl/algorithms/loss/loss_functions.py   ClippedPGLossConfig (defaults), ClippedPGLossFn.__call__ — every
                                              branch but the KL penalty (reads π_ref) and the VAPO NLL term
                                              (reads rewards): dual clip, CISPO, GSPO (sequence-level ratios and
                                              weights, sequence-level loss), disable_ppo_ratio,
                                              force_on_policy_ratio, the three truncations
  nemo_rl/algorithms/utils.py                 masked_mean, calculate_kl (k3, no clamps for the error metrics)
  nemo_rl/algorithms/grpo.py                  compute_and_apply_seq_logprob_error_masking (rewards left out),
                                              _resolve_logprob_skip_flags, _placeholder_seq_logprob_error_metrics
                                              and the step's rename of num_masked_seqs
  examples/configs/grpo_math_1B.yaml          the loss_fn block (defaults); prorlv2.v2.yaml (icepop 0.5–5),
                                              prorlv2_1_moe.v2.yaml, recipes (tis 2, seq_logprob_error_threshold
                                              2, dapo-*: ratio_clip_max 0.28 and ratio_clip_c 10, grpo-gspo-*,
                                              grpo-cispo-*), docs/guides/cispo.md, the loss's comments
                                              (seq-mask-tis 0.999–1.002, dual clip 3)
NeMo-RL needs Ray, Megatron and vLLM at import time, so its functions cannot be imported here: this module
re-expresses them in the project's code keeping their operations and order, on one micro-batch of one rank
(global_valid_toks / global_valid_seqs = that batch's counts). It shares no code with the preset module.
The batch's leading position NeMo-RL drops ([:, 1:]) is not part of these tensors.
"""

from __future__ import annotations

import torch

COMMIT = "7ea279abfbeb698b092856d0dab61e7cf39bc909"
LOSS_FN = {"ratio_clip_min": 0.2, "ratio_clip_max": 0.2, "ratio_clip_c": None, "reference_policy_kl_penalty": 0.0,
           "token_level_loss": True, "sequence_level_importance_ratios": False, "disable_ppo_ratio": False,
           "force_on_policy_ratio": False, "use_cispo": False, "positive_example_nll_weight": 0.0,
           "use_importance_sampling_correction": False, "truncated_importance_sampling_type": None,
           "truncated_importance_sampling_ratio": None, "truncated_importance_sampling_ratio_min": None,
           "seq_logprob_error_threshold": None}
"""grpo_math_1B.yaml's loss_fn (reference_policy_kl_penalty 0.01 there: 0 here, no π_ref) and
grpo.seq_logprob_error_threshold (null there); positive_example_nll_weight 0 as in ClippedPGLossConfig."""
PLACEHOLDER = {"max_seq_mult_prob_error": 0.0, "mean_seq_mult_prob_error": 0.0, "min_seq_mult_prob_error": 0.0,
               "max_seq_mult_prob_error_after_mask": 0.0, "mean_seq_mult_prob_error_after_mask": 0.0,
               "min_seq_mult_prob_error_after_mask": 0.0, "num_masked_seqs_by_logprob_error": 0}
"""grpo.py's _placeholder_seq_logprob_error_metrics (masked_correct_pct left out: it reads rewards)."""


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


def _ratios(curr_logprobs, prev_logprobs, token_mask, advantages, cfg):
    if cfg["force_on_policy_ratio"]:
        log_ratios = curr_logprobs - curr_logprobs.detach()
        ratios = log_ratios.exp()
        ratios_clamped = ratios
    elif not cfg["disable_ppo_ratio"]:
        log_ratios = curr_logprobs - prev_logprobs
        if cfg["sequence_level_importance_ratios"]:
            seq_log_ratio_mean = masked_mean(log_ratios, token_mask, dim=-1).unsqueeze(-1)
            seq_ratio = seq_log_ratio_mean.exp()
            ratios = seq_ratio.repeat(1, advantages.shape[1])
        else:
            ratios = log_ratios.exp()
        ratios_clamped = ratios.clamp(1.0 - cfg["ratio_clip_min"], 1.0 + cfg["ratio_clip_max"])
    else:
        ratios = curr_logprobs
        ratios_clamped = curr_logprobs
    if cfg["use_cispo"]:
        clip_loss = -advantages * ratios_clamped.detach() * curr_logprobs
    else:
        loss1 = -advantages * ratios
        loss2 = -advantages * ratios_clamped
        clip_loss = torch.max(loss1, loss2)
    if cfg["ratio_clip_c"] is not None:
        assert cfg["ratio_clip_c"] > 1
        loss3 = -advantages * cfg["ratio_clip_c"]
        clip_loss = torch.where(advantages < 0, torch.min(clip_loss, loss3), clip_loss)
    return ratios, ratios_clamped, clip_loss


def _importance_weights(prev_logprobs, generation_logprobs, token_mask, sample_mask, mask, cfg, global_valid_seqs,
                        global_valid_toks):
    filter_metrics = {}
    if cfg["sequence_level_importance_ratios"]:
        seq_lp_diff = ((prev_logprobs - generation_logprobs) * mask).sum(dim=-1)
        w = torch.exp(seq_lp_diff).detach()
        w = torch.nan_to_num(w, nan=0.0, posinf=0.0, neginf=0.0)
        w = w.unsqueeze(-1)
    else:
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
        elif kind == "seq-mask-tis":
            log_is = torch.nan_to_num(prev_logprobs - generation_logprobs, nan=0.0, posinf=0.0, neginf=0.0)
            geo = torch.exp(masked_mean(log_is, token_mask, dim=-1)).detach()
            seq_kept = ((geo >= lo) & (geo <= hi)).float().to(w.dtype)
            filter_metrics = {"is_oob_ratio": masked_mean(1.0 - seq_kept, sample_mask,
                                                          global_normalization_factor=global_valid_seqs).item()}
            w = w * seq_kept.unsqueeze(-1)
        else:
            raise ValueError(kind)
    return w, filter_metrics


def _diagnostics(prev_logprobs, generation_logprobs, mask, global_valid_toks):
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
    return {"token_mult_prob_error": mult_prob_error.item(), "gen_kl_error": gen_kl.item(),
            "policy_kl_error": policy_kl.item(), "js_divergence_error": js.item()}


def clipped_pg_loss(curr_logprobs, data, cfg, global_valid_seqs, global_valid_toks):
    """ClippedPGLossFn.__call__ without the KL and NLL terms. Returns (loss, metrics, weights used)."""
    token_mask, sample_mask, advantages = data["token_mask"], data["sample_mask"], data["advantages"]
    prev_logprobs = None if cfg["force_on_policy_ratio"] else data["prev_logprobs"]
    generation_logprobs = data["generation_logprobs"]
    mask = token_mask * sample_mask.unsqueeze(-1)
    if cfg["force_on_policy_ratio"]:
        prev_logprobs = curr_logprobs.detach()
    diagnostics = _diagnostics(prev_logprobs, generation_logprobs, mask, global_valid_toks)
    kl = torch.tensor(0.0)
    ratios, ratios_clamped, clip_loss = _ratios(curr_logprobs, prev_logprobs, token_mask, advantages, cfg)
    w, filter_metrics = _importance_weights(prev_logprobs, generation_logprobs, token_mask, sample_mask, mask, cfg,
                                            global_valid_seqs, global_valid_toks)
    used = w if cfg["use_importance_sampling_correction"] else torch.ones_like(prev_logprobs)
    if cfg["token_level_loss"]:
        actor_loss = masked_mean(used * clip_loss, mask, global_normalization_factor=global_valid_toks)
    else:
        actor_loss = masked_mean(masked_mean(used * clip_loss, token_mask, dim=-1), sample_mask,
                                 global_normalization_factor=global_valid_seqs)
    if cfg["sequence_level_importance_ratios"]:
        sample_importance_ratio = masked_mean(w, sample_mask, global_normalization_factor=global_valid_seqs)
    else:
        sample_importance_ratio = masked_mean(w, mask, global_normalization_factor=global_valid_toks)
    with torch.no_grad():
        entropy = -masked_mean(torch.exp(curr_logprobs - generation_logprobs) * curr_logprobs, mask,
                               global_normalization_factor=global_valid_toks)
    nll_loss = torch.tensor(0.0)
    loss = actor_loss + kl + cfg["positive_example_nll_weight"] * nll_loss
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
               "probs_ratio_clamped_max": extremes[3], "kl_penalty": 0, **diagnostics,
               "sampling_importance_ratio": sample_importance_ratio.item(),
               "num_valid_samples": sample_mask.sum().item(), "approx_entropy": entropy.item(), **filter_metrics,
               "positive_nll_loss": nll_loss.item()}
    return loss, metrics, used.detach()


def nemo_rl_step(curr, prev, gen, advantages, token_mask, cfg):
    """grpo.py's prev-logprob skip or sequence masking, then the loss on the batch; token_mask float. Returns
    (loss, metrics, weights used, mask the loss reads)."""
    skip_prev = cfg["force_on_policy_ratio"] and cfg["seq_logprob_error_threshold"] is None
    data = {"token_mask": token_mask, "sample_mask": torch.ones(token_mask.shape[0], dtype=token_mask.dtype),
            "prev_logprobs": torch.zeros_like(gen) if skip_prev else prev, "generation_logprobs": gen,
            "advantages": advantages}
    if skip_prev:
        seq_metrics = dict(PLACEHOLDER)
    else:
        seq_metrics = seq_logprob_error_masking(data, cfg["seq_logprob_error_threshold"])
        seq_metrics["num_masked_seqs_by_logprob_error"] = seq_metrics.pop("num_masked_seqs")
    mask = data["token_mask"] * data["sample_mask"].unsqueeze(-1)
    loss, metrics, used = clipped_pg_loss(curr, data, cfg, data["sample_mask"].sum(), mask.sum())
    return loss, {**metrics, **seq_metrics}, used, mask
