"""`diagnose(con)` -> Diagnosis (checks, what was not measured, recommendations), and its faces: the
one-screen text report, the JSON document (`--json`), the app's table (`doctor_table`), and the one-line
verdict per pair (`pair_verdicts`, `verdict_lines`) with the advice lines (`advice_lines`) that the text
report, the end of `collect` and the app's Overview all print (`doctor_view` bundles them for the app).

JSON: {"store", "run_ids" (the --run-id filter; null: every run), "gate", "gate_exit", "checks": [{pair, check, value, band, source, verdict, run_id, title,
metric, gates, detail}], "recommendations": [{rule, advice, because, numbers}], "not_measured": [{check,
title, needs, pair, gates}]} (pair: null when the store gives the check nothing at all, else the pair the
store holds but the check got no number for); NaN and ±inf are written as null.
"""

from __future__ import annotations

import json
import math
import textwrap
from dataclasses import dataclass, field

import duckdb
import pandas as pd

from mismatch_lab.analysis.summary import WIDTH
from mismatch_lab.doctor import attribution as A
from mismatch_lab.doctor.checks import BY_NAME, GATES, run_checks
from mismatch_lab.doctor.measure import Measurements
from mismatch_lab.doctor.recommend import recommendations
from mismatch_lab.doctor.verdicts import gate_status, worst

TABLE_COLUMNS = ["pair", "check", "verdict", "value", "band", "source", "detail"]
GATED = ("abs_dp_mean", "k3_kl", "seq_abs_dlogp", "bitwise")
ALWAYS_SHOWN = ("growth", "batch_tokens", "batch_logp")
"""Shown under findings whatever their verdict; the other non-matrix checks only when not ok."""
"""The framework checks the pair matrix of the text report shows one column each; the rest are folded into
'health' (the worst of the weight-health and non-finite verdicts)."""
TOLERANCE = ("abs_dp_mean", "k3_kl", "seq_abs_dlogp")
"""A pair's verdict is the worst of these framework tolerance checks (verl, prime-rl, slime) and its health.
The bitwise check is shown beside it, not in it: any two kernels that are not bitwise identical fail it,
which only bitwise on-policy training asks for."""
SHORT = {"abs_dp_mean": "mean|Δp|", "k3_kl": "k3", "seq_abs_dlogp": "seq|Δlogp|"}
BITWISE = {"ok": "bitwise equal", "fail": "bitwise differs"}
"""How a verdict line words the bitwise check (log π = log μ exactly on every row, or not)."""
VERDICT_KEY = "verdict = the worst of mean|Δp| (verl's band), k3 (prime-rl's), seq|Δlogp| (slime's) and health"
"""The line that explains the verdict lines, printed above them."""


@dataclass
class Diagnosis:
    store: str
    checks: list[dict]
    not_measured: list[dict]
    recommendations: list[dict]
    gate: str | None = None
    failed: list[dict] = field(default_factory=list)
    exit_code: int = 0
    attribution: list[dict] = field(default_factory=list)
    incomplete: dict[str, list[str]] = field(default_factory=dict)  # pair -> damaged shards its runs were read without
    run_ids: list[str] | None = None  # the runs judged (`--run-id`); None: every run of the store


def diagnose(con: duckdb.DuckDBPyConnection, store: str = "", gate: str | None = None, *,
             attribution: bool = True, sample_tokens: int | None = None) -> Diagnosis:
    """Every check, the not-measured list and the recommendations of the store on `con`, judged for `gate`;
    with `attribution` the shares of each pair's mismatch by source (attribution.py; the app's views, which
    do not show them, skip their cost); `sample_tokens`: the dropped shares of the advice on a sample of a store
    holding more tokens (measure.Measurements; the app's views)."""
    with Measurements(con, sample_tokens=sample_tokens) as m:
        return judged(m, store, gate, attribution=attribution and m.rows.ok, incomplete=lambda: _incomplete(m))


def judged(m, store: str = "", gate: str | None = None, *, attribution: bool, incomplete) -> Diagnosis:
    """The Diagnosis of measurements `m` (a `Measurements`, or a `measure.Measured` merged from parts);
    `incomplete()` gives the map of `_incomplete`."""
    rows, missing = run_checks(m)
    advice = [a | {"source": A.RULE_SOURCE.get(a["rule"])} for a in recommendations(m)]
    where = A.attribute(m.get("scored"), m.get("batch")) if attribution else []
    found = incomplete()
    code, failed = gate_status(rows, gate, missing)
    return Diagnosis(store, rows, missing, advice, gate, failed, code, where, found)


def _incomplete(m: Measurements) -> dict[str, list[str]]:
    """pair -> the damaged-shard lines of the runs behind it that a shard store was read without
    (`reader.damaged_units`): that pair's verdict is on incomplete runs. {} for a whole store."""
    from mismatch_lab.analysis.relations import query
    from mismatch_lab.store.reader import damaged_units

    damaged = damaged_units(m.con)
    if not damaged or not m.rows.ok:
        return {}
    rel, params = m.rows.sql["rollout"]
    out: dict[str, list[str]] = {}
    for run_id, _, line in damaged:
        found = query(m.con, f"SELECT DISTINCT rollout, scorer FROM ({rel}) WHERE run_id::VARCHAR = $damaged_run",
                      {**params, "damaged_run": run_id})
        for rollout, scorer in found.itertuples(index=False):
            out.setdefault(f"{rollout}/{scorer}", []).append(line)
    return out


def doctor_table(con: duckdb.DuckDBPyConnection) -> pd.DataFrame:
    """One row per (check, pair): TABLE_COLUMNS, the verdict next to the pair and check."""
    return _checks_frame(diagnose(con, attribution=False))


def _checks_frame(dx: Diagnosis) -> pd.DataFrame:
    return pd.DataFrame(dx.checks, columns=TABLE_COLUMNS) if dx.checks else pd.DataFrame(columns=TABLE_COLUMNS)


def _finite(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def json_doc(dx: Diagnosis) -> dict:
    return _finite({"store": dx.store, "run_ids": dx.run_ids, "gate": dx.gate, "gate_exit": dx.exit_code, "gates": list(GATES),
                    "checks": dx.checks, "recommendations": dx.recommendations, "not_measured": dx.not_measured,
                    "attribution": dx.attribution, "incomplete": dx.incomplete})


def write_json(dx: Diagnosis, path) -> None:
    with open(path, "w") as f:
        json.dump(json_doc(dx), f, indent=1, allow_nan=False)


def _cell(row: dict | None) -> str:
    return "-" if row is None else f"{row['value']:.3g} {row['verdict']}"


def pair_checks(dx: Diagnosis) -> dict[str, dict[str, dict]]:
    """pair -> check -> its row, for the checks made per (rollout, scorer) pair (not per run), pairs sorted."""
    by: dict[str, dict[str, dict]] = {}
    for r in dx.checks:
        if r["run_id"] is None and "/" in r["pair"]:
            by.setdefault(r["pair"], {}).setdefault(r["check"], r)
    return dict(sorted(by.items()))


def health(checks: dict[str, dict]) -> str:
    """The worst verdict of a pair's checks off the framework columns (weight health, non-finite rows)."""
    return worst(r["verdict"] for k, r in checks.items() if k not in GATED)


def pair_verdict(checks: dict[str, dict]) -> str:
    """A pair's verdict: the worst of its TOLERANCE checks and its health."""
    return worst([*(checks[g]["verdict"] for g in TOLERANCE if g in checks), health(checks)])


def pair_verdicts(dx: Diagnosis) -> list[dict]:
    """One verdict per pair: {pair, verdict (TOLERANCE's worst with health), detail (each check's number and
    verdict), line (the one-line verdict: pair, verdict, detail, aligned)}."""
    by = pair_checks(dx)
    width = max(map(len, by), default=0)
    out = []
    for pair, c in by.items():
        verdict = pair_verdict(c)
        parts = [f"{SHORT[g]} {_cell(c.get(g))}" for g in TOLERANCE]
        parts += [f"health {health(c)}", BITWISE[c["bitwise"]["verdict"]] if "bitwise" in c else "bitwise -"]
        if pair in dx.incomplete:
            parts.append(f"incomplete: read without {len(dx.incomplete[pair])} damaged shard(s), see below")
        detail = " · ".join(parts)
        out.append({"pair": pair, "verdict": verdict, "detail": detail, "line": f"{pair:<{width}}  {verdict:<4}  {detail}"})
    return out


def verdict_lines(dx: Diagnosis) -> list[str]:
    return [v["line"] for v in pair_verdicts(dx)]


def advice_lines(dx: Diagnosis, width: int | None = None, limit: int | None = None, because: bool = True) -> list[str]:
    """'  - advice: because' per recommendation ('  - advice' without `because`); wrapped at `width`
    (continuation indented) when given; past `limit` recommendations one line counts the rest."""
    shown = dx.recommendations[:limit]
    lines = [f"  - {a['advice']}: {a['because']}" if because else f"  - {a['advice']}" for a in shown]
    if width is not None:
        lines = [w for line in lines for w in textwrap.wrap(line, width, subsequent_indent="    ",
                                                             break_long_words=False, break_on_hyphens=False)]
    rest = len(dx.recommendations) - len(shown)
    return lines + ([f"  ... and {rest} more: `mismatch-lab doctor`"] if rest else [])


@dataclass
class DoctorView:
    """What the app's Overview shows of the doctor: the verdict per pair, the advice, the checks table."""

    verdicts: list[dict]
    recommendations: list[dict]
    table: pd.DataFrame


def doctor_view(con: duckdb.DuckDBPyConnection) -> DoctorView:
    """The app's doctor: no attribution, the advice's dropped shares on a sample of a large store."""
    from mismatch_lab.analysis.sample import SAMPLE_TOKENS

    return view_of(diagnose(con, attribution=False, sample_tokens=SAMPLE_TOKENS))


def view_of(dx: Diagnosis) -> DoctorView:
    """The app's view of a diagnosis (`doctor_view`; `store.units_overview` of one merged from parts)."""
    return DoctorView(pair_verdicts(dx), dx.recommendations, _checks_frame(dx))


def _pair_matrix(dx: Diagnosis) -> list[str]:
    by = pair_checks(dx)
    if not by:
        return []
    head = ["pair", "verdict", "mean|Δp| verl", "k3 prime-rl", "seq|Δlogp| slime", "≠ bitwise", "health"]
    lines = [[p, pair_verdict(c) + (" incomplete" if p in dx.incomplete else ""), *(_cell(c.get(g)) for g in GATED),
              health(c)] for p, c in by.items()]
    widths = [max(len(str(x[i])) for x in [head, *lines]) for i in range(len(head))]
    return ["  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip() for row in [head, *lines]]


def _notes(dx: Diagnosis) -> list[str]:
    """The growth and batch-invariance checks, and every other check off the matrix that is not ok."""
    out = []
    for r in dx.checks:
        if r["check"] in GATED or (r["verdict"] == "ok" and r["check"] not in ALWAYS_SHOWN):
            continue
        where = f"{r['pair']} {r['run_id']}" if r["run_id"] else r["pair"]
        detail = f"; {r['detail']}" if r["detail"] else ""
        out.append(f"  {r['verdict']:<4} {r['check']} {where}: {r['value']:.3g} ({r['band']}; {r['source']}){detail}")
    return out


def text_report(dx: Diagnosis) -> str:
    """The one-screen report: a pair matrix of the framework checks, the other findings, the advice, what
    was not measured, and the gate's result; lines longer than WIDTH wrapped (the matrix never is)."""
    lines = [f"doctor: {dx.store}" + (f" (--run-id {','.join(dx.run_ids)})" if dx.run_ids else "")]
    lines += [f"  {BY_NAME[g].title}: {BY_NAME[g].band.text} ({BY_NAME[g].band.source})" for g in GATED]
    lines += ["  health: the worst of the weight-health and non-finite checks (verl's illustrative levels)",
              f"  {VERDICT_KEY} (bitwise apart: only bitwise on-policy training needs it)", ""]
    lines += _pair_matrix(dx) or ["no (rollout, scorer) pair with scored tokens in this store"]
    lines += attribution_lines(dx)
    notes = _notes(dx)
    if notes:
        lines += ["", "findings:", *notes]
    if dx.incomplete:
        damaged = dict.fromkeys(line for found in dx.incomplete.values() for line in found)
        lines += ["", f"incomplete: the verdicts of {', '.join(dx.incomplete)} are on runs read without these units:",
                  *(f"  {line}" for line in damaged)]
    if dx.recommendations:
        lines += ["", "what to change:", *advice_lines(dx)]
    if dx.not_measured:
        needs: dict[str, list[str]] = {}
        for n in dx.not_measured:
            needs.setdefault(n["needs"], []).append(n["check"])  # per pair: the needs text names the pair
        lines += ["", "not measured:", *(f"  {', '.join(c)}: needs {k}" for k, c in needs.items())]
    lines.append("")
    lines.append(_gate_line(dx))
    return "\n".join(wrapped for line in lines for wrapped in _wrap(line))


def _pct(share: float) -> str:
    return f"{100 * share:.3g} %"


def _title(source: str) -> str:
    return A.SOURCES[source].title if source in A.SOURCES else source


def attribution_lines(dx: Diagnosis) -> list[str]:
    """'where it comes from': per pair, each measured source's share of its mismatch (attribution.py), the
    sources not measured (grouped by reason), and the fix of each source measured above 0."""
    by: dict[str, list[dict]] = {}
    for r in dx.attribution:
        by.setdefault(f"{r['rollout']}/{r['scorer']}", []).append(r)
    if not by:
        return []
    head = "where it comes from (share of the pair's mean |log π − log μ| each source's fix removes; docs/doctor.md):"
    lines = ["", head]
    missing: dict[tuple[str, str], int] = {}
    fixed = []
    for pair, rows in by.items():
        m = next(r["mismatch"] for r in rows if r["source"] == A.UNEXPLAINED)
        parts = [f"{_title(r['source'])} "
                 f"{'≤ ' if r['bound'] == 'upper' else ''}{_pct(r['share'])}"
                 for r in rows if not math.isnan(r["share"])]
        lines.append(f"  {pair} ({m:.3g}): {', '.join(parts) or 'nothing measured'}")
        for r in rows:
            if math.isnan(r["share"]) and r["reason"]:
                missing[(r["source"], r["reason"])] = missing.get((r["source"], r["reason"]), 0) + 1
            elif r["source"] in A.SOURCES and r["share"] > 0 and r["source"] not in fixed:
                fixed.append(r["source"])
    if any(r["bound"] == "upper" for r in dx.attribution):
        lines.append("  ≤: an upper bound: the rollout engine's difference from the trainer's at fp32 is not "
                     "measured here (no fp32 rollout of that engine) and counts as precision")
    lines += [f"  {_title(s)}: {why} ({n} of {len(by)} pairs)" for (s, why), n in missing.items()]
    advised = {a["source"] for a in dx.recommendations}
    lines += [f"  fix {A.SOURCES[s].title}: {A.SOURCES[s].fix}" + (" (advice below)" if s in advised else "")
              for s in fixed]
    return lines


def _wrap(line: str) -> list[str]:
    """`line` within WIDTH characters, continued with 4 spaces; words (paths, commands) never split."""
    if len(line) <= WIDTH:
        return [line]
    return textwrap.wrap(line, WIDTH, subsequent_indent="    ", break_long_words=False, break_on_hyphens=False)


def _gate_line(dx: Diagnosis) -> str:
    if dx.gate is None:
        return f"no gate chosen (exit 0); gates: {', '.join(GATES)}"
    if dx.failed:
        where = ", ".join(sorted({f"{r['check']} {r['pair']}" for r in dx.failed}))
        return f"gate {dx.gate}: FAIL ({len(dx.failed)} failing: {where})"
    return f"gate {dx.gate}: pass"
