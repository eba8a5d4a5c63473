"""The full-sort stage of log S (scoring/support.py `_sorted`): values sorted by numpy, the target placed by its
value, torch's sort with indices only where the target ties the top-p cut. Checked on rows whose support is
larger than every candidate stage, against torch's sort with indices (bitwise: the rule as vLLM runs it) and
a naive float64 reference, ties at the boundary included."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mismatch_lab.scoring import support
from mismatch_lab.scoring.support import SamplingRule, support_stats

V = 3 * max(support.CANDIDATES)  # wider than the last candidate stage: every row is sorted whole
FP32_TOL = 64 * np.finfo(np.float32).eps  # logsumexp over V terms in fp32: a few dozen ULPs, relative
RULES = [SamplingRule(top_p=0.9), SamplingRule(temperature=0.7, top_p=0.95), SamplingRule(top_k=V - 1, top_p=0.8)]


def _naive_log_s(lp: np.ndarray, rule: SamplingRule) -> float:
    """log S of one row in float64, by the rule as written (the kept mass does not depend on tie order)."""
    z = np.sort(lp.astype(np.float64) / rule.temperature)
    keep = z >= z[len(z) - rule.top_k] if rule.top_k else np.ones(len(z), dtype=bool)
    w = np.where(keep, np.exp(z - z.max()), 0.0)
    drop = np.cumsum(w / w.sum()) <= 1 - rule.top_p
    drop[-1] = False
    keep &= ~drop
    return float(np.log(w[keep].sum() / np.exp(z - z.max()).sum()))


@pytest.fixture(scope="module")
def flat():
    """Flat rows (support of thousands of tokens) and, per row, a target drawn from π."""
    g = torch.Generator().manual_seed(0)
    lp = torch.log_softmax(torch.randn(24, V, generator=g) * 0.3, dim=-1)
    return lp, torch.multinomial(lp.exp(), 1, generator=g).view(-1)


def _tied(n_rows: int):
    """One row repeated: a block of 2000 tied tokens straddles the top-p 0.5 cut; row i targets the i-th of
    them, so torch's order of the tied decides which targets fall."""
    logits = torch.zeros(V)
    logits[:V - 2000] = torch.linspace(-2.0, 1.0, V - 2000)
    lp = torch.log_softmax(logits, dim=-1).expand(n_rows, V).contiguous()
    return lp, torch.arange(V - 2000, V - 2000 + n_rows * 50, 50)


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.label())
def test_rows_sorted_whole_equal_torchs_sort_bitwise_and_a_float64_reference(flat, rule, monkeypatch):
    lp, tgt = flat
    calls, sorted_ = [], support._sorted
    monkeypatch.setattr(support, "_sorted", lambda *a: calls.append(len(a[0])) or sorted_(*a))
    log_s, logp_s = support_stats(lp, rule, tgt)
    assert calls == [len(lp)]  # no candidate stage decides a row: the support is too large
    z = lp / rule.temperature
    kept_lse, at = support._sorted_by_index(z, rule, tgt)
    lse = torch.logsumexp(z, dim=-1) if rule.temperature != 1.0 else torch.zeros(len(z))
    assert torch.equal(log_s, kept_lse - lse) and torch.equal(torch.isfinite(logp_s), at)
    assert 0 < int(at.sum()) < len(at)  # both outcomes occur
    ref = np.array([_naive_log_s(r, rule) for r in lp.numpy()])
    np.testing.assert_allclose(log_s.numpy(), ref, rtol=FP32_TOL, atol=FP32_TOL)


def test_targets_tied_at_the_top_p_cut_fall_by_torchs_sort_order(monkeypatch):
    lp, tgt = _tied(40)
    rule = SamplingRule(top_p=0.5)
    calls = []
    by_index = support._sorted_by_index
    monkeypatch.setattr(support, "_sorted_by_index", lambda *a: calls.append(len(a[0])) or by_index(*a))
    log_s, logp_s = support_stats(lp, rule, tgt)
    assert calls == [40]  # every row's target ties the cut: all go to torch's sort
    kept_lse, at = by_index(lp, rule, tgt)
    assert torch.equal(log_s, kept_lse) and torch.equal(torch.isfinite(logp_s), at)
    assert 0 < int(at.sum()) < len(at)  # the tied block is cut: some of its tokens kept, some dropped
    np.testing.assert_allclose(log_s.numpy(), _naive_log_s(lp[0].numpy(), rule), rtol=FP32_TOL, atol=FP32_TOL)


def test_targets_just_below_and_at_an_untied_cut_are_placed_by_value_without_torchs_sort(flat, monkeypatch):
    lp = flat[0][:2].repeat_interleave(2, dim=0)
    rule = SamplingRule(top_p=0.9)
    zs, idx = lp.sort(dim=-1)
    first = support._rule_on_sorted(zs, rule)[2]
    tgt = torch.stack([idx[0, first[0] - 1], idx[1, first[1]], idx[2, first[2] - 1], idx[3, first[3]]])
    monkeypatch.setattr(support, "_sorted_by_index", lambda *a: pytest.fail("a target off a tied cut needs no index"))
    _, logp_s = support_stats(lp, rule, tgt)
    assert torch.equal(torch.isfinite(logp_s), torch.tensor([False, True, False, True]))  # the last dropped, the first kept
