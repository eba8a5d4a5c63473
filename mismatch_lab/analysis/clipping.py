"""Clipping at identical parameters: which tokens PPO's ratio clip would drop, which DPPO would mask.

Before any update pi_theta = pi_old, so everything below is the engines' numerical disagreement alone.
Per token (definitions.py):
* ratio clip   r < 1 - eps_low or r > 1 + eps_high
* TV mask      binary TV |pi - mu| > delta_tv        * KL mask        binary KL(mu || pi) > delta_kl
* top-K TV     top-K TV > delta_tv (mu's top-K)      * top-K KL       top-K KL(mu || pi) > delta_kl
Rows with adv_sign = 'all' count every token with these rules two-sided. Where advantages exist, rows
'positive' / 'negative' count only a move in the advantage's direction, as the losses do: PPO clips
A > 0 at r > 1 + eps_high and A < 0 at r < 1 - eps_low; DPPO masks (A > 0, r > 1, D > delta) and
(A < 0, r < 1, D > delta). Denominator of every frac_*: the finite tokens of the row (`n_tokens`); of
the top-K ones: those with top-K recorded (`n_topk`).
"""

from __future__ import annotations

import duckdb
import pandas as pd

from mismatch_lab.analysis import definitions as d
from mismatch_lab.analysis.relations import Filters, empty
from mismatch_lab.analysis.rows import TOKEN_KEYS, Rows, Thresholds, rollup
from mismatch_lab.analysis.volatility import complete_buckets
from mismatch_lab.categories import CATEGORIES

METRIC_COLUMNS = [
    "n_tokens", "n_nonfinite", "mu_mean", "entropy_mean",
    "n_ratio_clip", "frac_ratio_clip", "frac_tv_mask", "frac_kl_mask",
    "n_topk", "frac_topk_tv_mask", "frac_topk_kl_mask",
    "frac_clip_not_tv", "frac_tv_not_clip", "mu_mean_clipped",
]  # fmt: skip
CATEGORY_COLUMNS = ["rollout", "scorer", "adv_sign", "category", *METRIC_COLUMNS]
BUCKET_COLUMNS = ["rollout", "scorer", "adv_sign", "scale", "bucket", "mu_lo", "mu_hi", "bucket_label", *METRIC_COLUMNS]
TOKEN_COLUMNS = ["rollout", "scorer", "adv_sign", "rank", "token_text", "token_id", "category", *METRIC_COLUMNS]
COUNTS = ("n_tokens", "n_nonfinite", "n_ratio_clip", "n_topk")
SIGN_ORDER = {"all": 0, "positive": 1, "negative": 2}

# Which counts of rows.sums_sql each rule reads, two-sided ('all') and in each advantage's direction.
RULES = {
    "all": {"clip": ("c_hi", "c_lo"), "tv": "c_tv", "kl": "c_kl", "ktv": "c_ktv", "kkl": "c_kkl",
                "clip_keep": ("c_hi_keep", "c_lo_keep"), "tv_inside": "c_tv_inside", "mu_clip": ("s_mu_hi", "s_mu_lo")},
    "positive": {"clip": ("c_hi",), "tv": "c_tv_up", "kl": "c_kl_up", "ktv": "c_ktv_up", "kkl": "c_kkl_up",
                     "clip_keep": ("c_hi_keep",), "tv_inside": "c_tv_up_inside", "mu_clip": ("s_mu_hi",)},
    "negative": {"clip": ("c_lo",), "tv": "c_tv_down", "kl": "c_kl_down", "ktv": "c_ktv_down", "kkl": "c_kkl_down",
                     "clip_keep": ("c_lo_keep",), "tv_inside": "c_tv_down_inside", "mu_clip": ("s_mu_lo",)},
}  # fmt: skip
TWO_SIDED_SUMS = ("n", "n_nonfinite", "s_mu", "s_ent", "n_ent", "n_topk",
                  *(c for v in RULES["all"].values() for c in ((v,) if isinstance(v, str) else v)))
"""The sums clip_metrics(s, 'all') reads: all the per-token-string pass computes for the ranked tokens."""
CATEGORY_SUMS = tuple(dict.fromkeys(
    ("n", "n_nonfinite", "s_mu", "s_ent", "n_ent", "n_topk",
     *(c for rule in RULES.values() for v in rule.values() for c in ((v,) if isinstance(v, str) else v)))))
"""The sums clip_metrics reads for every advantage sign: all a table by category needs of the grid."""


def clip_metrics(s: pd.DataFrame, sign: str) -> pd.DataFrame:
    """METRIC_COLUMNS from rolled-up sums, counting the rules of `sign` ('all' = two-sided)."""
    rule = RULES[sign]
    n, n_topk = s["n"].astype(float), s["n_topk"].astype(float)
    n_clip = sum(s[c] for c in rule["clip"])
    return pd.DataFrame(
        {
            "n_tokens": s["n"], "n_nonfinite": s["n_nonfinite"],
            "mu_mean": s["s_mu"] / n, "entropy_mean": s["s_ent"] / s["n_ent"].astype(float),
            "n_ratio_clip": n_clip, "frac_ratio_clip": n_clip / n,
            "frac_tv_mask": s[rule["tv"]] / n, "frac_kl_mask": s[rule["kl"]] / n,
            "n_topk": s["n_topk"],
            "frac_topk_tv_mask": s[rule["ktv"]] / n_topk, "frac_topk_kl_mask": s[rule["kkl"]] / n_topk,
            "frac_clip_not_tv": sum(s[c] for c in rule["clip_keep"]) / n,
            "frac_tv_not_clip": s[rule["tv_inside"]] / n,
            "mu_mean_clipped": sum(s[c] for c in rule["mu_clip"]) / n_clip.astype(float),
        },
        index=s.index,
    )  # fmt: skip


def _by(grid: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Metrics per (rollout, scorer, adv_sign, *keys): 'all' over every token, then each sign present (its sums
    rolled up with the others' in one pass: each group's rows, in their order, as from the sign's rows alone)."""
    pair = ["rollout", "scorer", *keys]
    signed = rollup(grid, ["rollout", "scorer", "adv_sign", *keys])
    parts = []
    for sign in SIGN_ORDER:
        s = rollup(grid, pair) if sign == "all" else signed[signed["adv_sign"] == sign]
        if s.empty:
            continue
        parts.append(pd.concat([s[pair].assign(adv_sign=sign), clip_metrics(s, sign)], axis=1))
    return pd.concat(parts, ignore_index=True)


def _sorted(df: pd.DataFrame, then: list[str]) -> pd.DataFrame:
    order = df["adv_sign"].map(SIGN_ORDER)
    return df.assign(_o=order).sort_values(["rollout", "scorer", "_o", *then], kind="stable").drop(columns="_o")


def _thresholds(eps_low, eps_high, delta_tv, delta_kl) -> Thresholds:
    return Thresholds(1.0 - eps_low, 1.0 + eps_high, delta_tv, delta_kl)


def clipping_by_category(
    con: duckdb.DuckDBPyConnection,
    *,
    rollout=None,
    scorer=None,
    run_ids=None,
    eps_low: float = d.EPS_LOW,
    eps_high: float = d.EPS_HIGH,
    delta_tv: float = d.DELTA_TV,
    delta_kl: float = d.DELTA_KL,
    _rows: Rows | None = None,
) -> pd.DataFrame:
    """Per (rollout, scorer, adv_sign, token category): the share of tokens each rule drops (module doc).
    Every category of mismatch_lab.categories is listed, empty ones with n_tokens = 0."""
    rows = _rows or Rows(con, Filters.make(rollout, scorer, run_ids))  # _rows: run_all's shared row set
    if not rows.ok:
        return empty(CATEGORY_COLUMNS)
    return category_table(rows.grid(_thresholds(eps_low, eps_high, delta_tv, delta_kl)))


def category_table(grid: pd.DataFrame) -> pd.DataFrame:
    """`clipping_by_category`'s table from sums (rows.sums_sql's names) per (rollout, scorer, adv_sign, category)
    and any further keys (a grid of `Rows.grid`, or such sums rolled up per unit of a store and added)."""
    if grid.empty:
        return empty(CATEGORY_COLUMNS)
    stats = _by(grid, ["category"])
    seen = sorted(c for c in stats["category"].dropna().unique() if c not in CATEGORIES)
    groups = stats[["rollout", "scorer", "adv_sign"]].drop_duplicates()
    full = groups.merge(pd.DataFrame({"category": [*CATEGORIES, *seen]}), how="cross")
    full = full.merge(stats, on=["rollout", "scorer", "adv_sign", "category"], how="left")
    full[list(COUNTS)] = full[list(COUNTS)].fillna(0).astype("int64")
    return _sorted(full, []).reset_index(drop=True)[CATEGORY_COLUMNS]


def clipping_by_bucket(
    con: duckdb.DuckDBPyConnection,
    *,
    rollout=None,
    scorer=None,
    run_ids=None,
    buckets: str = "linear",
    n_buckets: int | None = None,
    eps_low: float = d.EPS_LOW,
    eps_high: float = d.EPS_HIGH,
    delta_tv: float = d.DELTA_TV,
    delta_kl: float = d.DELTA_KL,
    _rows: Rows | None = None,
) -> pd.DataFrame:
    """Per (rollout, scorer, adv_sign, mu bucket) (buckets as in volatility_table): the share of tokens
    each rule drops. Every bucket is listed; rows with non-finite log mu form bucket -1 where present."""
    edges = d.bucket_edges(buckets, n_buckets)
    n = len(edges) - (1 if buckets == "log" else 0)
    rows = _rows or Rows(con, Filters.make(rollout, scorer, run_ids))
    if not rows.ok:
        return empty(BUCKET_COLUMNS)
    linear = buckets == "linear"
    grid = rows.grid(_thresholds(eps_low, eps_high, delta_tv, delta_kl), **({"n_linear": n} if linear else {"n_log": n}))
    if grid.empty:
        return empty(BUCKET_COLUMNS)
    key = "lb" if linear else "gb"
    stats = _by(grid, [key]).rename(columns={key: "bucket"})
    stats["bucket"] = stats["bucket"].astype("int64")
    full = complete_buckets(stats, buckets, edges, ["rollout", "scorer", "adv_sign"], COUNTS)
    return _sorted(full, ["bucket"]).reset_index(drop=True)[BUCKET_COLUMNS]


def top_clipped_tokens(
    con: duckdb.DuckDBPyConnection,
    n: int = d.TOP_N_TOKENS,
    *,
    rollout=None,
    scorer=None,
    run_ids=None,
    eps_low: float = d.EPS_LOW,
    eps_high: float = d.EPS_HIGH,
    delta_tv: float = d.DELTA_TV,
    delta_kl: float = d.DELTA_KL,
    _rows: Rows | None = None,
) -> pd.DataFrame:
    """The n token strings most often ratio-clipped (two-sided), per (rollout, scorer), ranked by
    n_ratio_clip (ties: more occurrences first, then the text, then the id). Metrics are over all finite
    occurrences of the string; mu_mean_clipped is the mean mu of its clipped occurrences. A token the store
    holds no text for (recorded without a tokenizer) is ranked by its id: token_text NULL, token_id set
    (token_id is NULL on rows named by their string)."""
    rows = _rows or Rows(con, Filters.make(rollout, scorer, run_ids))
    if not rows.ok:
        return empty(TOKEN_COLUMNS)
    t = _thresholds(eps_low, eps_high, delta_tv, delta_kl)
    # two passes: the clip counts of every token from the clipped rows alone, then every sum for the rows
    # of the tokens that can reach the top n (ties at the boundary are broken by the full counts)
    clips = rows.token_sums(t, ("c_hi", "c_lo"), clipped=True)
    contenders = contenders_of(clips, n)
    if contenders.empty:
        return empty(TOKEN_COLUMNS)
    s = rows.token_sums(t, TWO_SIDED_SUMS, tokens=contenders[["token_text", "token_id"]])
    return ranked_tokens(contenders[TOKEN_KEYS].merge(s, on=TOKEN_KEYS, how="left"), n)  # null keys match


def ranked_tokens(s: pd.DataFrame, n: int) -> pd.DataFrame:
    """`top_clipped_tokens`' table from TWO_SIDED_SUMS per rows.TOKEN_KEYS `s`: of every token, or of the
    contenders alone (every key that can be among the n most clipped of its pair). Tokens stored with neither id
    nor text (recorded where the ids were not at hand) are not ranked: nothing names them."""
    s = s[s["token_text"].notna() | s["token_id"].notna()]
    s = _ranked(s.assign(n_tokens=s["n"], n_ratio_clip=s["c_hi"] + s["c_lo"]), n)
    if s.empty:
        return empty(TOKEN_COLUMNS)
    out = pd.concat([s[[*TOKEN_KEYS, "rank"]], clip_metrics(s, "all")], axis=1)
    out[list(COUNTS)] = out[list(COUNTS)].astype("int64")
    out["token_id"] = out["token_id"].astype("Int64")
    out["adv_sign"] = "all"  # two-sided: a string is ranked over all its occurrences
    return out[TOKEN_COLUMNS]


def contenders_of(clips: pd.DataFrame, n: int) -> pd.DataFrame:
    """The keys of `clips` (the clip counts c_hi, c_lo per rows.TOKEN_KEYS) that can be among the n most clipped of
    their (rollout, scorer): n_ratio_clip > 0 and at least the n-th largest n_ratio_clip of the pair (every key
    tied with the n-th is kept)."""
    s = clips.assign(n_ratio_clip=clips["c_hi"] + clips["c_lo"])
    s = s[s["n_ratio_clip"] > 0]
    nth = s.groupby(["rollout", "scorer"])["n_ratio_clip"].transform(lambda c: c.nlargest(int(n)).min())
    return s[s["n_ratio_clip"] >= nth].reset_index(drop=True)


def _ranked(s: pd.DataFrame, n: int) -> pd.DataFrame:
    """The n tokens most often ratio-clipped per (rollout, scorer) (n_ratio_clip > 0), ordered by rank:
    n_ratio_clip descending, ties by more occurrences (n_tokens), then the text, then the id."""
    out = s[s["n_ratio_clip"] > 0].sort_values(
        ["rollout", "scorer", "n_ratio_clip", "n_tokens", "token_text", "token_id"],
        ascending=[True, True, False, False, True, True],
    )
    out = out.groupby(["rollout", "scorer"], sort=False).head(int(n))
    out["rank"] = out.groupby(["rollout", "scorer"]).cumcount() + 1
    return out.reset_index(drop=True)
