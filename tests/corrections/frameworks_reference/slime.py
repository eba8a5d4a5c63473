"""A transcription of slime's policy loss, statement by statement, for the slime/* preset tests.

Read from THUDM/slime at commit 624b824a898ab0ec1fcb4d373004c7f3852bf515:
  slime/backends/megatron_utils/loss.py   policy_loss_function, vanilla_tis_function, icepop_function,
                                          loss_function (the 1/step_global_batch_size scaling)
  slime/utils/ppo_utils.py                compute_policy_loss, compute_opsm_mask, compute_gspo_kl,
                                          compute_cispo_loss, compute_approx_kl
  slime/backends/megatron_utils/cp_utils.py   get_sum_of_sample_mean (context parallel size 1)
  slime/observability/train_metric_utils.py   reduce_train_step_metrics (per-rollout mean: / batch size)
  slime/ray/rollout.py, megatron_utils/actor.py   rollout_mask_sums (one sample per rollout: its own mask
                                          sum, as float32) and loss masks as torch.int
  examples/train_infer_mismatch_helper/mis.py     compute_mis_weights and its helpers
  slime/utils/arguments.py                defaults
slime needs Megatron and SGLang and cannot be installed here: this module re-expresses those functions in the
project's code, one list entry per sample as slime holds them, keeping their operations and their order. It
shares no code with the preset module. compute_approx_kl's `.float()` is the identity on slime's float32
log-probs and is left out, so the float64 inputs stay float64. Not transcribed: entropy (needs logits), context
parallelism, custom_pg_loss_reducer_function_path, get_mismatch_metrics without --use-tis.
"""

from __future__ import annotations

import torch

COMMIT = "624b824a898ab0ec1fcb4d373004c7f3852bf515"
ARGUMENT_DEFAULTS = {"eps_clip": 0.2, "eps_clip_high": None, "eps_clip_c": None, "use_rollout_logprobs": False,
                     "use_opsm": False, "opsm_delta": 1e-4, "use_tis": False, "tis_clip": 2.0, "tis_clip_low": 0,
                     "custom_tis_function_path": None, "entropy_coef": 0.0, "use_kl_loss": False,
                     "calculate_per_token_loss": False, "advantage_estimator": "grpo", "kl_loss_coef": 0.0,
                     "kl_loss_type": "k1", "use_unbiased_kl": False}
"""slime/utils/arguments.py; eps_clip_high None becomes eps_clip after parsing."""
MIS_YAML = {"use_tis": True, "use_rs": True, "tis_level": "token", "rs_level": "token", "tis_mode": "truncate",
            "tis_lower_bound": 0.5, "tis_upper_bound": 2.0, "rs_lower_bound": None, "rs_upper_bound": None,
            "rs_veto_threshold": 1.0e-4, "tis_batch_normalize": True}
"""examples/train_infer_mismatch_helper/mis.yaml."""


def sample_mean_reducer(loss_masks, denoms):
    def reduce(x):
        parts = x.split([len(m) for m in loss_masks], dim=0)
        return sum((xi * mi).sum() / torch.clamp_min(d, 1) for xi, mi, d in zip(parts, loss_masks, denoms))

    return reduce


def ppo_clip(ppo_kl, adv, eps, eps_high, eps_c):
    ratio = (-ppo_kl).exp()
    l1 = -ratio * adv
    l2 = -ratio.clamp(1 - eps, 1 + eps_high) * adv
    clipped = torch.maximum(l1, l2)
    frac = torch.gt(l2, l1).float()
    if eps_c is None:
        return clipped, frac
    return torch.where(adv < 0, torch.min(-eps_c * adv, clipped), clipped), frac


def gspo_kl(cur, old, masks):
    kl = [((o - lp) * m).sum() / torch.clamp_min(m.sum(), 1) for lp, o, m in zip(cur, old, masks)]
    return torch.cat([k.expand_as(lp) for k, lp in zip(kl, cur)], dim=0)


def cispo_loss(ppo_kl, log_probs, adv, eps, eps_high):
    ratio = (-ppo_kl).exp()
    truncated = torch.clamp(ratio, min=1.0 - eps, max=1.0 + eps_high)
    return -truncated.detach() * adv * log_probs, (truncated != ratio).float()


def approx_kl(log_probs, base, kl_loss_type, importance_ratio=None):
    log_ratio = log_probs - base
    if kl_loss_type == "k1":
        kl = log_ratio
    elif kl_loss_type == "k2":
        kl = log_ratio ** 2 / 2.0
    elif kl_loss_type in ["k3", "low_var_kl"]:
        log_ratio = -log_ratio
        kl = log_ratio.exp() - 1 - log_ratio
    else:
        raise ValueError(kl_loss_type)
    if importance_ratio is not None:
        kl = importance_ratio * kl
    if kl_loss_type == "low_var_kl":
        kl = torch.clamp(kl, min=-10, max=10)
    return kl


def opsm(args, cur, old, advs, masks):
    keep, frac = [], torch.tensor(0.0)
    for lp, olp, a, m in zip(cur, old, advs, masks):
        seq_kl = ((olp - lp) * m).sum() / torch.clamp_min(m.sum(), 1)
        dropped = ((a < 0) & (seq_kl > args["opsm_delta"])).float()
        frac = frac + dropped.sum() / torch.clamp_min(m.sum(), 1)
        keep.append(1 - dropped)
    return torch.cat(keep), frac


def vanilla_tis(args, pg, train_lp, roll_lp, masks):
    roll, old = torch.cat(roll_lp), torch.cat(train_lp)
    tis = torch.exp(old - roll)
    w = torch.clamp(tis, min=args["tis_clip_low"], max=args["tis_clip"])
    metrics = {"tis": tis, "tis_clipfrac": (w != tis).float(), "tis_abs": (torch.exp(old - roll) - 1).abs()}
    return pg * w, masks, metrics, w


def icepop(args, pg, train_lp, roll_lp, masks):
    roll, old = torch.cat(roll_lp), torch.cat(train_lp)
    ratio = torch.exp(old - roll)
    inside = (ratio >= args["tis_clip_low"]) & (ratio <= args["tis_clip"])
    w = torch.where(inside, ratio, torch.zeros_like(ratio))
    metrics = {"tis": ratio, "tis_clipfrac": (w != ratio).float(), "tis_abs": (torch.exp(old - roll) - 1).abs()}
    return pg * w, masks, metrics, w


# -- examples/train_infer_mismatch_helper/mis.py ---------------------------------------------------------------
def _msum(x, m, expand=False):
    r = (x * m).sum()
    return r.expand_as(x) if expand else r


def _mmean(x, m, expand=False):
    r = _msum(x, m) / torch.clamp_min(m.sum(), 1)
    return r.expand_as(x) if expand else r


def _mext(x, m, f):
    b = m.bool()
    r = f(x[b]) if b.any() else torch.tensor(0.0, dtype=x.dtype)
    return r.expand_as(x)


def _put(metrics, key, value):
    metrics.setdefault(key, []).append(value.clone().detach())


def _ppl(train, roll, m, metrics):
    m = m.float()
    mt, mr = _mmean(train, m, True), _mmean(roll, m, True)
    for k, v in (("training_log_ppl", -mt), ("training_ppl", torch.exp(-mt)), ("rollout_log_ppl", -mr),
                 ("rollout_ppl", torch.exp(-mr)), ("kl", roll - train)):
        _put(metrics, k, v)
    lr = train - roll
    _put(metrics, "k3_kl", torch.exp(lr) - lr - 1)
    diff = mr - mt
    _put(metrics, "log_ppl_diff", diff)
    _put(metrics, "log_ppl_abs_diff", diff.abs())
    _put(metrics, "ppl_ratio", torch.exp(diff))
    rho = torch.exp(torch.clamp(lr, min=-20.0, max=20.0))
    _put(metrics, "chi2_token", (_mmean(rho.square(), m) - 1.0).expand_as(train))
    _put(metrics, "chi2_seq", torch.exp(2.0 * torch.clamp(_msum(lr, m, True), min=-20.0, max=20.0)) - 1.0)


def _level(raw, m, level):
    return raw if level == "token" else (_msum(raw, m, True) if level == "sequence" else _mmean(raw, m, True))


def _mask_mode(w, m, metrics, lo, hi, prefix):
    _put(metrics, f"{prefix}mask_fraction_low", (w < lo).int())
    _put(metrics, f"{prefix}mask_fraction_high", (w > hi).int())
    inside = (w >= lo) & (w <= hi)
    return w * m, m * inside.float()


def compute_mis_weights(args, train_lps, roll_lps, masks):
    metrics = {}
    tis_lo = args["tis_lower_bound"] if args["tis_lower_bound"] is not None else 1.0 / args["tis_upper_bound"]
    rs_lo = args["rs_lower_bound"] if args["rs_lower_bound"] is not None else tis_lo
    rs_hi = args["rs_upper_bound"] if args["rs_upper_bound"] is not None else args["tis_upper_bound"]
    for tr, ro, m in zip(train_lps, roll_lps, masks):
        _ppl(tr, ro, m, metrics)
    weights_all, masks_all = [], []
    for tr, ro, m in zip(train_lps, roll_lps, masks):
        m = m.float()
        raw = tr - ro
        modified = m.clone().float()
        lr_tis = _level(raw, m, args["tis_level"])
        w = torch.exp(torch.clamp(lr_tis, min=-20.0, max=20.0))
        _put(metrics, "tis_weight_before_bound", w)
        if args["tis_mode"] == "truncate":
            _put(metrics, "tis_truncate_fraction", (w > args["tis_upper_bound"]).int())
            w = w.clamp(0, args["tis_upper_bound"]) * m
        elif args["tis_mode"] == "clip":
            _put(metrics, "tis_clip_fraction_low", (w < tis_lo).int())
            _put(metrics, "tis_clip_fraction_high", (w > args["tis_upper_bound"]).int())
            w = w.clamp(tis_lo, args["tis_upper_bound"]) * m
        else:
            w, modified = _mask_mode(w, m, metrics, tis_lo, args["tis_upper_bound"], "tis_")
        _put(metrics, "tis_weight_after_bound", w)
        if args["use_rs"]:
            lr_rs = lr_tis if args["rs_level"] == args["tis_level"] else _level(raw, m, args["rs_level"])
            _, modified = _mask_mode(torch.exp(torch.clamp(lr_rs, min=-20.0, max=20.0)), modified, metrics,
                                     rs_lo, rs_hi, "rs_")
            if args["rs_veto_threshold"] is not None:
                bad = (raw < torch.log(torch.tensor(args["rs_veto_threshold"]))) & m.bool()
                any_bad = bad.any()
                _put(metrics, "rs_catastrophic_token_fraction", bad.int())
                _put(metrics, "rs_catastrophic_seq_fraction", any_bad.int().expand_as(m))
                modified = modified * (~any_bad).float().expand_as(raw)
        _put(metrics, "is_ratio_mean_after_tis_rs", w)
        weights_all.append(w.detach())
        masks_all.append(modified.detach())
    if args["tis_batch_normalize"]:
        if args["tis_level"] == "token":
            mean = sum(_msum(w, m) for w, m in zip(weights_all, masks)) / torch.clamp_min(sum(m.sum() for m in masks), 1)
        else:
            per_seq = [_mmean(w, m) for w, m in zip(weights_all, masks)]
            mean = sum(per_seq) / len(per_seq)
        if mean > 1e-8:
            weights_all = [w / mean for w in weights_all]
            for w in weights_all:
                _put(metrics, "batch_norm_factor", mean.expand_as(w))
        else:
            for w in weights_all:
                _put(metrics, "batch_norm_factor", torch.ones_like(w))
    for w, m in zip(weights_all, masks):
        m = m.float()
        _put(metrics, "is_ratio_mean_final", _mmean(w, m, True))
        _put(metrics, "is_ratio_min_final", _mext(w, m, torch.min))
        _put(metrics, "is_ratio_max_final", _mext(w, m, torch.max))
    return weights_all, masks_all, metrics


def mis(args, pg, train_lp, roll_lp, masks):
    w, modified, metrics = compute_mis_weights(args, train_lp, roll_lp, masks)
    w = torch.cat(w)
    return pg * w, modified, {f"mis_{k}": torch.cat(v) for k, v in metrics.items()}, w


TIS_FUNCTIONS = {None: vanilla_tis, "slime.backends.megatron_utils.loss.icepop_function": icepop,
                 "examples.train_infer_mismatch_helper.mis.compute_mis_weights_with_cp": mis}


def slime_step(args, cur, old_lp, roll_lp, advs, masks, ref_lp=None):
    """One micro-batch of policy_loss_function + loss_function on one rank. cur: per-sample slices of a leaf
    requiring grad (π); old_lp: slime's batch["log_probs"] (π_old); roll_lp: batch["rollout_log_probs"] (μ);
    ref_lp: batch["ref_log_probs"] (π_ref, for --use-kl-loss); masks: torch.int loss masks. Returns (loss,
    reported metrics, per-token TIS weight, per-token keep)."""
    denoms = torch.tensor([float(m.sum()) for m in masks], dtype=torch.float32)
    reduce = sample_mean_reducer(masks, denoms)
    anchor = roll_lp if args["use_rollout_logprobs"] else old_lp
    if args["use_opsm"]:
        opsm_keep, opsm_frac = opsm(args, cur, anchor, advs, masks)
    adv, anchor_cat, lp = torch.cat(advs), torch.cat(anchor), torch.cat(cur)
    ppo_kl = gspo_kl(cur, anchor, masks) if args["advantage_estimator"] == "gspo" else anchor_cat - lp
    if args["advantage_estimator"] == "cispo":
        pg, clipfrac = cispo_loss(ppo_kl, lp, adv, args["eps_clip"], args["eps_clip_high"])
    else:
        pg, clipfrac = ppo_clip(ppo_kl, adv, args["eps_clip"], args["eps_clip_high"], args["eps_clip_c"])
    if args["use_opsm"]:
        pg = pg * opsm_keep
    keep = torch.cat(masks).bool()
    if args["use_opsm"]:
        keep &= opsm_keep.bool()
    weight = torch.ones_like(lp)
    if args["use_tis"]:
        metric_reduce = reduce
        ois = (-ppo_kl).exp()
        pg, modified, tis_metrics, weight = TIS_FUNCTIONS[args["custom_tis_function_path"]](
            args, pg, old_lp, roll_lp, masks)
        keep &= torch.cat(modified).bool() & (weight != 0) if args["custom_tis_function_path"] else \
            torch.cat(modified).bool()
        reduce = sample_mean_reducer(modified, denoms)
    pg_loss = reduce(pg)
    reported = {"pg_clipfrac": reduce(clipfrac), "ppo_kl": reduce(ppo_kl)}
    loss = pg_loss  # − entropy_coef · entropy_loss, entropy_coef 0 by default (the entropy needs logits)
    if args["use_kl_loss"]:
        ratio = torch.exp(lp - anchor_cat) if args["use_unbiased_kl"] else None
        kl_loss = reduce(approx_kl(lp, torch.cat(ref_lp), args["kl_loss_type"], importance_ratio=ratio))
        loss = loss + args["kl_loss_coef"] * kl_loss
        reported["kl_loss"] = kl_loss
    compare = lp if args["use_rollout_logprobs"] else anchor_cat
    reported["train_rollout_logprob_abs_diff"] = reduce((compare - torch.cat(roll_lp)).abs())
    reported.update({"loss": loss, "pg_loss": pg_loss})
    if args["use_tis"]:
        reported["ois"] = metric_reduce(ois)
        reported.update({k: metric_reduce(v) for k, v in tis_metrics.items()})
    if args["use_opsm"]:
        reported["opsm_clipfrac"] = opsm_frac
    batch = len(masks)
    scaled = loss * 1 / batch * 1
    return scaled, {k: float(v.detach()) / batch for k, v in reported.items()}, weight.detach(), keep
