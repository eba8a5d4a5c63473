"""slime's policy loss (THUDM/slime @624b824a: slime/backends/megatron_utils/loss.py policy_loss_function,
vanilla_tis_function, icepop_function, loss_function; slime/utils/ppo_utils.py compute_policy_loss,
compute_opsm_mask; slime/backends/megatron_utils/cp_utils.py get_sum_of_sample_mean;
examples/train_infer_mismatch_helper/mis.py and mis.yaml for the MIS example; defaults from slime/utils/arguments.py).

In the project's notation (π the trainer now, π_old slime's recomputed `log_probs`, μ the rollout):

  anchor       o = π_old, or o = μ with --use-rollout-logprobs; c = π/o per token.
  PPO          ℓ = max(−c A, −clip(c, 1 − eps_clip, 1 + eps_clip_high) A); with eps_clip_c (dual clip)
               ℓ ← min(ℓ, −eps_clip_c·A) where A < 0.
  GSPO         (--advantage-estimator gspo, compute_gspo_kl) the same clip on c = exp(mean_t log π/o), one value
               per sequence (its gradient flows through every token of the mean).
  CISPO        (--advantage-estimator cispo, compute_cispo_loss) ℓ = −sg(clip(c, 1 − eps_clip, 1 + eps_clip_high))
               ·A·log π; pg_clipfrac counts tokens whose c was clipped; eps_clip_c is not read.
  KL loss      (--use-kl-loss) + kl_loss_coef · sample-mean of compute_approx_kl(π, π_ref) of --kl-loss-type
               (k1 log π/π_ref, k2 ½ log², k3 and low_var_kl π_ref/π − 1 − log π_ref/π, low_var_kl clamped to
               ±10), times c = π/o (not detached) with --use-unbiased-kl. A store holds no reference model:
               π_ref = π_old here (the first step of a run, whose reference is the policy that rolled out).
  OPSM         (--use-opsm) a sequence with A < 0 and mean_t (log o − log π) > opsm_delta is zeroed: it compares
               π_old with π by default, μ with π only with --use-rollout-logprobs.
  TIS          (--use-tis) ρ = π_old/μ per token: vanilla_tis_function multiplies ℓ by clamp(ρ, tis_clip_low,
               tis_clip) = clamp(ρ, 0, 2); icepop_function (its custom-tis path) keeps ρ where
               tis_clip_low ≤ ρ ≤ tis_clip — [0, 2] by default, not [0.5, 5] — and zeroes the rest.
  MIS example  per token or sequence: ρ = exp(clamp(level log ratio, ±20)); truncate / clip / mask at its bounds,
               rejection (RS) on the same ratio at [rs_lower, rs_upper], a veto dropping a sequence with any
               per-token log ρ < log(1e-4) (the threshold rounded to float32, as slime builds it), then the
               weights divided by their batch mean; rejected tokens leave the numerator only.
  loss         (1/B) Σ_sequences Σ_t ℓ_t·m'_t / max(Σ_t m_t, 1): each sequence's token mean over its original
               response (m' drops RS-rejected tokens from the numerator), averaged over the B sequences.

Result.weight is the TIS / IcePop / MIS weight (1 without --use-tis); Result.keep drops OPSM sequences, IcePop's
out-of-band tokens and MIS rejections. Metrics under slime's names, each its per-sequence mean over the original
response averaged over sequences, as slime reports them: pg_loss, pg_clipfrac, ppo_kl, train_rollout_logprob_abs_diff
(mean |log π_old − log μ|, |log π − log μ| with --use-rollout-logprobs; like pg_clipfrac and ppo_kl its
numerator leaves out MIS-rejected tokens), and with --use-tis ois, tis,
tis_clipfrac, tis_abs (or mis_* for the MIS example), opsm_clipfrac with --use-opsm, kl_loss with --use-kl-loss.
Not reproduced: entropy_loss (it needs the logits), custom_pg_loss_reducer_function_path, --get-mismatch-metrics
without --use-tis, --calculate-per-token-loss, context parallelism.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mismatch_lab.corrections.frameworks.base import Preset, Result, Tokens

SOURCE = ("THUDM/slime @624b824a, slime/backends/megatron_utils/loss.py (policy_loss_function, "
          "vanilla_tis_function, icepop_function, loss_function), slime/utils/ppo_utils.py (compute_policy_loss, "
          "compute_gspo_kl, compute_cispo_loss, compute_approx_kl, compute_opsm_mask), "
          "examples/train_infer_mismatch_helper/mis.py")
MIS_SAFETY = 20.0
"""The MIS example clamps log ratios to ±20 before exp."""


def _row_sum(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return (x * m).sum(-1, keepdim=True)


def _row_mean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return _row_sum(x, m) / m.sum(-1, keepdim=True).clamp(min=1)


def _report(x: torch.Tensor, m: torch.Tensor, within: torch.Tensor | None = None) -> float:
    """slime's reported value: each sequence's sum over `within` (default its response m) divided by its response
    length, averaged over the sequences (slime accumulates bool fractions in float32; this is float64)."""
    x = x.to(m.dtype).expand_as(m)
    per_seq = _row_sum(x, m if within is None else within) / m.sum(-1, keepdim=True).clamp(min=1)
    return (per_seq.sum() / m.shape[0]).item()


def _log_ratio(t: Tokens, s: Mapping[str, Any], anchor: torch.Tensor) -> torch.Tensor:
    """log c = −ppo_kl: per token, or (--advantage-estimator gspo) each sequence's mean broadcast."""
    lc = t.logp - anchor
    return _row_mean(lc, t.mask.to(lc.dtype)).expand_as(lc) if s["advantage_estimator"] == "gspo" else lc


def _ppo(t: Tokens, s: Mapping[str, Any], lc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    c = lc.exp()
    a = t.advantages
    plain, clipped = -c * a, -c.clamp(1 - s["eps_clip"], 1 + s["eps_clip_high"]) * a
    loss = torch.maximum(plain, clipped)
    if s["eps_clip_c"] is not None:
        loss = torch.where(a < 0, torch.min(-s["eps_clip_c"] * a, loss), loss)
    return loss, (clipped > plain).to(t.logp.dtype)


def _cispo(t: Tokens, s: Mapping[str, Any], lc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """compute_cispo_loss: −sg(clip(c, 1 − eps_clip, 1 + eps_clip_high))·A·log π (eps_clip_c not read)."""
    c = lc.exp()
    kept = c.clamp(1 - s["eps_clip"], 1 + s["eps_clip_high"])
    return -kept.detach() * t.advantages * t.logp, (kept != c).to(t.logp.dtype)


def _kl(t: Tokens, s: Mapping[str, Any], anchor: torch.Tensor) -> torch.Tensor:
    """compute_approx_kl(π, π_ref) per token for --use-kl-loss, π_ref = π_old (module docstring)."""
    lr = t.logp - t.logp_old
    kl = KL_TYPES[s["kl_loss_type"]](lr)
    if s["use_unbiased_kl"]:
        kl = (t.logp - anchor).exp() * kl
    return kl.clamp(-10, 10) if s["kl_loss_type"] == "low_var_kl" else kl


KL_TYPES = {"k1": lambda lr: lr, "k2": lambda lr: lr ** 2 / 2.0, "k3": lambda lr: (-lr).exp() - 1 + lr,
            "low_var_kl": lambda lr: (-lr).exp() - 1 + lr}
"""--kl-loss-type: the estimator of KL(π ‖ π_ref) on lr = log π − log π_ref (low_var_kl is k3 clamped to ±10)."""


def _opsm_drop(t: Tokens, s: Mapping[str, Any], anchor: torch.Tensor) -> torch.Tensor:
    m = t.mask.to(t.logp.dtype)
    seq_kl = _row_mean(anchor - t.logp.detach(), m)
    return (t.advantages < 0) & (seq_kl > s["opsm_delta"])


def _tis(t: Tokens, s: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """vanilla_tis_function or icepop_function: (weight, kept, per-token metrics)."""
    rho = (t.logp_old - t.logp_rollout).exp()
    lo, hi = s["tis_clip_low"], s["tis_clip"]
    if s["custom_tis_function_path"] == ICEPOP:
        kept = (rho >= lo) & (rho <= hi)
        w = torch.where(kept, rho, torch.zeros_like(rho))
    else:
        kept, w = torch.ones_like(t.mask), rho.clamp(min=lo, max=hi)
    return w, kept, {"tis": rho, "tis_clipfrac": (w != rho).to(rho.dtype), "tis_abs": (rho - 1).abs()}


def _level_log_ratio(lr: torch.Tensor, m: torch.Tensor, level: str) -> torch.Tensor:
    if level == "token":
        return lr
    return (_row_sum(lr, m) if level == "sequence" else _row_mean(lr, m)).expand_as(lr)


def _mis_ppl_metrics(lp: torch.Tensor, lmu: torch.Tensor, m: torch.Tensor) -> dict[str, torch.Tensor]:
    train, roll = _row_mean(lp, m), _row_mean(lmu, m)
    lr = lp - lmu
    gap = roll - train
    safe = lr.clamp(-MIS_SAFETY, MIS_SAFETY)
    return {"training_log_ppl": -train, "training_ppl": (-train).exp(), "rollout_log_ppl": -roll,
            "rollout_ppl": (-roll).exp(), "kl": lmu - lp, "k3_kl": lr.exp() - lr - 1, "log_ppl_diff": gap,
            "log_ppl_abs_diff": gap.abs(), "ppl_ratio": gap.exp(), "chi2_token": _row_mean(safe.exp() ** 2, m) - 1,
            "chi2_seq": (2 * _row_sum(lr, m).clamp(-MIS_SAFETY, MIS_SAFETY)).exp() - 1}


def _mis_bound(w, m, s, metrics):
    """The MIS example's truncate / clip / mask of the weights: (weights, mask after the IS mode)."""
    mode, hi = s["tis_mode"], s["tis_upper_bound"]
    lo = s["tis_lower_bound"] if s["tis_lower_bound"] is not None else 1.0 / hi
    if mode == "truncate":
        metrics["tis_truncate_fraction"] = (w > hi).to(w.dtype)
        return w.clamp(0, hi) * m, m
    metrics[f"tis_{mode}_fraction_low"] = (w < lo).to(w.dtype)
    metrics[f"tis_{mode}_fraction_high"] = (w > hi).to(w.dtype)
    if mode == "clip":
        return w.clamp(lo, hi) * m, m
    return w * m, m * ((w >= lo) & (w <= hi))


def _mis_reject(lr, m, kept, s, metrics):
    """RS on the level ratio at [rs_lower, rs_upper] and the per-token veto: the final kept mask."""
    hi = s["tis_upper_bound"]
    lo = s["tis_lower_bound"] if s["tis_lower_bound"] is not None else 1.0 / hi
    rs_lo = s["rs_lower_bound"] if s["rs_lower_bound"] is not None else lo
    rs_hi = s["rs_upper_bound"] if s["rs_upper_bound"] is not None else hi
    rs = _level_log_ratio(lr, m, s["rs_level"]).clamp(-MIS_SAFETY, MIS_SAFETY).exp()
    metrics["rs_mask_fraction_low"] = (rs < rs_lo).to(lr.dtype)
    metrics["rs_mask_fraction_high"] = (rs > rs_hi).to(lr.dtype)
    kept = kept * ((rs >= rs_lo) & (rs <= rs_hi))
    if s["rs_veto_threshold"] is not None:
        floor = torch.log(torch.tensor(s["rs_veto_threshold"], dtype=torch.float32))
        bad = (lr < floor) & m.bool()
        seq_bad = bad.any(-1, keepdim=True)
        metrics["rs_catastrophic_token_fraction"] = bad.to(lr.dtype)
        metrics["rs_catastrophic_seq_fraction"] = seq_bad.to(lr.dtype).expand_as(lr)
        kept = kept * (~seq_bad).to(lr.dtype)
    return kept


def _mis_normalize(w, m, s, metrics):
    if s["tis_batch_normalize"]:
        if s["tis_level"] == "token":
            mean = (w * m).sum() / m.sum().clamp(min=1)
        else:
            mean = _row_mean(w, m).sum() / m.shape[0]
        factor = mean if mean > 1e-8 else torch.ones((), dtype=w.dtype)
        w = w / factor
        metrics["batch_norm_factor"] = factor.expand_as(w)
    metrics["is_ratio_mean_final"] = _row_mean(w, m).expand_as(w)
    big = torch.finfo(w.dtype).max
    metrics["is_ratio_min_final"] = torch.where(m.bool(), w, big).amin(-1, keepdim=True).expand_as(w)
    metrics["is_ratio_max_final"] = torch.where(m.bool(), w, -big).amax(-1, keepdim=True).expand_as(w)
    return w


def _mis(t: Tokens, s: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The MIS example (compute_mis_weights) on ρ = π_old/μ: (weight, kept as 0/1, per-token metrics)."""
    m = t.mask.to(t.logp.dtype)
    lr = t.logp_old - t.logp_rollout
    metrics = _mis_ppl_metrics(t.logp_old, t.logp_rollout, m)
    w = _level_log_ratio(lr, m, s["tis_level"]).clamp(-MIS_SAFETY, MIS_SAFETY).exp()
    metrics["tis_weight_before_bound"] = w
    w, kept = _mis_bound(w, m, s, metrics)
    metrics["tis_weight_after_bound"] = w
    if s["use_rs"]:
        kept = _mis_reject(lr, m, kept, s, metrics)
    metrics["is_ratio_mean_after_tis_rs"] = w
    w = _mis_normalize(w, m, s, metrics)
    return w, kept, {f"mis_{k}": v for k, v in metrics.items()}


def _objective(t: Tokens, s: Mapping[str, Any], lc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (_cispo if s["advantage_estimator"] == "cispo" else _ppo)(t, s, lc)


def policy_loss(t: Tokens, s: Mapping[str, Any]) -> Result:
    """slime's policy_loss_function + loss_function for one micro-batch of B sequences (module docstring)."""
    m = t.mask.to(t.logp.dtype)
    anchor = t.logp_rollout if s["use_rollout_logprobs"] else t.logp_old
    lc = _log_ratio(t, s, anchor)
    per_token, clipfrac = _objective(t, s, lc)
    keep, numerator = t.mask.clone(), m
    metrics: dict[str, float] = {}
    if s["use_opsm"]:
        drop = _opsm_drop(t, s, anchor)
        per_token = per_token * (1 - drop.to(m.dtype))
        keep &= ~drop
        metrics["opsm_clipfrac"] = (((drop & t.mask).sum(-1) / t.mask.sum(-1).clamp(min=1)).sum() / m.shape[0]).item()
    weight = torch.ones_like(m)
    if s["use_tis"]:
        mis = s["custom_tis_function_path"] == MIS
        weight, kept, tis_metrics = (_mis if mis else _tis)(t, s)
        per_token = per_token * weight
        numerator = m * kept if mis else m
        keep &= kept.bool()
        metrics["ois"] = _report(lc.exp().detach(), m)
        metrics.update({k: _report(v.detach(), m) for k, v in tis_metrics.items()})

    def sample_mean(x: torch.Tensor) -> torch.Tensor:
        return (_row_sum(x, numerator) / m.sum(-1, keepdim=True).clamp(min=1)).sum() / m.shape[0]

    pg_loss = sample_mean(per_token)
    loss = pg_loss
    if s["use_kl_loss"]:
        kl_loss = sample_mean(_kl(t, s, anchor))
        loss = loss + s["kl_loss_coef"] * kl_loss
        metrics["kl_loss"] = kl_loss.item()
    compare = t.logp.detach() if s["use_rollout_logprobs"] else t.logp_old
    metrics.update({"loss": loss.item(), "pg_loss": pg_loss.item(), "pg_clipfrac": _report(clipfrac, m, numerator),
                    "ppo_kl": _report(-lc.detach(), m, numerator),
                    "train_rollout_logprob_abs_diff": _report((compare - t.logp_rollout).abs(), m, numerator)})
    return Result(loss, keep, (weight * m).detach(), metrics)


ICEPOP = "slime.backends.megatron_utils.loss.icepop_function"
MIS = "examples.train_infer_mismatch_helper.mis.compute_mis_weights_with_cp"

DEFAULTS: dict[str, Any] = {
    "eps_clip": 0.2, "eps_clip_high": 0.2, "eps_clip_c": None, "use_rollout_logprobs": False, "use_opsm": False,
    "opsm_delta": 1e-4, "use_tis": False, "tis_clip": 2.0, "tis_clip_low": 0.0, "custom_tis_function_path": None,
    "advantage_estimator": "grpo", "use_kl_loss": False, "kl_loss_coef": 0.0, "kl_loss_type": "k1",
    "use_unbiased_kl": False,
}
"""slime/utils/arguments.py defaults (eps_clip_high None there means eps_clip, written out here)."""

MIS_YAML: dict[str, Any] = {
    "use_rs": True, "tis_level": "token", "rs_level": "token", "tis_mode": "truncate", "tis_lower_bound": 0.5,
    "tis_upper_bound": 2.0, "rs_lower_bound": None, "rs_upper_bound": None, "rs_veto_threshold": 1e-4,
    "tis_batch_normalize": True,
}
"""examples/train_infer_mismatch_helper/mis.yaml."""


MIS_MODES = {"truncate": "weight min(ρ, 2)", "clip": "weight clamp(ρ, 0.5, 2)",
             "mask": "weight ρ, masked outside [0.5, 2] (two-sided)"}
"""The MIS example's tis_mode values, in words (ρ the level's π_old/μ ratio)."""
KL_NAMES = {"k1": "mean log(π/π_ref)", "k2": "mean ½ log²(π/π_ref)", "k3": "mean k3(π_ref/π)",
            "low_var_kl": "mean clamp(k3, ±10)"}
"""--kl-loss-type values, in words."""


def _preset(name: str, summary: str, default: bool = False, where: str = "", **settings: Any) -> Preset:
    """A slime preset; `where` names the file that publishes its non-default flag values, if any."""
    source = f"{SOURCE}; values from {where}" if where else SOURCE
    return Preset(f"slime/{name}", "slime", source, summary, {**DEFAULTS, **settings}, policy_loss, default)


GSPO_SCRIPT = "scripts/run-qwen3-235B-A22B.sh"
MIS_SCRIPT = "examples/train_infer_mismatch_helper/run-qwen3-4b-mis.sh (--eps-clip-high 0.28) and mis.yaml"
CISPO_WARNING = "slime/utils/arguments.py (the CISPO warning's suggested setting)"
KL_SCRIPT = "examples/search-r1/run_qwen2.5_3B.sh (--kl-loss-coef 0.001 --kl-loss-type low_var_kl)"


PRESETS = (
    _preset("ppo", "PPO clip on π/π_old at ±0.2, no rollout correction; sequence token-means averaged", True),
    _preset("tis", "PPO clip · clamp(π_old/μ, 0, 2) per token (--use-tis)", use_tis=True),
    _preset("icepop", "PPO clip · π_old/μ where 0 ≤ π_old/μ ≤ 2, else 0 (icepop_function with the default "
            "--tis-clip-low 0, --tis-clip 2)", use_tis=True, custom_tis_function_path=ICEPOP),
    _preset("opsm", "PPO clip; sequences with A < 0 and mean(log π_old − log π) > 1e-4 dropped (--use-opsm)",
            use_opsm=True),
    _preset("opsm-rollout-logprobs", "PPO clip on π/μ; sequences with A < 0 and mean(log μ − log π) > 1e-4 "
            "dropped (--use-opsm --use-rollout-logprobs)", use_opsm=True, use_rollout_logprobs=True),
    _preset("dual-clip", "PPO clip with dual clip: −A·c capped at −3A where A < 0 (--eps-clip-c 3)",
            eps_clip_c=3.0),
    _preset("mis", "the MIS example (mis.yaml): PPO clip at [0.8, 1.28] · min(π_old/μ, 2) / batch mean; tokens "
            "with π_old/μ ∉ [0.5, 2] rejected, sequences with a token below 1e-4 vetoed", where=MIS_SCRIPT, use_tis=True,
            eps_clip_high=0.28, custom_tis_function_path=MIS, **MIS_YAML),
    _preset("mis-sequence-mask", "the MIS example at sequence level, mode mask: sequences with product ratio "
            "∉ [0.5, 2] rejected, kept ones weighted by it / batch mean; veto 1e-4", where=MIS_SCRIPT, use_tis=True,
            eps_clip_high=0.28, custom_tis_function_path=MIS,
            **{**MIS_YAML, "tis_level": "sequence", "rs_level": "sequence", "tis_mode": "mask"}),
    *(_preset(f"mis-{level}-{mode}", f"the MIS example with tis_level = rs_level = {level}, tis_mode {mode}: "
              f"{MIS_MODES[mode]}; tokens with ρ outside [0.5, 2] rejected, veto 1e-4; / batch mean",
              where=MIS_SCRIPT, use_tis=True, eps_clip_high=0.28, custom_tis_function_path=MIS,
              **{**MIS_YAML, "tis_level": level, "rs_level": level, "tis_mode": mode})
      for level, mode in (("token", "mask"), ("token", "clip"), ("geometric", "truncate"), ("geometric", "mask"))),
    _preset("gspo", "GSPO (--advantage-estimator gspo --eps-clip 4e-4): PPO clip at 1 ± 4e-4 on the sequence "
            "ratio exp(mean_t log π/π_old), every token of a sequence sharing it", where=GSPO_SCRIPT,
            advantage_estimator="gspo",
            eps_clip=4e-4, eps_clip_high=4e-4),
    _preset("cispo", "CISPO (--advantage-estimator cispo, default --eps-clip 0.2): −sg(clip(π/π_old, 0.8, 1.2))"
            "·A·log π", advantage_estimator="cispo"),
    _preset("cispo-eps-clip-1-eps-clip-high-4", "CISPO at the setting slime's warning names (--eps-clip 1.0 "
            "--eps-clip-high 4.0): −sg(min(π/π_old, 5))·A·log π", where=CISPO_WARNING, advantage_estimator="cispo",
            eps_clip=1.0,
            eps_clip_high=4.0),
    *(_preset(f"kl-loss-{kind}", f"PPO clip + 0.001·{KL_NAMES[kind]} (--use-kl-loss --kl-loss-coef 0.001 "
              f"--kl-loss-type {kind}), π_ref = π_old", where=KL_SCRIPT, use_kl_loss=True, kl_loss_coef=0.001,
              kl_loss_type=kind)
      for kind in KL_TYPES),
    _preset("kl-loss-low_var_kl-unbiased", "PPO clip + 0.001·clamp((π/π_old)·k3, ±10) (--use-kl-loss "
            "--kl-loss-coef 0.001 --kl-loss-type low_var_kl --use-unbiased-kl), π_ref = π_old", where=KL_SCRIPT,
            use_kl_loss=True,
            kl_loss_coef=0.001, kl_loss_type="low_var_kl", use_unbiased_kl=True),
)
