"""The checks of `mismatch-lab doctor`: each one declared once, with its band, source, gates and the
measurement column it reads (measure.py defines every column and its denominator; docs/doctor.md lists
them all). `run_checks` turns a store's measurements into one row per (check, pair), judged by
`verdicts.judge`; a check whose measurement is empty is listed as not measured, with the run that would
provide it.

Gates (`--gate NAME`) are the union of the checks' `gates`: a gate fails when one of its checks fails.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

from mismatch_lab.analysis.steps import quarter
from mismatch_lab.doctor import bands as B
from mismatch_lab.doctor.measure import Measurements
from mismatch_lab.doctor.verdicts import judge


@dataclass(frozen=True)
class Check:
    """One check: `column` of measurement `measure` (a row per pair), judged by `band` (on `judged`
    instead where the judged number is not the value shown, e.g. a slope judged on its CI's low end)."""

    name: str
    title: str
    band: B.Band
    measure: str
    column: str
    gates: tuple[str, ...] = ()
    judged: str | None = None
    needs: str = ""  # what run provides the data, said when the store lacks it
    only_some_runs: bool = False  # a framework's own metric for its runs only: not listed as not measured elsewhere


PAIR_NEEDS = "a store with scored tokens: `mismatch-lab doctor --model M` or `mismatch-lab collect`"
STEP_NEEDS = ("a run over at least 3 training steps with finite scored tokens (`mismatch-lab train`, the "
              "Recorder, or `mismatch-lab import`)")
BATCH_NEEDS = ("collect runs of one rollout at two generation batch sizes, otherwise alike (same config and "
               "model): `mismatch-lab collect --study S --gen-batch 1` and `--gen-batch 8` into the same store "
               "(studies/batch-invariance/study.toml)")
SUPPORT_NEEDS = ("a rollout whose μ is processed by a sampling rule, scored with log S stored (`mismatch-lab collect "
                 "--top-p 0.9 --logprobs-mode processed`: scores.log_support)")
NEMO_RL_NEEDS = "a run imported from NeMo-RL (`mismatch-lab import nemo-rl LOG_DIR`)"
ROUTING_NEEDS = ("an MoE run with routing recorded on both sides (`mismatch-lab collect` on an MoE model; "
                 "docs/moe.md)")
SKIPPED_NEEDS = ("a `collect` run (only collect skips prompts longer than the context and lists them in "
                 "skipped_prompts; train, recorded and imported runs skip none)")

CHECKS: tuple[Check, ...] = (
    Check("abs_dp_mean", "mean |π − μ| of the sampled token", B.ABS_DP, "pairs", "abs_dp_mean", ("verl",),
          needs=PAIR_NEEDS),
    Check("k3_kl", "mean k3 = mean(r − log r − 1)", B.K3_KL, "pairs", "kl_k3", ("prime-rl",), needs=PAIR_NEEDS),
    Check("seq_abs_dlogp", "mean over sequences of the sequence's mean |log π − log μ|", B.SEQ_ABS_DLOGP, "pairs",
          "seq_abs_dlogp_mean", ("slime",), needs=PAIR_NEEDS),
    Check("bitwise", "share of (token, scorer) rows with log π != log μ", B.BITWISE_EQUAL, "pairs", "frac_unequal",
          ("bitwise",), needs=PAIR_NEEDS),
    Check("is_weight_mean", "mean token IS weight r", B.IS_WEIGHT_MEAN, "pairs", "r_mean", needs=PAIR_NEEDS),
    Check("seq_is_weight_mean", "mean sequence IS weight exp(Σ log r)", B.IS_WEIGHT_MEAN, "pairs", "seq_is_mean",
          needs=PAIR_NEEDS),
    Check("ess", "token ESS (Σr)² / (n Σr²)", B.ESS, "pairs", "ess", needs=PAIR_NEEDS),
    Check("chi2", "token χ² = mean(r²) − 1", B.CHI2, "pairs", "chi2", needs=PAIR_NEEDS),
    Check("k1_abs", "|mean k1| = |mean(log μ − log π)|", B.K1_ABS, "pairs", "kl_k1_abs", needs=PAIR_NEEDS),
    Check("seq_product_out", "share of sequences with exp(Σ log r) outside [0.5, 2]", B.SEQ_PRODUCT_SHARE, "pairs",
          "seq_product_out", needs=PAIR_NEEDS),
    Check("nonfinite", "non-finite (token, scorer) rows", B.NONFINITE, "pairs", "n_nonfinite", needs=PAIR_NEEDS),
    Check("support_bias", "share of mean |log π − log μ| that π on the sampling rule removes (processed μ, raw π)",
          B.SUPPORT_BIAS, "support",
          "support_ratio", needs=SUPPORT_NEEDS),
    Check("skipped_prompts", "prompts skipped (longer than the context)", B.SKIPPED, "skipped", "n_skipped",
          needs=SKIPPED_NEEDS),
    Check("growth", "OLS slope of the per-step mean |π − μ| (per step)", B.GROWTH, "steps", "slope",
          judged="ci_low", needs=STEP_NEEDS),
    Check("batch_tokens", "share of sequences not token-identical across generation batch sizes",
          B.BATCH_VARIANCE, "batch", "frac_differ", ("bitwise",), needs=BATCH_NEEDS),
    Check("batch_logp", "mean |Δ log μ| across generation batch sizes (shared prefix)", B.BATCH_VARIANCE, "batch",
          "abs_dlogp_mean", ("bitwise",), needs=BATCH_NEEDS),
    Check("nemo_rl_mult_prob_error", "NeMo-RL token_mult_prob_error = mean exp|log π − log μ|, median over steps",
          B.NEMO_RL_MULT_PROB_ERROR, "nemo_rl", "median_step", needs=NEMO_RL_NEEDS, only_some_runs=True),
    Check("routing", "share of tokens routed to another expert set than the rollout's in at least one MoE layer",
          B.ROUTING, "routing", "any_layer_differs", needs=ROUTING_NEEDS, only_some_runs=True),
)
BY_NAME = {c.name: c for c in CHECKS}
GATES = tuple(sorted({g for c in CHECKS for g in c.gates}))
"""The gate names `--gate` accepts, derived from the registry."""


def _label(row) -> str:
    return f"{row['rollout']}/{row['scorer']}" if isinstance(row.get("scorer"), str) else str(row["rollout"])


def _detail(check: Check, row) -> str:
    """What stands behind the number, per measurement (counts, intervals, the compared batch sizes)."""
    return DETAILS[check.measure](row)


DETAILS = {
    "pairs": lambda r: f"n = {int(r['n_finite']):,} finite rows, {int(r['seq_n']):,} sequences",
    "skipped": lambda r: "",
    "support": lambda r: (f"mean |Δlogp| {r['abs_dlogp_mean']:.3g}, {r['abs_dlogp_rule']:.3g} with π on the rule; "
                          f"mean rule bias {r['mean_rule_bias']:.3g} (mean log S {r['mean_log_s']:.3g}) over "
                          f"{int(r['n_support']):,} rows inside the support"),
    "steps": lambda r: (f"95 % CI [{r['ci_low']:.3g}, {r['ci_high']:.3g}] over {int(r['n_steps'])} steps; "
                        f"first {quarter(r['n_steps'])} steps {r['first_mean']:.3g} → last {quarter(r['n_steps'])} {r['last_mean']:.3g}"),
    "batch": lambda r: (f"batch {int(r['b0'])} vs {int(r['batch'])}: {int(r['n_seq'])} sequences, "
                        f"{int(r['n_tok'])} prefix tokens"),
    "nemo_rl": lambda r: (f"{int(r['n_steps'])} steps, largest {r['max_step']:.4g} at step {int(r['max_at'])}, "
                          f"{int(r['steps_above'])} above 1.05; n = {int(r['n_finite']):,} finite rows"),
    "routing": lambda r: (f"{int(r['tokens']):,} tokens × {int(r['layers'])} MoE layers (top-{int(r['k'])}); flip rate "
                          f"{r['flip_rate']:.3g} of (token, layer) cells"
                          + (f"; what R3 ({r['r3_scorer']}) removes: the routing share under 'where it comes from'"
                             if isinstance(r.get("r3_scorer"), str) else "")),
}


def check_rows(check: Check, table: pd.DataFrame, records: list[dict] | None = None) -> list[dict]:
    """One row per pair of `table` whose value is a number: the judged check (module doc). `records`: the table's
    rows as dicts, where the caller has them (one conversion a measurement, not one a check)."""
    out = []
    for row in table.to_dict("records") if records is None else records:
        value = row.get(check.column)
        judged = row.get(check.judged or check.column)
        if value is None or judged is None or (isinstance(judged, float) and math.isnan(judged)):
            continue
        out.append({
            "pair": _label(row), "run_id": row.get("run_id") if check.measure == "steps" else None,
            "check": check.name, "title": check.title, "value": float(value), "band": check.band.text,
            "source": check.band.source, "metric": check.band.metric, "verdict": judge(judged, check.band),
            "gates": list(check.gates), "detail": _detail(check, row),
        })
    return out


def run_checks(m: Measurements, names: tuple[str, ...] | None = None) -> tuple[list[dict], list[dict]]:
    """(check rows, not measured): every check of the registry (or `names`) on the store of `m`. Not measured:
    a check no row of the store gives a number for, and, per pair, a check the store holds the pair for but
    without a number (e.g. every sequence of the pair holds a non-finite row); such a pair fails the check's
    gates (`verdicts.gate_status`): a gate never passes a pair it did not measure."""
    rows, missing, records = [], [], {}
    for check in CHECKS if names is None else [BY_NAME[n] for n in names]:
        table = m.get(check.measure)
        if check.measure not in records:
            records[check.measure] = table.to_dict("records")
        found = check_rows(check, table, records[check.measure])
        rows += found
        if table.empty:
            if check.only_some_runs:
                continue
            missing.append({"check": check.name, "title": check.title, "needs": check.needs, "pair": None,
                            "gates": list(check.gates)})
            continue
        measured = {r["pair"] for r in found}
        for pair in dict.fromkeys(_label(r) for r in records[check.measure]):
            if pair not in measured:
                missing.append({"check": check.name, "title": check.title, "pair": pair, "gates": list(check.gates),
                                "needs": f"finite values of {pair} (none of its rows or sequences gave one)"})
    return rows, missing
