"""The verdicts on the stored studies, run on their committed Parquet results (the numbers docs/doctor.md quotes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mismatch_lab.doctor.report import diagnose
from mismatch_lab.doctor.verdicts import gate_status
from mismatch_lab.store.reader import open_store

STUDIES = Path(__file__).resolve().parents[2] / "studies"

# study -> gate -> exit code
GATES = {
    "precision-sweep": {"verl": 0, "prime-rl": 0, "slime": 0, "bitwise": 1},
    "dppo-sanity": {"verl": 1, "prime-rl": 0, "slime": 0, "bitwise": 1},
    "batch-invariance": {"verl": 0, "prime-rl": 0, "slime": 0, "bitwise": 1},
    "fp8-rollout": {"verl": 1, "prime-rl": 1, "slime": 1, "bitwise": 1},
}


@pytest.fixture(scope="module")
def diagnoses():
    out = {}
    for name in GATES:
        con = open_store(STUDIES / name)
        out[name] = diagnose(con, name)
        con.close()
    return out


def _verdicts(dx, check: str) -> dict[str, str]:
    return {r["pair"] + (f" {r['run_id']}" if r["run_id"] else ""): r["verdict"] for r in dx.checks if r["check"] == check}


@pytest.mark.parametrize("study", sorted(GATES))
def test_gate_exit_codes(diagnoses, study):
    dx = diagnoses[study]
    assert {g: gate_status(dx.checks, g, dx.not_measured)[0] for g in GATES[study]} == GATES[study]


def test_precision_sweep_bf16_pairs_warn_under_verl_and_fp16_pairs_pass(diagnoses):
    verl = _verdicts(diagnoses["precision-sweep"], "abs_dp_mean")
    assert {p for p, v in verl.items() if v == "warn"} == {
        "vllm:bf16/hf:bf16", "vllm:bf16/hf:fp16", "vllm:bf16/hf:fp32", "vllm:fp16/hf:bf16", "vllm:fp16/vllm:bf16",
        "vllm:fp32/hf:bf16", "vllm:fp32/vllm:bf16"}
    assert {v for p, v in verl.items()} == {"ok", "warn"}
    (fp16,) = [a for a in diagnoses["precision-sweep"].recommendations if a["rule"] == "fp16"]
    assert fp16["numbers"]["ratio"] == pytest.approx(8.46, abs=0.01)  # claim 2: "8.5× below BF16"


def test_dppo_sanity_fails_verl_and_shows_no_growth(diagnoses):
    dx = diagnoses["dppo-sanity"]
    rows = {r["check"]: r for r in dx.checks if r["pair"] == "vllm:bf16/hf:fp32" and r["run_id"] is None}
    assert rows["abs_dp_mean"]["value"] == pytest.approx(0.0188, abs=5e-5) and rows["abs_dp_mean"]["verdict"] == "fail"
    assert rows["k3_kl"]["value"] == pytest.approx(0.0122, abs=5e-5) and rows["k3_kl"]["verdict"] == "ok"
    growth = _verdicts(dx, "growth")
    assert len(growth) == 6 and set(growth.values()) == {"ok"}  # claim 6: "no upward trend"


def test_batch_invariance_fails_bitwise_on_bf16_token_identity_only(diagnoses):
    dx = diagnoses["batch-invariance"]
    tokens = [(r["pair"], r["verdict"]) for r in dx.checks if r["check"] == "batch_tokens"]
    assert sorted(tokens) == [("vllm:bf16", "fail")] * 2 + [("vllm:fp32", "ok")] * 2
    logp = {r["pair"]: r["value"] for r in dx.checks if r["check"] == "batch_logp"}
    assert logp["vllm:bf16"] == pytest.approx(0.030, abs=5e-4) and 0 < logp["vllm:fp32"] < 1e-5


def _rules(dx) -> dict[str, dict]:
    return {a["rule"]: a for a in dx.recommendations}


def test_fp8_rollout_advises_top_k_tv_where_binary_tv_misses_most_tokens_above_delta(diagnoses):
    rules = _rules(diagnoses["fp8-rollout"])
    est = rules["tv_estimator"]  # claim 4: binary TV misses 78 % of the tokens above δ, top-K 32 %
    assert est["advice"].startswith("mask with top-K TV")
    assert est["numbers"]["binary_miss_pct"] == pytest.approx(78.2, abs=0.05)
    assert est["numbers"]["topk_miss_pct"] == pytest.approx(31.6, abs=0.05)
    assert "DPPO top-K TV" in rules["trust_region"]["advice"]


def test_no_estimator_advice_where_no_token_crosses_delta(diagnoses):
    # precision-sweep stores exact TV, but no token's exceeds δ_TV: binary TV misses nothing
    from mismatch_lab.analysis.approximation import approximation_table

    con = open_store(STUDIES / "precision-sweep")
    table = approximation_table(con)
    con.close()
    exact = table[table["n_exact"] > 0]
    assert len(exact) > 0 and (exact["frac_exact_gt_delta"] == 0).all()
    rules = _rules(diagnoses["precision-sweep"])
    assert "tv_estimator" not in rules and "DPPO binary TV" in rules["trust_region"]["advice"]


def test_without_top_k_the_estimator_advice_asks_for_it():
    """The fp8 store's measured approximation table with the top-K columns as a store without top-K
    lists gives them (n_topk_exact 0, top-K columns empty)."""
    from mismatch_lab.doctor.measure import Measurements
    from mismatch_lab.doctor.recommend import trust_region, tv_estimator

    con = open_store(STUDIES / "fp8-rollout")
    with Measurements(con) as m:
        a = m.get("approximation")
        m._cache["approximation"] = a.assign(n_topk_exact=0, **{c: float("nan") for c in a if c.startswith("topk_tv")})
        (est,) = tv_estimator(m)
        assert est["advice"].startswith("record top-K lists") and "not recorded" in est["because"]
        assert "DPPO binary TV" in trust_region(m)[0]["advice"]
    con.close()


def test_sampling_support_warns_support_bias_on_every_processed_rollout_and_never_on_a_raw_one():
    con = open_store(STUDIES / "sampling-support")
    dx = diagnose(con, "sampling-support")
    con.close()
    rows = {r["pair"]: r for r in dx.checks if r["check"] == "support_bias"}
    processed = {r["pair"] for r in dx.checks if r["check"] == "abs_dp_mean" and "-processed/" in r["pair"]}
    assert processed and set(rows) == processed  # raw rollouts (plain and top-p 0.9 raw) get no support_bias row
    # the check is the share of mean |log r| that π on the rule (tempered, cut, renormalised) removes: it sees
    # the cut and a temperature the trainer does not apply alike, so every processed rollout warns
    assert {p: r["verdict"] for p, r in rows.items()} == {p: "warn" for p in rows}
    # fp32 on both sides: the whole mean |log r| is the support's bias, to 1 %
    assert rows["vllm:fp32-p0.9-processed/hf:fp32"]["value"] == pytest.approx(1.0, rel=0.01)
