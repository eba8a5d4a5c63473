"""Every check on planted stores on each side of its band: the measured value (closed form) and the verdict."""

from __future__ import annotations

import math

import pytest
from doctor_stores import Pair

from mismatch_lab.doctor.checks import BY_NAME, CHECKS, GATES
from mismatch_lab.doctor.report import diagnose
from mismatch_lab.store.reader import open_store


def mixture(s: int, pos: int) -> float:
    """pi for mu = 0.1: r = 5 at every tenth position, r = 0.05 elsewhere."""
    return 0.5 if pos % 10 == 0 else 0.005


MIX_R, MIX_R2 = 0.1 * 5 + 0.9 * 0.05, 0.1 * 25 + 0.9 * 0.0025  # mean r, mean r² of `mixture`

# check -> [(pair, skipped prompts, expected value, expected verdict)], one case on each side of the band
CASES = {
    "abs_dp_mean": [(Pair(pi=0.503), [], 0.003, "ok"), (Pair(pi=0.507), [], 0.007, "warn"),
                    (Pair(pi=0.52), [], 0.02, "fail")],
    "k3_kl": [(Pair(mu=0.01, pi=0.0115), [], 0.15 - math.log(1.15), "ok"),
              (Pair(mu=0.01, pi=0.012), [], 0.2 - math.log(1.2), "fail")],
    "seq_abs_dlogp": [(Pair(mu=0.01, pi=0.0105), [], math.log(1.05), "ok"),
                      (Pair(mu=0.01, pi=0.012), [], math.log(1.2), "fail")],
    "bitwise": [(Pair(pi=0.5), [], 0.0, "ok"),
                (Pair(pi_at=lambda s, p: 0.5 + 1e-9 * (s == 3 and p == 4)), [], 1 / 80, "fail")],
    "is_weight_mean": [(Pair(mu=0.1, pi=0.105), [], 1.05, "ok"), (Pair(mu=0.1, pi=0.25), [], 2.5, "warn")],
    "seq_is_weight_mean": [(Pair(mu=0.1, pi=0.105), [], 1.05**10, "ok"), (Pair(mu=0.1, pi=0.11), [], 1.1**10, "warn")],
    "ess": [(Pair(mu=0.1, pi=0.105), [], 1.0, "ok"), (Pair(mu=0.1, pi_at=mixture), [], MIX_R**2 / MIX_R2, "warn")],
    "chi2": [(Pair(mu=0.1, pi=0.105), [], 1.05**2 - 1, "ok"), (Pair(mu=0.1, pi_at=mixture), [], MIX_R2 - 1, "warn")],
    "k1_abs": [(Pair(mu=0.1, pi=0.105), [], math.log(1.05), "ok"), (Pair(mu=0.1, pi=0.12), [], math.log(1.2), "warn")],
    "seq_product_out": [(Pair(mu=0.1, pi=0.105), [], 0.0, "ok"), (Pair(mu=0.1, pi=0.11), [], 1.0, "warn")],
    "nonfinite": [(Pair(), [], 0, "ok"), (Pair(nonfinite=2), [], 2, "warn")],
    "skipped_prompts": [(Pair(), [], 0, "ok"), (Pair(), [(0, "long-1"), (0, "long-2")], 2, "warn")],
}


def _rows(path: str, check: str) -> list[dict]:
    con = open_store(path)
    try:
        return [r for r in diagnose(con, path).checks if r["check"] == check]
    finally:
        con.close()


@pytest.mark.parametrize(("check", "case"), [(c, i) for c, cases in CASES.items() for i in range(len(cases))])
def test_each_side_of_every_pair_band(store, check, case):
    pair, skipped, value, verdict = CASES[check][case]
    (row,) = _rows(store(pair, skipped=skipped), check)
    assert row["value"] == pytest.approx(value, rel=1e-9, abs=1e-12)
    assert row["verdict"] == verdict
    assert row["pair"] == ("vllm:bf16" if check == "skipped_prompts" else "vllm:bf16/hf:fp32")
    assert row["band"] == BY_NAME[check].band.text and row["source"] == BY_NAME[check].band.source


def test_every_pair_and_store_check_has_cases_on_both_sides():
    planted_elsewhere = {"growth", "batch_tokens", "batch_logp"}  # test_doctor_runs.py
    planted_elsewhere |= {"support_bias"}  # test_attribution.py
    planted_elsewhere |= {"routing"}  # test_routing_check.py (an MoE store; a dense one has no row)
    planted_elsewhere |= {"nemo_rl_mult_prob_error"}  # tests/importers/test_nemo_rl_metric.py (ok and warn)
    assert set(CASES) | planted_elsewhere == {c.name for c in CHECKS}
    for check, cases in CASES.items():
        assert {"ok"} < {v for *_, v in cases}, check


def test_gates_come_from_the_registry():
    assert GATES == ("bitwise", "prime-rl", "slime", "verl")
    assert {c.name for c in CHECKS if "verl" in c.gates} == {"abs_dp_mean"}


def test_one_row_per_pair_each_judged_on_its_own(store):
    path = store(Pair(rollout="vllm:bf16", pi=0.52), Pair(rollout="vllm:fp16", pi=0.501))
    rows = {r["pair"]: r for r in _rows(path, "abs_dp_mean")}
    assert {p: (round(r["value"], 9), r["verdict"]) for p, r in rows.items()} == {
        "vllm:bf16/hf:fp32": (0.02, "fail"), "vllm:fp16/hf:fp32": (0.001, "ok")}


def test_non_finite_rows_are_left_out_of_the_means_and_counted(store):
    (row,) = _rows(store(Pair(pi=0.52, nonfinite=3)), "abs_dp_mean")
    assert row["value"] == pytest.approx(0.02) and row["detail"].startswith("n = 77 finite rows, 7 sequences")
