"""Record the golden numbers of every stored study: tests/golden/<study>.json.

    .venv/bin/python scripts/record_golden.py                    # every study with a committed results/
    .venv/bin/python scripts/record_golden.py precision-sweep    # only these studies

For every `studies/<name>/` with a `results/` folder, each registered result kind (KINDS below) is computed
from the committed Parquet and written, with its provenance, to `tests/golden/<name>.json`.
`tests/test_golden.py` recomputes the same kinds from the same Parquet and compares every number within
its stated tolerance; `tests/golden/claims.py` ties each number quoted in the claims table of
studies/README.md to these files. Re-record (and review the diff) only when the data or a definition
changed on purpose; a test failure after an optimisation means the numbers moved.

File layout (deterministic: keys in a fixed order, one row per line, floats as `json` writes them, i.e.
the shortest repr that reads back to the same double; nothing is rounded):

    {"study": ..., "provenance": {...},
     "<kind>": {"<table>": {"key": [...], "ordered": bool, "columns": [...], "rows": [{...}, ...]}, ...}, ...}

Each row holds its non-null values only (a missing column reads as null, as NaN and +-inf do in
`analyze --json`). `key` names the columns that identify a row (rows are matched on them, so row order
does not matter unless `ordered`); `columns` lists every column of the table, null or not.

Adding a result kind (the future `corrections` and `doctor` JSON): write a function
`(study_dir) -> {table: [row dict, ...]}` returning what that command's `--json` writes, and register it
with `@kind("<name>", keys={"<table>": (<key columns>), ...})`. Nothing else changes: the recorder writes
it, the test recomputes and compares it. Tables without declared keys are compared row by row in order.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STUDIES = REPO / "studies"
GOLDEN = REPO / "tests" / "golden"

CODE = ("mismatch_lab/analysis", "mismatch_lab/store")  # what the recorded numbers are computed by (provenance)
Rows = list[dict]
THREADS = 1
"""DuckDB threads of the computation: with one, the summation order is fixed, so recording unchanged data and
code twice writes the same numbers to the last bit (with several, sums differ in the last bits from run to
run). The comparison's tolerance covers other orders, e.g. a regrouped pass."""


@dataclass(frozen=True)
class Kind:
    """One kind of result: `compute(study_dir)` gives {table: rows}; `keys` the identifying columns of
    each table; `ordered` the tables whose row order is defined (checked as well)."""

    name: str
    compute: Callable[[Path], dict[str, Rows]]
    keys: dict[str, tuple[str, ...]] = field(default_factory=dict)
    ordered: frozenset[str] = frozenset()


KINDS: dict[str, Kind] = {}
"""The registry: kind name -> Kind. Every kind is recorded for every study and checked by the test."""


def kind(name: str, *, keys: dict[str, tuple[str, ...]], ordered: tuple[str, ...] = ()):
    """Register `fn(study_dir) -> {table: rows}` as the result kind `name` (module docstring)."""

    def register(fn: Callable[[Path], dict[str, Rows]]) -> Callable[[Path], dict[str, Rows]]:
        if name in KINDS:
            raise ValueError(f"result kind {name!r} registered twice")
        KINDS[name] = Kind(name, fn, dict(keys), frozenset(ordered))
        return fn

    return register


# -- the registered kinds ----------------------------------------------------------------------------


@kind(
    "analyze",
    keys={
        "volatility": ("scale", "rollout", "scorer", "bucket"),
        "clipping": ("view", "rollout", "scorer", "adv_sign", "category", "scale", "bucket", "rank"),
        "precision": ("comparison", "rollout", "scorer", "reference"),
        "violations": ("source", "rollout", "scorer", "adv_sign", "run_id", "step", "name"),
        "approximation": ("rollout", "scorer", "reference"),
        "steps": ("run_id", "rollout", "scorer", "step"),
    },
    ordered=("steps",),  # docs/analysis.md: "ordered by run_id, rollout, scorer, step"
)
def analyze(study: Path) -> dict[str, Rows]:
    """`mismatch-lab analyze --db studies/<name> --json` with the command's defaults (every rollout,
    scorer and run; --top-n 30): the same run_all and the same JSON conversion."""
    from mismatch_lab.analysis import run_all
    from mismatch_lab.analysis.command import to_json
    from mismatch_lab.store.reader import open_store

    con = open_store(study)
    try:
        con.execute(f"SET threads = {THREADS}")
        return to_json(run_all(con, top_n=30))
    finally:
        con.close()


@kind("corrections", keys={"corrections": ("method", "rollout", "scorer")})
def corrections(study: Path) -> dict[str, Rows]:
    """`mismatch-lab corrections --db studies/<name> --json`'s main table (every method at its published
    defaults, one row per method and pair); its split tables are left out to keep the files small."""
    from mismatch_lab.analysis.command import to_json
    from mismatch_lab.corrections.compare import compare
    from mismatch_lab.store.reader import open_store

    con = open_store(study)
    try:
        con.execute(f"SET threads = {THREADS}")
        return to_json({"corrections": compare(con)["corrections"]})
    finally:
        con.close()


@kind("doctor", keys={"checks": ("pair", "run_id", "check", "detail"), "recommendations": ("rule", "advice", "because")})
def doctor(study: Path) -> dict[str, Rows]:
    """`mismatch-lab doctor --db studies/<name> --json`'s checks (value, band, source, verdict per pair and
    check) and recommendations (rule, advice, the measured reason as printed)."""
    from mismatch_lab.doctor.report import diagnose, json_doc
    from mismatch_lab.store.reader import open_store

    con = open_store(study)
    try:
        con.execute(f"SET threads = {THREADS}")
        doc = json_doc(diagnose(con))
    finally:
        con.close()
    checks = [{k: v for k, v in c.items() if k != "gates"} | {"gates": ",".join(c["gates"])} for c in doc["checks"]]
    advice = [{k: r[k] for k in ("rule", "advice", "because")} for r in doc["recommendations"]]
    return {"checks": checks, "recommendations": advice}


# -- recording ---------------------------------------------------------------------------------------


def stored_studies() -> list[Path]:
    """Every study directory with committed Parquet results (studies/<name>/results/*.parquet)."""
    return sorted(p.parent for p in STUDIES.glob("*/results") if p.is_dir() and any(p.glob("*.parquet")))


def compute(study: Path, kinds: list[str] | None = None) -> dict[str, dict[str, Rows]]:
    """{kind: {table: rows}} of every registered kind (or of `kinds`) on the study's committed Parquet."""
    return {name: k.compute(study) for name, k in KINDS.items() if kinds is None or name in kinds}


def key_of(row: dict, key: tuple[str, ...]) -> tuple:
    return tuple(row.get(c) for c in key)


def tables_of(name: str, results: dict[str, Rows]) -> dict[str, dict]:
    """The file form of one kind's tables (module docstring); refuses a key that does not identify rows."""
    spec = KINDS[name]
    out = {}
    for table, rows in results.items():
        key = spec.keys.get(table, ())
        columns = list(dict.fromkeys(c for r in rows for c in r))
        if key:
            seen: set[tuple] = set()
            for r in rows:
                k = key_of(r, key)
                if k in seen:
                    raise ValueError(f"{name}.{table}: key {key} does not identify rows ({k} twice); fix KINDS")
                seen.add(k)
        out[table] = {
            "key": list(key),
            "ordered": not key or table in spec.ordered,
            "columns": columns,
            "rows": [{c: v for c, v in r.items() if v is not None} for r in rows],
        }
    return out


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()


def provenance(study: Path, argv: list[str]) -> dict:
    rel = study.relative_to(REPO).as_posix()
    files = {}
    for f in sorted((study / "results").glob("*.parquet")):
        files[f.name] = {"bytes": f.stat().st_size, "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
    return {
        "command": " ".join([".venv/bin/python", "scripts/record_golden.py", *argv]),
        "recorded": dt.date.today().isoformat(),
        "data": f"{rel}/results",
        "data_commit": _git("log", "-1", "--format=%H", "--", f"{rel}/results"),
        "data_uncommitted": bool(_git("status", "--porcelain", "--", f"{rel}/results")),  # True: not reproducible
        "code_commit": _git("rev-parse", "HEAD"),
        "code_uncommitted": sorted({*_git("diff", "--name-only", "HEAD", "--", *CODE).split(),
                                    *_git("ls-files", "--others", "--exclude-standard", "--", *CODE).split()}),
        "files": files,
    }


def dumps(doc: dict) -> str:
    """Deterministic text: top-level and table keys in a fixed order, one row per line."""
    lines = ["{"]
    head = [(k, v) for k, v in doc.items() if k not in KINDS]
    body = [(k, v) for k, v in doc.items() if k in KINDS]
    items = [f" {json.dumps(k)}: {json.dumps(v, indent=1, sort_keys=True, allow_nan=False)}".replace("\n", "\n ")
             for k, v in head]
    for name, tables in body:
        parts = []
        for table, t in tables.items():
            rows = ",\n".join("    " + json.dumps(r, ensure_ascii=False, allow_nan=False) for r in t["rows"])
            parts.append(
                f"  {json.dumps(table)}: {{\"key\": {json.dumps(t['key'])}, \"ordered\": {json.dumps(t['ordered'])}, "
                f"\"columns\": {json.dumps(t['columns'])},\n   \"rows\": [" + ("\n" + rows + "\n   " if rows else "") + "]}"
            )
        items.append(f" {json.dumps(name)}: {{\n" + ",\n".join(parts) + "\n }")
    lines.append(",\n".join(items))
    lines.append("}")
    return "\n".join(lines) + "\n"


def record(study: Path, argv: list[str], kinds: list[str] | None = None) -> Path:
    """Write tests/golden/<study>.json; with `kinds`, recompute only those and keep the file's other kinds."""
    out = GOLDEN / f"{study.name}.json"
    old = json.loads(out.read_text()) if kinds and out.exists() else {}
    results = compute(study, kinds)
    doc = {"study": study.name, "provenance": provenance(study, argv)}
    for name in KINDS:
        if name in results:
            doc[name] = tables_of(name, results[name])
        elif name in old:
            doc[name] = old[name]
    text = dumps(doc)
    assert json.loads(text) == json.loads(json.dumps(doc)), "dumps() lost something"
    GOLDEN.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("studies", nargs="*", help="study names (default: every study with committed results)")
    parser.add_argument("--kind", action="append", choices=list(KINDS), dest="kinds",
                        help="recompute only this result kind, keeping the others of each file (repeatable)")
    args = parser.parse_args(argv)
    studies = stored_studies()
    if args.studies:
        unknown = sorted(set(args.studies) - {s.name for s in studies})
        if unknown:
            parser.error(f"no committed results for {', '.join(unknown)}; stored: {', '.join(s.name for s in studies)}")
        studies = [s for s in studies if s.name in args.studies]
    for study in studies:
        out = record(study, argv, args.kinds)
        print(f"wrote {out.relative_to(REPO)} ({out.stat().st_size / 1e3:.0f} kB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
