"""Naive numpy / plain-Python references for the analysis tests (no SQL)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd


def naive_binary_kl(mu: float, pi: float) -> float:
    """KL(Bern(mu) || Bern(pi)) with 0 log 0 = 0 and +inf where pi = 1 != mu."""
    out = mu * math.log(mu / pi)
    if 1.0 - mu > 0:
        out += math.inf if 1.0 - pi <= 0 else (1.0 - mu) * math.log((1.0 - mu) / (1.0 - pi))
    return out


def naive_topk(ids, a_lps, b_lps, tok, a_lp, b_lp) -> tuple[float, float]:
    """(top-K TV, top-K KL(a || b)) on S = ids + the sampled token, one 'other' bucket, by a loop."""
    if ids is None or a_lps is None or b_lps is None or len(a_lps) == 0 or len(a_lps) != len(b_lps):
        return math.nan, math.nan
    support = {int(i): (float(a), float(b)) for i, a, b in zip(ids, a_lps, b_lps)}
    support.setdefault(int(tok), (a_lp, b_lp))
    tv = kl = mass_a = mass_b = 0.0
    for a, b in support.values():
        pa, pb = math.exp(a), math.exp(b)
        tv += abs(pb - pa)
        kl += pa * (a - b)
        mass_a += pa
        mass_b += pb
    oa, ob = max(1.0 - mass_a, 0.0), max(1.0 - mass_b, 0.0)
    tv = 0.5 * (tv + abs(oa - ob))
    if oa > 0:
        kl += math.inf if ob <= 0 else oa * math.log(oa / ob)
    return tv, kl


def naive_adv_sign(sequences: pd.DataFrame) -> pd.Series:
    """adv_sign per (run_id, seq_id): sign of `advantage`, else of reward - its (run, step, prompt) mean."""
    q = sequences.copy()
    for c in ("advantage", "reward", "step"):
        if c not in q:
            q[c] = np.nan
    q["step"] = q["step"].astype(float).fillna(-1)
    rew = q["reward"].astype(float)
    base = rew - rew.groupby([q["run_id"], q["step"], q["prompt_id"]]).transform("mean")
    a = q["advantage"].astype(float).fillna(base)
    sign = np.where(a > 0, "positive", np.where(a < 0, "negative", None))
    return pd.Series(sign, index=pd.MultiIndex.from_frame(q[["run_id", "seq_id"]]), name="adv_sign")


def naive_rows(store) -> pd.DataFrame:
    """One row per (token, scorer) with rollout, scorer, every per-token metric, computed naively."""
    f = store.frames
    runs = f["runs"].assign(rollout=lambda r: r["engine"] + ":" + r["engine_dtype"])[["run_id", "rollout"]]
    t = f["tokens"].merge(runs, on="run_id")
    df = t.merge(f["scores"], on=["run_id", "seq_id", "pos"])
    signs = naive_adv_sign(f["sequences"])
    df["adv_sign"] = [signs.get((r, s)) for r, s in zip(df["run_id"], df["seq_id"])]
    rows = []
    for row in df.itertuples(index=False):
        lmu = float(row.logp_rollout) if row.logp_rollout is not pd.NA else math.nan
        lpi = float(row.logp) if row.logp is not pd.NA else math.nan
        finite = math.isfinite(lmu) and math.isfinite(lpi) and not bool(row.nonfinite)
        out = {"finite": finite, "lmu": lmu, "lpi": lpi}
        if finite:
            mu, pi = math.exp(lmu), math.exp(lpi)
            r = math.exp(lpi - lmu)
            out |= {"mu": mu, "pi": pi, "r": r, "dlogp": lpi - lmu, "dp": pi - mu, "btv": abs(pi - mu), "k1": lmu - lpi,
                        "k2": 0.5 * (lpi - lmu) ** 2, "k3": r - (lpi - lmu) - 1.0, "bkl": naive_binary_kl(mu, pi)}  # fmt: skip
            if hasattr(row, "topk_ids_rollout") and isinstance(row.topk_ids_rollout, (list, np.ndarray)):
                out["topk_tv"], out["topk_kl"] = naive_topk(row.topk_ids_rollout, row.topk_logps_rollout,
                                                            row.logps_at_rollout_topk, row.token_id, lmu, lpi)  # fmt: skip
        rows.append(out)
    metrics = pd.DataFrame(rows, index=df.index)
    keep = ["run_id", "seq_id", "pos", "rollout", "scorer", "token_id", "token_text", "category", "adv_sign"]
    keep += [c for c in ("entropy", "tv_exact_vs_ref") if c in df]
    out = pd.concat([df[keep], metrics], axis=1)
    for c in ("mu", "pi", "r", "dlogp", "dp", "btv", "k1", "k2", "k3", "bkl", "topk_tv", "topk_kl", "entropy", "tv_exact_vs_ref"):
        out[c] = pd.to_numeric(out[c], errors="coerce") if c in out else np.nan
    return out


def naive_scorer_rows(store, reference: str = "hf:fp32") -> pd.DataFrame:
    """One row per (token, scorer != reference): the reference's log-prob as lmu, naive metrics."""
    f = store.frames
    runs = f["runs"].assign(rollout=lambda r: r["engine"] + ":" + r["engine_dtype"])[["run_id", "rollout"]]
    sc = f["scores"]
    ref = sc[sc["scorer"] == reference].add_prefix("ref_").rename(
        columns={"ref_run_id": "run_id", "ref_seq_id": "seq_id", "ref_pos": "pos"}
    )
    df = sc[sc["scorer"] != reference].merge(ref, on=["run_id", "seq_id", "pos"]).merge(runs, on="run_id")
    df = df.merge(f["tokens"][["run_id", "seq_id", "pos", "token_id"]], on=["run_id", "seq_id", "pos"])
    rows = []
    for row in df.itertuples(index=False):
        lmu = float(row.ref_logp) if row.ref_logp is not pd.NA else math.nan
        lpi = float(row.logp) if row.logp is not pd.NA else math.nan
        finite = math.isfinite(lmu) and math.isfinite(lpi) and not (row.nonfinite or row.ref_nonfinite)
        out = {"finite": finite, "lmu": lmu, "lpi": lpi}
        if finite:
            mu, pi = math.exp(lmu), math.exp(lpi)
            out |= {"btv": abs(pi - mu), "dlogp": lpi - lmu, "r": math.exp(lpi - lmu)}
            if isinstance(getattr(row, "ref_topk_ids", None), (list, np.ndarray)):
                out["topk_tv"], _ = naive_topk(row.ref_topk_ids, row.ref_topk_logps, row.logps_at_ref_topk,
                                               row.token_id, lmu, lpi)  # fmt: skip
        rows.append(out)
    metrics = pd.DataFrame(rows, index=df.index)
    keep = ["run_id", "seq_id", "pos", "rollout", "scorer"] + (["tv_exact_vs_ref"] if "tv_exact_vs_ref" in df else [])
    out = pd.concat([df[keep], metrics], axis=1)
    for c in ("btv", "dlogp", "r", "topk_tv", "tv_exact_vs_ref"):
        out[c] = pd.to_numeric(out[c], errors="coerce") if c in out else np.nan
    return out


def row_of(df: pd.DataFrame, **match) -> pd.Series:
    """The single row of df matching every column=value given."""
    sel = df
    for k, v in match.items():
        sel = sel[sel[k] == v]
    assert len(sel) == 1, f"expected one row for {match}, got {len(sel)}"
    return sel.iloc[0]


def rollout_label(engine, dtype) -> str:
    """'<engine>:<dtype>', or the engine alone where the dtype is unknown (None, NaN or empty)."""
    return f"{engine}:{dtype}" if isinstance(dtype, str) and dtype else str(engine)


def naive_pair_rows(frames: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """Vectorised pandas reference of the rollout pairs: one row per (token, scorer) of frames as written,
    with rollout (rollout_label), scorer, step, category ('uncategorized' where NULL), entropy, tv_exact,
    adv_sign (stored advantage), finite and, on finite rows, dp, abs_dp, dlogp, abs_dlogp, r, k3."""
    runs = frames["runs"]
    labels = runs.assign(rollout=[rollout_label(e, t) for e, t in zip(runs["engine"], runs["engine_dtype"])])
    tok = frames["tokens"].merge(labels[["run_id", "rollout"]], on="run_id")
    sc = frames["scores"]
    df = tok.merge(sc, on=["run_id", "seq_id", "pos"])
    seqs = frames["sequences"]
    seq_cols = ["run_id", "seq_id"] + [c for c in ("step", "advantage") if c in seqs]
    df = df.merge(seqs[seq_cols], on=["run_id", "seq_id"], how="left")
    lmu = pd.to_numeric(df["logp_rollout"], errors="coerce").to_numpy(dtype=float, na_value=np.nan)
    lpi = pd.to_numeric(df["logp"], errors="coerce").to_numpy(dtype=float, na_value=np.nan)
    with np.errstate(over="ignore", invalid="ignore"):
        r = np.exp(lpi - lmu)
        finite = np.isfinite(lmu) & np.isfinite(lpi) & np.isfinite(r) & ~df["nonfinite"].fillna(False).astype(bool).to_numpy()
        mu, pi = np.exp(lmu), np.exp(lpi)
    out = pd.DataFrame({
        "run_id": df["run_id"], "seq_id": df["seq_id"], "pos": df["pos"], "rollout": df["rollout"],
        "scorer": df["scorer"], "token_id": df["token_id"],
        "step": df["step"].astype("Int64") if "step" in df else pd.array([pd.NA] * len(df), dtype="Int64"),
        "category": df["category"].fillna("uncategorized") if "category" in df else "uncategorized",
        "entropy": _numeric(df, "entropy"),
        "tv_exact": _numeric(df, "tv_exact_vs_ref"),
        "advantage": _numeric(df, "advantage"),
        "finite": finite,
    })  # fmt: skip
    out["adv_sign"] = np.where(out["advantage"] > 0, "positive", np.where(out["advantage"] < 0, "negative", None))
    for name, values in {"dp": pi - mu, "dlogp": lpi - lmu, "r": r, "k3": r - (lpi - lmu) - 1.0}.items():
        out[name] = np.where(finite, values, np.nan)
    out["abs_dp"], out["abs_dlogp"] = out["dp"].abs(), out["dlogp"].abs()
    return out


def _numeric(df: pd.DataFrame, column: str) -> pd.Series:
    if column not in df:
        return pd.Series(np.nan, index=df.index)
    return pd.Series(pd.to_numeric(df[column], errors="coerce").to_numpy(dtype=float, na_value=np.nan), index=df.index)
