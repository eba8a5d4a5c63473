"""The skyrl/* presets against a transcription of SkyRL's policy losses and off-policy correction
(tests/corrections/frameworks_reference/skyrl.py, read at NovaSky-AI/SkyRL @a9564572; SkyRL itself cannot be
installed here) on the same float64 tokens: real store tokens plus extreme ones. Loss, gradient wrt log π, keep
mask, weight and every logged metric at 1e-9 relative (SkyRL's ratios are float32 by construction; both writings
round them the same way).
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from frameworks_reference import skyrl as ref
from frameworks_reference.inputs import (
    assert_same_result,
    fresh,
    rel_close,
    rows,
    tokens,
)

from mismatch_lab.corrections.frameworks import of_framework
from mismatch_lab.corrections.frameworks.skyrl import PRESETS

BY_NAME = {p.name: p for p in PRESETS}


@pytest.fixture(scope="module")
def t():
    return tokens(rows())


def _reference(t, cfg, seed=0):
    torch.manual_seed(seed)  # clip_cov draws its tokens with torch's global generator; the preset then draws the same
    leaf = fresh(t).logp
    mask = t.mask.to(torch.float64)
    loss, metrics, final, gate, weight = ref.skyrl_step(leaf, t.logp_old, t.logp_rollout, t.advantages, mask,
                                                        dict(cfg))
    loss.backward()
    return loss.item(), leaf.grad, (final > 0) & (gate > 0), weight * mask, metrics


@pytest.mark.parametrize("preset", PRESETS, ids=[p.name for p in PRESETS])
def test_each_skyrl_preset_matches_the_transcribed_loss_weights_masks_gradient_and_metrics(preset, t):
    loss, grad, keep, weight, metrics = _reference(t, preset.settings)
    ours_t = fresh(t)
    torch.manual_seed(0)
    ours = preset(ours_t)
    ours.loss.backward()
    assert_same_result(ours_t, ours, loss, grad, keep, weight, metrics)


def test_the_skyrl_default_is_its_config_and_the_others_change_only_their_correction_or_loss_type():
    assert of_framework("skyrl")[0] is BY_NAME["skyrl/default"] and BY_NAME["skyrl/default"].default
    assert dict(BY_NAME["skyrl/default"].settings) == {**ref.ALGORITHM, **ref.OFF_POLICY_CORRECTION}
    for preset in PRESETS:
        changed = {k for k, v in preset.settings.items() if BY_NAME["skyrl/default"].settings[k] != v}
        assert changed <= set(ref.OFF_POLICY_CORRECTION) | {"policy_loss_type", "dppo_type", "loss_reduction",
                                                             "eps_clip_high", "clip_ratio_c", "cispo_anchor",
                                                             "max_seq_len"}, (preset.name, changed)
    assert {p.settings["policy_loss_type"] for p in PRESETS} == set(ref.REGISTRY)


def test_each_skyrl_mask_drops_some_tokens_of_the_inputs_and_keeps_others(t):
    for name in ("skyrl/geometric_mask", "skyrl/product_mask", "skyrl/token_mask", "skyrl/outlier_token_mask",
                 "skyrl/recommended", "skyrl/dppo-binary_tv", "skyrl/dppo-binary_kl", "skyrl/rollout_is",
                 "skyrl/rollout_is-geometric_mask"):
        out = BY_NAME[name](fresh(t))
        assert (t.mask & ~out.keep).any() and out.keep.any(), name
    assert BY_NAME["skyrl/default"](fresh(t)).keep.equal(t.mask)


def test_one_outlier_token_drops_its_whole_sequence_and_skyrl_rounds_the_ratio_in_float32():
    t = tokens([([-1.0, -1.0], [-1.0, -1.0], [-25.0, -1.0], 1.0),   # w = e^24 > 100 on the first token
                ([-1.0], [-1.0], [-1.0 + 1e-3], 1.0)])
    out = BY_NAME["skyrl/outlier_token_mask"](fresh(t))
    assert out.keep.tolist() == [[False, False], [True, False]]
    w = BY_NAME["skyrl/token_tis"](fresh(t)).weight[1, 0].item()
    log_w = torch.tensor(-1.0, dtype=torch.float64) - (-1.0 + 1e-3)
    assert w == log_w.float().exp().item() != log_w.exp().item()


def _compare(preset, t, seed=0):
    loss, grad, keep, weight, metrics = _reference(t, preset.settings, seed)
    ours_t = fresh(t)
    torch.manual_seed(seed)
    ours = preset(ours_t)
    ours.loss.backward()
    assert_same_result(ours_t, ours, loss, grad, keep, weight, metrics)
    return ours_t, ours


@pytest.mark.parametrize("name, c", [("skyrl/dual_clip", 3.0), ("skyrl/dapo", 10.0)])
def test_the_skyrl_dual_clip_caps_a_negative_advantage_token_at_c_and_stops_its_gradient(name, c):
    t = tokens([([-0.5], [-3.0], [-3.0], -1.0),    # r = e^2.5 ≈ 12.2, A < 0
                ([-1.5], [-3.0], [-3.0], -1.0),    # r = e^1.5 ≈ 4.48, A < 0
                ([-1.0], [-1.0], [-1.0], 1.0)])
    ours_t, _ = _compare(BY_NAME[name], t)
    for row in (0, 1):
        r = math.exp(1.5 + (row == 0))
        expected = 0.0 if c < r else r / 3   # ℓ = c·|A'| (no gradient) or |A'|·r, r rounded through float32
        assert rel_close(ours_t.logp.grad[row, 0].item(), expected, rtol=4 * 2**-24), (row, expected)


def test_skyrl_clip_cov_zeroes_the_gradient_of_one_randomly_drawn_high_covariance_token():
    # A' = ±8 / 4 tokens = ±2, log π 1 away from its mean: covariance 2 ∈ (1, 5) on all four; r = 1, unclipped
    t = tokens([([-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0], 8.0), ([-3.0, -3.0], [-3.0, -3.0], [-3.0, -3.0], -8.0)])
    drawn = set()
    for seed in range(4):
        ours_t, ours = _compare(BY_NAME["skyrl/clip_cov"], t, seed)
        zero = (ours_t.logp.grad == 0).nonzero().tolist()
        assert len(zero) == 1 and (~ours.keep).nonzero().tolist() == zero
        assert ours.metrics["clip_ratio"] == 0.25
        drawn.add(tuple(zero[0]))
    assert len(drawn) > 1


def test_skyrl_rollout_is_keeps_only_tokens_strictly_inside_its_band_weighted_by_pi_over_mu():
    t = tokens([([-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0], [-1.1, -1.5, -0.9], 1.0)])   # π/μ = e^0.1, e^0.5, e^−0.1
    _, ours = _compare(BY_NAME["skyrl/rollout_is"], t)
    assert ours.keep.tolist() == [[True, False, True]]
    w = [torch.tensor(x, dtype=torch.float64).float().exp().item() for x in (-1.0 + 1.1, 0.0, -1.0 + 0.9)]
    torch.testing.assert_close(ours.weight, torch.tensor([[w[0], 0.0, w[2]]], dtype=torch.float64), rtol=0, atol=0)


def test_the_corrections_docs_table_has_a_row_for_each_of_these_presets():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "corrections.md").read_text()
    assert [p.name for p in PRESETS if f"| `{p.name}`" not in text] == []
