"""`doctor --model`: the probe's orchestration with a fake collect (the real collect is exercised by
tests/collect; a real probe of the embedded model is measured in docs/doctor.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from doctor_stores import Pair, planted

import mismatch_lab.collect as collect_pkg
from mismatch_lab.cli import main
from mismatch_lab.doctor import probe


@pytest.fixture
def fake_collect(monkeypatch):
    """Replaces collect's public entry point: records the config, writes a planted store at cfg.db once."""
    calls = []

    def collect(cfg, *, progress=True, verbose=False):
        calls.append(cfg)
        if len(calls) == 1:
            planted(cfg.db, *[Pair(rollout=f"{cfg.engine}:{d}", scorer=f"hf:{cfg.scorer_dtypes[0]}", pi=0.52)
                              for d in cfg.rollout_dtypes])
        return []

    monkeypatch.setattr(collect_pkg, "collect", collect)
    return calls


def test_the_probe_collects_the_fixed_probe_then_judges_it(tmp_path, capsys, fake_collect):
    db = tmp_path / "probe.duckdb"
    argv = ["doctor", "--model", "some/model", "--db", str(db), "--rollout-dtype", "bf16,fp16",
            "--trainer-dtype", "bf16", "--engine", "hf", "--gate", "verl"]
    assert main(argv) == 1
    (cfg,) = fake_collect
    assert (cfg.model, cfg.engine, cfg.rollout_dtypes, cfg.scorer_dtypes) == ("some/model", "hf", ["bf16", "fp16"], ["bf16"])
    assert (cfg.samples, cfg.max_tokens, cfg.top_k, cfg.seed, cfg.study) == (2, 24, 0, 0, "doctor-probe")
    lines = [json.loads(x) for x in Path(cfg.prompts).read_text().splitlines()]
    assert [x["id"] for x in lines] == [p[0] for p in probe.PROBE_PROMPTS] and len(lines) == 12
    assert {x["id"].split("-")[0] for x in lines} == {"arith", "chat", "code"}
    out = capsys.readouterr().out
    assert "hf:bf16/hf:bf16" in out and "gate verl: FAIL" in out


def test_a_rerun_keeps_the_prompt_file_so_collect_resumes_the_same_runs(tmp_path, fake_collect):
    db = tmp_path / "probe.duckdb"
    assert main(["doctor", "--model", "m", "--db", str(db)]) == 0
    first = probe.prompts_file(db).stat().st_mtime_ns
    assert main(["doctor", "--model", "m", "--db", str(db)]) == 0
    assert [c.prompts for c in fake_collect] == [str(probe.prompts_file(db))] * 2
    assert probe.prompts_file(db).stat().st_mtime_ns == first  # unchanged file: same run ids, resumed
    assert [c.rollout_dtypes for c in fake_collect] == [["bf16"], ["bf16"]]  # the defaults
    assert [c.scorer_dtypes for c in fake_collect] == [["fp32"], ["fp32"]]


def test_no_store_and_no_model_probes_the_embedded_model_into_the_default_store(tmp_path, monkeypatch, fake_collect):
    monkeypatch.chdir(tmp_path)
    assert main(["doctor"]) == 0
    (cfg,) = fake_collect
    assert cfg.model == "default" and cfg.db == probe.DEFAULT_DB and (tmp_path / probe.DEFAULT_DB).is_file()


def test_bad_probe_dtypes_are_refused_before_collecting(tmp_path, capsys, fake_collect):
    assert main(["doctor", "--model", "m", "--db", str(tmp_path / "p.duckdb"), "--rollout-dtype", "fp8"]) == 2
    assert "unknown rollout dtype 'fp8'" in capsys.readouterr().err and fake_collect == []


@pytest.mark.slow
def test_the_real_probe_on_the_tiny_model_collects_judges_and_resumes(tmp_path, tiny_model, capsys):
    """The fixed probe through the real collect (HF engine at bf16, HF trainer at fp32), then its verdicts;
    a second call finds the probe complete and collects nothing new."""
    import duckdb

    db = tmp_path / "probe.duckdb"
    argv = ["doctor", "--model", tiny_model, "--db", str(db), "--engine", "hf", "--rollout-dtype", "bf16",
            "--trainer-dtype", "fp32", "--json", str(tmp_path / "d.json")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "hf:bf16/hf:fp32" in out
    with duckdb.connect(str(db), read_only=True) as con:
        n_seq = con.execute("SELECT count(*) FROM sequences").fetchone()[0]
        n_tok = con.execute("SELECT count(*) FROM tokens").fetchone()[0]
    assert n_seq == 12 * probe.PROBE["samples"] and 0 < n_tok <= n_seq * probe.PROBE["max_tokens"]
    checks = json.loads((tmp_path / "d.json").read_text())["checks"]
    assert {c["check"] for c in checks} >= {"abs_dp_mean", "k3_kl", "seq_abs_dlogp", "ess"}
    assert all(c["pair"] != "hf:bf16/hf:fp32" or c["value"] is not None for c in checks if c["check"] == "abs_dp_mean")
    assert main(argv) == 0  # resumes: the runs are complete, nothing is collected twice
    with duckdb.connect(str(db), read_only=True) as con:
        assert con.execute("SELECT count(*) FROM sequences").fetchone()[0] == n_seq
