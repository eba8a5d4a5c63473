"""`mismatch-lab doctor` end to end in-process: exit codes per gate, the JSON document, the report, bad input."""

from __future__ import annotations

import json

import pytest
from doctor_stores import Pair

from mismatch_lab.cli import main

# gate -> (a pair that fails it, a pair that passes it: for verl a warn, which passes)
GATE_CASES = {
    "verl": (Pair(pi=0.52), Pair(pi=0.507)),
    "prime-rl": (Pair(mu=0.01, pi=0.012), Pair(mu=0.01, pi=0.0115)),
    "slime": (Pair(mu=0.01, pi=0.012), Pair(mu=0.01, pi=0.0105)),
    "bitwise": (Pair(pi=0.5000001), Pair(pi=0.5)),
}


@pytest.mark.parametrize("gate", sorted(GATE_CASES))
def test_exit_code_of_each_gate(store, capsys, gate):
    failing, passing = GATE_CASES[gate]
    assert main(["doctor", "--db", store(failing), "--gate", gate]) == 1
    assert f"gate {gate}: FAIL" in capsys.readouterr().out
    assert main(["doctor", "--db", store(passing), "--gate", gate]) == 0
    assert f"gate {gate}: pass" in capsys.readouterr().out


def test_without_a_gate_a_failing_store_exits_0(store, capsys):
    assert main(["doctor", "--db", store(Pair(pi=0.9))]) == 0
    out = capsys.readouterr().out
    assert "0.4 fail" in out and "no gate chosen (exit 0)" in out


def test_json_holds_checks_and_recommendations(store, tmp_path, capsys):
    path = store(Pair(rollout="vllm:bf16", scorer="hf:bf16", pi=0.52), Pair(rollout="vllm:fp16", scorer="hf:fp16", pi=0.504))
    out = tmp_path / "doctor.json"
    assert main(["doctor", "--db", path, "--gate", "verl", "--json", str(out)]) == 1
    doc = json.loads(out.read_text())
    assert doc["gate"] == "verl" and doc["gate_exit"] == 1
    for row in doc["checks"]:
        assert {"pair", "check", "value", "band", "source", "verdict"} <= set(row)
        assert row["verdict"] in ("ok", "warn", "fail")
    verl = {r["pair"]: r["verdict"] for r in doc["checks"] if r["check"] == "abs_dp_mean"}
    assert verl == {"vllm:bf16/hf:bf16": "fail", "vllm:fp16/hf:fp16": "ok"}
    (fp16,) = [a for a in doc["recommendations"] if a["rule"] == "fp16"]
    assert fp16["numbers"]["ratio"] == pytest.approx(0.02 / 0.004)
    assert fp16["advice"].startswith("use fp16") and "5×" in fp16["because"]
    assert "use fp16 rollouts" in capsys.readouterr().out


def test_a_small_fp16_gain_is_not_advised(store):
    from mismatch_lab.doctor.measure import Measurements
    from mismatch_lab.doctor.recommend import fp16
    from mismatch_lab.store.reader import open_store

    con = open_store(store(Pair(rollout="vllm:bf16", pi=0.506), Pair(rollout="vllm:fp16", pi=0.504)))
    with Measurements(con) as m:
        (a,) = fp16(m)
    con.close()
    assert a["numbers"]["ratio"] == pytest.approx(1.5) and not a["advice"].startswith("use fp16")


@pytest.mark.parametrize(("argv", "message"), [
    (["--db", "/nonexistent/store.duckdb"], "no such file or directory"),
    (["--db", "STORE", "--json", "/nonexistent/dir/x.json"], "the folder of --json"),
    (["--db", "STORE", "--rollout-dtype", "fp16"], "--rollout-dtype configure the probe: add --model"),
    (["--db", "EMPTY", "--gate", "verl"], "holds nothing its checks measure"),
    (["--model", "default", "--db", "DIR"], "the probe writes a DuckDB file"),
])
def test_bad_input_exits_2_with_one_line(store, tmp_path, capsys, argv, message):
    from mismatch_lab.store.synthetic import write_store

    empty = write_store(tmp_path / "empty.duckdb", {})
    subst = {"STORE": store(Pair()), "EMPTY": str(empty), "DIR": str(tmp_path)}
    assert main(["doctor", *[subst.get(a, a) for a in argv]]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mismatch-lab doctor: error:") and message in err and "\n" not in err


def test_gate_names_outside_the_registry_are_refused(store, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["doctor", "--db", store(Pair()), "--gate", "miles"])
    assert exc.value.code == 2 and "invalid choice" in capsys.readouterr().err
