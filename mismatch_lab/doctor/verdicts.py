"""The verdict logic, pure: a value against a band, and a gate over a list of verdicts. No I/O, no SQL.

    judge(value, band) -> 'ok' | 'warn' | 'fail'   (bands.Band documents the three kinds)
    gate_status(rows, gate, unmeasured) -> (exit code, the failing rows)

A value that is NaN or None cannot be judged: `judge` raises, and the checks never hand one in (a check
that lacks its data is reported as not measured instead, see checks.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from mismatch_lab.doctor.bands import Band

VERDICTS = ("ok", "warn", "fail")


def judge(value: float, band: Band) -> str:
    """The verdict of `value` under `band`."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        raise ValueError(f"cannot judge a missing value against {band.text!r}")
    return _KINDS[band.kind](float(value), band)


def _above(v: float, b: Band) -> str:
    if b.fail is not None and v > b.fail:
        return "fail"
    if b.warn is not None and (v >= b.warn if b.warn_inclusive else v > b.warn):
        return "warn"
    return "ok"


def _outside(v: float, b: Band) -> str:
    return "ok" if b.low <= v <= b.high else b.otherwise


def _below(v: float, b: Band) -> str:
    return "ok" if v >= b.low else b.otherwise


_KINDS = {"above": _above, "outside": _outside, "below": _below}


def worst(verdicts: Iterable[str]) -> str:
    """The worst of several verdicts ('ok' for none)."""
    return max(verdicts, key=VERDICTS.index, default="ok")


def gate_status(rows: Iterable[Mapping], gate: str | None, unmeasured: Iterable[Mapping] = ()) -> tuple[int, list[Mapping]]:
    """Exit code of a gate over check rows (each with 'gates' and 'verdict'): 1 when a row of the gate
    failed or a pair of the store is `unmeasured` (not-measured entries with a 'pair') by one of its
    checks, else 0; with the failing rows. No gate (None): always 0. A gate none of whose checks could be
    measured passes nothing: the caller reports that as bad input (nothing to gate on)."""
    if gate is None:
        return 0, []
    failed = [r for r in rows if gate in r["gates"] and r["verdict"] == "fail"]
    failed += [{**u, "verdict": "not measured"} for u in unmeasured if u.get("pair") and gate in u.get("gates", ())]
    return (1 if failed else 0), failed
