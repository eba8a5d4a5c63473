"""Where a pair's mismatch comes from: each source's share of it, from what the store holds. Pure computation
over DataFrames (measure.py reads them: `scored`, `pairs`' rows, `batch`); no SQL, no I/O.

The measure is M = mean |log π − log μ| (nats) over a pair's rows. A source's share is what its fix would
remove, as a fraction of M, clipped to [0, 1]:

    share = max(0, M − M_without) / M

where M_without is the mismatch once that source is taken away, measured on the SAME (token, scorer) rows
wherever the store holds the counterfactual on the rollout's own tokens (another scorer of the same tokens):

    precision        both sides computed in fp32 with their own weights: the rollout side replaced by a scorer
                     of its tokens at fp32 on its weights (its engine first, e.g. vllm:fp32, else the trainer's
                     engine, hf:fp32[-w<format>]), the scorer side by its fp32 twin; M_without = mean |log π_twin(S)
                     − log π_twin(R)|, plus, where the rollout's twin is another engine's, that engine difference at
                     fp32 as the store measured it (the <engine>:fp32 rollout scored by the twin, on its own tokens);
                     a processed μ's twin is the twin scorer's log π on the sampling support (logp_support)
    weight_rounding  the two sides on differently rounded weights ('-w<format>' in a label, e.g. an fp8-weights
                     rollout): the scorer replaced by the same scorer on the rollout's weights (hf:fp32 →
                     hf:fp32-wfp8); 0 where both labels name the same weights (a dtype's own rounding of the
                     checkpoint, e.g. a bf16 rollout of fp32 weights, counts as precision)
    support          the rollout's μ after its sampling rule (temperature, top-k, top-p; processed log-probs)
                     against a raw π: the scorer's log π restricted to that support and renormalised
                     (`scores.logp_support`, what replaying the sampling mask in the trainer computes)
    staleness        μ from an older policy: M_without = M over the pair's sequences with
                     `sequences.policy_lag` = 0 (other tokens of the same runs)
    batch_composition  no counterfactual on the same tokens: share = min(1, D / M), D = mean |Δ log μ| of the
                     same rollout between generation batch sizes on their shared prefix (the `batch` measurement,
                     the largest over the batch sizes compared), M over all the pair's finite rows
    routing          an MoE rollout's expert choices against the trainer's own: the scorer replaced by the same
                     scorer replaying the rollout's expert ids (`<scorer>-r3`, store.schema's routing side label);
                     M_without = mean |log π_r3 − log μ|; 0 for a scorer that already replays (`-r3`); not measured
                     without such a scorer (a dense model has none)

A source the store cannot measure gets share NaN and a `reason`. The shares need not sum to 1: fixes overlap
(a bf16 rollout is batch-variant because it computes in bf16), and what no measured fix removes,
max(0, 1 − Σ measured shares), is 'unexplained by what this store holds'.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from mismatch_lab.analysis.routing import R3_SUFFIX as R3

MU = "μ"
"""The rollout side's own log-probs (tokens.logp_rollout) in a counterfactual pair."""
TRAINER_ENGINE = "hf"
"""The engine whose fp32 scorer stands in for a side at fp32 when the side's own engine has none."""


@dataclass(frozen=True)
class Source:
    title: str
    fix: str
    rules: tuple[str, ...] = ()  # the recommend.py rules whose advice fixes this source


SOURCES = {
    "precision": Source("precision", "fp16 rollouts and trainer, or fp32 where it matters (the lm_head in fp32)",
                        ("fp16",)),
    "weight_rounding": Source("weight rounding", "roll out on the trainer's weights, or train on the rounded "
                              "weights (quantisation-aware training)"),
    "batch_composition": Source("batch composition", "batch-invariant kernels (or a fixed batch composition)",
                                ("batch",)),
    "support": Source("sampling support", "replay the sampling mask (temperature, top-k, top-p) in the trainer, "
                      "or return raw log-probs from the engine"),
    "staleness": Source("staleness", "fewer off-policy steps, or correct with the behaviour policy's log-probs"),
    "routing": Source("routing", "R3: replay the rollout's expert routing in the trainer", ("routing",)),
}
UNEXPLAINED = "unexplained"
RULE_SOURCE = {rule: name for name, src in SOURCES.items() for rule in src.rules}
"""recommend.py's rule -> the source its advice fixes (rules absent here correct a mismatch, whatever its source)."""


def parse(label: str) -> tuple[str, str, str]:
    """'<engine>:<compute dtype>[-w<format>][-<sampling>...]' -> (engine, compute dtype, 'w<format>' or '')."""
    engine, _, dtype = str(label).partition(":")
    parts = dtype.split("-")
    return engine, parts[0], next((p for p in parts[1:] if p.startswith("w")), "")


def wide(scored: pd.DataFrame, rollout: str) -> pd.DataFrame:
    """One rollout's (token, scorer) rows of `scored` as one row per token: lmu, lag, and per scorer s the
    columns lpi|s, finite|s, log_s|s, lp_s|s."""
    g = scored[scored["rollout"] == rollout]
    keys = ["run_id", "seq_id", "pos"]
    base = g.drop_duplicates(keys).set_index(keys)[["lmu", "lag"]]
    per = g.drop_duplicates([*keys, "scorer"]).set_index([*keys, "scorer"])[["lpi", "finite", "log_s", "lp_s"]]
    per = per.unstack("scorer")
    per.columns = [f"{c}|{s}" for c, s in per.columns]
    return base.join(per)


def _col(w: pd.DataFrame, side: str) -> pd.Series:
    return w["lmu"] if side == MU else w[f"lpi|{side}"]


def _ok(w: pd.DataFrame, *sides: str) -> pd.Series:
    ok = pd.Series(True, index=w.index)
    for s in sides:
        if s != MU:
            ok &= w[f"finite|{s}"].fillna(False).astype(bool)
    return ok


def mean_abs(a: pd.Series, b: pd.Series) -> float:
    d = (a - b).abs()
    return float(d.mean()) if len(d) else math.nan


def _row(rollout, scorer, source, share=math.nan, m=math.nan, without=math.nan, n=0, evidence="", reason=None,
         runs=()) -> dict:
    return {"rollout": rollout, "scorer": scorer, "source": source, "share": share, "mismatch": m,
            "without": without, "n": int(n), "evidence": evidence, "reason": reason, "bound": None, "runs": list(runs),
            "fix": SOURCES[source].fix if source in SOURCES else "", "rules": list(SOURCES[source].rules)
            if source in SOURCES else []}


def _share(m: float, without: float) -> float:
    return max(0.0, m - without) / m if m > 0 else math.nan


def _removal(w, rollout, scorer, source, a, b, evidence, extra=0.0, rows=None) -> dict:
    """The share of `source` where its counterfactual is the pair (a, b) on the same rows (module doc)."""
    ok = _ok(w, scorer, a, b) if rows is None else rows & _ok(w, scorer, a, b)
    sub = w[ok]
    m, without = mean_abs(sub[f"lpi|{scorer}"], sub["lmu"]), mean_abs(_col(sub, a), _col(sub, b)) + extra
    if not len(sub) or not m > 0:
        return _row(rollout, scorer, source, reason=f"no finite row of {rollout}/{scorer} with a mismatch to share")
    return _row(rollout, scorer, source, _share(m, without), m, without, len(sub), evidence)


def fp32_twin(label: str, scorers: list[str]) -> str | None:
    """The side `label` computed in fp32 on its own weights among `scorers` (itself when already fp32)."""
    engine, compute, w = parse(label)
    if compute == "fp32":
        return label
    suffix = f"-{w}" if w else ""
    return next((c for c in (f"{engine}:fp32{suffix}", f"{TRAINER_ENGINE}:fp32{suffix}") if c in scorers), None)


def precision(w, rollout, scorer, scorers, pair_means: dict) -> dict:
    unknown = [x for x in (rollout, scorer) if not parse(x)[1]]
    if unknown:
        return _row(rollout, scorer, "precision", reason=f"not measured: {unknown[0]}'s label names no dtype (a "
                    "recorded or imported run): its compute precision is not known")
    cs = fp32_twin(scorer, scorers)
    cr = MU if parse(rollout)[1] == "fp32" else fp32_twin(rollout, scorers)
    if cs is None or cr is None:
        side = scorer if cs is None else rollout
        wr = parse(side)[2]
        return _row(rollout, scorer, "precision", reason=f"not measured: no fp32 twin of {side} among the scorers "
                    f"of {rollout}'s tokens (`collect --scorer-dtypes fp32{'-' + wr if wr else ''}`)")
    extra, note, upper = 0.0, "", False
    if cr != MU and parse(cr)[0] != parse(rollout)[0]:
        engine, _, wr = parse(rollout)
        twin_rollout = f"{engine}:fp32{'-' + wr if wr else ''}"
        extra = pair_means.get((twin_rollout, cr), math.nan)
        note = (f"; {parse(rollout)[0]} vs {parse(cr)[0]} at fp32 ({twin_rollout}/{cr}, its own tokens) "
                f"{extra:.3g} added" if not math.isnan(extra) else
                f"; the {parse(rollout)[0]} vs {parse(cr)[0]} difference at fp32 is not measured (no {twin_rollout} "
                f"rollout scored by {cr}) and counts as precision")
        upper, extra = math.isnan(extra), 0.0 if math.isnan(extra) else extra
    sides = "both sides already fp32" if (cr == MU and cs == scorer) else f"{cr} for {rollout}, {cs} for {scorer}"
    if cr != MU and rollout.endswith(PROCESSED):  # a processed μ's twin is processed too: π on its support
        if f"lp_s|{cr}" not in w or not w[f"lp_s|{cr}"].notna().any():
            return _row(rollout, scorer, "precision", reason=f"not measured: {rollout}'s μ is processed and its "
                        f"fp32 twin {cr} has no log π on the sampling support (scores.logp_support)")
        w, cr, sides = _on_support(w, cr), f"{cr}{PROCESSED}", sides + " (on the rollout's sampling support)"
    out = _removal(w, rollout, scorer, "precision", cs, cr, f"fp32 twins on {rollout}'s tokens: {sides}{note}", extra)
    return out | {"bound": "upper" if note and upper else None}


def weight_rounding(w, rollout, scorer, scorers) -> dict:
    wr, (engine, compute, ws) = parse(rollout)[2], parse(scorer)
    if not parse(rollout)[1]:
        return _row(rollout, scorer, "weight_rounding", reason="not measured: the rollout's label names no dtype "
                    "(a recorded or imported run): its weights are not known")
    if ws == wr:
        return _row(rollout, scorer, "weight_rounding", 0.0, evidence="both sides on the same weights" + (
            f" ({wr})" if wr else " (a dtype's own rounding of the checkpoint counts as precision)"))
    twin = f"{engine}:{compute}{'-' + wr if wr else ''}"
    if twin not in scorers:
        return _row(rollout, scorer, "weight_rounding", reason=f"not measured: needs the scorer {twin} (the scorer on "
                    f"the rollout's weights) on {rollout}'s tokens "
                    f"(`collect --scorer-dtypes {twin.partition(':')[2]}`)")
    return _removal(w, rollout, scorer, "weight_rounding", twin, MU, f"{twin} (the scorer on {rollout}'s weights) "
                    f"vs {rollout}")


def rule_side(lp_s, finite) -> tuple[np.ndarray, np.ndarray]:
    """The sampling rule's side of a pair and where it is usable: the scorer's log π tempered, restricted to
    the rollout's support and renormalised (`scores.logp_support`, what replaying the sampling mask computes),
    on finite rows whose token is inside that support. The rule's bias of a row is log π − this side: log S
    at T = 1, log S plus the temperature's reshaping of π otherwise. The support share (`support`) and the
    support_bias check (`support_table`, the same share) both read the rule through this one side."""
    lp = np.asarray(pd.Series(lp_s).to_numpy(dtype=float, na_value=np.nan), dtype=float)
    return lp, np.isfinite(lp) & pd.Series(finite).fillna(False).astype(bool).to_numpy()


def _on_support(w: pd.DataFrame, scorer: str) -> pd.DataFrame:
    """`w` with the side '<scorer>-processed': the scorer's log π on the rollout's sampling rule (`rule_side`)."""
    lp, ok = rule_side(w[f"lp_s|{scorer}"], w[f"finite|{scorer}"])
    return w.assign(**{f"lpi|{scorer}{PROCESSED}": lp, f"finite|{scorer}{PROCESSED}": ok})


def support(w, rollout, scorer) -> dict:
    col = f"log_s|{scorer}"
    if col not in w or not w[col].notna().any():
        return _row(rollout, scorer, "support", reason="not measured: no log S stored for this pair "
                    "(scores.log_support: a rollout with a sampling rule, "
                    "`collect --top-p/--sample-top-k/--temperature`)")
    sub = _on_support(w, scorer)
    rows = sub[f"finite|{scorer}{PROCESSED}"]
    out = _removal(sub, rollout, scorer, "support", f"{scorer}{PROCESSED}", MU, f"{scorer}'s log π on {rollout}'s "
                   f"sampling support (scores.logp_support) vs {rollout}", rows=rows)
    return out | {"evidence": out["evidence"] + f"; mean log S {float(w.loc[rows, col].mean()):.3g}"}


def staleness(w, rollout, scorer) -> dict:
    if not w["lag"].notna().any():
        return _row(rollout, scorer, "staleness", reason="not measured: no sequences.policy_lag stored (runs that "
                    "train off-policy record it)")
    fin = _ok(w, scorer)
    fresh, stale = fin & (w["lag"] == 0), fin & (w["lag"] > 0)
    m = mean_abs(w.loc[fin, f"lpi|{scorer}"], w.loc[fin, "lmu"])
    if not stale.any():
        return _row(rollout, scorer, "staleness", 0.0, m, m, int(fin.sum()), "every sequence has policy_lag 0")
    if not fresh.any():
        return _row(rollout, scorer, "staleness", reason="not measured: no sequence with policy_lag 0 to compare")
    without = mean_abs(w.loc[fresh, f"lpi|{scorer}"], w.loc[fresh, "lmu"])
    return _row(rollout, scorer, "staleness", _share(m, without), m, without, int(fin.sum()),
                f"policy_lag 0 sequences ({int(fresh.sum())} rows) vs all ({int(fin.sum())} rows)")


def routing(rollout, scorer, scorers, w) -> dict:
    """The routing source: what replaying the rollout's expert ids in the trainer (R3) removes (module doc)."""
    if scorer.endswith(R3):
        return _row(rollout, scorer, "routing", 0.0, evidence=f"{scorer} already replays {rollout}'s expert routing")
    twin = f"{scorer}{R3}"
    if twin not in scorers:
        return _row(rollout, scorer, "routing", reason=f"not measured: no {twin} scorer (the trainer replaying the "
                    f"rollout's expert routing, MoE runs only; docs/moe.md) of {rollout}'s tokens")
    return _removal(w, rollout, scorer, "routing", twin, MU, f"{twin} (the trainer on {rollout}'s expert ids) vs {rollout}")


def routing_rows(scored: pd.DataFrame, pairs) -> dict[tuple[str, str], dict]:
    """(rollout, scorer) -> the routing source's row (`routing`) of each pair of `pairs`: the one R3 share,
    which the attribution lists under "where it comes from" and doctor's R3 advice (recommend.routing) quotes.
    A rollout's tokens are laid out (`wide`) only where one of its scorers has an R3 twin."""
    out = {}
    for rollout in dict.fromkeys(ro for ro, _ in pairs):
        scorers = sorted(scored.loc[scored["rollout"] == rollout, "scorer"].unique())
        w = wide(scored, rollout) if any(f"{s}{R3}" in scorers for s in scorers) else None
        out |= {(ro, sc): routing(rollout, sc, scorers, w) for ro, sc in pairs if ro == rollout}
    return out


def batch_composition(batch: pd.DataFrame, rollout, scorer, m: float, n: int) -> dict:
    b = batch[batch["rollout"] == rollout] if not batch.empty else batch
    if b.empty:
        return _row(rollout, scorer, "batch_composition", reason="not measured: needs collect runs of this rollout "
                    "at two generation batch sizes (studies/batch-invariance/study.toml)")
    r = b.sort_values("abs_dlogp_mean", ascending=False).iloc[0]
    d = float(r["abs_dlogp_mean"])
    return _row(rollout, scorer, "batch_composition", min(1.0, d / m) if m > 0 else math.nan, m, math.nan, n,
                f"mean |Δ log μ| {d:.3g} between generation batch {int(r['b0'])} and {int(r['batch'])} "
                f"({int(r['n_tok'])} shared-prefix tokens) against the pair's {m:.3g}")


def pair_means(scored: pd.DataFrame) -> dict[tuple[str, str], float]:
    """(rollout, scorer) -> M over the pair's finite rows."""
    f = scored[scored["finite"]]
    return (f["lpi"] - f["lmu"]).abs().groupby([f["rollout"], f["scorer"]]).mean().to_dict()


def attribute(scored: pd.DataFrame, batch: pd.DataFrame) -> list[dict]:
    """Every (rollout, scorer) pair's rows: one per source of SOURCES and one 'unexplained' (module doc)."""
    if scored.empty:
        return []
    means, out = pair_means(scored), []
    for rollout in sorted(scored["rollout"].unique()):
        w = wide(scored, rollout)
        scorers = sorted(scored.loc[scored["rollout"] == rollout, "scorer"].unique())
        runs = sorted(scored.loc[scored["rollout"] == rollout, "run_id"].unique())
        for scorer in scorers:
            m, n = means.get((rollout, scorer), math.nan), int(_ok(w, scorer).sum())
            rows = [precision(w, rollout, scorer, scorers, means), weight_rounding(w, rollout, scorer, scorers),
                    batch_composition(batch, rollout, scorer, m, n), support(w, rollout, scorer),
                    staleness(w, rollout, scorer), routing(rollout, scorer, scorers, w)]
            out += [r | {"runs": runs} for r in rows] + [unexplained(rows, rollout, scorer, m, n, runs)]
    return out


def unexplained(rows: list[dict], rollout, scorer, m: float, n: int, runs) -> dict:
    measured = [r["share"] for r in rows if not math.isnan(r["share"])]
    share = max(0.0, 1.0 - sum(measured)) if m > 0 else math.nan
    return _row(rollout, scorer, UNEXPLAINED, share, m, n=n, runs=runs, reason=None if m > 0 else
                "the pair has no mismatch to share", evidence="1 − the sum of the measured shares: what no "
                "source this store measures removes") | {"fix": "", "rules": []}


def support_table(scored: pd.DataFrame) -> pd.DataFrame:
    """The support_bias check's rows: per pair of a rollout whose μ is processed (its label ends in PROCESSED)
    with log S stored, over its finite rows inside the rule's support (`rule_side`): support_ratio = the
    support share of the attribution (`support`), max(0, M − M_rule) / M with M = mean |log π − log μ| and
    M_rule = mean |log π_rule − log μ|. Also the mean rule bias log π − log π_rule (= log S at T = 1) and
    mean log S, the part of it the cut accounts for."""
    cols = ["rollout", "scorer", "support_ratio", "abs_dlogp_mean", "abs_dlogp_rule", "mean_rule_bias", "mean_log_s",
            "n_support"]
    lp_s = scored["lp_s"] if "lp_s" in scored else pd.Series(np.nan, index=scored.index)
    lp, ok = rule_side(lp_s, scored["finite"])
    keep = ok & scored["log_s"].notna().to_numpy() & scored["rollout"].str.endswith(PROCESSED).to_numpy()
    if not keep.any():
        return pd.DataFrame(columns=cols)
    s = scored[keep]
    lpi, lmu = s["lpi"].astype(float), s["lmu"].astype(float)
    g = s.assign(ad=(lpi - lmu).abs(), ad_rule=(lp[keep] - lmu).abs(), bias=lpi - lp[keep])
    t = g.groupby(["rollout", "scorer"]).agg(
        abs_dlogp_mean=("ad", "mean"), abs_dlogp_rule=("ad_rule", "mean"), mean_rule_bias=("bias", "mean"),
        mean_log_s=("log_s", "mean"), n_support=("ad", "size")).reset_index()
    share = [_share(m, w) for m, w in zip(t["abs_dlogp_mean"], t["abs_dlogp_rule"])]
    return t.assign(support_ratio=share)[cols]


PROCESSED = "-processed"
"""The rollout label's suffix of processed log-probs (scoring.support.SamplingRule.label: μ after the rule)."""

__all__ = ["SOURCES", "attribute", "rule_side", "support_table"]
