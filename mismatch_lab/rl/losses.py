"""Policy objectives, one entry point: `policy_loss(name, logp, logp_rollout, advantages, mask, ...) -> (loss, metrics)`.

Notation (docs/design.md): μ = rollout-engine probability of the sampled token (`logp_rollout`), π = trainer
probability of the same token (`logp`, the only input that carries a gradient), r = π/μ, A = advantage.
The trust region is measured against an *anchor* a: μ itself (`anchor='rollout'`, the default) or the
trainer's recomputed π_old (`anchor='old'`, the "decoupled" ablation); ρ = π/a (= r when a = μ).

Every objective is one instance of DPPO's unified policy gradient (arXiv 2602.04879v3, appendix
"Algorithmic details for stability analysis"):

    loss = −Σ_{b,t} M_bt · w_bt · A_bt / N          ∇loss = −Σ M · sg(w) · A · ∇log π / N

M ∈ {0, 1} keeps or masks a token, w is the (possibly clipped or truncated) importance weight, whose
value is computed detached and whose gradient flows through log π only (w · π/sg(π)), and N comes from
`cfg.aggregation`. With no clipping w = r, so the value is the surrogate −Σ M·r·A/N of DPPO Eq. 12.

    name            M = 0 when                                           w
    pg_is           never                                                r
    tis             never                                                min(r, tis_cap)
    cispo           never                                                clip(ρ, 1−ε_low^IS, 1+ε_high^IS) · a/μ
    grpo            (A>0 and ρ>1+eps_high) or (A<0 and ρ<1−eps_low)      r
    dppo_*          (A>0 and ρ>1 and D>δ) or (A<0 and ρ<1 and D>δ)       r
    (all)           w is finally truncated at `is_cap` (inf = off)

D is binary TV |π−a| (Eq. 13), binary KL KL(Bern(a) ‖ Bern(π)) (Eq. 14), or the top-K TV / KL over the
anchor's top-K tokens plus one 'other' bucket (Eqs. 15-16); see `TopK`. Equation numbers follow v3 of
arXiv 2602.04879. Metric names are documented in `METRICS` and docs/rl.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

OBJECTIVES = ("grpo", "cispo", "pg_is", "tis", "dppo_binary_tv", "dppo_binary_kl", "dppo_topk_tv", "dppo_topk_kl")
AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "constant")
ANCHORS = ("rollout", "old")
# DPPO reference defaults (arXiv 2602.04879v3, sanity-test appendix): δ_TV = 0.15, δ_KL = 0.05.
DEFAULT_DELTA = {"tv": 0.15, "kl": 0.05}
_TRUST_REGION = ("grpo", "cispo") + tuple(n for n in OBJECTIVES if n.startswith("dppo_"))

METRICS = {
    "loss/value": "the returned loss (−Σ M·w·A / N)",
    "tokens/valid/count": "response tokens (mask true)",
    "tokens/nonzero_adv/count": "response tokens with A ≠ 0",
    "mask/all/frac": "tokens masked (grpo, dppo_*) or whose weight was clipped (cispo) or truncated (tis), over response tokens",
    "mask/nonzero_adv/frac": "the same masked/clipped tokens with A ≠ 0, over tokens with A ≠ 0 (reference code: actor/pg_clipfrac)",
    "mask/negative_adv/frac": "masked/clipped tokens with A < 0, over tokens with A ≠ 0 (reference: actor/invalid_tr_negative_advantage)",
    "mask/positive_adv/frac": "masked/clipped tokens with A > 0, over tokens with A ≠ 0",
    "ratio/mean": "mean of r = π/μ over response tokens (always against μ, whatever the anchor)",
    "ratio/min": "min of r over response tokens",
    "ratio/max": "max of r over response tokens",
    "ratio/capped/frac": "response tokens whose weight hit `is_cap`, over response tokens",
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

    eps_low: float = 0.2
    """grpo: a token with A < 0 is clipped when ρ < 1 − eps_low."""
    eps_high: float = 0.2
    """grpo: a token with A > 0 is clipped when ρ > 1 + eps_high. 0.2 is GRPO; 0.28 is DAPO's Clip-Higher
    (arXiv 2503.14476), the 'GRPO-Clip-Higher' baseline of the DPPO paper."""
    delta: float | None = None
    """dppo_*: divergence threshold δ. None takes the paper default of the divergence: 0.15 for TV, 0.05 for KL."""
    is_cap: float = math.inf
    """Truncates every objective's importance weight w at this value; inf = off (the DPPO reference code's
    cap of 20 is effectively off too). Set 3 with grpo + anchor='old' for the paper's MiniRL-TIS."""
    tis_cap: float = 3.0
    """tis: w = min(r, tis_cap). 3 is the PG-TIS cap of the DPPO sanity test."""
    cispo_eps_low: float = 1.0
    """cispo: lower IS-weight bound 1 − cispo_eps_low. 1.0 (bound 0) means no lower bound, as MiniMax-M1 does."""
    cispo_eps_high: float = 2.0
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

    def delta_for(self, name: str) -> float:
        """δ used by DPPO objective `name`: `delta` when set, else the paper default of its divergence."""
        if self.delta is not None:
            return self.delta
        return DEFAULT_DELTA["kl" if name.endswith("_kl") else "tv"]


@dataclass
class TopK:
    """Per-token top-K log-probs for `dppo_topk_tv` / `dppo_topk_kl` (DPPO Eqs. 15-16).

    The K slots of token (b, t) are the rollout engine's top-K ids at that step with the sampled token
    included (K or K+1 ids; pad to a common width and mark padding with `valid`). Every token outside the
    slots falls into one 'other' bucket: p(other) = 1 − Σ_k p_k, for the anchor and for π alike.

        anchor_logps  [B, T, K]  log-probs of the anchor policy at those ids: μ from the rollout engine when
                                 cfg.anchor == 'rollout', π_old recomputed by the trainer when 'old'
        logps         [B, T, K]  log π of the current policy at the same ids (e.g. gathered from the same
                                 log-softmax as `logp`); detached inside, since the mask is a hard gate:
                                 no gradient ever flows through the divergence
        valid         [B, T, K]  bool, False on padding slots (their values are ignored); None = all valid
    A plain dict with these keys is accepted as well.
    """

    anchor_logps: torch.Tensor
    logps: torch.Tensor
    valid: torch.Tensor | None = None

    @classmethod
    def coerce(cls, obj: TopK | Mapping) -> TopK:
        if isinstance(obj, TopK):
            return obj
        if isinstance(obj, Mapping):
            unknown = set(obj) - {"anchor_logps", "logps", "valid"}
            if unknown or "anchor_logps" not in obj or "logps" not in obj:
                raise ValueError(f"topk dict needs keys 'anchor_logps', 'logps' (optional 'valid'); got {sorted(obj)}")
            return cls(obj["anchor_logps"], obj["logps"], obj.get("valid"))
        raise ValueError(f"topk must be a TopK or a dict with anchor_logps/logps/valid, not {type(obj).__name__}")


# ----------------------------------------------------------------------------------------------------
# divergences (on detached tensors, fp32 or wider; shapes [B, T] or [B, T, K] -> [B, T])


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 − exp(x)) for x <= 0, accurate at both ends (x → 0⁻ and x → −inf)."""
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def binary_tv(logp: torch.Tensor, logp_anchor: torch.Tensor) -> torch.Tensor:
    """Binary TV |π − a| of the sampled token (DPPO Eq. 13); [B, T] -> [B, T]."""
    return (logp.exp() - logp_anchor.exp()).abs()


def binary_kl(logp: torch.Tensor, logp_anchor: torch.Tensor) -> torch.Tensor:
    """KL(Bern(a) ‖ Bern(π)) = a log(a/π) + (1−a) log((1−a)/(1−π)) (DPPO Eq. 14), nats; 0·log 0 = 0.

    Log-probs a hair above 0 (engine rounding) are read as 0, where log(1 − p) would otherwise be nan."""
    logp, logp_anchor = logp.clamp(max=0), logp_anchor.clamp(max=0)
    a = logp_anchor.exp()
    head = a * (logp_anchor - logp)
    tail = (1 - a) * (_log1mexp(logp_anchor) - _log1mexp(logp))
    return head + torch.where(a < 1, tail, torch.zeros_like(tail))


def _topk_parts(topk: TopK):
    """(la, lq, p, q, p_other, q_other): slot log-probs and probabilities (0 on padding) of anchor and π,
    and the 'other' bucket's probability for each."""
    dt = torch.promote_types(topk.logps.dtype, torch.float32)
    la = topk.anchor_logps.detach().to(dt)
    lq = topk.logps.detach().to(dt)
    p, q = la.exp(), lq.exp()
    if topk.valid is not None:
        zero = torch.zeros((), dtype=dt, device=p.device)
        p, q = torch.where(topk.valid, p, zero), torch.where(topk.valid, q, zero)
    # clamp: rounding in the engines can push Σ_k p_k a hair above 1
    return la, lq, p, q, (1 - p.sum(-1)).clamp(min=0), (1 - q.sum(-1)).clamp(min=0)


def topk_tv(topk: TopK) -> torch.Tensor:
    """½ Σ_{a ∈ top-K ∪ {other}} |p_anchor(a) − p_π(a)| (DPPO Eq. 15); -> [B, T]."""
    _, _, p, q, po, qo = _topk_parts(topk)
    return 0.5 * ((q - p).abs().sum(-1) + (qo - po).abs())


def topk_kl(topk: TopK) -> torch.Tensor:
    """Σ_{a ∈ top-K ∪ {other}} p_anchor(a) log(p_anchor(a) / p_π(a)) (DPPO Eq. 16), nats; -> [B, T].

    Slots use the given log-probs directly (no exp/log round trip); 0 · log 0 = 0 for empty slots/buckets."""
    la, lq, p, _, po, qo = _topk_parts(topk)
    zero = torch.zeros((), dtype=p.dtype, device=p.device)
    slots = torch.where(p > 0, p * (la - lq), zero).sum(-1)
    other = torch.where(po > 0, po * (po.log() - qo.log()), zero)
    return slots + other


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
    if name not in OBJECTIVES:
        raise ValueError(f"unknown objective {name!r}; choose one of {', '.join(OBJECTIVES)}")
    if not isinstance(cfg, LossConfig):
        raise ValueError(f"cfg must be a LossConfig, not {type(cfg).__name__}")  # noqa: TRY004 - one error type for bad input
    adv = _check_inputs(logp, logp_rollout, advantages, mask)
    valid = mask
    n_valid = int(valid.sum())
    if n_valid == 0:
        raise ValueError("mask has no response tokens: every row is padding; drop empty batches before the loss")

    # compute in fp32 at least (bf16 log-probs are promoted); fp64 inputs stay fp64
    dt = torch.promote_types(logp.dtype, torch.float32)
    logp = logp.to(dt)
    lp = logp.detach()
    lmu = logp_rollout.detach().to(dt)
    uses_anchor = name in _TRUST_REGION
    if uses_anchor and cfg.anchor == "old":
        if logp_old is None:
            raise ValueError(f"cfg.anchor='old' needs logp_old (π_old recomputed by the trainer) for {name}; "
                             "pass logp_old or use anchor='rollout'")
        _check_same_shape("logp_old", logp_old, logp)
        la = logp_old.detach().to(dt)
    else:
        la = lmu

    zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
    adv = torch.where(valid, adv.detach().to(dt), zero)
    log_r = lp - lmu
    r = log_r.exp()
    rho = r if la is lmu else (lp - la).exp()
    pos, neg = adv > 0, adv < 0

    divergence = None
    if name == "pg_is":
        weight, flagged = r, torch.zeros_like(valid)
    elif name == "tis":
        weight, flagged = r.clamp(max=cfg.tis_cap), r > cfg.tis_cap
    elif name == "cispo":
        # CISPO (MiniMax-M1, arXiv 2506.13585): sg(clip(ρ, 1−ε_low^IS, 1+ε_high^IS)) · A · ∇log π; every token
        # keeps its gradient, only the weight is bounded. With anchor='old', a/μ corrects π_old back to μ.
        clipped = rho.clamp(min=1 - cfg.cispo_eps_low, max=1 + cfg.cispo_eps_high)
        weight = clipped if la is lmu else clipped * (la - lmu).exp()
        flagged = clipped != rho
    elif name == "grpo":
        # PPO clip (DPPO Eq. 10; ε_high > ε_low is DAPO's Clip-Higher). min(ρA, clip(ρ)A) has zero gradient
        # exactly where this mask is 0, so the masked surrogate has the same gradient as the clipped one.
        weight = r
        flagged = (pos & (rho > 1 + cfg.eps_high)) | (neg & (rho < 1 - cfg.eps_low))
    else:
        # DPPO (Eq. 12): mask only a token that leaves the trust region in its advantage's direction.
        divergence = _divergence(name, lp, la, topk, cfg)
        weight = r
        flagged = ((pos & (rho > 1)) | (neg & (rho < 1))) & (divergence > cfg.delta_for(name))

    capped = weight > cfg.is_cap
    weight = weight.clamp(max=cfg.is_cap)
    masks_tokens = name == "grpo" or name.startswith("dppo_")
    keep = valid & ~flagged if masks_tokens else valid
    # zero the weight off `keep` *before* it meets the graph: an inf/nan weight on a masked or padded
    # token must not leak a nan into the gradient (0 · inf)
    weight = torch.where(keep, weight, zero)
    w = weight * (logp - lp).exp()  # value = weight, d/dlogp = weight
    per_token = torch.where(keep, -w * adv, zero)
    loss = aggregate(per_token, valid, cfg, denominator=denominator)

    metrics = _metrics(loss, valid, adv, flagged, capped, lp, lmu, la, r, log_r, divergence)
    return loss, metrics


def _divergence(name: str, lp: torch.Tensor, la: torch.Tensor, topk, cfg: LossConfig) -> torch.Tensor:
    if name == "dppo_binary_tv":
        return binary_tv(lp, la)
    if name == "dppo_binary_kl":
        return binary_kl(lp, la)
    if topk is None:
        raise ValueError(f"{name} needs `topk` (TopK with anchor_logps and logps [B, T, K]); "
                         "request top-K log-probs from the rollout engine or use a dppo_binary_* objective")
    topk = TopK.coerce(topk)
    b, t = lp.shape
    for field in ("anchor_logps", "logps"):
        x = getattr(topk, field)
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or tuple(x.shape[:2]) != (b, t):
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"topk.{field} must be a tensor [B, T, K] with B, T = {b}, {t}; got {shape}")
    if topk.logps.shape != topk.anchor_logps.shape:
        raise ValueError(f"topk.logps {tuple(topk.logps.shape)} and topk.anchor_logps "
                         f"{tuple(topk.anchor_logps.shape)} must have the same shape")
    if topk.valid is not None and (topk.valid.dtype != torch.bool or topk.valid.shape != topk.logps.shape):
        raise ValueError("topk.valid must be a bool tensor shaped like topk.logps (or None)")
    if topk.logps.shape[-1] > cfg.topk + 1:
        raise ValueError(f"topk tensors hold {topk.logps.shape[-1]} slots but cfg.topk={cfg.topk} allows at most "
                         f"K+1 = {cfg.topk + 1} (top-K plus the sampled token); set LossConfig.topk to match the rollout")
    return topk_tv(topk) if name == "dppo_topk_tv" else topk_kl(topk)


def _metrics(loss, valid, adv, flagged, capped, lp, lmu, la, r, log_r, divergence) -> dict[str, float]:
    """All metrics in one stacked tensor and a single host transfer."""
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
