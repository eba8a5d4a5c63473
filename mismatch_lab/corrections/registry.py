"""The registry: every base objective and every rollout correction, declared once with its rule, published
defaults, source and the framework option it corresponds to. The train command's choices and help, the
loss (rl/losses.py) and the side-by-side comparison (`mismatch-lab corrections`) all read it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from mismatch_lab.corrections import defaults as D
from mismatch_lab.corrections import rules


@dataclass(frozen=True)
class Method:
    """One declared rule.

    axis       'objective' (the trust region and weight of the policy gradient) or 'correction' (applied on top)
    level      'token' or 'sequence': whether the rule masks or weights tokens one by one or whole sequences
    params     published defaults, by parameter name (overridable)
    rule       rules.<name>(Batch, params) -> Decision
    summary    M and w in one line;  source: where the rule and its defaults come from
    framework  the option of a framework this equals, or '' when none
    sign       whether the rule reads the advantage's sign;  needs: extra inputs ('topk')
    anchored   objectives: whether the trust region is measured against the anchor (False: pg_is, tis)
    reweights  corrections: whether u may differ from r_c (truncations); the others only drop tokens
    below_one  parameters that must stay below 1 (a lower bound 1 − ε must stay positive)
    """

    name: str
    axis: str
    level: str
    params: Mapping[str, float]
    rule: Callable
    summary: str
    source: str
    framework: str = ""
    sign: bool = False
    needs: tuple[str, ...] = field(default=())
    anchored: bool = True
    reweights: bool = False
    below_one: tuple[str, ...] = field(default=())

    def resolve(self, overrides: Mapping[str, float] | None = None, label: str | None = None) -> dict[str, float]:
        """The method's parameters: its defaults, then `overrides` (unknown names are an error). `label`:
        the name errors use (a variant such as grpo_clip_higher; default the method's)."""
        name = label or self.name
        out = dict(self.params)
        for key, value in (overrides or {}).items():
            if key not in out:
                known = ", ".join(out) or "none"
                raise ValueError(f"{name} has no parameter {key!r} (its parameters: {known})")
            if not float(value) > 0:
                raise ValueError(f"{name}.{key}={value} must be > 0")
            if key in self.below_one and not float(value) < 1:
                raise ValueError(f"{name}.{key}={value} must be below 1 (the lower bound is 1 − {key})")
            out[key] = float(value)
        for lo, hi in (("low", "high"),):
            if lo in out and hi in out and not out[lo] < out[hi]:
                raise ValueError(f"{name}: low={out[lo]} must be below high={out[hi]}")
        return out


def _objectives() -> list[Method]:
    dppo = "DPPO (arXiv 2602.04879) Eq. 12, anchored on μ; δ from its reference code"
    return [
        Method("pg_is", "objective", "token", {}, rules.pg_is, "M = 1; w = r",
               "importance-sampled policy gradient (DPPO's PG-IS baseline)", anchored=False),
        Method("grpo", "objective", "token", {"eps_low": D.GRPO_EPS_LOW, "eps_high": D.GRPO_EPS_HIGH}, rules.grpo,
               "M = 0 where (A>0, ρ>1+ε_high) or (A<0, ρ<1−ε_low); w = r",
               "PPO/GRPO ratio clip (DPPO Eq. 10); ε_high 0.28 is DAPO's Clip-Higher (arXiv 2503.14476)",
               "verl: clip_ratio_low/high 0.2 (0.28 Clip-Higher) on π/π_old, but verl's default also caps the loss of "
               "A < 0 tokens at −3·A (clip_ratio_c 3: no gradient where ρ > 3) and clamps log ρ to ±20, which this rule "
               "does not (preset verl/default); TRL: epsilon / epsilon_high and slime: --eps-clip / "
               "--eps-clip-high are these ε on π/π_old, but TRL always multiplies its vLLM IS ratio in (default: the "
               "sequence product π_old/μ, sequences above 3 dropped) and slime weights by π_old/μ only with --use-tis "
               "(presets trl/*, slime/*)",
               sign=True, below_one=("eps_low",)),
        Method("cispo", "objective", "token", {"cispo_eps_low": D.CISPO_EPS_LOW, "cispo_eps_high": D.CISPO_EPS_HIGH},
               rules.cispo, "M = 1; w = clip(ρ, 1−ε_low, 1+ε_high) · a/μ",
               "CISPO, MiniMax-M1 (arXiv 2506.13585); cap 3 as in the DPPO sanity test",
               "TRL: loss_type=cispo with epsilon_high=3.0 caps π/π_old at 3 like this rule, but multiplies by its vLLM "
               "IS ratio (default: the sequence product π_old/μ, sequences above 3 dropped) where this rule multiplies "
               "by a/μ untruncated; TRL recommends epsilon_high 5 (preset trl/cispo-*)"),
        Method("gspo", "objective", "sequence", {"gspo_eps_low": D.GSPO_EPS_LOW, "gspo_eps_high": D.GSPO_EPS_HIGH},
               rules.gspo, "sequence masked where s = exp(mean log ρ) leaves [1−ε_low, 1+ε_high] in A's direction; "
               "w = exp(mean log r)", "GSPO (arXiv 2507.18071), its clip ranges 3e-4 / 4e-4",
               "verl: policy_loss.loss_mode=gspo; TRL: importance_sampling_level=sequence (epsilon 3e-4, epsilon_high "
               "4e-4) masks the same sequences but weights them by s times its vLLM IS ratio (π_old/μ per token, or "
               "the sequence's product), not by the geometric mean of π_old/μ (presets trl/gspo-*)", sign=True,
               below_one=("gspo_eps_low",)),
        Method("gmpo", "objective", "sequence", {"gmpo_eps": D.GMPO_EPS}, rules.gmpo,
               "M = 0 where log ρ leaves ±ε in A's direction; w = exp(mean of the clipped log ρ)",
               "GMPO (arXiv 2507.20673), clip ±0.4 in log space", "verl: policy_loss.loss_mode=geo_mean", sign=True),
        Method("dppo_binary_tv", "objective", "token", {"delta": D.DPPO_DELTA_TV}, rules.dppo_binary_tv,
               "M = 0 where A's direction and |π − a| > δ; w = r", dppo + ", D = binary TV (Eq. 13)",
               "prime-rl's default loss masks like this rule with a = μ at δ 0.2, but also masks A = 0 tokens with "
               "π − μ < −0.2 and adds 1e-3·(log π/μ)² on every token: not equal (preset prime-rl/default)", sign=True),
        Method("dppo_binary_kl", "objective", "token", {"delta": D.DPPO_DELTA_KL}, rules.dppo_binary_kl,
               "M = 0 where A's direction and KL(Bern(a) ‖ Bern(π)) > δ; w = r", dppo + ", D = binary KL (Eq. 14)",
               sign=True),
        Method("dppo_topk_tv", "objective", "token", {"delta": D.DPPO_DELTA_TV}, rules.dppo_topk_tv,
               "M = 0 where A's direction and top-K TV > δ; w = r", dppo + ", D = top-K TV (Eq. 15)",
               sign=True, needs=("topk",)),
        Method("dppo_topk_kl", "objective", "token", {"delta": D.DPPO_DELTA_KL}, rules.dppo_topk_kl,
               "M = 0 where A's direction and top-K KL > δ; w = r", dppo + ", D = top-K KL (Eq. 16)",
               sign=True, needs=("topk",)),
        Method("tis", "objective", "token", {"tis_cap": D.TIS_OBJECTIVE_CAP}, rules.tis, "M = 1; w = min(r, C)",
               "PG-TIS of the DPPO sanity test (C = 3); the same as pg_is with correction token_tis at cap 3, "
               "kept so stored runs keep their name", anchored=False),
    ]


def _corrections() -> list[Method]:
    return [
        Method("none", "correction", "token", {}, rules.none, "u = r_c", "no rollout correction"),
        Method("token_tis", "correction", "token", {"cap": D.TIS_CAP}, rules.token_tis, "u = min(r_c, C)",
               "truncated IS per token; C = 2 in verl/slime/miles, 3 in TRL",
               "verl: rollout_is=token, rollout_is_threshold=2.0 (log r_c clamped to ±20 first; preset "
               "verl/decoupled_token_is); TRL: vllm_importance_sampling_mode=token_truncate "
               "at C = 3 (its vllm_importance_sampling_clip_max; this rule's default is 2), r_c = π_old/μ; slime: "
               "--use-tis (clamp to [--tis-clip-low 0, --tis-clip 2])", reweights=True),
        Method("seq_tis", "correction", "sequence", {"cap": D.TIS_CAP}, rules.seq_tis,
               "u = min(exp(Σ log r_c), C) on every token", "truncated IS on the sequence's product ratio",
               "verl: rollout_is=sequence, rollout_is_threshold=2.0 (Σ log r_c clamped to ±20 first; preset "
               "verl/decoupled_seq_is); TRL: vllm_importance_sampling_mode=sequence_truncate "
               "at C = 3 (this rule's default is 2)",
               reweights=True),
        Method("token_mis", "correction", "token", {"cap": D.MIS_CAP}, rules.token_mis, "M = 0 where r_c > C",
               "masked IS per token", "TRL: vllm_importance_sampling_mode=token_mask, vllm_importance_sampling_clip_max=3.0"),
        Method("icepop", "correction", "token", {"low": D.ICEPOP_LOW, "high": D.ICEPOP_HIGH}, rules.icepop,
               "M = 0 where r_c ∉ [low, high]", "IcePop", "verl: rollout_is=token with rollout_is_threshold 0.5_5.0 zeroes the IS weight outside the band and keeps "
               "those tokens in the token-mean's denominator (preset verl/decoupled_token_icepop); slime's "
               "icepop_function keeps π_old/μ in [--tis-clip-low, --tis-clip] = [0, 2] by default: equal to this rule "
               "only with --tis-clip-low 0.5 --tis-clip 5 (preset slime/icepop)"),
        Method("seq_mis", "correction", "sequence", {"cap": D.MIS_CAP}, rules.seq_mis,
               "sequence dropped where exp(Σ log r_c) > C", "masked IS on the product ratio",
               "TRL: vllm_importance_sampling_mode=sequence_mask (its default) drops the same sequences at C = 3 "
               "(it compares exp(Σ log π_old/μ) with C, so a product at C in log space can round above it) but "
               "weights every kept token by the sequence's product ratio exp(Σ log π_old/μ), where this rule keeps "
               "each token's own r_c: not equal (preset trl/dapo-sequence_mask)"),
        Method("geo_mis", "correction", "sequence", {"low": D.GEO_LOW, "high": D.GEO_HIGH}, rules.geo_mis,
               "sequence dropped where exp(mean log r_c) ∉ [low, high]", "Geo-RS, geometric-mean rejection",
               "verl Geo-RS (rollout_rs=seq_mean_k1, 0.999_1.001) bounds exp(mean(log μ − log π_old)) = 1 / this "
               "rule's statistic, so its band is this rule's [1/1.001, 1/0.999], and its rejection replaces the "
               "response mask (token-mean over kept tokens; preset verl/decoupled_geo_rs)"),
        Method("k3_rs", "correction", "sequence", {"threshold": D.K3_THRESHOLD}, rules.k3_rs,
               "sequence dropped where mean(r_c − log r_c − 1) > t", "rejection on the per-sequence mean k3",
               "verl: rollout_rs=seq_mean_k3, threshold 0.01, whose rejection replaces the response mask (token-mean "
               "over kept tokens; preset verl/decoupled_k3_rs)"),
        Method("veto", "correction", "sequence", {"floor": D.VETO_FLOOR}, rules.veto,
               "sequence dropped where any r_c < floor", "catastrophic-token veto", "slime: the MIS example's rs_veto_threshold 1e-4 (on log π_old/μ, its "
               "threshold rounded to float32; preset slime/mis); verl 0.9.1 has no token veto"),
        Method("opsm", "correction", "sequence", {"delta": D.OPSM_DELTA}, rules.opsm,
               "sequence dropped where A < 0 and mean(log μ − log π_ref) > δ",
               "off-policy sequence masking (DeepSeek-V3.2)",
               "TRL: off_policy_mask_threshold and slime: --use-opsm --use-rollout-logprobs compare μ with the current "
               "π, not π_ref (equal only when π_ref = π); slime's --use-opsm alone compares π_old with π and never reads "
               "μ; slime's --opsm-delta default is 1e-4, TRL has none (presets trl/dapo-sequence_mask-opsm, slime/opsm*)",
               sign=True),
        Method("prime_rl_mask", "correction", "token", {"threshold": D.PRIME_RL_DP}, rules.prime_rl_mask,
               "M = 0 where (A>0, π − μ > t) or (A<0, π − μ < −t)", "prime-rl's default loss mask (Δp, t = 0.2)",
               "prime-rl's default loss (dppo_mask_low/high 0.2) differs: it reads the current π, not π_ref; it masks "
               "A = 0 tokens with π − μ < −0.2 (this rule keeps them); it weights kept tokens by π/μ and adds "
               "1e-3·(log π/μ)² on every token (preset prime-rl/default)", sign=True),
    ]


OBJECTIVES: dict[str, Method] = {m.name: m for m in _objectives()}
CORRECTIONS: dict[str, Method] = {m.name: m for m in _corrections()}


def check_pair(objective: Method, correction: Method) -> None:
    """ValueError for a pair the loss cannot combine: a reweighting correction replaces the per-token ratio
    r_c an objective's weight carries, which gspo's and gmpo's sequence-level weights do not carry."""
    if objective.level == "sequence" and correction.reweights:
        raise ValueError(f"{objective.name}'s weight is its sequence's geometric-mean ratio, not a token's r: "
                         f"{correction.name} (which rescales token ratios) does not combine with it; use a masking "
                         "correction (seq_mis, geo_mis, k3_rs, ...) or a token-level objective (grpo, dppo_*, ...)")


def get(axis: str, name: str) -> Method:
    """The method `name` of an axis ('objective' or 'correction'); ValueError naming the choices."""
    table = {"objective": OBJECTIVES, "correction": CORRECTIONS}[axis]
    if name not in table:
        raise ValueError(f"unknown {axis} {name!r}; choose one of {', '.join(table)}")
    return table[name]


def help_text(axis: str) -> str:
    """CLI help listing an axis' methods with their defaults."""
    table = OBJECTIVES if axis == "objective" else CORRECTIONS
    return "; ".join(f"{m.name}" + (f" ({', '.join(f'{k} {v:g}' for k, v in m.params.items())})" if m.params else "")
                     for m in table.values())
