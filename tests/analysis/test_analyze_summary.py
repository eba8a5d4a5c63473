"""`mismatch-lab analyze` prints a one-screen summary by default, `--table NAME` / `--all` print tables in full,
and the `--json` document does not depend on what is printed."""

from __future__ import annotations

import json
import math

import pytest

from mismatch_lab.analysis import ANALYSES, run_all
from mismatch_lab.analysis.command import to_json
from mismatch_lab.analysis.precision import precision_table
from mismatch_lab.cli import main
from mismatch_lab.store.reader import open_store

REL = 1e-12  # float64 sums whose order DuckDB's parallel aggregation does not fix differ in the last bits


def analyze(capsys, *argv) -> tuple[int, str]:
    code = main(["analyze", *map(str, argv)])
    return code, capsys.readouterr().out


def test_the_default_output_fits_one_screen_and_starts_with_what_the_store_holds(full_store, capsys):
    code, out = analyze(capsys, "--db", full_store.path)
    lines = out.rstrip("\n").splitlines()
    assert code == 0
    # 120 characters besides the store's own path, which the summary names (the user's, of any length)
    assert len(lines) <= 40 and max(len(line.replace(str(full_store.path), "STORE")) for line in lines) <= 120
    con = open_store(full_store.path)
    n_seq, n_tok = con.execute("SELECT (SELECT count(*) FROM sequences), (SELECT count(*) FROM tokens)").fetchone()
    con.close()
    assert lines[0] == (f"store {full_store.path}: 3 run(s) (2 collect, 1 train), {n_seq:,} sequences, "
                        f"{n_tok:,} response tokens")
    assert "== " not in out  # no full table


def test_each_pair_line_holds_the_precision_numbers_with_fractions_in_percent(full_store, capsys):
    _, out = analyze(capsys, "--db", full_store.path)
    lines = out.splitlines()
    (head,) = [i for i, line in enumerate(lines) if line.startswith("rollout    scorer   tokens")]
    assert lines[head + 1].split() == ["count", "prob.", "prob.", "nats", "nats", "%", "tokens", "nats", "rows"]
    con = open_store(full_store.path)
    pairs = precision_table(con)
    con.close()
    shown = {tuple(line.split()[:2]): line.split()[2:] for line in lines[head + 2: head + 2 + len(pairs)]}
    assert set(shown) == set(zip(pairs["rollout"], pairs["scorer"]))
    for row in pairs.to_dict("records"):
        tokens, *numbers, nonfinite = shown[(row["rollout"], row["scorer"])]
        assert int(tokens.replace(",", "")) == row["n_tokens"] and int(nonfinite) == row["n_nonfinite"]
        expected = [row["abs_dp_mean"], row["abs_dp_max"], row["abs_dlogp_mean"], row["kl_k3"],
                    100 * row["frac_ratio_outside_clip"], row["seq_logratio_rate_per_1k"]]
        assert [float(v) for v in numbers] == pytest.approx(expected, rel=5e-3)  # printed to 3 significant digits
    assert any(float(v[5]) > 1 for v in shown.values())  # planted ratios: a share above 1 % (not 0.0x)


def test_the_last_line_names_every_table_and_the_help_lists_them_too(full_store, capsys):
    _, out = analyze(capsys, "--db", full_store.path)
    lines = out.rstrip("\n").splitlines()
    first = max(i for i, line in enumerate(lines) if line.startswith("tables: "))  # wrapped at 120 characters
    last = " ".join(line.strip() for line in lines[first:])
    assert all(line.startswith("  ") for line in lines[first + 1:])
    assert last.startswith("tables: ") and all(f"{name} (" in last for name in ANALYSES)
    assert f"mismatch-lab doctor --db {full_store.path}" in out
    with pytest.raises(SystemExit) as exit_:
        main(["analyze", "--help"])
    assert exit_.value.code == 0
    helptext = " ".join(capsys.readouterr().out.split())
    assert "--table NAME" in helptext and "--all" in helptext
    assert ", ".join(ANALYSES) in helptext


def test_table_prints_only_the_named_tables_in_full_and_all_prints_every_one(full_store, capsys):
    _, out = analyze(capsys, "--db", full_store.path, "--table", "steps", "--table", "volatility")
    heads = [line for line in out.splitlines() if line.startswith("== ")]
    assert heads[0].startswith("== steps") and {h.split()[1] for h in heads} == {"steps", "volatility"}
    assert not out.startswith("store ")
    _, out = analyze(capsys, "--db", full_store.path, "--all")
    assert {h.split()[1] for h in out.splitlines() if h.startswith("== ")} == set(ANALYSES)


@pytest.mark.parametrize("argv", [["--table", "nope"], ["--table", "steps", "--all"]])
def test_an_unknown_table_or_both_options_exit_2(full_store, capsys, argv):
    with pytest.raises(SystemExit) as exit_:
        main(["analyze", "--db", str(full_store.path), *argv])
    assert exit_.value.code == 2


def _same(a, b) -> None:
    """Equal JSON values: same keys and row order, numbers to REL, everything else exactly."""
    assert type(a) is type(b) or {type(a), type(b)} == {int, float}, (a, b)
    if isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    elif isinstance(a, float):
        assert math.isclose(a, b, rel_tol=REL, abs_tol=0.0) or a == b, (a, b)
    else:
        assert a == b


def test_the_json_document_does_not_depend_on_what_is_printed(full_store, tmp_path, capsys):
    docs = {}
    for name, extra in {"summary": [], "all": ["--all"], "table": ["--table", "clipping"]}.items():
        target = tmp_path / f"{name}.json"
        assert analyze(capsys, "--db", full_store.path, "--json", target, *extra)[0] == 0
        docs[name] = json.loads(target.read_text())
    con = open_store(full_store.path)
    direct = json.loads(json.dumps(to_json(run_all(con)), allow_nan=False))
    con.close()
    assert list(direct) == list(ANALYSES)
    for doc in docs.values():
        _same(doc, direct)


def test_filters_are_named_and_a_store_without_scores_says_so(full_store, tmp_path, capsys):
    _, out = analyze(capsys, "--db", full_store.path, "--rollout", "vllm:fp16", "--scorer", "hf:fp32")
    assert out.splitlines()[1] == "shown: --rollout vllm:fp16 --scorer hf:fp32"
    assert "1 pair(s) of rollout μ (vllm:fp16) and scorer π (hf:fp32)" in out

    import pandas as pd

    from mismatch_lab.store.synthetic import write_store

    runs = pd.DataFrame([{"run_id": "r", "kind": "collect", "status": "complete", "engine": "vllm", "engine_dtype": "bf16"}])
    empty = write_store(tmp_path / "noscores.duckdb", {"runs": runs})
    code, out = analyze(capsys, "--db", empty)
    assert code == 0 and "no (rollout μ, scorer π) pair with scored tokens in this store" in out


def test_progress_keeps_one_line_on_a_terminal_and_one_line_per_analysis_in_a_log(full_store):
    import os
    import pty
    import subprocess
    import sys

    argv = [sys.executable, "-m", "mismatch_lab.cli", "analyze", "--db", str(full_store.path)]
    logged = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert logged.returncode == 0
    assert [line.split(" done")[0] for line in logged.stderr.splitlines()[:-1]] == [
        f"analyze: {name}" for name in ("join", *ANALYSES)]
    master, slave = pty.openpty()
    proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=slave, timeout=300, check=False)
    os.close(slave)
    seen = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the terminal closed
            break
        if not chunk:
            break
        seen += chunk
    os.close(master)
    assert proc.returncode == 0 and proc.stdout.decode().startswith("store ")
    text = seen.decode()
    assert text.count("\n") == 1 and text.rstrip().endswith("definitions and denominators: docs/analysis.md")
    assert text.count("\r") >= len(ANALYSES) + 1  # every progress line rewritten in place
