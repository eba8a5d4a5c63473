"""`mismatch-lab doctor`: is this rollout/trainer mismatch normal, what to change, and a gate for CI.

    bands.py      every band with its source (verl FAQ, prime-rl, slime CI, bitwise, verl's illustrative levels)
    verdicts.py   the pure verdict logic: a value against a band; a gate over the verdicts
    stats.py      Student t quantile and the OLS slope with its t-interval (no scipy)
    measure.py    the measurements, SQL over the store through the analyses' row sets and tables
    checks.py     the registry of checks (band, source, gates, the measured column); GATES derives from it
    recommend.py  what to change, derived from the measured numbers
    attribution.py  where each pair's mismatch comes from: each source's share (precision, weight rounding, ...)
    report.py     diagnose(con) -> Diagnosis; the one-screen report, the JSON, the app's doctor_table
    probe.py      `--model`: a short fixed probe collection through `collect`
    command.py    the CLI

Torch is imported by two paths only: `--model` (the probe) loads the engines through `collect`, and the
advice's dropped-sequence shares run `corrections.compare` on the store (measure.corrections).
"""

from __future__ import annotations


def __getattr__(name: str):
    """`from mismatch_lab.doctor import diagnose, doctor_table` without importing the analyses at package import."""
    if name in ("diagnose", "doctor_table", "Diagnosis"):
        from mismatch_lab.doctor import report

        return getattr(report, name)
    raise AttributeError(f"module 'mismatch_lab.doctor' has no attribute {name!r}")


__all__ = ["Diagnosis", "diagnose", "doctor_table"]
