"""The skyrl/* presets against a transcription of SkyRL's policy losses and off-policy correction
(tests/corrections/frameworks_reference/skyrl.py, read at NovaSky-AI/SkyRL @a9564572; SkyRL itself cannot be
installed here) on the same float64 tokens: real store tokens plus extreme ones. Loss, gradient wrt log π, keep
mask, weight and every logged metric at 1e-9 relative (SkyRL's ratios are float32 by construction; both writings
round them the same way).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from frameworks_reference import skyrl as ref
from frameworks_reference.inputs import (
    assert_same_result,
    fresh,
    rows,
    tokens,
)

from mismatch_lab.corrections.frameworks import of_framework
from mismatch_lab.corrections.frameworks.skyrl import PRESETS

BY_NAME = {p.name: p for p in PRESETS}


@pytest.fixture(scope="module")
def t():
    return tokens(rows())


def _reference(t, cfg):
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
    ours = preset(ours_t)
    ours.loss.backward()
    assert_same_result(ours_t, ours, loss, grad, keep, weight, metrics)


def test_the_skyrl_default_is_its_config_and_the_others_change_only_their_correction_or_loss_type():
    assert of_framework("skyrl")[0] is BY_NAME["skyrl/default"] and BY_NAME["skyrl/default"].default
    assert dict(BY_NAME["skyrl/default"].settings) == {**ref.ALGORITHM, **ref.OFF_POLICY_CORRECTION}
    for preset in PRESETS:
        changed = {k for k, v in preset.settings.items() if BY_NAME["skyrl/default"].settings[k] != v}
        assert changed <= set(ref.OFF_POLICY_CORRECTION) | {"policy_loss_type", "dppo_type"}, (preset.name, changed)


def test_each_skyrl_mask_drops_some_tokens_of_the_inputs_and_keeps_others(t):
    for name in ("skyrl/geometric_mask", "skyrl/product_mask", "skyrl/token_mask", "skyrl/outlier_token_mask",
                 "skyrl/recommended", "skyrl/dppo-binary_tv", "skyrl/dppo-binary_kl"):
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
