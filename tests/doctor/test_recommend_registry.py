"""doctor's advice reads the corrections registry through `mismatch-lab corrections`' own code path on the same
store: it never advises a method that drops most of the pair's sequences (recommend.MAX_DROPPED_SEQS), the
shares it names are the ones `corrections` prints, and its fp16 advice names the trainer dtype it measured."""

from __future__ import annotations

import json
import math

import pytest
from doctor_stores import Pair

from mismatch_lab.cli import main
from mismatch_lab.doctor.recommend import MAX_DROPPED_SEQS
from mismatch_lab.store.reader import open_store

# The first token of every sequence has π = 0.645 against μ = 0.5: r = 1.29 leaves PPO's clip [0.8, 1.28]
# while |π − μ| = 0.145 stays under DPPO's δ_TV, so the trust-region advice (dppo_binary_tv) is given too.
# GEO_DROPS_ALL: log r = log 1.04 on the other tokens; 20 tokens carry the product ratio to 2.9, outside
# [0.5, 2], while the geometric mean (1.05) stays inside [0.5, 2] but leaves Geo-RS's [0.999, 1.001]: geo_mis
# drops every sequence.
GEO_DROPS_ALL = Pair(mu=0.5, n_seq=6, length=20, pi_at=lambda s, pos: 0.645 if pos == 0 else 0.52)
# GEO_KEEPS_ALL: log r = 0.0006 on the other tokens; 800 tokens carry the product to exp(0.73) = 2.08, the
# geometric mean exp(0.00092) stays inside Geo-RS's band: geo_mis drops nothing, the product's problem is the same
GEO_KEEPS_ALL = Pair(mu=0.5, n_seq=3, length=800, pi_at=lambda s, pos: 0.645 if pos == 0 else 0.5 * math.exp(0.0006))

def _doctor(path: str, tmp_path, capsys) -> dict[str, dict]:
    out = tmp_path / "doctor.json"
    assert main(["doctor", "--db", path, "--json", str(out)]) == 0
    capsys.readouterr()
    return {a["rule"]: a for a in json.loads(out.read_text())["recommendations"]}


def _corrections(path: str, tmp_path, capsys) -> dict[tuple[str, str, str], dict]:
    out = tmp_path / "corrections.json"
    assert main(["corrections", "--db", path, "--json", str(out)]) == 0
    capsys.readouterr()
    return {(r["method"], r["rollout"], r["scorer"]): r for r in json.loads(out.read_text())["corrections"]}


def test_doctor_does_not_advise_the_geometric_mean_rule_where_corrections_shows_it_dropping_most_sequences(
        store, tmp_path, capsys):
    path = store(GEO_DROPS_ALL)
    rules = _doctor(path, tmp_path, capsys)
    geo = _corrections(path, tmp_path, capsys)[("geo_mis", "vllm:bf16", "hf:fp32")]
    assert geo["frac_seqs_masked"] == 1.0 > MAX_DROPPED_SEQS and geo["n_seqs"] == 6
    seq = rules["sequence_ratio"]
    assert seq["numbers"]["product_pct"] == 100.0  # the product ratio leaves [0.5, 2] for every sequence
    assert "geometric" not in seq["advice"] and "geo_mis" not in seq["advice"]
    assert seq["advice"].startswith("prefer token-level correction (token_tis, icepop)")
    assert "geo_mis 100 % (not advised: above 50 %)" in seq["because"] and "of its 6 sequences" in seq["because"]


def test_the_apps_doctor_measures_the_shares_of_a_store_above_its_sample_size_on_a_sample_and_says_so(
        store, tmp_path, capsys):
    from mismatch_lab.analysis import sample
    from mismatch_lab.doctor.report import diagnose

    path = store(GEO_DROPS_ALL)
    con = open_store(path)
    try:
        n_tokens = sample.sample_size(con)["tokens"]
        sampled = diagnose(con, attribution=False, sample_tokens=n_tokens // 2)  # what doctor_view asks for
        every = sample.stride(n_tokens, n_tokens // 2)
    finally:
        con.close()
    seq = {a["rule"]: a for a in sampled.recommendations}["sequence_ratio"]
    assert every > 1
    assert f"sequences sampled (1 in {every} prompt groups)" in seq["because"]
    assert "geo_mis 100 % (not advised: above 50 %)" in seq["because"]  # every sampled sequence dropped, as all are
    assert "geometric" not in seq["advice"]
    assert "of its 6 sequences" in _doctor(path, tmp_path, capsys)["sequence_ratio"]["because"]  # the CLI: all


def test_doctor_advises_the_geometric_mean_rule_where_it_keeps_the_sequences(store, tmp_path, capsys):
    path = store(GEO_KEEPS_ALL)
    seq = _doctor(path, tmp_path, capsys)["sequence_ratio"]
    assert _corrections(path, tmp_path, capsys)[("geo_mis", "vllm:bf16", "hf:fp32")]["frac_seqs_masked"] == 0.0
    assert seq["numbers"]["product_pct"] == 100.0
    assert "geometric-mean correction (geo_mis)" in seq["advice"] and "not advised" not in seq["because"]


@pytest.mark.parametrize("pair", [GEO_DROPS_ALL, GEO_KEEPS_ALL], ids=["geo drops all", "geo keeps all"])
def test_every_dropped_share_doctor_names_is_the_one_corrections_prints_for_the_store(store, tmp_path, capsys, pair):
    path = store(pair)
    rules = _doctor(path, tmp_path, capsys)
    rows = _corrections(path, tmp_path, capsys)
    named = {(rule, k.removesuffix("_dropped_seqs_pct")): v for rule, a in rules.items()
             for k, v in a["numbers"].items() if k.endswith("_dropped_seqs_pct")}
    assert {m for _, m in named} >= {"token_tis", "icepop", "geo_mis", "dppo_binary_tv"}
    for (rule, method), pct in named.items():
        assert pct == 100 * rows[(method, "vllm:bf16", "hf:fp32")]["frac_seqs_masked"], (rule, method)
        assert f"{method} {pct:.3g} %" in rules[rule]["because"]


def test_fp16_advice_against_an_fp32_trainer_names_it_and_does_not_advise_an_fp16_trainer(store, tmp_path, capsys):
    path = store(Pair(rollout="vllm:bf16", scorer="hf:fp32", pi=0.52), Pair(rollout="vllm:fp16", scorer="hf:fp32", pi=0.504))
    fp16 = _doctor(path, tmp_path, capsys)["fp16"]
    assert fp16["numbers"]["ratio"] == pytest.approx(0.02 / 0.004, rel=1e-12)
    assert fp16["advice"].startswith("use fp16 rollouts (measured against the hf:fp32 trainer only")
    assert "an fp16 trainer was not measured" in fp16["advice"] and "and an fp16 trainer" not in fp16["advice"]
    assert "same hf:fp32 trainer (trainer dtype fp32)" in fp16["because"]
    assert fp16["numbers"]["fp16_trainer_dtype"] == "fp32" and fp16["numbers"]["fp16_pair"] == "vllm:fp16/hf:fp32"


def test_fp16_advice_names_the_fp16_trainer_it_measured(store, tmp_path, capsys):
    path = store(Pair(rollout="vllm:bf16", scorer="hf:bf16", pi=0.52), Pair(rollout="vllm:fp16", scorer="hf:fp16", pi=0.504))
    fp16 = _doctor(path, tmp_path, capsys)["fp16"]
    assert fp16["advice"] == "use fp16 rollouts and an fp16 trainer (measured: vllm:fp16 against the hf:fp16 trainer)"
    assert "(hf:bf16, hf:fp16)" in fp16["because"] and fp16["numbers"]["fp16_trainer_dtype"] == "fp16"


def test_an_advice_whose_every_method_drops_most_sequences_is_withheld(store):
    """The trust-region advice names one method (dppo_binary_tv); the store's comparison, with that method's
    row set to drop 90 % of the pair's sequences, turns it into a warning against the method."""
    from mismatch_lab.doctor.measure import Measurements
    from mismatch_lab.doctor.recommend import trust_region
    from mismatch_lab.store.reader import open_store

    con = open_store(store(GEO_DROPS_ALL))
    with Measurements(con) as m:
        (kept,) = trust_region(m)
        c = m.get("corrections")
        m._cache["corrections"] = c.assign(frac_seqs_masked=c["frac_seqs_masked"].where(c["method"] != "dppo_binary_tv", 0.9))
        (withheld,) = trust_region(m)
    con.close()
    assert kept["advice"] == "bound the trust region (DPPO binary TV), not the ratio clip"
    assert withheld["advice"] == "do not enable dppo_binary_tv at the published defaults on vllm:bf16/hf:fp32"
    assert "dppo_binary_tv 90 % (not advised: above 50 %)" in withheld["because"]
