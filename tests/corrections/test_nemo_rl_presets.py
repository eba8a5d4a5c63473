"""The nemo-rl/* presets against a transcription of NeMo-RL's clipped policy-gradient loss and its GRPO sequence
masking (tests/corrections/frameworks_reference/nemo_rl.py, read at NVIDIA-NeMo/RL @7ea279ab; NeMo-RL itself
cannot be installed here) on the same float64 tokens: real store tokens plus extreme ones. Loss, gradient wrt
log π, keep mask, weight and every logged metric at 1e-9 relative.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from frameworks_reference import nemo_rl as ref
from frameworks_reference.inputs import (
    assert_same_result,
    fresh,
    rel_close,
    rows,
    tokens,
)

from mismatch_lab.corrections.frameworks import of_framework
from mismatch_lab.corrections.frameworks.nemo_rl import PRESETS

BY_NAME = {p.name: p for p in PRESETS}


@pytest.fixture(scope="module")
def t():
    return tokens(rows())


def _reference(t, cfg):
    leaf = fresh(t).logp
    token_mask = t.mask.to(torch.float64)
    loss, metrics, used, mask = ref.nemo_rl_step(leaf, t.logp_old, t.logp_rollout, t.advantages, token_mask, cfg)
    loss.backward()
    keep = mask.bool()
    if cfg["use_importance_sampling_correction"] and cfg["truncated_importance_sampling_type"] in ("icepop",
                                                                                                  "seq-mask-tis"):
        keep = keep & (used != 0)
    return loss.item(), leaf.grad, keep, used * mask, metrics


@pytest.mark.parametrize("preset", PRESETS, ids=[p.name for p in PRESETS])
def test_each_nemo_rl_preset_matches_the_transcribed_loss_weights_masks_gradient_and_metrics(preset, t):
    loss, grad, keep, weight, metrics = _reference(t, preset.settings)
    ours_t = fresh(t)
    ours = preset(ours_t)
    ours.loss.backward()
    assert_same_result(ours_t, ours, loss, grad, keep, weight, metrics)


def test_the_nemo_rl_default_is_its_grpo_config_and_the_others_change_only_their_correction():
    assert of_framework("nemo-rl")[0] is BY_NAME["nemo-rl/default"] and BY_NAME["nemo-rl/default"].default
    assert dict(BY_NAME["nemo-rl/default"].settings) == ref.LOSS_FN
    assert dict(BY_NAME["nemo-rl/icepop"].settings)["truncated_importance_sampling_ratio_min"] == 0.5
    loss_options = {"ratio_clip_min", "ratio_clip_max", "ratio_clip_c", "token_level_loss",
                    "sequence_level_importance_ratios", "disable_ppo_ratio", "force_on_policy_ratio", "use_cispo"}
    for preset in PRESETS:
        assert set(preset.settings) == set(ref.LOSS_FN), preset.name
        changed = {k for k, v in preset.settings.items() if ref.LOSS_FN[k] != v}
        assert changed <= loss_options | {"use_importance_sampling_correction", "truncated_importance_sampling_type",
                                          "truncated_importance_sampling_ratio",
                                          "truncated_importance_sampling_ratio_min",
                                          "seq_logprob_error_threshold"}, (preset.name, changed)


def test_each_nemo_rl_filter_drops_some_tokens_of_the_inputs_and_keeps_others(t):
    for name in ("nemo-rl/icepop", "nemo-rl/seq-mask-tis", "nemo-rl/seq_logprob_error_threshold"):
        out = BY_NAME[name](fresh(t))
        dropped = t.mask & ~out.keep
        assert dropped.any() and out.keep.any(), name
    assert BY_NAME["nemo-rl/default"](fresh(t)).keep.equal(t.mask)


def test_nemo_rl_tis_caps_the_weight_at_two_and_counts_the_tokens_above_it():
    t = tokens([([-1.0, -1.0], [-1.0, -1.0], [-25.0, -1.0], 1.0)])  # w = e^24 on the first token, 1 on the second
    out = BY_NAME["nemo-rl/tis"](fresh(t))
    assert out.weight.tolist() == [[2.0, 1.0]]
    assert rel_close(out.metrics["is_oob_ratio"], 1 / (2 + 1e-8))
