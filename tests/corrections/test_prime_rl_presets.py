"""The prime-rl/* presets against a transcription of prime-rl's loss (tests/corrections/frameworks_reference/
prime_rl.py, read at PrimeIntellect-ai/prime-rl @559b4477; prime-rl itself cannot be installed here) on the same
float64 tokens: real store tokens plus extreme ones. Loss, gradient wrt log π, keep mask, weight and every
logged metric at 1e-9 relative.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from frameworks_reference import prime_rl as ref
from frameworks_reference.inputs import (
    assert_same_result,
    fresh,
    rel_close,
    rows,
    tokens,
)

from mismatch_lab.corrections.batch import Batch
from mismatch_lab.corrections.frameworks.prime_rl import PRESETS
from mismatch_lab.corrections.registry import CORRECTIONS


@pytest.fixture(scope="module")
def t():
    return tokens(rows())


def _reference(t, cfg):
    leaf = fresh(t).logp
    lengths = t.mask.sum(-1).tolist()
    samples = [(leaf[b, :n], t.logp_rollout[b, :n], t.advantages[b, :n], t.mask[b, :n])
               for b, n in enumerate(lengths)]
    loss, metrics, per_sample = ref.prime_rl_step(samples, cfg)
    loss.backward()
    keep = torch.zeros_like(t.mask)
    weight = torch.zeros_like(t.logp_old)
    for b, (n, (k, r)) in enumerate(zip(lengths, per_sample)):
        keep[b, :n], weight[b, :n] = k, r
    return loss.item(), leaf.grad, keep, weight, metrics


@pytest.mark.parametrize("preset", PRESETS, ids=[p.name for p in PRESETS])
def test_each_prime_rl_preset_matches_the_transcribed_loss_weights_masks_gradient_and_metrics(preset, t):
    loss, grad, keep, weight, metrics = _reference(t, preset.settings)
    ours_t = fresh(t)
    ours = preset(ours_t)
    ours.loss.backward()
    assert_same_result(ours_t, ours, loss, grad, keep, weight, metrics)


def test_the_prime_rl_presets_carry_prime_rls_config_defaults():
    by_name = {p.name: p for p in PRESETS}
    assert dict(by_name["prime-rl/default"].settings) == ref.DEFAULT_LOSS and by_name["prime-rl/default"].default
    assert dict(by_name["prime-rl/ipo"].settings) == ref.IPO_LOSS


def test_the_inputs_mask_on_both_sides_and_at_zero_advantage(t):
    out = PRESETS[0](fresh(t))
    masked = t.mask & ~out.keep
    a = t.advantages
    assert (masked & (a > 0)).any() and (masked & (a < 0)).any() and (masked & (a == 0)).any()


def test_prime_rl_masks_a_zero_advantage_token_that_our_generic_rule_keeps():
    """prime-rl tests A ≤ 0 on the low side (torch.where on A > 0); our prime_rl_mask reads A's sign and leaves
    A = 0 alone — and reads π_ref where prime-rl reads the current π. The registry says so."""
    t = tokens([([-2.0], [-2.0], [-0.5], 0.0)])  # Δp = e^-2 − e^-0.5 ≈ −0.47, A = 0
    assert not PRESETS[0](fresh(t)).keep.any()
    b = Batch(t.logp.detach(), t.logp_rollout, t.logp_rollout, t.logp_old, t.mask, t.advantages)
    ours = CORRECTIONS["prime_rl_mask"].rule(b, CORRECTIONS["prime_rl_mask"].params)
    assert ours.keep.all()
    assert "A = 0" in CORRECTIONS["prime_rl_mask"].framework


@pytest.mark.filterwarnings("ignore:std\\(\\)")
def test_a_one_sequence_batch_gives_prime_rls_nan_std_without_a_warning_of_ours():
    import warnings

    t = tokens([([-0.2, -1.0], [-0.2, -1.0], [-0.4, -0.9], 1.0)])
    _, _, _, _, metrics = _reference(t, PRESETS[0].settings)  # torch warns inside the transcription
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours = PRESETS[0](fresh(t)).metrics
    assert sorted(ours) == sorted(metrics)
    assert all(rel_close(ours[k], v) for k, v in metrics.items())
    assert math.isnan(ours["is_masked/std"])
