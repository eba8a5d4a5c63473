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
    (["--db", "STORE", "--json", "DIR"], "is a folder; pass a file path"),
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


def test_a_gate_fails_a_pair_it_could_not_measure(store, capsys):
    """slime's check is per sequence over sequences without a non-finite row: an fp16 pair whose only
    sequence holds one has no value, and the gate must not pass it unseen."""
    fine = Pair(mu=0.01, pi=0.0105)
    blind = Pair(rollout="vllm:fp16", mu=0.01, pi=0.02, n_seq=1, length=10, nonfinite=1)
    assert main(["doctor", "--db", store(fine), "--gate", "slime"]) == 0
    capsys.readouterr()
    assert main(["doctor", "--db", store(fine, blind), "--gate", "slime"]) == 1
    out = capsys.readouterr().out
    assert "gate slime: FAIL" in out and "vllm:fp16/hf:fp32" in out.split("gate slime:", 1)[1]
    assert "not measured:" in out and "finite values of vllm:fp16/hf:fp32" in out


def test_no_fp16_advice_from_a_rollout_without_finite_rows(store):
    from mismatch_lab.doctor.measure import Measurements
    from mismatch_lab.doctor.recommend import fp16
    from mismatch_lab.store.reader import open_store

    con = open_store(store(Pair(rollout="vllm:bf16", pi=0.51, n_seq=2, length=3),
                           Pair(rollout="vllm:fp16", n_seq=1, length=3, nonfinite=3)))
    with Measurements(con) as m:
        (a,) = fp16(m)
    con.close()
    assert not a["advice"].startswith("use fp16") and "no finite scored token" in a["because"]
    assert "inf" not in a["because"] and "nan" not in a["because"]


def test_corrections_report_a_pair_whose_every_token_is_non_finite(store, tmp_path, capsys):
    """Its counts are 0 and its shares NaN (0 / 0), not a ZeroDivisionError; --json to a folder is refused."""
    path = store(Pair(rollout="vllm:fp16", n_seq=1, length=3, nonfinite=3))
    out = tmp_path / "c.json"
    assert main(["corrections", "--db", path, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["corrections"]
    assert rows and all(r["n_tokens"] == 0 and r["frac_tokens_masked"] is None for r in rows)
    capsys.readouterr()
    assert main(["corrections", "--db", path, "--json", str(tmp_path)]) == 2
    assert "is a folder; pass a file path" in capsys.readouterr().err


@pytest.mark.parametrize(("setting", "message"), [
    ("gspo.gspo_eps_low=1", "gspo.gspo_eps_low=1.0 must be below 1"),  # was: math domain error
    ("grpo_clip_higher.eps_low=0", "grpo_clip_higher.eps_low=0.0 must be > 0"),  # names the variant set
    ("grpo.eps_low=1.5", "grpo.eps_low=1.5 must be below 1"),
])
def test_corrections_overrides_out_of_range_exit_2_naming_the_setting(store, capsys, setting, message):
    assert main(["corrections", "--db", store(Pair()), "--set", setting]) == 2
    err = capsys.readouterr().err
    assert message in err and "\n" not in err.strip()


def test_a_gate_fails_its_only_pair_when_it_could_not_measure_it(store, capsys):
    blind = Pair(rollout="vllm:fp16", mu=0.01, pi=0.02, n_seq=1, length=10, nonfinite=1)
    assert main(["doctor", "--db", store(blind), "--gate", "slime"]) == 1
    out = capsys.readouterr().out
    assert "gate slime: FAIL" in out and "finite values of vllm:fp16/hf:fp32" in out


def test_skipped_prompts_are_not_measured_without_a_collect_run(tmp_path, capsys):
    """Only collect skips prompts: on a recorded run '0 skipped' would be vacuous, so the check is listed
    under 'not measured' (not 'ok 0'); growth names what it needs, finite steps."""
    import numpy as np

    from mismatch_lab.record import Recorder

    rng = np.random.default_rng(0)
    with Recorder(tmp_path / "s", "r", framework="trl", rollout_engine="vllm") as rec:
        for step in range(2):
            lmu = -rng.exponential(1.0, (4, 8))
            rec.log_step(step, rng.integers(0, 50, (4, 8)), np.ones((4, 8), bool), lmu, np.minimum(lmu + 0.01, 0.0))
    assert main(["doctor", "--db", str(tmp_path / "s"), "--json", str(tmp_path / "d.json")]) == 0
    doc = json.loads((tmp_path / "d.json").read_text())
    assert "skipped_prompts" not in {c["check"] for c in doc["checks"]}
    needs = {c["check"]: c["needs"] for c in doc["not_measured"]}
    assert needs["skipped_prompts"].startswith("a `collect` run")
    assert "at least 3 training steps with finite scored tokens" in needs["growth"]
    capsys.readouterr()


def test_the_fp16_advice_for_a_bf16_only_store_is_a_command_the_cli_takes(store, tmp_path, monkeypatch):
    import re
    import shlex

    from mismatch_lab.cli import build_parser
    from mismatch_lab.errors import UserError

    out = tmp_path / "doctor.json"
    main(["doctor", "--db", store(Pair(rollout="vllm:bf16", scorer="hf:bf16", pi=0.52)), "--json", str(out)])
    (fp16,) = [a for a in json.loads(out.read_text())["recommendations"] if a["rule"] == "fp16"]
    cmd = re.search(r"`mismatch-lab (doctor [^`]+)`", fp16["because"]).group(1).replace(" M ", " default ")
    args = build_parser().parse_args(shlex.split(cmd))
    seen = []
    monkeypatch.setattr("mismatch_lab.collect.collect", lambda cfg, **kw: seen.append(cfg))  # vLLM not started
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match="no such file"):  # the stubbed collect wrote no store to judge
        args._run(args)
    (cfg,) = seen
    assert cfg.rollout_dtypes == ["bf16", "fp16"] and cfg.scorer_dtypes == ["bf16", "fp16"]
    assert cfg.db == "probe.duckdb"
