"""Golden numbers: every stored study's results, recomputed from the committed Parquet, equal
tests/golden/<study>.json (written by scripts/record_golden.py) within TOLERANCE; and every number the
claims table of studies/README.md quotes is the golden number at the rounding it is written with
(tests/golden/claims.py).

Tolerance: |recomputed − golden| ≤ ABS_TOL + REL_TOL · |golden| for floats; integers, strings and booleans
exactly; null (NaN, ±inf, missing) equals only null. Why these values: the analyses are DuckDB
aggregates over doubles whose summation order depends on threads and on how passes are grouped.
Recomputing every study with 1 to 8 DuckDB threads (2026-11-24; the files are recorded with 1) moved no value by more than 1e-11
relative except those computed as a difference from 1, e.g. chi2 = mean(r²) − 1 of an fp32/fp32 pair
(2.4e-8, moved by 6.7e-16 absolute, 3e-8 relative); the largest absolute move of any value was 7e-15.
REL_TOL = 1e-9 and ABS_TOL = 1e-12 leave two to three orders of magnitude above that noise, while any
change of meaning (a row more or less among ≤ 10^5 moves a mean by ≳ 1e-5 relative; counts compare
exactly) is far outside them. A failure names the first differing table, row (by its key) and column.
Rows match on their key columns, so row order counts only where the table defines one (`ordered`).
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import math
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests" / "golden"
REL_TOL = 1e-9
ABS_TOL = 1e-12


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


recorder = _load("record_golden", REPO / "scripts" / "record_golden.py")
claims = _load("golden_claims", GOLDEN / "claims.py")
STUDIES = [p.name for p in recorder.stored_studies()]


def golden(study: str) -> dict:
    return json.loads((GOLDEN / f"{study}.json").read_text(encoding="utf-8"))


# -- comparison --------------------------------------------------------------------------------------


def same_value(g, v) -> bool:
    if g is None or v is None:
        return g is None and v is None
    if isinstance(g, (bool, str)) or isinstance(v, (bool, str)):
        return type(g) is type(v) and g == v
    if isinstance(g, int) and isinstance(v, int):
        return g == v
    if isinstance(g, (int, float)) and isinstance(v, (int, float)):
        return math.isfinite(v) and abs(v - g) <= ABS_TOL + REL_TOL * abs(g)
    return g == v


def _where(key: list[str], k: tuple) -> str:
    return ", ".join(f"{c}={v!r}" for c, v in zip(key, k) if v is not None) or "(no key)"


def compare(kind: str, gold: dict, recomputed: dict[str, list[dict]]) -> list[str]:
    """Differences between one kind's golden tables (file form) and its recomputed {table: rows}, in
    table order; each names the table, the row (its key) and the column."""
    out = []
    if set(gold) != set(recomputed):
        out.append(f"{kind}: tables differ: golden {sorted(gold)}, recomputed {sorted(recomputed)}")
    for table in [t for t in gold if t in recomputed]:
        spec, rows = gold[table], recomputed[table]
        where = f"{kind}.{table}"
        columns = list(dict.fromkeys(c for r in rows for c in r))
        if set(columns) != set(spec["columns"]):
            out.append(f"{where}: columns differ: only golden {sorted(set(spec['columns']) - set(columns))}, "
                       f"only recomputed {sorted(set(columns) - set(spec['columns']))}")
        key = spec["key"]
        if key:
            g_rows = {recorder.key_of(r, key): r for r in spec["rows"]}
            n_rows = {recorder.key_of(r, key): r for r in rows}
            if len(n_rows) != len(rows):
                out.append(f"{where}: the key {key} does not identify the recomputed rows")
        else:  # no key: rows compare in order
            g_rows, n_rows = dict(enumerate(spec["rows"])), dict(enumerate(rows))
        missing = [k for k in g_rows if k not in n_rows]
        extra = [k for k in n_rows if k not in g_rows]
        if missing:
            out.append(f"{where}: {len(missing)} golden row(s) not recomputed, first: {_where(key, missing[0]) if key else missing[0]}")
        if extra:
            out.append(f"{where}: {len(extra)} recomputed row(s) not in golden, first: {_where(key, extra[0]) if key else extra[0]}")
        if spec["ordered"] and key and not missing and not extra and list(g_rows) != list(n_rows):
            i = next(i for i, (a, b) in enumerate(zip(g_rows, n_rows)) if a != b)
            out.append(f"{where}: row order differs (defined order) at row {i}: golden {_where(key, list(g_rows)[i])}, "
                       f"recomputed {_where(key, list(n_rows)[i])}")
        for k, g_row in g_rows.items():
            n_row = n_rows.get(k)
            if n_row is None:
                continue
            for c in spec["columns"]:
                g, v = g_row.get(c), n_row.get(c)
                if not same_value(g, v):
                    rel = f" (relative {abs(v - g) / abs(g):.2g})" if isinstance(g, float) and isinstance(v, float) and g else ""
                    out.append(f"{where} row {_where(key, k) if key else k} column {c}: golden {g!r}, recomputed {v!r}{rel}")
    return out


def _data_note(study: str, doc: dict) -> str:
    results = REPO / "studies" / study / "results"
    now = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(results.glob("*.parquet"))}
    was = {name: f["sha256"] for name, f in doc["provenance"]["files"].items()}
    if now == was:
        return "the committed Parquet is the one recorded: the computation (or the golden file) changed"
    changed = sorted(n for n in now.keys() | was.keys() if now.get(n) != was.get(n))
    return (f"the Parquet differs from the one recorded ({', '.join(changed)}): if the data changed on purpose, "
            "re-record with scripts/record_golden.py and update the claims table")


# -- the golden files --------------------------------------------------------------------------------


def test_every_stored_study_has_golden_numbers_of_every_kind():
    assert STUDIES, "no study with committed results found"
    files = sorted(p.stem for p in GOLDEN.glob("*.json"))
    assert files == sorted(STUDIES), f"golden files {files} vs stored studies {STUDIES}: run scripts/record_golden.py"
    for study in STUDIES:
        doc = golden(study)
        assert doc["study"] == study
        assert set(recorder.KINDS) <= set(doc), f"{study}: kinds {sorted(set(recorder.KINDS) - set(doc))} not recorded"
        for field in ("command", "recorded", "data_commit", "code_commit", "files"):
            assert doc["provenance"].get(field), f"{study}: provenance lacks {field}"


@pytest.mark.parametrize("study", STUDIES)
def test_golden_numbers_equal_the_committed_parquet(study):
    doc = golden(study)
    recomputed = recorder.compute(REPO / "studies" / study)
    diffs = [d for name in recorder.KINDS for d in compare(name, doc[name], recomputed[name])]
    assert not diffs, (f"{study}: {len(diffs)} difference(s) beyond |Δ| ≤ {ABS_TOL:g} + {REL_TOL:g}·|golden|; "
                       f"first: {diffs[0]}\n{_data_note(study, doc)}\n" + "\n".join(diffs[1:6]))


def _as_recomputed(tables: dict) -> dict[str, list[dict]]:
    """A golden kind turned back into what a kind's function returns (every column, null as None)."""
    return {t: [{c: r.get(c) for c in spec["columns"]} for r in spec["rows"]] for t, spec in tables.items()}


def test_the_comparison_finds_a_changed_number_and_ignores_noise():
    doc = golden(min(STUDIES, key=lambda s: (GOLDEN / f"{s}.json").stat().st_size))
    gold = doc["analyze"]
    assert compare("analyze", gold, _as_recomputed(gold)) == []
    table = next(t for t, spec in gold.items() if spec["key"] and len(spec["rows"]) > 1)
    key = gold[table]["key"]
    i, col, val = next((i, c, v) for i, r in enumerate(gold[table]["rows"]) for c, v in r.items()
                       if isinstance(v, float) and abs(v) > 1e-3)

    def with_value(new):
        rec = _as_recomputed(gold)
        rec[table][i][col] = new
        return compare("analyze", gold, rec)

    assert with_value(val * (1 + 1e-12)) == []  # float noise
    diffs = with_value(val * (1 + 1e-7))
    where = _where(key, recorder.key_of(gold[table]["rows"][i], key))
    assert diffs == [diffs[0]] and diffs[0].startswith(f"analyze.{table} row {where} column {col}: golden"), diffs
    assert with_value(None) and with_value(float("nan")) and with_value(str(val))
    rec = _as_recomputed(gold)
    rec[table].reverse()  # an unordered table: same rows, another order
    assert compare("analyze", {table: {**gold[table], "ordered": False}}, {table: rec[table]}) == []
    assert compare("analyze", {table: {**gold[table], "ordered": True}}, {table: rec[table]})  # a defined order
    rec = _as_recomputed(gold)
    rec[table].pop()
    assert "golden row(s) not recomputed" in compare("analyze", gold, rec)[0]
    nulls = copy.deepcopy(gold)
    nullable = next((c for c in nulls[table]["columns"] if any(c not in r for r in nulls[table]["rows"])), None)
    if nullable is not None:  # null in both is equal
        assert compare("analyze", nulls, _as_recomputed(nulls)) == []


# -- the claims table --------------------------------------------------------------------------------


def claims_rows() -> dict[int, str]:
    """Claim number -> the text of its 'what our data shows' and 'verdict' cells (studies/README.md)."""
    text = (REPO / "studies" / "README.md").read_text(encoding="utf-8")
    rows = {}
    for line in text.split("## Claims", 1)[1].splitlines():
        cells = re.split(r"(?<!\\)\|", line)
        if len(cells) >= 7 and cells[1].strip().isdigit():
            rows[int(cells[1])] = (cells[4] + " | " + cells[5]).strip()
    return rows


def test_every_quoted_number_is_the_golden_number():
    rows = claims_rows()
    docs = {s: golden(s) for s in STUDIES}
    wrong = []
    for q in claims.quotes(claims.Golden(docs)):
        found = q.locate(rows.get(q.claim, ""))
        if found is None:
            wrong.append(f"claim {q.claim}: {q.fragment!r} is not in its row (the table changed? update claims.py)")
            continue
        wrong += [f"claim {q.claim} {found.group()!r}: {problem}" for problem in q.problems(found)]
    assert not wrong, f"{len(wrong)} quoted number(s) disagree with tests/golden:\n" + "\n".join(wrong)


def test_every_number_of_the_claims_table_is_checked_or_explained():
    """A number added to the claims table needs a quote in claims.py (or a stated reason it is not data)."""
    rows = claims_rows()
    docs = {s: golden(s) for s in STUDIES}
    covered: dict[int, list[tuple[int, int]]] = {}
    missing: list[str] = []
    for q in claims.quotes(claims.Golden(docs)):
        found = q.locate(rows.get(q.claim, ""))
        if found is not None:  # else reported by the test above
            covered.setdefault(q.claim, []).extend(found.span(i) for i in range(1, len(found.groups()) + 1))
    for c in claims.CONTEXT:
        start = rows.get(c.claim, "").find(c.fragment)
        if start < 0:
            missing.append(f"claim {c.claim}: context {c.fragment!r} is not in its row")
            continue
        covered.setdefault(c.claim, []).extend((start + a, start + b) for a, b in c.spans())
    unexplained = []
    for claim, text in rows.items():
        for m in claims.NUMBER.finditer(text):
            if not any(a <= m.start() and m.end() <= b for a, b in covered.get(claim, [])):
                unexplained.append(f"claim {claim}: {m.group()!r} in …{text[max(0, m.start() - 40):m.end() + 10]}…")
    assert not missing and not unexplained, (
        f"{len(unexplained)} number(s) neither checked nor explained (tests/golden/claims.py):\n"
        + "\n".join(unexplained + missing))


def test_the_stability_run_ids_are_those_of_the_study_commands():
    # claims.STABILITY_RUNS names the runs of studies/stability by their ids: they must be the ids its
    # run.sh commands produce (TrainConfig.run_id of the study file plus each command's flags)
    import argparse
    import shlex

    from mismatch_lab.rl.command import add_arguments, load_config

    script = (REPO / "studies" / "stability" / "run.sh").read_text(encoding="utf-8")
    commands = re.findall(r'^\s+"(--loss [^"]+)"$', script, flags=re.MULTILINE)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    ids = [load_config(parser.parse_args(["--study", str(REPO / "studies" / "stability" / "study.toml"),
                                          *shlex.split(c)])).run_id() for c in commands]
    assert len(commands) == 11 and sorted(ids) == sorted(claims.STABILITY_RUNS.values())
