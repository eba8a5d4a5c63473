"""The policy loss, one entry point: `policy_loss(name, logp, logp_rollout, advantages, mask, ...) -> (loss, metrics)`.

Notation (docs/design.md): μ = rollout-engine probability of the sampled token (`logp_rollout`), π = trainer
probability of the same token (`logp`, the only input that carries a gradient), r = π/μ, A = advantage.
The trust region is measured against an *anchor* a: μ itself (`anchor='rollout'`, the default) or the
trainer's recomputed π_old (`anchor='old'`, the "decoupled" ablation); ρ = π/a (= r when a = μ).

Every pair (base objective, rollout correction) of the registry (mismatch_lab/corrections, docs/corrections.md)
is one instance of DPPO's unified policy gradient (arXiv 2602.04879v3, appendix "Algorithmic details for
stability analysis"):

    loss = −Σ_{b,t} M_bt · w_bt · A_bt / N          ∇loss = −Σ M · sg(w) · A · ∇log π / N

with M = M_objective · M_correction and w = w_objective · u / r_c: the correction replaces the rollout ratio
r_c = π_ref/μ the objective's weight carries by its corrected value u (π_ref = π_old when given, else π).
The weight's value is computed detached and its gradient flows through log π only (w · π/sg(π)); N comes
from `cfg.aggregation`; finally w is truncated at `is_cap` (inf = off). Metric names are in `METRICS`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from mismatch_lab.corrections import defaults as D
from mismatch_lab.corrections.batch import Batch, seq_any
from mismatch_lab.corrections.divergences import (  # noqa: F401 - re-exported
    TopK,
    binary_kl,
    binary_tv,
    topk_kl,
    topk_tv,
)
from mismatch_lab.corrections.registry import CORRECTIONS, Method, check_pair
from mismatch_lab.corrections.registry import OBJECTIVES as _OBJECTIVES
from mismatch_lab.corrections.rules import NEEDS_TOPK

OBJECTIVES = tuple(_OBJECTIVES)
"""Base objectives (registry order)."""
AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "constant")
ANCHORS = ("rollout", "old")

METRICS = {
    "loss/value": "the returned loss (−Σ M·w·A / N)",
    "tokens/valid/count": "response tokens (mask true)",
    "tokens/nonzero_adv/count": "response tokens with A ≠ 0",
    "mask/all/frac": "tokens the objective masked (grpo, gspo, gmpo, dppo_*) or whose weight it clipped (cispo) or truncated (tis), over response tokens",
    "mask/nonzero_adv/frac": "the same masked/clipped tokens with A ≠ 0, over tokens with A ≠ 0 (reference code: actor/pg_clipfrac)",
    "mask/negative_adv/frac": "masked/clipped tokens with A < 0, over tokens with A ≠ 0 (reference: actor/invalid_tr_negative_advantage)",
    "mask/positive_adv/frac": "masked/clipped tokens with A > 0, over tokens with A ≠ 0",
    "correction/masked/frac": "response tokens the rollout correction dropped, over response tokens",
    "correction/seqs_masked/frac": "sequences the rollout correction dropped whole, over sequences with a response token",
    "correction/modified/frac": "tokens the correction kept with a changed weight (u ≠ r_c), over response tokens "
                                "(seq_tis: every token of a sequence of > 1 token, its weight being the sequence's)",
    "correction/truncated/frac": "tokens whose weight the correction truncated at its cap (token_tis: r_c > C; "
                                 "seq_tis: tokens of sequences whose product ratio exceeds C), over response tokens",
    "correction/ess": "effective sample size of the correction's weights u over the tokens it keeps: (Σu)² / (n Σu²)",
    "weight/ess": "effective sample size of the final weights w over the tokens kept by objective and correction",
    "ratio/mean": "mean of r = π/μ over response tokens (always against μ, whatever the anchor)",
    "ratio/min": "min of r over response tokens",
    "ratio/max": "max of r over response tokens",
    "ratio/capped/frac": "kept tokens whose weight hit `is_cap`, over response tokens",
    "mismatch/abs_dp/mean": "mean |π − μ| (probability space) over response tokens",
    "mismatch/abs_dp/max": "max |π − μ| over response tokens",
    "mismatch/abs_dlogp/mean": "mean |log π − log μ| over response tokens",
    "mismatch/abs_dlogp/max": "max |log π − log μ| over response tokens",
    "mismatch/kl_k3/mean": "mean of k3 = r − log r − 1 (r = π/μ; estimates KL(μ‖π) from μ's samples) over response tokens",
    "trust_region/divergence/mean": "dppo_* only: mean of the divergence D(anchor ‖ π) used by the mask, over response tokens",
    "trust_region/divergence/max": "dppo_* only: max of D over response tokens",
    "nonfinite/tokens/count": "response tokens whose logp, logp_rollout, anchor or advantage is nan/inf (never zeroed)",
}


@dataclass
class LossConfig:
    """Hyper-parameters of every objective; one instance per run (stored in runs.config)."""

    eps_low: float = D.GRPO_EPS_LOW
    """grpo: a token with A < 0 is clipped when ρ < 1 − eps_low."""
    eps_high: float = D.GRPO_EPS_HIGH
    """grpo: a token with A > 0 is clipped when ρ > 1 + eps_high. 0.2 is GRPO; 0.28 is DAPO's Clip-Higher
    (arXiv 2503.14476), the 'GRPO-Clip-Higher' baseline of the DPPO paper."""
    delta: float | None = None
    """dppo_*: divergence threshold δ. None takes the paper default of the divergence: 0.15 for TV, 0.05 for KL."""
    is_cap: float = math.inf
    """Truncates every objective's importance weight w at this value; inf = off (the DPPO reference code's
    cap of 20 is effectively off too). Set 3 with grpo + anchor='old' for the paper's MiniRL-TIS."""
    tis_cap: float = D.TIS_OBJECTIVE_CAP
    """tis: w = min(r, tis_cap). 3 is the PG-TIS cap of the DPPO sanity test."""
    cispo_eps_low: float = D.CISPO_EPS_LOW
    """cispo: lower IS-weight bound 1 − cispo_eps_low. 1.0 (bound 0) means no lower bound, as MiniMax-M1 does."""
    cispo_eps_high: float = D.CISPO_EPS_HIGH
    """cispo: upper IS-weight bound 1 + cispo_eps_high. 2.0 (cap 3) matches the DPPO sanity test's CISPO."""
    aggregation: str = "token-mean"
    """How the token terms become one number (the divisor N): 'token-mean' (N = response tokens in the batch,
    DAPO), 'seq-mean-token-sum' (N = sequences), 'seq-mean-token-mean' (each sequence's mean, then the mean
    over sequences: original GRPO), 'constant' (N = B · constant_norm: Dr. GRPO, arXiv 2503.20783)."""
    constant_norm: float | None = None
    """aggregation='constant' only: the per-sequence constant, e.g. the max response tokens of the run."""
    anchor: str = "rollout"
    """What the trust region (grpo, cispo, dppo_*) is measured against: 'rollout' (μ, what the DPPO paper shows
    is needed) or 'old' (π_old, the trainer's recomputed log-probs, passed as `logp_old`: the decoupled ablation)."""
    topk: int = 20
    """dppo_topk_*: K, the number of anchor top-K tokens requested from the rollout engine (vLLM caps it at 20)."""
    gspo_eps_low: float = D.GSPO_EPS_LOW
    """gspo: a sequence with A < 0 is masked when s = exp(mean log ρ) < 1 − gspo_eps_low."""
    gspo_eps_high: float = D.GSPO_EPS_HIGH
    """gspo: a sequence with A > 0 is masked when s > 1 + gspo_eps_high."""
    gmpo_eps: float = D.GMPO_EPS
    """gmpo: per-token log ρ clipped at ±gmpo_eps in the advantage's direction."""
    correction: str = "none"
    """The rollout correction applied on top of the objective (mismatch_lab.corrections.registry.CORRECTIONS)."""
    correction_args: Mapping[str, float] = field(default_factory=dict)
    """Overrides of the correction's published thresholds by parameter name, e.g. {'cap': 3.0}."""

    def __post_init__(self) -> None:
        def bad(msg: str) -> ValueError:
            return ValueError(f"LossConfig: {msg}")

        if not 0 < self.eps_low < 1:
            raise bad(f"eps_low={self.eps_low} must be in (0, 1): the lower clip bound is 1 − eps_low (GRPO uses 0.2)")
        if not self.eps_high > 0:
            raise bad(f"eps_high={self.eps_high} must be > 0 (0.2 for GRPO, 0.28 for Clip-Higher)")
        if self.delta is not None and not self.delta > 0:
            raise bad(f"delta={self.delta} must be > 0, or None for the defaults (TV 0.15, KL 0.05)")
        if not self.is_cap >= 1:
            raise bad(f"is_cap={self.is_cap} must be >= 1 (use inf to switch truncation off)")
        if not self.tis_cap >= 1:
            raise bad(f"tis_cap={self.tis_cap} must be >= 1 (the DPPO sanity test used 3)")
        if not 0 <= self.cispo_eps_low <= 1:
            raise bad(f"cispo_eps_low={self.cispo_eps_low} must be in [0, 1] (1 = no lower bound, as in MiniMax-M1)")
        if not self.cispo_eps_high >= 0:
            raise bad(f"cispo_eps_high={self.cispo_eps_high} must be >= 0 (the weight cap is 1 + cispo_eps_high)")
        if self.aggregation not in AGGREGATIONS:
            raise bad(f"aggregation={self.aggregation!r} is not one of {', '.join(AGGREGATIONS)}")
        if self.aggregation == "constant":
            if self.constant_norm is None or not self.constant_norm > 0:
                raise bad("aggregation='constant' needs constant_norm > 0, e.g. the run's max response tokens")
        elif self.constant_norm is not None:
            raise bad(f"constant_norm is only used with aggregation='constant' (got aggregation={self.aggregation!r}); "
                      "drop constant_norm or set aggregation='constant'")
        if self.anchor not in ANCHORS:
            raise bad(f"anchor={self.anchor!r} is not one of {', '.join(ANCHORS)}")
        if isinstance(self.topk, bool) or not isinstance(self.topk, int) or self.topk < 1:
            raise bad(f"topk={self.topk!r} must be a positive int (the DPPO paper uses 20)")
        for name in ("gspo_eps_low", "gspo_eps_high", "gmpo_eps"):
            if not getattr(self, name) > 0:
                raise bad(f"{name}={getattr(self, name)} must be > 0")
        if not self.gspo_eps_low < 1:
            raise bad(f"gspo_eps_low={self.gspo_eps_low} must be < 1 (the lower bound is 1 − gspo_eps_low; GSPO uses 3e-4)")
        if self.correction not in CORRECTIONS:
            raise bad(f"correction={self.correction!r} is not one of {', '.join(CORRECTIONS)}")
        try:
            CORRECTIONS[self.correction].resolve(self.correction_args)
        except ValueError as exc:
            raise bad(str(exc)) from None

    def objective_params(self, method: Method) -> dict[str, float]:
        """The objective's parameters: this config's value of each (its field of the same name), the
        method's published default where the field is None (δ: 0.15 for TV, 0.05 for KL)."""
        return {k: default if getattr(self, k) is None else float(getattr(self, k)) for k, default in method.params.items()}

    def delta_for(self, name: str) -> float:
        """δ used by DPPO objective `name`: `delta` when set, else the paper default of its divergence."""
        return self.objective_params(_OBJECTIVES[name])["delta"]


# ----------------------------------------------------------------------------------------------------
# aggregation


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, cfg: LossConfig, *, denominator: float | None = None) -> torch.Tensor:
    """Reduce per-token terms [B, T] (already zero off the mask) to a scalar according to cfg.aggregation.

    token-mean          Σ_bt x / Σ_bt mask                      (every response token weighs the same)
    seq-mean-token-sum  Σ_bt x / #sequences with a response token
    seq-mean-token-mean Σ_b (Σ_t x / L_b) / #sequences           (L_b = response tokens of sequence b)
    constant            Σ_bt x / (B · constant_norm)            (Dr. GRPO: no length normalisation)
    `denominator` replaces the divisor (the token, sequence or B·constant count) when one batch is split
    into micro-batches and the divisor must be the whole batch's.
    """
    if cfg.aggregation == "seq-mean-token-mean":
        lengths = mask.sum(-1)
        num = (per_token.sum(-1) / lengths.clamp(min=1)).sum()
        den = (lengths > 0).sum()
    else:
        num = per_token.sum()
        if cfg.aggregation == "token-mean":
            den = mask.sum()
        elif cfg.aggregation == "seq-mean-token-sum":
            den = mask.any(-1).sum()
        else:
            den = mask.shape[0] * cfg.constant_norm
    if denominator is not None:
        if not denominator > 0:
            raise ValueError(f"denominator={denominator} must be > 0 (the whole batch's token/sequence count)")
        den = denominator
    return num / den


# ----------------------------------------------------------------------------------------------------
# the entry point


def policy_loss(
    name: str,
    logp: torch.Tensor,
    logp_rollout: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    cfg: LossConfig,
    topk: TopK | Mapping | None = None,
    logp_old: torch.Tensor | None = None,
    denominator: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss of objective `name` and its metrics (see the module docstring for the table of objectives).

    name          one of OBJECTIVES
    logp          [B, T] log π of the sampled tokens under the trainer; the gradient flows through it only
    logp_rollout  [B, T] log μ of the same tokens as reported by the rollout engine (detached inside)
    advantages    [B, T] or [B] (one advantage per sequence, broadcast over its tokens)
    mask          [B, T] bool, True on response tokens; values elsewhere are ignored
    cfg           LossConfig
    topk          TopK (or dict) for dppo_topk_*; ignored otherwise
    logp_old      [B, T] log π_old recomputed by the trainer before the update; needed when cfg.anchor == 'old'
                  for grpo, cispo and dppo_* (pg_is and tis have no trust region and ignore the anchor)
    denominator   optional divisor N for micro-batching (see `aggregate`)
    Returns (loss scalar tensor, metrics dict of floats named as in METRICS). The metrics describe π as
    passed in, i.e. before the optimiser step.
    """
    objective = _objective(name)
    if not isinstance(cfg, LossConfig):
        raise ValueError(f"cfg must be a LossConfig, not {type(cfg).__name__}")  # noqa: TRY004 - one error type for bad input
    adv = _check_inputs(logp, logp_rollout, advantages, mask)
    if not bool(mask.any()):
        raise ValueError("mask has no response tokens: every row is padding; drop empty batches before the loss")
    # compute in fp32 at least (bf16 log-probs are promoted); fp64 inputs stay fp64
    dt = torch.promote_types(logp.dtype, torch.float32)
    logp = logp.to(dt)
    b = _batch(objective, logp.detach(), logp_rollout, adv, mask, cfg, topk, logp_old)
    correction = CORRECTIONS[cfg.correction]
    check_pair(objective, correction)
    obj = objective.rule(b, cfg.objective_params(objective))
    cor = correction.rule(b, correction.resolve(cfg.correction_args))
    zero = torch.zeros((), dtype=dt, device=logp.device)
    weight = _combined_weight(b, obj, cor, correction.reweights)
    keep = obj.keep & cor.keep
    capped = keep & (weight > cfg.is_cap)
    weight = weight.clamp(max=cfg.is_cap)
    # zero the weight off `keep` *before* it meets the graph: an inf/nan weight on a masked or padded
    # token must not leak a nan into the gradient (0 · inf)
    weight = torch.where(keep, weight, zero)
    # value = weight, d/dlogp = weight; the exponent is 0 off `keep` so that a non-finite log π on a padded or
    # masked cell cannot put exp(nan) · 0 = nan into the gradient
    w = weight * torch.where(keep, logp - b.lp, zero).exp()
    per_token = torch.where(keep, -w * b.adv, zero)
    loss = aggregate(per_token, mask, cfg, denominator=denominator)
    metrics = _metrics(loss, b, obj.flagged, capped, obj.divergence) | _correction_metrics(b, cor, keep, weight)
    return loss, metrics


def _combined_weight(b: Batch, obj, cor, reweights: bool) -> torch.Tensor:
    """w = w_obj · u / r_c: the correction replaces the rollout ratio r_c the objective's weight carries by u.
    A masking correction keeps u = r_c, so w = w_obj exactly. A reweighting one (token-level objectives only,
    registry.check_pair) is applied as w = (w_obj / r) · (π / π_ref) · u, finite where r = π/μ overflows
    (w_obj / r is exactly 1 where the objective's weight is r itself)."""
    if not reweights:
        return obj.weight
    own = torch.where(obj.weight == b.r, 1.0, obj.weight / b.r)
    return own * cor.weight if b.lref is b.lp else own * (b.lp - b.lref).exp() * cor.weight


def _objective(name: str) -> Method:
    if name not in _OBJECTIVES:
        raise ValueError(f"unknown objective {name!r}; choose one of {', '.join(OBJECTIVES)}")
    return _OBJECTIVES[name]


def _batch(objective: Method, lp, logp_rollout, adv, mask, cfg: LossConfig, topk, logp_old) -> Batch:
    """The rules' inputs: detached, in lp's dtype; the anchor a is π_old for anchored objectives with
    cfg.anchor == 'old', else μ; π_ref (rollout corrections) is π_old when given, else π."""
    lmu = logp_rollout.detach().to(lp.dtype)
    old = None
    if logp_old is not None:
        _check_same_shape("logp_old", logp_old, lp)
        old = logp_old.detach().to(lp.dtype)
    la = lmu
    if objective.anchored and cfg.anchor == "old":
        if old is None:
            raise ValueError(f"cfg.anchor='old' needs logp_old (π_old recomputed by the trainer) for {objective.name}; "
                             "pass logp_old or use anchor='rollout'")
        la = old
    if "topk" in objective.needs:
        topk = _check_topk(objective.name, topk, lp.shape, cfg)
    adv = torch.where(mask, adv.detach().to(lp.dtype), torch.zeros((), dtype=lp.dtype, device=lp.device))
    return Batch(lp=lp, lmu=lmu, la=la, lref=lp if old is None else old, mask=mask, adv=adv, topk=topk)


def _check_topk(name: str, topk, shape, cfg: LossConfig) -> TopK:
    if topk is None:
        raise ValueError(f"{name} {NEEDS_TOPK}")
    topk = TopK.coerce(topk)
    b, t = shape
    for name_, x in (("anchor_logps", topk.anchor_logps), ("logps", topk.logps)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or tuple(x.shape[:2]) != (b, t):
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"topk.{name_} must be a tensor [B, T, K] with B, T = {b}, {t}; got {got}")
    if topk.logps.shape != topk.anchor_logps.shape:
        raise ValueError(f"topk.logps {tuple(topk.logps.shape)} and topk.anchor_logps "
                         f"{tuple(topk.anchor_logps.shape)} must have the same shape")
    if topk.valid is not None and (topk.valid.dtype != torch.bool or topk.valid.shape != topk.logps.shape):
        raise ValueError("topk.valid must be a bool tensor shaped like topk.logps (or None)")
    if topk.logps.shape[-1] > cfg.topk + 1:
        raise ValueError(f"topk tensors hold {topk.logps.shape[-1]} slots but cfg.topk={cfg.topk} allows at most "
                         f"K+1 = {cfg.topk + 1} (top-K plus the sampled token); set LossConfig.topk to match the rollout")
    return topk


def _ess(w: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Effective sample size (Σw)² / (n Σw²) of the weights w [B, T] over the tokens `keep` holds (n of
    them); 1 when every weight is equal, 0 when nothing is kept."""
    wk = torch.where(keep, w, torch.zeros((), dtype=w.dtype, device=w.device))
    return wk.sum() ** 2 / (keep.sum() * (wk * wk).sum()).clamp(min=torch.finfo(w.dtype).tiny)


def _correction_metrics(b: Batch, cor, keep: torch.Tensor, weight: torch.Tensor) -> dict[str, float]:
    """The rollout correction's shares and effective sample sizes (METRICS 'correction/*', 'weight/ess')."""
    n = b.mask.sum()
    seqs = b.mask.any(-1)
    dropped_seq = seqs & ~seq_any(cor.keep, b.mask)
    values = {
        "correction/masked/frac": (b.mask & ~cor.keep).sum() / n,
        "correction/seqs_masked/frac": dropped_seq.sum() / seqs.sum(),
        "correction/modified/frac": (cor.keep & (cor.weight != b.rc) & ~b.rc.isnan()).sum() / n,
        "correction/truncated/frac": (cor.keep & cor.flagged & (cor.weight != b.rc)).sum() / n,
        "correction/ess": _ess(cor.weight, cor.keep),
        "weight/ess": _ess(weight, keep),
    }
    return dict(zip(values, torch.stack([v.to(torch.float64) for v in values.values()]).tolist()))


def _metrics(loss, b: Batch, flagged, capped, divergence) -> dict[str, float]:
    """All metrics in one stacked tensor and a single host transfer."""
    valid, adv, lp, lmu, la, r, log_r = b.mask, b.adv, b.lp, b.lmu, b.la, b.r, b.log_r
    f = valid.float()
    n = f.sum()
    nz = valid & (adv != 0)
    n_nz = nz.float().sum()
    flag = (flagged & valid).float()
    nzd = n_nz.clamp(min=1)  # an empty denominator gives 0.0 (the count metrics say it was empty)
    neg_inf = torch.tensor(-math.inf, dtype=lp.dtype, device=lp.device)
    pos_inf = torch.tensor(math.inf, dtype=lp.dtype, device=lp.device)

    def mean(x):
        return torch.where(valid, x, 0).sum() / n

    def vmax(x):
        return torch.where(valid, x, neg_inf).max()

    abs_dp = (lp.exp() - lmu.exp()).abs()
    abs_dlogp = log_r.abs()
    nonfinite = valid & ~(torch.isfinite(lp) & torch.isfinite(lmu) & torch.isfinite(la) & torch.isfinite(adv))
    names = ["loss/value", "tokens/valid/count", "tokens/nonzero_adv/count", "mask/all/frac",
             "mask/nonzero_adv/frac", "mask/negative_adv/frac", "mask/positive_adv/frac",
             "ratio/mean", "ratio/min", "ratio/max", "ratio/capped/frac",
             "mismatch/abs_dp/mean", "mismatch/abs_dp/max", "mismatch/abs_dlogp/mean", "mismatch/abs_dlogp/max",
             "mismatch/kl_k3/mean", "nonfinite/tokens/count"]
    values = [loss.detach().float(), n, n_nz, flag.sum() / n,
              (flag * nz).sum() / nzd, (flag * (adv < 0)).sum() / nzd, (flag * (adv > 0)).sum() / nzd,
              mean(r), torch.where(valid, r, pos_inf).min(), vmax(r), (capped & valid).float().sum() / n,
              mean(abs_dp), vmax(abs_dp), mean(abs_dlogp), vmax(abs_dlogp),
              mean(r - log_r - 1), nonfinite.float().sum()]
    if divergence is not None:
        names += ["trust_region/divergence/mean", "trust_region/divergence/max"]
        values += [mean(divergence), vmax(divergence)]
    assert set(names) <= set(METRICS), "every metric must be documented in METRICS"
    return dict(zip(names, torch.stack([v.reshape(()).to(torch.float64) for v in values]).tolist()))


def _check_same_shape(label: str, x, ref: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or x.shape != ref.shape:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{label} must be a tensor shaped like logp {tuple(ref.shape)}; got {shape}")


def _check_inputs(logp, logp_rollout, advantages, mask) -> torch.Tensor:
    """Validate shapes and dtypes; return advantages as [B, T]."""
    if not isinstance(logp, torch.Tensor) or logp.dim() != 2:
        raise ValueError(f"logp must be a [B, T] tensor of log-probs; got "
                         f"{tuple(logp.shape) if isinstance(logp, torch.Tensor) else type(logp).__name__}")
    if not logp.is_floating_point():
        raise ValueError(f"logp must be floating point, not {logp.dtype}")
    _check_same_shape("logp_rollout", logp_rollout, logp)
    _check_same_shape("mask", mask, logp)
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor (True on response tokens), not {mask.dtype}; pass mask.bool()")
    if not isinstance(advantages, torch.Tensor):
        raise ValueError(f"advantages must be a tensor [B] or [B, T], not {type(advantages).__name__}")  # noqa: TRY004
    if advantages.shape == logp.shape:
        return advantages
    if advantages.dim() == 1 and advantages.shape[0] == logp.shape[0]:
        return advantages[:, None].expand_as(logp)
    raise ValueError(f"advantages must be [B] or [B, T] with B, T = {tuple(logp.shape)}; got {tuple(advantages.shape)}")


def bad_update_metrics(
    logp_after: torch.Tensor,
    logp_before: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    delta: float = 0.5,
) -> dict[str, float]:
    """Share of 'bad updates' (DPPO arXiv 2602.04879v3, "Identifying the source of instability"): tokens with
    A < 0 whose probability fell by at least δ, before − after ≥ δ in probability space.

    logp_after   [B, T] log π after the optimiser step (re-scored on the same tokens)
    logp_before  [B, T] the reference: log μ (logp_rollout) for the paper's definition, or log π before the step
    advantages   [B, T] or [B];  mask [B, T] bool;  delta: the paper plots δ = 0.5
    Returns bad_update/negative_adv/frac (over tokens with A < 0), bad_update/all/frac (over response tokens)
    and bad_update/all/count.
    """
    if not delta > 0:
        raise ValueError(f"delta={delta} must be > 0 (the DPPO paper uses 0.5)")
    adv = _check_inputs(logp_after, logp_before, advantages, mask)
    drop = logp_before.detach().float().exp() - logp_after.detach().float().exp()
    neg = mask & (adv < 0)
    bad = neg & (drop >= delta)
    n_bad = bad.sum().to(torch.float64)
    out = torch.stack([n_bad / neg.sum().clamp(min=1), n_bad / mask.sum().clamp(min=1), n_bad])
    return dict(zip(["bad_update/negative_adv/frac", "bad_update/all/frac", "bad_update/all/count"], out.tolist()))
