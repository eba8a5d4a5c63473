"""What to change, derived from the store's own measurements (never canned text): each rule reads the
measurements and returns advice only where the numbers support it, with the numbers behind it.

    fp16            a fp16 rollout measured N× below bf16 (same engine, same or same-precision scorer); names
                    the trainer dtype(s) and pairs measured, and advises an fp16 trainer only where one was
    sequence_ratio  the product sequence ratio leaves [0.5, 2] for X % of sequences, the geometric mean Y %
    trust_region    PPO's ratio clip drops W % of tokens, DPPO's binary-TV mask Z %
    tv_estimator    where exact TV is stored and tokens exceed δ_TV: binary TV misses X % of them, top-K Y %
    growth          a run whose per-step mean |π − μ| grows significantly
    batch           a rollout whose sequences change with the generation batch size
    nonfinite       non-finite rows, which every mean excludes
    routing         an MoE pair whose R3 replay removes most of its mean |Δ log p| (enable R3, named per framework),
                    or whose tokens change experts with no R3 scorer to say how much that costs

Each rule: `rule(m: Measurements) -> list[dict]` with keys `rule`, `advice`, `because` (the sentence with
the numbers) and `numbers` (the same numbers, by name).

A rule that advises a correction method of the registry (ADVISES) reads the share of sequences that method
drops on the same pair from `mismatch-lab corrections`' own rows of the same store (measurement
`corrections`), names it, and never advises a method dropping more than MAX_DROPPED_SEQS of them.
"""

from __future__ import annotations

import math

import pandas as pd

from mismatch_lab.analysis import definitions as d
from mismatch_lab.doctor import bands as B
from mismatch_lab.doctor.measure import Measurements

FP16_PAPER = "FP16 paper, arXiv 2510.26788"

MAX_DROPPED_SEQS = 0.5
"""Doctor advises no correction that drops more than half of the pair's sequences (every token M = 0) at its
published defaults on the judged store: such a rule throws away most of the batch's learning signal, which
no mismatch correction is meant to do (it says the rule's band is far tighter than this store's mismatch,
e.g. verl's Geo-RS [0.999, 1.001] drops 92.6 % of studies/precision-sweep's vllm:bf16/hf:fp32 sequences).
The share is named instead."""

ADVISES = {
    "sequence_ratio": {"token-level correction": ("token_tis", "icepop"), "geometric-mean correction": ("geo_mis",)},
    "trust_region": {"DPPO binary TV": ("dppo_binary_tv",), "DPPO top-K TV": ("dppo_topk_tv",)},
    "tv_estimator": {"top-K TV (DPPO top-K)": ("dppo_topk_tv",)},
}
"""The registry methods (corrections/registry.py) behind each named option of each advising rule."""
ADVISABLE = sorted({m for options in ADVISES.values() for ms in options.values() for m in ms})
"""The methods whose dropped share doctor measures (measure.corrections)."""


def _advice(rule: str, advice: str, because: str, **numbers) -> dict:
    return {"rule": rule, "advice": advice, "because": because, "numbers": numbers}


def _split(label: str) -> tuple[str, str]:
    engine, _, dtype = str(label).partition(":")
    return engine, dtype


def _dropped(m: Measurements, method: str, rollout: str, scorer: str) -> tuple[float, float, int]:
    """(share of the pair's sequences `method` drops whole, the pair's sequences, the sample's stride: 1 for
    every prompt group): `mismatch-lab corrections`' frac_seqs_masked and n_seqs of the same store (of a sample
    of a large one, measure.corrections); NaN where it has no number (no finite token, no top-K)."""
    c = m.get("corrections")
    row = c[(c["method"] == method) & (c["rollout"] == rollout) & (c["scorer"] == scorer)] if not c.empty else c
    if not len(row):
        return math.nan, math.nan, 1
    every = int(row["sample_every"].iloc[0]) if "sample_every" in row else 1
    return float(row["frac_seqs_masked"].iloc[0]), float(row["n_seqs"].iloc[0]), every


def _vet(m: Measurements, options: dict[str, tuple[str, ...]], rollout: str, scorer: str):
    """The options (name -> registry methods, from ADVISES) on one pair, each method judged by its dropped
    share: ({option: its methods that drop at most MAX_DROPPED_SEQS (or were not measured)}, the sentence
    naming every share, {'<method>_dropped_seqs_pct': share in %})."""
    kept, parts, pct, n_seqs, every = {}, [], {}, math.nan, 1
    for option, methods in options.items():
        for x in methods:
            share, n, every = _dropped(m, x, rollout, scorer)
            pct[f"{x}_dropped_seqs_pct"] = 100 * share
            n_seqs = n if math.isnan(n_seqs) else n_seqs
            refused = share > MAX_DROPPED_SEQS  # False for NaN: not measured is said, not refused
            parts.append(f"{x} not measured" if math.isnan(share) else f"{x} {100 * share:.3g} %"
                         + (f" (not advised: above {100 * MAX_DROPPED_SEQS:g} %)" if refused else ""))
            if not refused:
                kept.setdefault(option, []).append(x)
    of = f" of its {int(n_seqs):,} sequences" if not math.isnan(n_seqs) else " of its sequences"
    if every > 1:
        of = f" of {int(n_seqs):,} sequences sampled (1 in {every} prompt groups)" if not math.isnan(n_seqs) else of
    return kept, f"`mismatch-lab corrections` on {rollout}/{scorer}, share{of} dropped: {', '.join(parts)}", pct


def _named(kept: dict[str, list[str]]) -> str:
    return " or ".join(f"{o} ({', '.join(ms)})" for o, ms in kept.items())


def _withheld(rule: str, options: dict[str, tuple[str, ...]], said: str, rollout: str, scorer: str, **numbers) -> dict:
    """The advice a rule gives instead where every method it would advise drops most sequences."""
    methods = ", ".join(x for ms in options.values() for x in ms)
    return _advice(rule, f"do not enable {methods} at the published defaults on {rollout}/{scorer}", said,
                   **numbers)


def _fp16_pairs(p: pd.DataFrame) -> tuple[pd.Series, pd.Series] | None:
    """(bf16 pair, fp16 pair) of one rollout engine to compare: same-precision pairs (each rollout scored by
    a trainer of its own dtype: the RL setting) first, else the same scorer (hf:fp32 first)."""
    rows = {(r["rollout"], r["scorer"]): r for r in p.to_dict("records")}
    engines = sorted({_split(r)[0] for r, _ in rows})
    for eng in engines:
        bf, fp = f"{eng}:bf16", f"{eng}:fp16"
        for sb, sf in [("hf:bf16", "hf:fp16"), (f"{eng}:bf16", f"{eng}:fp16")]:
            if (bf, sb) in rows and (fp, sf) in rows:
                return pd.Series(rows[(bf, sb)]), pd.Series(rows[(fp, sf)])
        common = sorted({s for r, s in rows if r == bf} & {s for r, s in rows if r == fp},
                        key=lambda s: (s != d.REFERENCE_SCORER, s))
        if common:
            return pd.Series(rows[(bf, common[0])]), pd.Series(rows[(fp, common[0])])
    return None


def fp16(m: Measurements) -> list[dict]:
    p = m.get("pairs")
    if p.empty or not p["rollout"].map(lambda r: _split(r)[1] == "bf16").any():
        return []
    found = _fp16_pairs(p)
    if found is None:
        rollout = p.loc[p["rollout"].map(lambda r: _split(r)[1] == "bf16"), "rollout"].iloc[0]
        return [_advice("fp16", "measure a fp16 rollout next to bf16",
                        f"only bf16 is measured for {rollout}; `mismatch-lab doctor --model M --rollout-dtype bf16,fp16 "
                        f"--trainer-dtype bf16,fp16 --db probe.duckdb` measures both rollouts of model M in a probe "
                        f"store of its own (a new .duckdb file; this machine's engines, not this store's run) and "
                        f"makes the comparison the {FP16_PAPER} makes")]
    bf, fp = found
    if not (math.isfinite(bf["abs_dp_mean"]) and math.isfinite(fp["abs_dp_mean"])):  # a side without finite rows
        unmeasured = bf if not math.isfinite(bf["abs_dp_mean"]) else fp
        return [_advice("fp16", "measure the fp16 and bf16 rollouts again",
                        f"{unmeasured['rollout']}/{unmeasured['scorer']} has no finite scored token: fp16 and bf16 "
                        f"cannot be compared ({FP16_PAPER})")]
    ratio = bf["abs_dp_mean"] / fp["abs_dp_mean"] if fp["abs_dp_mean"] > 0 else float("inf")
    because = (f"mean |π − μ| {bf['rollout']}/{bf['scorer']} {bf['abs_dp_mean']:.3g} vs {fp['rollout']}/{fp['scorer']} "
               f"{fp['abs_dp_mean']:.3g}: fp16 is {ratio:.3g}× below bf16 ({FP16_PAPER}); {_trainers_measured(bf, fp)}")
    advice = (f"use fp16 rollouts {_fp16_trainer_advice(fp)}" if ratio >= B.FP16_GAIN
              else f"fp16 gains less than {B.FP16_GAIN:g}× here: precision is not the main source")
    return [_advice("fp16", advice, because, ratio=ratio, bf16=bf["abs_dp_mean"], fp16=fp["abs_dp_mean"],
                    bf16_pair=f"{bf['rollout']}/{bf['scorer']}", fp16_pair=f"{fp['rollout']}/{fp['scorer']}",
                    fp16_trainer_dtype=_split(fp["scorer"])[1])]


def _fp16_trainer_advice(fp: pd.Series) -> str:
    """An fp16 trainer is advised only where the fp16 rollout was measured against one."""
    if _split(fp["scorer"])[1] == "fp16":
        return f"and an fp16 trainer (measured: {fp['rollout']} against the {fp['scorer']} trainer)"
    return (f"(measured against the {fp['scorer']} trainer only; an fp16 trainer was not measured: "
            f"--trainer-dtype fp16 in a `doctor --model` probe measures it)")


def _trainers_measured(bf: pd.Series, fp: pd.Series) -> str:
    dtypes = {_split(bf["scorer"])[1], _split(fp["scorer"])[1]}
    if len(dtypes) == 1:
        return f"both rollouts scored by the same {fp['scorer']} trainer (trainer dtype {dtypes.pop()})"
    return (f"each rollout scored by a trainer of its own dtype ({bf['scorer']}, {fp['scorer']}): the trainer dtype "
            f"changes with the rollout's")


def sequence_ratio(m: Measurements) -> list[dict]:
    p = m.get("pairs")
    p = p[p["seq_product_out"].fillna(0) > p["seq_geo_out"].fillna(0)] if not p.empty else p
    if p.empty:
        return []
    r = p.sort_values(["seq_product_out", "rollout", "scorer"], ascending=[False, True, True]).iloc[0]
    x, y = 100 * r["seq_product_out"], 100 * r["seq_geo_out"]
    because = (f"{r['rollout']}/{r['scorer']}: the product ratio exp(Σ log r) leaves [{B.IS_WEIGHT_LOW}, "
               f"{B.IS_WEIGHT_HIGH}] for {x:.3g} % of {int(r['seq_n'])} sequences at a mean length of "
               f"{r['seq_len_mean']:.3g} tokens; the geometric mean exp(mean log r) for {y:.3g} %")
    options = ADVISES["sequence_ratio"]
    kept, said, pct = _vet(m, options, r["rollout"], r["scorer"])
    numbers = {"product_pct": x, "geometric_pct": y, "mean_len": r["seq_len_mean"], **pct}
    if not kept:
        return [_withheld("sequence_ratio", options, f"{because}; {said}", r["rollout"], r["scorer"], **numbers)]
    return [_advice("sequence_ratio", f"prefer {_named(kept)} to a product sequence ratio", f"{because}; {said}",
                    **numbers)]


def trust_region(m: Measurements) -> list[dict]:
    p = m.get("pairs")
    p = p[p["frac_ratio_outside_clip"] > p["frac_tv_mask"]] if not p.empty else p
    if p.empty:
        return []
    r = p.sort_values(["frac_ratio_outside_clip", "rollout", "scorer"], ascending=[False, True, True]).iloc[0]
    w, z = 100 * r["frac_ratio_outside_clip"], 100 * r["frac_tv_mask"]
    because = (f"{r['rollout']}/{r['scorer']}: PPO's ratio clip (r outside [{d.CLIP_LOW:g}, {d.CLIP_HIGH:g}]) touches "
               f"{w:.3g} % of tokens before any update, DPPO's binary-TV mask (|π − μ| > {d.DELTA_TV:g}) {z:.3g} %")
    estimator = "DPPO top-K TV" if _topk_catches_more(_most_missed(m)) else "DPPO binary TV"
    options = {estimator: ADVISES["trust_region"][estimator]}
    kept, said, pct = _vet(m, options, r["rollout"], r["scorer"])
    if not kept:
        return [_withheld("trust_region", options, f"{because}; {said}", r["rollout"], r["scorer"],
                          clip_pct=w, tv_mask_pct=z, **pct)]
    return [_advice("trust_region", f"bound the trust region ({estimator}), not the ratio clip",
                    f"{because}; {said}", clip_pct=w, tv_mask_pct=z, **pct)]


def _most_missed(m: Measurements) -> pd.Series | None:
    """The approximation row where some token's exact TV exceeds δ_TV and binary TV misses the largest share
    of those tokens (None where no row has such a miss)."""
    a = m.get("approximation")
    if a.empty:
        return None
    a = a[(a["frac_exact_gt_delta"] > 0) & (a["binary_tv_miss"] > 0)]
    a = a.sort_values(["binary_tv_miss", "rollout", "scorer"], ascending=[False, True, True])
    return None if a.empty else a.iloc[0]


def _topk_catches_more(r: pd.Series | None) -> bool:
    """Whether top-K TV misses fewer over-δ tokens than binary TV on row `r` of _most_missed."""
    return r is not None and bool(r["topk_tv_miss"] < r["binary_tv_miss"])  # NaN (not recorded): False


def tv_estimator(m: Measurements) -> list[dict]:
    """Binary TV is a lower bound of the exact TV (so is top-K TV, a finer one): where tokens cross δ_TV
    it lets some through that the exact TV would mask. Advice only from stored exact TV."""
    r = _most_missed(m)
    if r is None:
        return []
    x = 100 * r["binary_tv_miss"]
    where = (f"{r['scorer']} vs {r['reference']} on {r['rollout']}'s tokens: {100 * r['frac_exact_gt_delta']:.3g} % "
             f"of {int(r['n_exact']):,} have an exact TV above δ_TV = {r['delta_tv']:g}; binary TV misses {x:.3g} % of them")
    if _topk_catches_more(r):
        y = 100 * r["topk_tv_miss"]
        options = ADVISES["tv_estimator"]
        kept, said, pct = _vet(m, options, r["rollout"], r["scorer"])
        because = f"{where}, top-K TV {y:.3g} %; {said}"
        if not kept:
            return [_withheld("tv_estimator", options, because, r["rollout"], r["scorer"], binary_miss_pct=x,
                              topk_miss_pct=y, **pct)]
        return [_advice("tv_estimator", "mask with top-K TV (DPPO top-K), not binary TV", because,
                        binary_miss_pct=x, topk_miss_pct=y, **pct)]
    if r["n_topk_exact"] > 0:
        return []  # top-K was measured and misses as many: nothing to gain
    return [_advice("tv_estimator", "record top-K lists (collect --top-k 20) to measure top-K TV",
                    f"{where}; top-K TV was not recorded", binary_miss_pct=x)]


def growth(m: Measurements) -> list[dict]:
    s = m.get("steps")
    s = s[s["ci_low"] > 0] if not s.empty else s
    return [_advice("growth", f"watch run {r['run_id']}: its mismatch grows",
                    f"{r['rollout']}/{r['scorer']}: mean |π − μ| rises {r['slope']:.3g} per step (95 % CI "
                    f"[{r['ci_low']:.3g}, {r['ci_high']:.3g}]), {r['first_mean']:.3g} → {r['last_mean']:.3g}; "
                    "prime-rl reads sustained growth as the early warning of collapse",
                    slope=r["slope"], ci_low=r["ci_low"], ci_high=r["ci_high"])
            for r in s.to_dict("records")]


def batch(m: Measurements) -> list[dict]:
    b = m.get("batch")
    b = b[b["frac_differ"] > 0] if not b.empty else b
    return [_advice("batch", f"{r['rollout']} is not batch-invariant: bitwise on-policy training needs "
                             "batch-invariant kernels (or a fixed batch composition)",
                    f"{100 * r['frac_differ']:.3g} % of {int(r['n_seq'])} sequences change between generation batch "
                    f"{int(r['b0'])} and {int(r['batch'])}; mean |Δ log μ| {r['abs_dlogp_mean']:.3g} on the shared prefix",
                    frac_differ=r["frac_differ"], abs_dlogp_mean=r["abs_dlogp_mean"])
            for r in b.to_dict("records")]


def nonfinite(m: Measurements) -> list[dict]:
    p = m.get("pairs")
    p = p[p["n_nonfinite"] > 0] if not p.empty else p
    return [_advice("nonfinite", f"find the overflow in {r['rollout']}/{r['scorer']}",
                    f"{int(r['n_nonfinite']):,} of {int(r['n_tokens']):,} (token, scorer) rows are non-finite "
                    "(fp16 overflow is the usual cause); every number above excludes them",
                    n_nonfinite=int(r["n_nonfinite"]), n_tokens=int(r["n_tokens"]))
            for r in p.to_dict("records")]


R3_DOMINANT = 0.5
"""Doctor advises R3 where replaying the rollout's expert ids removes more than half of the pair's mean
|log π − log μ|: the attribution's routing share (attribution.routing_rows), the number "where it comes from"
prints; routing is then the largest part of the mismatch (ours)."""
R3_OPTIONS = {
    "verl": (("actor_rollout_ref.actor.<megatron|veomni>.router_replay.mode=R3 with "
              "actor_rollout_ref.rollout.enable_rollout_routing_replay=True"),
             "verl-project/verl@95cc6195 examples/router_replay/README.md"),
    "slime": ("--use-rollout-routing-replay (--use-routing-replay is R2: the trainer's own recorded routing)",
              "THUDM/slime@624b824a slime/utils/arguments.py"),
    "miles": ("--use-rollout-routing-replay", "radixark/miles@31f1ca96 miles/utils/arguments.py"),
    "NeMo-RL": ("policy.router_replay.enabled=true", "NVIDIA-NeMo/RL@7ea279ab docs/guides/router-replay.md"),
    "SkyRL": (("trainer.policy.megatron_config.moe_enable_routing_replay=true with "
               "generator.inference_engine.enable_return_routed_experts=true"),
              "NovaSky-AI/SkyRL@a9564572 skyrl/train/config/config.py"),
}
"""framework -> (the option that turns on rollout routing replay, where it is defined). Each was read in the
framework's source at that commit."""


def _r3_options() -> str:
    return "; ".join(f"{name}: {option}" for name, (option, _) in R3_OPTIONS.items())


def routing(m: Measurements) -> list[dict]:
    """R3 where the pair's routing share (attribution.routing_rows, the one definition) is above R3_DOMINANT;
    "measure R3" where its tokens change experts and no R3 twin of its scorer says how much that costs."""
    from mismatch_lab.doctor.attribution import R3, routing_rows

    r = m.get("routing")
    rows = [] if r.empty else r.to_dict("records")
    shares = routing_rows(m.get("scored"), [(row["rollout"], row["scorer"]) for row in rows]) if rows else {}
    out = []
    for row in rows:
        if str(row["scorer"]).endswith(R3):  # already replays: its share is 0 by definition
            continue
        pair, differ = f"{row['rollout']}/{row['scorer']}", 100 * row["any_layer_differs"]
        because = f"{pair}: {differ:.3g} % of {int(row['tokens']):,} tokens go to another expert set in >= 1 MoE layer"
        source = shares[(row["rollout"], row["scorer"])]
        if not math.isnan(source["share"]):
            if source["share"] > R3_DOMINANT:
                share = 100 * source["share"]
                out.append(_advice("routing", f"enable R3 (rollout routing replay): {_r3_options()}",
                                   f"{because}; replaying the rollout's expert ids ({row['scorer']}{R3}) removes "
                                   f"{share:.3g} % of mean |log π − log μ| (its routing share, 'where it comes "
                                   "from')", routing_share_pct=share, any_layer_differs_pct=differ))
        elif row["any_layer_differs"] > 0 and not isinstance(row.get("r3_scorer"), str):
            out.append(_advice("routing", f"measure R3 on {pair}: score its tokens with the trainer replaying the "
                               "rollout's expert ids (docs/moe.md)", f"{because}; no R3 scorer beside "
                               f"{row['scorer']} says how much of the mismatch that is", any_layer_differs_pct=differ))
    return out


RULES = {"fp16": fp16, "sequence_ratio": sequence_ratio, "trust_region": trust_region, "tv_estimator": tv_estimator,
         "growth": growth, "batch": batch, "nonfinite": nonfinite, "routing": routing}


def recommendations(m: Measurements) -> list[dict]:
    """Every rule's advice for the store of `m`, in RULES order."""
    return [a for rule in RULES.values() for a in rule(m)]
