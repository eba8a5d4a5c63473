"""The nemo-rl/* presets against a transcription of NeMo-RL's clipped policy-gradient loss and its GRPO sequence
masking (tests/corrections/frameworks_reference/nemo_rl.py, read at NVIDIA-NeMo/RL @7ea279ab; NeMo-RL itself
cannot be installed here) on the same float64 tokens: real store tokens plus extreme ones. Loss, gradient wrt
log π, keep mask, weight and every logged metric at 1e-9 relative.
"""

from __future__ import annotations

import math

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


def _compare(preset, t):
    loss, grad, keep, weight, metrics = _reference(t, preset.settings)
    ours_t = fresh(t)
    ours = preset(ours_t)
    ours.loss.backward()
    assert_same_result(ours_t, ours, loss, grad, keep, weight, metrics)
    return ours_t, ours


DUAL = [([-0.5], [-3.0], [-3.0], -1.0),     # r = e^2.5 ≈ 12.2, A < 0
        ([-1.5], [-3.0], [-3.0], -1.0),     # r = e^1.5 ≈ 4.48, A < 0
        ([-1.0], [-1.0], [-1.0], 1.0)]      # r = 1, A > 0


@pytest.mark.parametrize("name, c", [("nemo-rl/dual_clip", 3.0), ("nemo-rl/dapo", 10.0)])
def test_the_nemo_rl_dual_clip_caps_a_negative_advantage_token_at_c_and_stops_its_gradient(name, c):
    t = tokens(DUAL)
    ours_t, _ = _compare(BY_NAME[name], t)
    for row in (0, 1):
        r = (t.logp[row, 0] - t.logp_old[row, 0]).exp().item()
        if c < r:   # the cap binds: ℓ = c·|A|, no gradient
            assert ours_t.logp.grad[row, 0].item() == 0.0, (name, row)
        else:       # below the cap: ℓ = |A|·r, gradient r/N
            assert rel_close(ours_t.logp.grad[row, 0].item(), r / (3 + 1e-8)), (name, row)


def test_nemo_rl_cispo_keeps_a_gradient_on_every_token_scaled_by_the_clipped_detached_ratio():
    t = tokens(DUAL)
    ours_t, ours = _compare(BY_NAME["nemo-rl/cispo"], t)
    r = (t.logp - t.logp_old).exp().clamp(0.0, 6.0)
    expected = -t.advantages * r / (3 + 1e-8)
    torch.testing.assert_close(ours_t.logp.grad, expected, rtol=1e-12, atol=0.0)
    assert ours.keep.all()


def test_nemo_rl_gspo_logs_the_sum_of_sequence_weights_times_the_sequence_count_as_it_broadcasts_them():
    t = tokens([([-1.0, -1.0], [-1.0, -1.0], [-1.5, -1.0], 1.0),   # w = e^0.5 for the sequence
                ([-2.0], [-2.0], [-1.0], -1.0)])                    # w = e^-1
    _, ours = _compare(BY_NAME["nemo-rl/gspo-importance_sampling"], t)
    w = math.exp(0.5) + math.exp(-1.0)
    assert rel_close(ours.metrics["sampling_importance_ratio"], w * 2 / (2 + 1e-8))
    assert ours.weight.tolist() == [[math.exp(0.5)] * 2, [math.exp(-1.0), 0.0]]


def test_nemo_rl_force_on_policy_ratio_weights_by_pi_over_mu_and_logs_zero_sequence_errors():
    t = tokens([([-1.0, -2.0], [-9.0, -9.0], [-1.5, -2.0], 1.0), ([-0.5], [-9.0], [-0.5], -1.0)])
    _, ours = _compare(BY_NAME["nemo-rl/prorlv2_1"], t)
    # π_old (−9) is never read: w = π/μ, geometric means e^0.25 (dropped: above 1.002) and 1 (kept)
    assert ours.keep.tolist() == [[False, False], [True, False]]
    assert rel_close(ours.metrics["probs_ratio"], 3 / (3 + 1e-8)) and ours.metrics["max_seq_mult_prob_error"] == 0.0
    assert rel_close(ours.metrics["token_mult_prob_error"], (math.exp(0.5) + 1 + 1) / (3 + 1e-8))


def test_the_corrections_docs_table_has_a_row_for_each_of_these_presets():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "corrections.md").read_text()
    assert [p.name for p in PRESETS if f"| `{p.name}`" not in text] == []
