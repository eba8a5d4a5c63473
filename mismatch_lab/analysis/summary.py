"""The one-screen summaries: `analyze` by default and the end of `collect` print the same pair table.

    pair_table(df)                    the (rollout, scorer) rows of the precision table as text, units in
                                      a second header line, fractions as %, at most 120 characters wide
    analyze_summary(...)              `analyze`'s headline, pair table, noise floor, and its table list
    program()                         how to print a `mismatch-lab` command so that it runs as printed

Definitions of every column: docs/analysis.md (precision). No SQL here except the headline's counts.
"""

from __future__ import annotations

import math
import shlex
import shutil
import sys
import textwrap
from pathlib import Path

import duckdb
import pandas as pd

from mismatch_lab.analysis import definitions as d

WIDTH = 120
"""The widest line a summary prints."""
MAX_PAIRS = 24
"""The most pair rows a summary lists; the rest are counted and left to `analyze --table precision`."""

PAIR_COLUMNS = (
    # (precision column, header, unit, factor)
    ("n_tokens", "tokens", "count", 1),
    ("abs_dp_mean", "mean|Δp|", "prob.", 1),
    ("abs_dp_max", "max|Δp|", "prob.", 1),
    ("abs_dlogp_mean", "mean|Δlogp|", "nats", 1),
    ("kl_k3", "KL k3", "nats", 1),
    ("frac_ratio_outside_clip", f"r∉[{d.CLIP_LOW:g},{d.CLIP_HIGH:g}]", "% tokens", 100),
    ("seq_logratio_rate_per_1k", "Σlog r/1K", "nats", 1),
    ("n_nonfinite", "non-finite", "rows", 1),
)
"""The key numbers of a pair, in the order printed. Δp = π − μ (probability), Δlogp = log π − log μ,
KL k3 = mean(r − log r − 1), r∉[…] = the share PPO's ratio clip touches, Σlog r/1K = the drift of the
sequence log-ratio per 1,000 tokens (fit through the origin)."""

LEGEND = ("per token, sampled token only: Δp = π − μ in probability space, Δlogp = log π − log μ, r = π/μ;\n"
          "KL k3 = mean(r − log r − 1) estimates KL(μ‖π); Σlog r/1K = drift of the sequence log-ratio per 1,000 tokens;\n"
          "non-finite rows are counted and left out of every mean")


COUNTS = ("count", "rows")
"""Units whose numbers are counts, printed as integers with thousands separators."""


def _cell(v, unit: str, factor: float) -> str:
    if v is None or v is pd.NA or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return f"{int(v):,}" if unit in COUNTS else f"{float(v) * factor:.3g}"


def pair_table(df: pd.DataFrame, labels: tuple[str, ...] = ("rollout", "scorer"), limit: int = MAX_PAIRS) -> list[str]:
    """`df`'s rows (precision_table or noise_floor columns) as aligned text: labels left, numbers right,
    units under the headers; rows past `limit` are counted in a last line."""
    cols = [c for c in PAIR_COLUMNS if c[0] in df.columns]
    head = [*labels, *(c[1] for c in cols)]
    units = [""] * len(labels) + [c[2] for c in cols]
    rows = [[str(r[lab]) for lab in labels] + [_cell(r[c[0]], c[2], c[3]) for c in cols]
            for r in df.head(limit).to_dict("records")]
    widths = [max(len(x[i]) for x in [head, units, *rows]) for i in range(len(head))]

    def line(cells: list[str]) -> str:
        n = len(labels)
        return "  ".join([c.ljust(w) for c, w in zip(cells[:n], widths)]
                         + [c.rjust(w) for c, w in zip(cells[n:], widths[n:])]).rstrip()

    out = [line(head), line(units), *(line(r) for r in rows)]
    if len(df) > limit:
        out.append(f"... {len(df) - limit} more rows: `analyze --table precision`")
    return out


def program() -> str:
    """`mismatch-lab` as this process was started when that is how a shell would find it again: the plain
    name where the one on PATH is this one, else the path it was started by (`.venv/bin/mismatch-lab`)."""
    argv0 = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if argv0 is None or argv0.name != "mismatch-lab":
        return "mismatch-lab"
    found = shutil.which("mismatch-lab")
    if found and Path(found).resolve() == argv0.resolve():
        return "mismatch-lab"
    return shlex.quote(sys.argv[0])


def command(*words) -> str:
    """A `mismatch-lab` command line that runs as printed (program() and each word shell-quoted)."""
    return " ".join([program(), *(shlex.quote(str(w)) for w in words)])


def store_counts(con: duckdb.DuckDBPyConnection) -> dict:
    """What the store holds: runs by kind, sequences, response tokens (counts of whole tables)."""
    kinds = dict(con.execute("SELECT coalesce(kind, '?'), count(*) FROM runs GROUP BY ALL ORDER BY ALL").fetchall())
    n_seq, n_tok = con.execute("SELECT (SELECT count(*) FROM sequences), (SELECT count(*) FROM tokens)").fetchone()
    return {"runs": kinds, "sequences": int(n_seq), "tokens": int(n_tok), "routing_sides": routing_sides(con)}


def routing_sides(con: duckdb.DuckDBPyConnection) -> list[str]:
    """The distinct `routing.side` values of the store (empty without routing)."""
    from mismatch_lab.analysis.routing import has_routing

    if not has_routing(con):
        return []
    return [r[0] for r in con.execute("SELECT DISTINCT side FROM routing ORDER BY 1").fetchall()]


def headline(store: str, counts: dict) -> str:
    kinds = ", ".join(f"{n} {k}" for k, n in counts["runs"].items())
    n_runs = sum(counts["runs"].values())
    return (f"store {store}: {n_runs} run(s) ({kinds or 'none'}), {counts['sequences']:,} sequences, "
            f"{counts['tokens']:,} response tokens")


def _split(df: pd.DataFrame, column: str, value: str) -> pd.DataFrame:
    return df[df[column] == value] if not df.empty and column in df.columns else df.iloc[0:0]


def routing_lines(pairs: pd.DataFrame, sides: list[str] = ()) -> list[str]:
    """One line per (rollout, scorer) pair of the routing table (none when the store holds no routing); a
    store whose routing has the rollout's side only (an import: the dumps hold the engine's routing) says so."""
    if pairs.empty and sides:
        return ["", (f"MoE routing recorded for side(s) {', '.join(sides)} only: no rollout/trainer pair to compare "
                     "(a trainer side comes from `collect` on the MoE checkpoint; docs/moe.md)")]
    out = []
    for r in pairs.itertuples():
        r3 = f", R3 share {r.r3_share:.0%} ({r.r3_scorer})" if pd.notna(r.r3_share) else ""
        out.append(f"  {r.rollout} vs {r.scorer}: {r.any_layer_differs:.1%} of {r.tokens:,} tokens differ in >= 1 layer, "
                   f"flip rate {r.flip_rate:.2%}{r3}")
    head = "MoE routing: tokens sent to another expert set than the rollout's; flip rate per (token, layer) cell"
    return ["", head + " (`--table routing`)", *out] if out else []


def analyze_summary(store: str, counts: dict, tables: dict[str, pd.DataFrame], filters: list[str]) -> list[str]:
    """`analyze`'s default output: what the store holds, the pair table, the scorers' noise floor, the
    per-step runs, a pointer to `doctor`, and (last line) the table names `--table` prints."""
    pairs = _split(tables["precision"], "comparison", "rollout_vs_scorer")
    floor = _split(tables["precision"], "comparison", "scorer_vs_reference")
    out = [headline(store, counts)]
    if filters:
        out.append("shown: " + " ".join(filters))
    if pairs.empty:
        out.append("no (rollout μ, scorer π) pair with scored tokens in this store")
    else:
        rollouts, scorers = sorted(set(pairs["rollout"])), sorted(set(pairs["scorer"]))
        out += textwrap.wrap(f"{len(pairs)} pair(s) of rollout μ ({', '.join(rollouts)}) and scorer π "
                             f"({', '.join(scorers)})", WIDTH)
        out += [*LEGEND.splitlines(), "", *pair_table(pairs)]
    if not floor.empty:
        out += ["", ("noise floor: each scorer against the reference scorer on the same rollout tokens "
                     "(no rollout can be judged below it)")]
        out += pair_table(floor, ("rollout", "scorer", "reference"), limit=8)
    steps = tables.get("steps", pd.DataFrame())
    if not steps.empty:
        out += ["", (f"training steps: {steps['run_id'].nunique()} run(s) over {steps['step'].nunique()} step(s), "
                     "the same numbers per step: `--table steps`")]
    out += routing_lines(_split(tables.get("routing", pd.DataFrame()), "view", "pair"), counts.get("routing_sides", []))
    sizes = ", ".join(f"{name} ({len(df):,})" for name, df in tables.items())  # row counts; 120 characters
    out += ["", f"verdicts and what to change: {command('doctor', '--db', store)}",
            "print a table in full with --table NAME (repeatable), every table with --all; docs/analysis.md",
            *textwrap.wrap(f"tables: {sizes}", 120, subsequent_indent="  ", break_on_hyphens=False)]
    return out
