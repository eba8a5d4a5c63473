"""The comparison's tables from its additive sums (compare.py), and their one-screen print.

Columns of every table (per method and (rollout, scorer) pair; the split tables add their key):
    method, axis ('objective' | 'correction'), level ('token' | 'sequence'), rollout, scorer,
    n_tokens                    finite response tokens (the denominator of every token share)
    n_seqs                      sequences with a finite token (the denominator of frac_seqs_masked)
    frac_tokens_masked          tokens the method drops (M = 0), over n_tokens
    frac_seqs_masked            sequences dropped whole (every token M = 0), over n_seqs
    frac_tokens_weight_changed  tokens kept with a weight other than r = π/μ, over n_tokens
    weight_mean, weight_max     of w over kept tokens
    ess                         (Σw)² / (n Σw²) over the n kept tokens (1 = all weights equal)
    advantage_source            where the advantage's sign came from (compare.py docstring)
    framework, params, source   the framework option it equals, the parameters used, the rule's origin
    n_nonfinite                 tokens left out as non-finite (main table only)
"""

from __future__ import annotations

import math

import pandas as pd

from mismatch_lab.corrections.layout import SIGN_CODES

SIGN_NAMES = {code: name for name, code in SIGN_CODES.items()}
SPLITS = {"by_adv_sign": "adv_sign", "by_mu_bucket": "mu_bucket", "by_category": "category"}
TOKEN_SUMS = {"n_tokens": "sum", "n_masked": "sum", "n_changed": "sum", "s_w": "sum", "s_w2": "sum", "x_w": "max"}


def rates(df: pd.DataFrame) -> pd.DataFrame:
    """The table's shares, means and ESS from additive sums n_tokens, n_masked, n_changed, s_w, s_w2, x_w (and
    n_seqs, n_seqs_masked where present): the one definition of every derived column."""
    kept = df["n_tokens"] - df["n_masked"]
    out = df.assign(
        frac_tokens_masked=df["n_masked"] / df["n_tokens"],
        frac_tokens_weight_changed=df["n_changed"] / df["n_tokens"],
        weight_mean=(df["s_w"] / kept).where(kept > 0),
        weight_max=df["x_w"].where(kept > 0),
        ess=(df["s_w"] ** 2 / (kept * df["s_w2"])).where((kept > 0) & (df["s_w2"] > 0)),
    )
    if "n_seqs" in df:
        out["frac_seqs_masked"] = df["n_seqs_masked"] / df["n_seqs"]
    return out


def _describe(vs, info: pd.DataFrame) -> pd.DataFrame:
    """One row per (variant, pair) with the method's declared fields and the pair's labels."""
    rows = []
    for v in vs:
        for pair, p in enumerate(info.itertuples()):
            skipped = "topk" in v.method.needs and not p.has_topk
            rows.append({"label": v.label, "pair": pair, "method": v.label, "axis": v.method.axis,
                         "level": v.method.level, "rollout": p.rollout, "scorer": p.scorer,
                         "advantage_source": p.advantage_source, "framework": v.method.framework,
                         "params": ", ".join(f"{k}={x:g}" for k, x in v.params.items()),
                         "source": v.method.source, "n_nonfinite": p.n_nonfinite,
                         "note": "needs top-K log-probs of both sides, which this pair lacks" if skipped else ""})
    return pd.DataFrame(rows)


COLUMNS = ["method", "axis", "level", "rollout", "scorer", "n_tokens", "n_seqs", "frac_tokens_masked",
           "frac_seqs_masked", "frac_tokens_weight_changed", "weight_mean", "weight_max", "ess",
           "advantage_source", "framework", "params", "source", "note"]


def tables(vs, tok: pd.DataFrame | None, seq: pd.DataFrame | None, info: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """The comparison's tables from the sums per (label, pair, adv_sign, mu_bucket, category) (`tok`) and per
    (label, pair, adv_sign) (`seq`); None when the store has no finite token."""
    desc = _describe(vs, info)
    if desc.empty:  # a store without any (rollout, scorer) pair
        return {"corrections": pd.DataFrame(columns=[*COLUMNS, "n_nonfinite"]),
                **{name: pd.DataFrame(columns=[*COLUMNS[:5], key, *COLUMNS[5:]]) for name, key in SPLITS.items()}}
    if tok is None:  # numeric sums (object columns would make 0 / 0 a ZeroDivisionError instead of NaN)
        tok = pd.DataFrame(columns=["label", "pair", *SPLITS.values(), *TOKEN_SUMS]).astype(dict.fromkeys(TOKEN_SUMS, float))
        seq = pd.DataFrame(columns=["label", "pair", "adv_sign", "n_seqs", "n_seqs_masked"]).astype(
            {"n_seqs": float, "n_seqs_masked": float})
    for df in (tok, seq):
        if "adv_sign" in df:
            df["adv_sign"] = df["adv_sign"].map(SIGN_NAMES)
    main = desc.merge(tok.groupby(["label", "pair"]).agg(TOKEN_SUMS).reset_index(), how="left", on=["label", "pair"])
    main = main.merge(seq.groupby(["label", "pair"])[["n_seqs", "n_seqs_masked"]].sum().reset_index(),
                      how="left", on=["label", "pair"])
    # a pair whose every token is non-finite has no sums: its counts are 0 (its shares then NaN, 0 / 0)
    main = main.fillna({c: 0 for c in ("n_tokens", "n_masked", "n_changed", "s_w", "s_w2", "n_seqs", "n_seqs_masked")})
    out = {"corrections": rates(main)[[*COLUMNS, "n_nonfinite"]]}
    for name, key in SPLITS.items():
        part = tok.groupby(["label", "pair", key], dropna=False).agg(TOKEN_SUMS).reset_index()
        if key == "adv_sign":
            part = part.merge(seq.groupby(["label", "pair", key])[["n_seqs", "n_seqs_masked"]].sum().reset_index(),
                              how="left", on=["label", "pair", key])
        cols = [c for c in COLUMNS if c not in ("n_seqs", "frac_seqs_masked") or key == "adv_sign"]
        part = desc.merge(part, on=["label", "pair"])
        out[name] = rates(part)[[*cols[:5], key, *cols[5:]]]
    return out


def format_table(df: pd.DataFrame) -> str:
    """The main table as fixed-width text, one block per pair."""
    lines = []
    for (rollout, scorer), g in df.groupby(["rollout", "scorer"], sort=False):
        lines.append(f"\n{rollout} vs {scorer}: {int(g['n_tokens'].max()):,} tokens, {int(g['n_seqs'].max()):,} "
                     f"sequences; advantage: {g['advantage_source'].iloc[0]}")
        lines.append(f"  {'method':18s} {'tokens masked':>13s} {'seqs dropped':>12s} {'w changed':>9s} "
                     f"{'w mean':>7s} {'w max':>8s} {'ESS':>6s}  framework option")
        for r in g.itertuples():
            if r.note:
                lines.append(f"  {r.method:18s} {'-':>13s} {'-':>12s} {'-':>9s} {'-':>7s} {'-':>8s} {'-':>6s}  ({r.note})")
                continue
            lines.append(f"  {r.method:18s} {_pct(r.frac_tokens_masked):>13s} {_pct(r.frac_seqs_masked):>12s} "
                         f"{_pct(r.frac_tokens_weight_changed):>9s} {r.weight_mean:7.3f} {r.weight_max:8.3g} "
                         f"{r.ess:6.3f}  {r.framework}")
    return "\n".join(lines)


def _pct(x: float) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.2f} %"
