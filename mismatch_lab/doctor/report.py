"""`diagnose(con)` -> Diagnosis (checks, what was not measured, recommendations), and its three faces:
the one-screen text report, the JSON document (`--json`), and the app's table (`doctor_table`).

JSON: {"store", "gate", "gate_exit", "checks": [{pair, check, value, band, source, verdict, run_id, title,
metric, gates, detail}], "recommendations": [{rule, advice, because, numbers}], "not_measured": [{check,
title, needs, pair, gates}]} (pair: null when the store gives the check nothing at all, else the pair the
store holds but the check got no number for); NaN and ±inf are written as null.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import duckdb
import pandas as pd

from mismatch_lab.doctor.checks import BY_NAME, GATES, run_checks
from mismatch_lab.doctor.measure import Measurements
from mismatch_lab.doctor.recommend import recommendations
from mismatch_lab.doctor.verdicts import gate_status, worst

TABLE_COLUMNS = ["pair", "check", "value", "band", "source", "verdict", "detail"]
GATED = ("abs_dp_mean", "k3_kl", "seq_abs_dlogp", "bitwise")
ALWAYS_SHOWN = ("growth", "batch_tokens", "batch_logp")
"""Shown under findings whatever their verdict; the other non-matrix checks only when not ok."""
"""The framework checks the pair matrix of the text report shows one column each; the rest are folded into
'health' (the worst of the weight-health and non-finite verdicts)."""


@dataclass
class Diagnosis:
    store: str
    checks: list[dict]
    not_measured: list[dict]
    recommendations: list[dict]
    gate: str | None = None
    failed: list[dict] = field(default_factory=list)
    exit_code: int = 0


def diagnose(con: duckdb.DuckDBPyConnection, store: str = "", gate: str | None = None) -> Diagnosis:
    """Every check, the not-measured list and the recommendations of the store on `con`, judged for `gate`."""
    with Measurements(con) as m:
        rows, missing = run_checks(m)
        advice = recommendations(m)
    code, failed = gate_status(rows, gate, missing)
    return Diagnosis(store, rows, missing, advice, gate, failed, code)


def doctor_table(con: duckdb.DuckDBPyConnection) -> pd.DataFrame:
    """One row per (check, pair): TABLE_COLUMNS (the app's Doctor section)."""
    rows = diagnose(con).checks
    return pd.DataFrame(rows, columns=TABLE_COLUMNS) if rows else pd.DataFrame(columns=TABLE_COLUMNS)


def _finite(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def json_doc(dx: Diagnosis) -> dict:
    return _finite({"store": dx.store, "gate": dx.gate, "gate_exit": dx.exit_code, "gates": list(GATES),
                    "checks": dx.checks, "recommendations": dx.recommendations, "not_measured": dx.not_measured})


def write_json(dx: Diagnosis, path) -> None:
    with open(path, "w") as f:
        json.dump(json_doc(dx), f, indent=1, allow_nan=False)


def _cell(row: dict | None) -> str:
    return "-" if row is None else f"{row['value']:.3g} {row['verdict']}"


def _pair_matrix(dx: Diagnosis) -> list[str]:
    by = {}
    for r in dx.checks:
        if r["run_id"] is None and "/" in r["pair"]:
            by.setdefault(r["pair"], {}).setdefault(r["check"], r)
    if not by:
        return []
    head = ["pair", "mean|Δp| verl", "k3 prime-rl", "seq|Δlogp| slime", "≠ bitwise", "health"]
    lines = [[p, *(_cell(c.get(g)) for g in GATED),
              worst(r["verdict"] for k, r in c.items() if k not in GATED)] for p, c in sorted(by.items())]
    widths = [max(len(str(x[i])) for x in [head, *lines]) for i in range(len(head))]
    return ["  ".join(str(x).ljust(w) for x, w in zip(row, widths)) for row in [head, *lines]]


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
    was not measured, and the gate's result."""
    lines = [f"doctor: {dx.store}"]
    lines += [f"  {BY_NAME[g].title}: {BY_NAME[g].band.text} ({BY_NAME[g].band.source})" for g in GATED]
    lines += ["  health: the worst of the weight-health and non-finite checks (verl's illustrative levels)", ""]
    lines += _pair_matrix(dx) or ["no (rollout, scorer) pair with scored tokens in this store"]
    notes = _notes(dx)
    if notes:
        lines += ["", "findings:", *notes]
    if dx.recommendations:
        lines += ["", "what to change:"]
        lines += [f"  - {a['advice']}: {a['because']}" for a in dx.recommendations]
    if dx.not_measured:
        needs: dict[str, list[str]] = {}
        for n in dx.not_measured:
            needs.setdefault(n["needs"], []).append(n["check"])  # per pair: the needs text names the pair
        lines += ["", "not measured:", *(f"  {', '.join(c)}: needs {k}" for k, c in needs.items())]
    lines.append("")
    lines.append(_gate_line(dx))
    return "\n".join(lines)


def _gate_line(dx: Diagnosis) -> str:
    if dx.gate is None:
        return f"no gate chosen (exit 0); gates: {', '.join(GATES)}"
    if dx.failed:
        where = ", ".join(sorted({f"{r['check']} {r['pair']}" for r in dx.failed}))
        return f"gate {dx.gate}: FAIL ({len(dx.failed)} failing: {where})"
    return f"gate {dx.gate}: pass"
