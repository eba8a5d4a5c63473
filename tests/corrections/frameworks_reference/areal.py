"""A transcription of AReaL's PPO actor loss, statement by statement, for the areal/* preset tests.

Read from inclusionAI/AReaL at commit 4aef98d8d818af55b43621aaadba047ae10f4e77:
  areal/utils/functional/functional.py   _check_bounds, apply_rejection_sampling (2-D padded branch),
                                         _compute_sequence_level_ratio_and_advantages (2-D), ppo_actor_loss_fn
  areal/utils/data.py                    KLEstimator._compute_approx_kl (apply_clamp=False)
  areal/trainer/ppo/actor.py             compute_advantages (which log-probs become `logprobs` / `prox_logp`),
                                         grpo_loss_fn (the stats it records), stats_tracker reductions
  areal/api/cli_args.py                  PPOActorConfig / RejectionSamplingConfig defaults
AReaL needs its GPU stack to import, so its functions are re-expressed here in the project's code, keeping
their operations, dtypes (the float32 casts) and order. stats_tracker refuses float64 tensors; here its
AVG_MIN_MAX / SUM / SCALAR reductions are applied to the float64 tensors directly. Independent of the preset
module (no shared code).
"""

from __future__ import annotations

import torch

COMMIT = "4aef98d8d818af55b43621aaadba047ae10f4e77"
ACTOR_DEFAULTS = {"eps_clip": 0.2, "eps_clip_higher": None, "c_clip": None, "importance_sampling_level": "token",
                  "use_decoupled_loss": False, "recompute_logprob": False, "rejection_sampling": None}
RS_DEFAULTS = {"level": "token", "action": "mask", "metric": "ratio", "agg": "mean", "upper": 5.0, "lower": None}
LEGACY = {"token_mask": {"level": "token", "action": "mask", "metric": "ratio"},
          "token_truncate": {"level": "token", "action": "clamp", "metric": "ratio"}}
"""_LEGACY_MIGRATION_MESSAGE: behave_imp_weight_mode → rejection_sampling (cap X → upper X; the old cap: 5.0)."""


def approx_kl(log_probs, log_probs_base, est):
    if est == "k1":
        lr = log_probs.float() - log_probs_base.float()
    if est == "k2":
        lr = log_probs.float() - log_probs_base.float()
        lr = lr ** 2 / 2.0
    if est == "k3":
        lr = log_probs.float() - log_probs_base.float()
        lr = -lr
        lr = lr.exp() - 1 - lr
    return lr


def check_bounds(metric, cfg):
    if cfg["lower"] is not None:
        return (metric >= cfg["lower"]) & (metric <= cfg["upper"])
    return metric <= cfg["upper"]


def rejection_sampling(prox, old, loss_mask, cfg):
    log_ratio = prox.detach().float() - old.detach().float()
    log_ratio = torch.where(torch.isfinite(log_ratio), log_ratio, 0.0)
    if cfg["metric"] == "ratio":
        metric = torch.exp(log_ratio)
    else:
        metric = approx_kl(prox.detach(), old.detach(), cfg["metric"].replace("kl_", ""))
    w = torch.exp(log_ratio)
    original = w
    use_log = cfg["metric"] == "ratio"
    lo = cfg["lower"] if cfg["lower"] is not None else 0.0
    if cfg["level"] == "sequence":
        agg_values = log_ratio if use_log else metric
        masked_agg = torch.where(loss_mask.bool(), agg_values, 0.0)
        valid = loss_mask.sum(dim=-1, keepdim=True).clamp(min=1)
        if use_log:
            w = torch.exp(masked_agg.sum(dim=-1, keepdim=True) / valid).expand_as(log_ratio)
            original = w
        if cfg["agg"] == "sum":
            seq = masked_agg.sum(dim=-1, keepdim=True)
        elif cfg["agg"] == "mean":
            seq = masked_agg.sum(dim=-1, keepdim=True) / valid
        else:
            seq = agg_values.masked_fill(~loss_mask.bool(), float("-inf")).max(dim=-1, keepdim=True)[0]
            empty = loss_mask.sum(dim=-1, keepdim=True) == 0
            seq = torch.where(empty, torch.zeros_like(seq), seq)
        seq_metric = torch.exp(seq) if use_log else seq
        if cfg["action"] == "mask":
            in_bounds = check_bounds(seq_metric, cfg).expand_as(loss_mask)
        else:
            oob = (~check_bounds(seq_metric, cfg)).expand_as(loss_mask)
            w = torch.where(oob, w.clamp(min=lo, max=cfg["upper"]), w)
    elif cfg["action"] == "mask":
        in_bounds = check_bounds(metric, cfg)
    else:
        w = w.clamp(min=lo, max=cfg["upper"])
    if cfg["action"] == "mask":
        cand = loss_mask.bool()
        new_mask = cand & in_bounds
        frac = (cand & ~in_bounds).sum().item() / max(cand.sum().item(), 1)
    else:
        new_mask = loss_mask
        frac = (loss_mask.bool() & (original != w)).sum().item() / max(loss_mask.bool().sum().item(), 1)
    return new_mask, torch.where(new_mask.bool(), w, 0.0), frac


def ppo_actor_loss_fn(logprobs, proximal_logprobs, old_logprobs, advantages, eps_clip, loss_mask,
                      eps_clip_higher, c_clip, rejection, importance_sampling_level):
    loss_mask_count = loss_mask.count_nonzero() or 1
    if rejection is not None:
        loss_mask, behave_w, frac = rejection_sampling(proximal_logprobs, old_logprobs, loss_mask, rejection)
    if importance_sampling_level == "sequence":
        log_ratio = logprobs - proximal_logprobs
        mean = torch.where(loss_mask, log_ratio, 0.0).sum(dim=1) / loss_mask.sum(dim=1).clamp(min=1)
        ratio = torch.where(loss_mask, torch.exp(mean.unsqueeze(1).expand_as(log_ratio)), 0.0)
        lens = loss_mask.sum(dim=-1, keepdim=True).clamp(min=1)
        advantages = (torch.where(loss_mask, advantages, 0.0).sum(dim=-1, keepdim=True) / lens)
        advantages = torch.where(loss_mask, advantages.expand_as(log_ratio), 0.0)
    else:
        ratio = torch.where(loss_mask, torch.exp(logprobs - proximal_logprobs), 0)
    clipped = torch.clamp(ratio, 1.0 - eps_clip, 1.0 + (eps_clip if eps_clip_higher is None else eps_clip_higher))
    pg1, pg2 = -advantages * ratio, -advantages * clipped
    clip_mask = pg1.detach() < pg2.detach()
    pg = torch.max(pg1, pg2)
    if c_clip is not None:
        pg3 = torch.sign(advantages) * c_clip * advantages
        dual = pg3.detach() < pg.detach()
        pg = torch.min(pg, pg3)
    else:
        dual = torch.zeros_like(clip_mask)
    if rejection is not None:
        kl = proximal_logprobs.detach() - old_logprobs.detach()
        behave_mask = (behave_w > 0).logical_and(loss_mask.bool())
        kl = torch.where(behave_mask, kl, 0.0)
        pg = pg * behave_w
    logging_loss = pg.detach()
    pg = torch.where(loss_mask, pg, 0).sum() / loss_mask_count
    clip_mask.logical_and_(loss_mask)
    dual.logical_and_(loss_mask)
    stat = {"loss": logging_loss, "importance_weight": ratio.detach(),
            "approx_kl": (logprobs - proximal_logprobs).detach(), "clip_mask": clip_mask, "dual_clip_mask": dual,
            "loss_mask": loss_mask}
    if rejection is not None:
        stat.update(behave_approx_kl=kl, behave_imp_weight=behave_w.detach(), behave_mask=behave_mask,
                    filtered_fraction=frac)
    return pg, stat


def avg_min_max(key, v, d):
    out = {}
    if d.sum() != 0:
        out[f"{key}/avg"] = (torch.where(d, v, 0.0).sum() / d.sum()).item()
    lo, hi = torch.where(d, v, float("inf")).min(), torch.where(d, v, -float("inf")).max()
    if not torch.isinf(lo):
        out[f"{key}/min"] = float(lo)
    if not torch.isinf(hi):
        out[f"{key}/max"] = float(hi)
    return out


def grpo_loss(logprobs, logp_old, logp_rollout, advantages, loss_mask, cfg):
    """compute_advantages' choice of logprobs / prox_logp, then grpo_loss_fn: (loss, stat, metrics)."""
    if not cfg["use_decoupled_loss"] and cfg["recompute_logprob"]:
        old_logp = prox = logp_old
    elif not cfg["use_decoupled_loss"]:
        old_logp = prox = logp_rollout
    else:
        old_logp, prox = logp_rollout, logp_old
    rs = cfg["rejection_sampling"] if cfg["use_decoupled_loss"] else None  # ignored otherwise (a warning)
    loss, stat = ppo_actor_loss_fn(logprobs, prox, old_logp, advantages, cfg["eps_clip"], loss_mask,
                                   cfg["eps_clip_higher"], cfg["c_clip"], rs, cfg["importance_sampling_level"])
    out = {"n_valid_tokens": float(loss_mask.sum()), "clipped_tokens": float(stat["clip_mask"].sum()),
           "dual_clipped_tokens": float(stat["dual_clip_mask"].sum())}
    for key, v in {"importance_weight": stat["importance_weight"], "approx_kl": stat["approx_kl"],
                   "new_logp": logprobs.detach(), "old_logp": old_logp, "actor_loss": stat["loss"],
                   "clip_ratio": stat["clip_mask"].double(), "dual_clip_ratio": stat["dual_clip_mask"].double()}.items():
        out.update(avg_min_max(key, v, loss_mask))
    if "behave_imp_weight" in stat:
        out["unclipped_behave_tokens"] = float(stat["behave_mask"].sum())
        out.update(avg_min_max("behave_imp_weight", stat["behave_imp_weight"], stat["behave_mask"]))
        out.update(avg_min_max("behave_approx_kl", stat["behave_approx_kl"], stat["behave_mask"]))
        out["rs_filtered_fraction"] = float(torch.tensor(stat["filtered_fraction"], dtype=torch.float32) / 1.0)
    cm = stat["clip_mask"]
    out.update(avg_min_max("clipped_new_logp", torch.where(cm, logprobs.detach(), 0.0), cm))
    out.update(avg_min_max("clipped_old_logp", torch.where(cm, old_logp, 0.0), cm))
    return loss, stat, out
