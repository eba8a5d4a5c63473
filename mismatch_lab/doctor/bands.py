"""Every band `mismatch-lab doctor` judges a number by, in one place, each with its source. No torch.

A band maps a measured value to a verdict (`verdicts.judge`):

    'above'    fail when value > fail; else warn when value > warn (>= warn with warn_inclusive); else ok
    'outside'  ok inside [low, high], `otherwise` outside
    'below'    ok when value >= low, `otherwise` below it

Illustrative levels (verl's rollout-correction doc gives them as examples, not calibrated) and our own levels
only ever warn; published acceptance or CI thresholds fail. Where a framework names the metric it logs,
`metric` holds that name, so a user can compare our number with their dashboard.
"""

from __future__ import annotations

from dataclasses import dataclass

from mismatch_lab.corrections import defaults as D


@dataclass(frozen=True)
class Band:
    """One band. `text` is how the report prints it; `source` names where it comes from."""

    kind: str  # 'above' | 'outside' | 'below'
    text: str
    source: str
    warn: float | None = None  # 'above': warn beyond this
    fail: float | None = None  # 'above': fail beyond this
    warn_inclusive: bool = False  # 'above': warn from `warn` itself (verl: "0.005-0.01 warn")
    low: float | None = None  # 'outside' / 'below'
    high: float | None = None  # 'outside'
    otherwise: str = "warn"  # 'outside' / 'below': the verdict off the band
    metric: str = ""  # the framework's own metric name, where it has one


VERL_FAQ = "verl FAQ (training/rollout_probs_diff_mean)"
VERL_ROLLOUT_CORR = "verl rollout_corr doc, illustrative alert level (uncalibrated)"
PRIME_RL = "prime-rl new-model acceptance (mismatch_kl over 20 steps)"
SLIME_CI = "slime CI (train_rollout_logprob_abs_diff)"
BITWISE = "bitwise true on-policy training (slime/miles): exactly equal log-probs"
OURS = "mismatch_lab (ours, not published)"

ABS_DP = Band("above", "< 0.005 ok, 0.005-0.01 warn, > 0.01 fail", VERL_FAQ, warn=0.005, fail=0.01, warn_inclusive=True,
              metric="training/rollout_probs_diff_mean")
"""verl's FAQ on mean |π − μ| of the sampled token (probability space): below 0.005 normal, 0.005-0.01 worth a look,
above 0.01 points at an inference-precision problem."""

K3_KL = Band("above", "<= 0.015 ok, > 0.015 fail", PRIME_RL, fail=0.015, metric="mismatch_kl")
"""prime-rl asks a new model's PR to show mean k3 = mean(r − log r − 1) below 0.015 over 20 steps."""

SEQ_ABS_DLOGP = Band("above", "<= 0.1 ok, > 0.1 fail", SLIME_CI, fail=0.1, metric="train_rollout_logprob_abs_diff")
"""slime's CI fails when the per-sequence mean |log π − log μ| exceeds 0.1."""

BITWISE_EQUAL = Band("above", "= 0 ok, > 0 fail", BITWISE, fail=0.0)
"""Bitwise 'true on-policy' training expects log π = log μ exactly: any non-zero difference fails."""

IS_WEIGHT_LOW, IS_WEIGHT_HIGH = 0.5, 2.0
IS_WEIGHT_MEAN = Band("outside", f"in [{IS_WEIGHT_LOW}, {IS_WEIGHT_HIGH}] ok, outside warn", VERL_ROLLOUT_CORR,
                      low=IS_WEIGHT_LOW, high=IS_WEIGHT_HIGH)
ESS = Band("below", ">= 0.3 ok, < 0.3 warn", VERL_ROLLOUT_CORR, low=0.3)
"""ESS = 1/mean(w²) after normalising w to mean 1 = (Σw)² / (n Σw²), in (0, 1]."""
CHI2 = Band("above", "<= 1 ok, > 1 warn", VERL_ROLLOUT_CORR, warn=1.0)
K1_ABS = Band("above", "<= 0.1 ok, > 0.1 warn", VERL_ROLLOUT_CORR, warn=0.1)
SEQ_PRODUCT_SHARE = Band("above", "<= 0.5 ok, > 0.5 warn", OURS + ": most sequences' weight outside verl's [0.5, 2]",
                         warn=0.5)
"""Share of sequences whose product ratio exp(Σ log r) leaves [IS_WEIGHT_LOW, IS_WEIGHT_HIGH]: a sequence-level
product weight is then off verl's alert range for most sequences (our level; the bounds are verl's)."""

NONFINITE = Band("above", "= 0 ok, > 0 warn", OURS + ": non-finite rows are excluded from every mean", warn=0.0)
SKIPPED = Band("above", "= 0 ok, > 0 warn", OURS + ": prompts longer than the context were not sampled", warn=0.0)
GROWTH = Band("above", "95 % CI above 0 warn, else ok",
              "prime-rl: sustained growth is the early warning of collapse", warn=0.0)
"""Judged on the lower end of the slope's 95 % t-interval: warn when even that is above 0 (growth is significant)."""
SUPPORT_BIAS = Band("above", "<= 0.5 ok, > 0.5 warn", OURS + ": above half, the sampling rule is the largest part of "
                    "log r, larger than every other source together", warn=0.5)
"""The share of mean |log r| that π on the sampling rule removes, for a rollout whose μ is processed (after
temperature / top-k / top-p) against a raw π: max(0, M − M_rule) / M, M_rule = mean |log π_rule − log μ| with
π_rule = π tempered, restricted and renormalised (scores.logp_support) — the attribution's support share
(doctor/attribution.py support_table). It sees the cut (log S) and a temperature the trainer does not apply,
whose per-token bias is two-signed; above 0.5 the pair's mismatch is mostly the sampling rule, not the numerics
(our level: it only warns)."""
NEMO_RL_MULT_PROB_ERROR = Band(
    "above", "<= 1.05 ok, > 1.05 warn",
    "NeMo-RL docs/guides/dtensor-tp-accuracy.md: above 1.05 warrants investigation (token_mult_prob_error)",
    warn=1.05, metric="token_mult_prob_error")
"""NeMo-RL's mean exp|log π − log μ| over a step's tokens (analysis/nemo_rl_metric.py), judged on the pair's median
step: its guide calls occasional spikes acceptable when the metric returns to about 1.0, so one spike does not
judge a run (the largest step is shown beside it). A level for looking, not a CI gate: it only warns."""
ROUTING = Band(
    "above", "= 0 ok, > 0 warn",
    OURS + "; for scale: NVIDIA/Megatron-LM PR #4256 (refs issue #4168) reports ~10 % of routers disagreeing per "
    "forward and ~94 % of tokens differing in at least one layer at scale (a reported figure, not a published band)",
    warn=0.0)
"""Share of a pair's response tokens whose expert set differs from the rollout's in at least one MoE layer
(analysis/routing.py any_layer_differs). Any such token had π computed through other experts than μ: a part of
the mismatch that no precision fix removes and R3 (replaying the rollout's expert ids) does. No framework
publishes a threshold; the reported ~94 % at scale says how far it goes on deep MoE models (our level: it warns)."""
BATCH_VARIANCE = Band("above", "= 0 ok, > 0 fail", BITWISE + "; needs batch-invariant kernels", fail=0.0)

SEQ_K3_REJECT = D.K3_THRESHOLD
"""verl's seq_mean_k3 rejection threshold (corrections.defaults): used by the recommendations."""
FP16_GAIN = 2.0
"""A fp16 rollout whose mean |Δp| is at least this many times below bf16's earns the 'use fp16' advice (ours)."""
