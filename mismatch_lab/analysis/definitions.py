"""Every definition the analyses use, in one place (mirrored in docs/analysis.md).

Notation (docs/design.md): for the sampled token of one position,
    mu  = rollout probability      = exp(tokens.logp_rollout)      (the sampling engine, e.g. 'vllm:bf16')
    pi  = trainer/scorer probability = exp(scores.logp)            (teacher forcing, e.g. 'hf:fp32')
    r   = pi / mu                  (computed as exp(log pi - log mu), never as a quotient of rounded probs)
    dlogp = log pi - log mu        (log space, signed; nats)
    dp    = pi - mu                (probability space, signed)

Divergences, all with the rollout mu as the *first* argument (the anchor, as DPPO anchors on mu):
    binary TV  = |pi - mu|                                    (TV between Bernoulli(mu) and Bernoulli(pi))
    binary KL  = mu log(mu/pi) + (1-mu) log((1-mu)/(1-pi))     = KL(Bern(mu) || Bern(pi)), nats
                 with 0 log 0 = 0, and +inf where pi = 1 != mu (the mask then fires)
    top-K TV   = 1/2 [ sum_{v in S} |pi(v) - mu(v)| + |pi(other) - mu(other)| ]
    top-K KL   = sum_{v in S} mu(v) log(mu(v)/pi(v)) + mu(other) log(mu(other)/pi(other))
                 S = the anchor's recorded top-K ids plus the sampled token; 'other' = the rest of the mass
                 (1 - sum over S), clamped at 0 against rounding. K is whatever the store recorded.
                 Two leftovers both below |S| * eps_fp32 count as equal (their term is 0 in TV and KL:
                 rounding, not mass; corrections/leftover.py).
KL estimators of KL(mu || pi) from the sampled token (tokens are drawn from mu), Schulman's k1/k2/k3:
    k1 = log mu - log pi = -dlogp            (unbiased, can be negative)
    k2 = 1/2 (log r)^2                       (biased, always >= 0)
    k3 = r - log r - 1                       (unbiased, always >= 0)
    chi2 = mean(r^2) - 1                     (estimates chi^2(pi || mu) = E_mu[r^2] - 1)

Which rows count: a (token, scorer) row is *finite* when log mu and log pi are both stored and finite,
`scores.nonfinite` is not true, and r = exp(dlogp) does not overflow a double. Every mean, share and
quantile runs over finite rows only; the rest are counted in `n_nonfinite` and reported, never zeroed.
"""

from __future__ import annotations

import math

from mismatch_lab.corrections import defaults as _published
from mismatch_lab.corrections.leftover import leftover_floor_sql

# the rollout label and the reference scorer are part of the data contract (store.schema); re-exported
from mismatch_lab.store.schema import MAX_LOG_RATIO, REFERENCE_SCORER, rollout_label_sql  # noqa: F401 - re-exported

# -- labels ---------------------------------------------------------------------------------------
ROLLOUT_LABEL_SQL = rollout_label_sql("runs")
"""A rollout is named '<engine>:<dtype>' from its run, e.g. 'vllm:bf16' ('<engine>' alone when the dtype is
unknown); a scorer is `scores.scorer`, e.g. 'hf:fp32' or a framework's 'trl:fp32'."""

# -- default thresholds, each with its source -----------------------------------------------------
EPS_LOW = _published.GRPO_EPS_LOW
EPS_HIGH = _published.CLIP_HIGHER_EPS
"""PPO ratio clip range [1 - EPS_LOW, 1 + EPS_HIGH]: DAPO's 'clip-higher' values, the GRPO-Clip-Higher
baseline of DPPO. A token is *ratio-clipped* when r < 1 - EPS_LOW or r > 1 + EPS_HIGH."""
CLIP_LOW = 1.0 - EPS_LOW  # 0.8
CLIP_HIGH = 1.0 + EPS_HIGH  # 1.28

DELTA_TV = _published.DPPO_DELTA_TV
"""DPPO binary/top-K TV trust-region radius (reference code default; corrections/defaults.py)."""
DELTA_KL = _published.DPPO_DELTA_KL
"""DPPO binary/top-K KL trust-region radius (reference code default; corrections/defaults.py)."""

R_DEVIATION = 0.1
"""Share of tokens with |r - 1| > R_DEVIATION: the '4-8 % of tokens outside [0.9, 1.1]' figure."""
BIG_DP = 0.5
"""Share of tokens with |dp| > BIG_DP: catastrophic disagreements (max |dp| reaches 1 in BF16)."""

LOG_BUCKET_FLOOR = 1e-6
"""Log-spaced mu buckets span [LOG_BUCKET_FLOOR, 1]; one extra bucket holds mu < LOG_BUCKET_FLOOR."""
N_LINEAR_BUCKETS = 10
N_LOG_BUCKETS = 12  # two per decade from 1e-6 to 1

RATIO_QUANTILES = (0.01, 0.05, 0.5, 0.95, 0.99)
"""Quantiles of r reported per mu bucket (linear interpolation, = numpy.quantile's default)."""

TOP_N_TOKENS = 30

ADV_SIGNS = ("positive", "negative")
"""Advantage signs. A sequence's advantage is `sequences.advantage`; where only `reward` is stored it is
reward - mean(reward) over the sequences of the same (run_id, step, prompt_id) (GRPO's group baseline;
only the sign is used, so the std normalisation does not matter); sequences without a prompt_id form one
group per (run_id, step): the batch mean. Advantage 0 or NULL has no sign."""

def group_advantage_sql(advantage: str, reward: str, group: str) -> str:
    """SQL of a sequence's advantage: `advantage` where stored, else its reward minus the mean reward of its
    prompt group (`group`: the PARTITION BY list, e.g. 'run_id, step, prompt_id'); NULL where neither is
    stored. The one definition of "reward minus group mean" (see ADV_SIGNS)."""
    return f"coalesce({advantage}, {reward} - avg({reward}) OVER (PARTITION BY {group}))"


def direction_rule_sql(adv: str, up: str, down: str) -> str:
    """SQL boolean of a rule applied in the advantage's direction: `up` where A > 0, `down` where A < 0,
    false where A = 0, either where A is unknown (NULL: two-sided). The SQL twin of the registry's sign
    rule (mismatch_lab.corrections.batch.Batch.pos / neg); tests/corrections checks both agree."""
    return f"(CASE WHEN {adv} > 0 THEN {up} WHEN {adv} < 0 THEN {down} WHEN {adv} = 0 THEN false ELSE ({up}) OR ({down}) END)"


def ppo_clip_sql(adv: str, ratio: str, eps_low: float, eps_high: float) -> str:
    """PPO/GRPO clip in the advantage's direction (registry `grpo`): r > 1 + eps_high up, r < 1 − eps_low down."""
    return direction_rule_sql(adv, f"{ratio} > {1 + float(eps_high)!r}", f"{ratio} < {1 - float(eps_low)!r}")


def dppo_tv_sql(adv: str, pi: str, mu: str, delta: float) -> str:
    """DPPO binary-TV mask anchored on μ (registry `dppo_binary_tv`): π − μ > δ up, μ − π > δ down."""
    return direction_rule_sql(adv, f"{pi} - {mu} > {float(delta)!r}", f"{mu} - {pi} > {float(delta)!r}")


# -- per-token SQL expressions over columns `lmu` (log mu) and `lpi` (log pi) ---------------------


def finite_sql(lmu: str = "lmu", lpi: str = "lpi", nonfinite: str | None = "nonfinite") -> str:
    """SQL boolean: the row is finite (see module docstring); never NULL."""
    flag = f" AND NOT coalesce({nonfinite}, false)" if nonfinite else ""
    return (
        f"coalesce(isfinite({lmu}) AND isfinite({lpi}) AND ({lpi} - {lmu}) < {MAX_LOG_RATIO!r}{flag}, false)"
    )


def token_metrics_sql(lmu: str = "lmu", lpi: str = "lpi", shared: dict[str, str] | None = None) -> dict[str, str]:
    """Name -> SQL expression of each per-token quantity (see the module docstring). `shared`: columns
    already holding some of shared_sql's expressions (its name -> the column), read instead of recomputed:
    DuckDB evaluates every occurrence of exp(lmu) in a projection, so a pass that computes them once in a
    layer below (relations.with_metrics) pays a few exponentials a row instead of a dozen, with the same
    values bit for bit."""
    shared = shared or {}
    mu, pi, r = (shared.get(name, expr) for name, expr in shared_sql(lmu, lpi).items())
    return {
        "mu": mu,
        "pi": pi,
        "dlogp": f"({lpi} - {lmu})",
        "r": r,
        "dp": f"({pi} - {mu})",
        "btv": f"abs({pi} - {mu})",
        "k1": f"({lmu} - {lpi})",
        "k2": f"(0.5 * ({lpi} - {lmu}) * ({lpi} - {lmu}))",
        "k3": f"({r} - ({lpi} - {lmu}) - 1.0)",
        "bkl": (
            f"({mu} * ({lmu} - {lpi}) + CASE WHEN 1.0 - {mu} <= 0 THEN 0.0 "
            f"WHEN 1.0 - {pi} <= 0 THEN 'inf'::DOUBLE "
            f"ELSE (1.0 - {mu}) * ln((1.0 - {mu}) / (1.0 - {pi})) END)"
        ),
    }


def shared_sql(lmu: str = "lmu", lpi: str = "lpi") -> dict[str, str]:
    """The exponentials several token metrics read: mu, pi and r = exp(log pi - log mu). Total on every
    double (inf, NaN and NULL in, inf, NaN or NULL out, never an error), so safe to compute before the
    finite-row guard."""
    return {"mu": f"exp({lmu})", "pi": f"exp({lpi})", "r": f"exp({lpi} - {lmu})"}


def topk_anchor_sql(ids: str, a_lps: str, tok: str, kl: bool = True) -> dict[str, str]:
    """Top-K, part 1, from the anchor a's side alone (one row per token for mu's top-K): a_lps are a's
    log-probs at its top-K `ids`, `tok` the sampled token id. The sums need no join, so they run once
    per token rather than once per (token, scorer). k_len is NULL, and the sums with it, where the
    lists are missing, of different lengths or hold NULLs (list_inner_product refuses NULLs)."""
    ok = f"list_count({a_lps}) = len({a_lps}) AND len({ids}) = len({a_lps}) AND len({a_lps}) > 0"
    ea = f"list_transform({a_lps}, lambda x: exp(x))"
    return {
        "k_len": f"CASE WHEN {ok} THEN len({a_lps}) END",
        "k_ea": f"CASE WHEN {ok} THEN {ea} END",  # a's probabilities at the ids
        "k_mass_a": f"CASE WHEN {ok} THEN list_sum({ea}) END",
        # sum a log a. Lambdas, not list_inner_product: that one raises on a NULL element anywhere in
        # the vector, even in rows a CASE has excluded
        "k_ea_la": f"CASE WHEN {ok} THEN list_sum(list_transform({a_lps}, lambda x: exp(x) * x)) END"
        if kl
        else "CAST(NULL AS DOUBLE)",
        # the sampled token joins S only when it is not already among the anchor's top-K ids
        "k_extra": f"NOT coalesce(list_contains({ids}, {tok}), false)",
    }


def topk_pair_sql(b_lps: str, kl: bool = True) -> dict[str, str]:
    """Top-K, part 2, once a's part-1 columns sit next to b's log-probs at the same ids (`b_lps`).
    Every sum is computed only where k_ok holds (CASE evaluates its branch on those rows alone).
    kl=False leaves the KL sum NULL (top-K KL then NULL) and saves its list pass where only TV is read."""
    ok = f"coalesce(k_len > 0 AND len({b_lps}) = k_len AND list_count({b_lps}) = k_len, false)"
    return {
        "k_ok": ok,
        "k_mass_b": f"CASE WHEN {ok} THEN list_sum(list_transform({b_lps}, lambda x: exp(x))) END",
        "k_abs": f"CASE WHEN {ok} THEN list_sum(list_transform(k_ea, lambda x, i: abs(exp({b_lps}[i]) - x))) END",
        # sum a (log a - log b)
        "k_kl": f"CASE WHEN {ok} THEN k_ea_la - list_sum(list_transform(k_ea, lambda x, i: x * {b_lps}[i])) END"
        if kl
        else "CAST(NULL AS DOUBLE)",
        "k_n": f"CASE WHEN {ok} THEN k_len END",  # K, for the leftover floor of part 3
    }


def topk_sql(a_lp: str, b_lp: str) -> str:
    """Top-K, part 3: a STRUCT(tv, kl) of top-K TV and top-K KL(a || b) on S = the anchor's top-K ids +
    the sampled token, with one 'other' bucket for the rest of the mass (clamped at 0 against rounding;
    both sides' below corrections.leftover's floor count as equal);
    a_lp / b_lp are the sampled token's log-probs. NULL where k_ok is false (lists missing, unequal, or
    holding NULLs). Each part-2 column is read once and bound to `v` by a one-element list_transform:
    written out, the masses would appear four times and DuckDB would evaluate their lambdas each time."""
    extra = "CASE WHEN k_extra THEN {} ELSE 0.0 END"
    bound = (
        f"{{'oa': greatest(1.0 - (k_mass_a + {extra.format(f'exp({a_lp})')}), 0.0), "
        f"'ob': greatest(1.0 - (k_mass_b + {extra.format(f'exp({b_lp})')}), 0.0), "
        f"'floor': {leftover_floor_sql(f'k_n + {extra.format(1)}')}, "
        f"'s_abs': k_abs + {extra.format(f'abs(exp({b_lp}) - exp({a_lp}))')}, "
        f"'s_kl': k_kl + {extra.format(f'exp({a_lp}) * ({a_lp} - {b_lp})')}}}"
    )
    # leftovers both below the floor are rounding, not mass: equal, the bucket adds 0 (corrections/leftover.py)
    same = "(v.oa < v.floor AND v.ob < v.floor)"
    other_kl = (f"CASE WHEN v.oa <= 0 OR {same} THEN 0.0 WHEN v.ob <= 0 THEN 'inf'::DOUBLE "
                "ELSE v.oa * ln(v.oa / v.ob) END")
    out = f"{{'tv': 0.5 * (v.s_abs + CASE WHEN {same} THEN 0.0 ELSE abs(v.oa - v.ob) END), 'kl': v.s_kl + {other_kl}}}"
    return f"CASE WHEN k_ok THEN list_transform([{bound}], lambda v: {out})[1] END"


# -- mu buckets -----------------------------------------------------------------------------------
def bucket_edges(scale: str, n_buckets: int | None = None) -> list[tuple[float, float]]:
    """(lo, hi) of each mu bucket, index order. Linear: n equal widths on [0, 1]. Log: bucket 0 is
    [0, LOG_BUCKET_FLOOR), then n log-spaced buckets up to 1. Every bucket is [lo, hi) except the last,
    which includes mu = 1."""
    n = n_buckets or (N_LINEAR_BUCKETS if scale == "linear" else N_LOG_BUCKETS)
    if scale == "linear":
        return [(i / n, (i + 1) / n) for i in range(n)]
    if scale == "log":
        f = math.log(LOG_BUCKET_FLOOR)
        edges = [math.exp(f * (1 - i / n)) for i in range(n + 1)]
        edges[-1] = 1.0
        return [(0.0, LOG_BUCKET_FLOOR)] + [(edges[i], edges[i + 1]) for i in range(n)]
    raise ValueError(f"buckets must be 'linear' or 'log', got {scale!r}")


def bucket_sql(scale: str, n_buckets: int | None = None, lmu: str = "lmu") -> str:
    """SQL integer: the mu bucket of a row (NULL where log mu is not finite). Computed on log mu so that
    mu < 1e-300 still lands in bucket 0 of the log scale."""
    n = n_buckets or (N_LINEAR_BUCKETS if scale == "linear" else N_LOG_BUCKETS)
    if scale == "linear":
        body = f"least(greatest(floor(exp({lmu}) * {n}), 0), {n - 1})::INTEGER"
    elif scale == "log":
        f = math.log(LOG_BUCKET_FLOOR)
        body = (
            f"CASE WHEN {lmu} < {f!r} THEN 0 "
            f"ELSE least(floor(({lmu} - ({f!r})) * {n / -f!r}), {n - 1})::INTEGER + 1 END"
        )
    else:
        raise ValueError(f"buckets must be 'linear' or 'log', got {scale!r}")
    return f"CASE WHEN isfinite({lmu}) THEN {body} END"


def bucket_label(lo: float, hi: float, last: bool) -> str:
    return f"[{lo:.3g}, {hi:.3g}{']' if last else ')'}"
