"""Live metrics (`mismatch_lab.record.live`, `Recorder.last_metrics`): the math against a plain Python loop
over the tokens, the framework definitions, the doctor's bands, and the Recorder's copies."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mismatch_lab.doctor import bands as B
from mismatch_lab.errors import UserError
from mismatch_lab.record import Recorder
from mismatch_lab.record.live import LIVE_CHECKS, crossed, step_metrics, verdict_name
from mismatch_lab.store.schema import MAX_LOG_RATIO

REL = 1e-12  # float64 sums of a few hundred terms in another order: a few ulps each


def _batch(seed: int = 0, B_: int = 5, T: int = 9):
    """log mu, log pi, mask with a hole, an empty sequence, a NaN, a -inf and an overflowing ratio."""
    rng = np.random.default_rng(seed)
    mu = np.log(rng.uniform(0.01, 1.0, (B_, T)))
    pi = np.minimum(mu + rng.normal(0, 0.3, (B_, T)), 0.0)
    mask = rng.uniform(size=(B_, T)) > 0.25
    mask[2] = False  # a sequence with no stored token
    mask[0, :3] = True
    mu[0, 0], pi[0, 1] = np.nan, -np.inf
    mu[0, 2], pi[0, 2] = -800.0, -0.0  # r = exp(800) overflows a double: not a finite row
    return mu, pi, mask


def _naive(mu, pi, mask) -> dict[str, float]:
    """Every metric by a loop over positions, straight from the definitions (module docstring of live)."""
    tok = {"abs_dp": [], "abs_dlogp": [], "k3": [], "mult": []}
    per_seq, nonfinite = [], 0
    for b in range(mask.shape[0]):
        seq = []
        for t in range(mask.shape[1]):
            if not mask[b, t]:
                continue
            lmu, lpi = float(mu[b, t]), float(pi[b, t])
            if not (math.isfinite(lmu) and math.isfinite(lpi) and lpi - lmu < MAX_LOG_RATIO):
                nonfinite += 1
                continue
            d = lpi - lmu
            tok["abs_dp"].append(abs(math.exp(lpi) - math.exp(lmu)))
            tok["abs_dlogp"].append(abs(d))
            tok["k3"].append(math.exp(d) - d - 1.0)
            tok["mult"].append(math.exp(abs(d)))
            seq.append(abs(d))
        per_seq.append(sum(seq) / len(seq) if seq else None)
    mean = lambda xs: sum(xs) / len(xs)
    have = [s for s in per_seq if s is not None]
    return {"mismatch/tokens/count": len(tok["k3"]), "mismatch/nonfinite/count": nonfinite,
            "mismatch/abs_dp/mean": mean(tok["abs_dp"]), "mismatch/abs_dlogp/mean": mean(tok["abs_dlogp"]),
            "mismatch/k3/mean": mean(tok["k3"]), "mismatch/seq_abs_dlogp/mean": mean(have),
            "verl/training/rollout_probs_diff_mean": mean(tok["abs_dp"]),
            "prime-rl/mismatch_kl/all/mean": mean(tok["k3"]),
            "nemo-rl/token_mult_prob_error": mean(tok["mult"]),
            "slime/train_rollout_logprob_abs_diff": sum(have) / len(per_seq)}  # fmt: skip


def test_the_live_metrics_equal_a_plain_loop_over_the_tokens_and_count_the_nonfinite_ones():
    mu, pi, mask = _batch()
    got, want = step_metrics(mu, pi, mask), _naive(mu, pi, mask)
    assert want["mismatch/nonfinite/count"] == 3
    for name, value in want.items():
        assert got[name] == pytest.approx(value, rel=REL), name
    # the empty sequence counts in slime's average (0 over 1), not in ours
    assert got["slime/train_rollout_logprob_abs_diff"] < got["mismatch/seq_abs_dlogp/mean"]


def test_the_verdicts_are_the_doctors_bands_judged_on_the_step():
    mu = np.full((1, 4), math.log(0.5))
    mask = np.ones((1, 4), bool)
    just_over = B.ABS_DP.fail * 1.01  # |dp| just past verl's fail level: abs_dp fails, the others stay ok
    got = step_metrics(mu, np.log(np.exp(mu) + just_over), mask)
    assert got[verdict_name(LIVE_CHECKS[0])] == 2.0
    assert [(c.name, v) for c, v, _ in crossed(got)] == [("abs_dp", "fail")]
    calm = step_metrics(mu, mu, mask)
    assert all(calm[verdict_name(c)] == 0.0 for c in LIVE_CHECKS) and crossed(calm) == []


def test_a_step_without_a_finite_token_gives_counts_only():
    mu = np.full((2, 3), np.nan)
    got = step_metrics(mu, mu, np.ones((2, 3), bool))
    assert got == {"mismatch/tokens/count": 0.0, "mismatch/nonfinite/count": 6.0}


def test_the_recorder_returns_the_metrics_of_the_tokens_it_stored_and_keeps_its_api(tmp_path):
    mu, pi, mask = _batch(seed=1)
    rec = Recorder(tmp_path / "s", "live", framework="test", every=2, max_sequences_per_step=3)
    assert rec.last_metrics == {}
    n = rec.log_step(2, None, mask, mu, pi)
    assert n == int(mask[:3].sum())  # log_step still returns the tokens written
    want = step_metrics(mu[:3], pi[:3], mask[:3])  # the cap keeps the first 3 sequences
    mu[:], pi[:] = -1.0, -2.0  # the loop reuses its buffers: the metrics were taken from copies
    assert rec.last_metrics == want
    assert rec.log_step(3, None, mask, mu, pi) == 0 and rec.last_metrics == {}  # a step `every` skips
    rec.close()


@pytest.mark.parametrize("lag, message", [([0, -1, 0, 0, 0], "policy_lag must be a whole number"),
                                          ([[0, 1]], "policy_lag must be [B]"),
                                          ([0, 1], "sequence column policy_lag has 2 values, expected 5")])
def test_a_bad_policy_lag_is_refused_before_anything_is_written(tmp_path, lag, message):
    mu, pi, mask = _batch(seed=2)
    with Recorder(tmp_path / "s", "lag", framework="test") as rec:
        with pytest.raises(UserError, match=message.replace("[", r"\[").replace("]", r"\]")):
            rec.log_step(1, None, mask, mu, pi, policy_lag=lag)
        assert rec.tokens_written == 0 and not list((tmp_path / "s").glob("sequences/*/step-*/*.parquet"))
