"""Published defaults of every objective and rollout correction, each with its source. No torch here:
the analyses (DuckDB only) read the same constants as the losses.

r = π/μ per token; a sequence's ratio is exp(Σ log r), its geometric mean exp(mean log r).
"""

from __future__ import annotations

# -- base objectives --------------------------------------------------------------------------------
GRPO_EPS_LOW = 0.2
"""PPO/GRPO lower clip ε_low: a token with A < 0 is clipped when ρ < 1 − ε_low."""
GRPO_EPS_HIGH = 0.2
"""PPO/GRPO upper clip ε_high (0.2); DAPO's Clip-Higher (arXiv 2503.14476) raises it to CLIP_HIGHER_EPS."""
CLIP_HIGHER_EPS = 0.28
"""DAPO's Clip-Higher ε_high, the 'GRPO-Clip-Higher' baseline of the DPPO paper."""
DPPO_DELTA_TV = 0.15
"""DPPO binary/top-K TV trust-region radius δ (DPPO reference code, arXiv 2602.04879)."""
DPPO_DELTA_KL = 0.05
"""DPPO binary/top-K KL trust-region radius δ (DPPO reference code)."""
CISPO_EPS_LOW = 1.0
"""CISPO lower IS-weight bound 1 − ε (1.0: no lower bound, as MiniMax-M1, arXiv 2506.13585)."""
CISPO_EPS_HIGH = 2.0
"""CISPO upper IS-weight bound 1 + ε (cap 3, the DPPO sanity test's CISPO)."""
GSPO_EPS_LOW = 3e-4
GSPO_EPS_HIGH = 4e-4
"""GSPO sequence-ratio clip range [1 − 3e-4, 1 + 4e-4] (GSPO paper, arXiv 2507.18071)."""
GMPO_EPS = 0.4
"""GMPO per-token log-ratio clip ±0.4 before the geometric mean (GMPO paper, arXiv 2507.20673)."""
TIS_OBJECTIVE_CAP = 3.0
"""The legacy `tis` objective's cap (the DPPO sanity test's PG-TIS) = pg_is + token_tis at C = 3."""

# -- rollout corrections ----------------------------------------------------------------------------
TIS_CAP = 2.0
"""Token / sequence TIS cap C (verl, slime, miles); TRL's `token_truncate` default is 3."""
MIS_CAP = 3.0
"""Token MIS (TRL `token_mask`) and sequence MIS (TRL `sequence_mask`, its default) cap C."""
ICEPOP_LOW, ICEPOP_HIGH = 0.5, 5.0
"""IcePop keeps tokens with r in [0.5, 5] (verl preset). slime's icepop_function reads --tis-clip-low / --tis-clip,
[0, 2] by default (THUDM/slime @624b824a, slime/utils/arguments.py)."""
GEO_LOW, GEO_HIGH = 0.999, 1.001
"""Geo-RS keeps sequences whose geometric-mean ratio is in [0.999, 1.001] (verl)."""
K3_THRESHOLD = 0.01
"""verl `seq_mean_k3` rejection: a sequence with mean k3 = mean(r − log r − 1) above 0.01 is dropped."""
VETO_FLOOR = 1e-4
"""The veto of slime's MIS example (rs_veto_threshold in examples/train_infer_mismatch_helper/mis.yaml): a sequence
with any token r below 1e-4 is dropped."""
OPSM_DELTA = 1e-4
"""slime's `--opsm-delta` default (DeepSeek-V3.2's off-policy sequence masking): A < 0 and mean(log μ − log π) > δ.
slime compares log π_old (not μ) with log π unless --use-rollout-logprobs; TRL's off_policy_mask_threshold has no
default."""
PRIME_RL_DP = 0.2
"""prime-rl's default loss (dppo_mask_high / dppo_mask_low) masks A > 0 with π − μ > 0.2 and A ≤ 0 with π − μ < −0.2
(PrimeIntellect-ai/prime-rl @559b4477, trainer/rl/loss.py)."""
