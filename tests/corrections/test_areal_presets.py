"""The areal/* presets against a transcription of AReaL's PPO actor loss (tests/corrections/frameworks_reference/
areal.py, read at inclusionAI/AReaL @4aef98d8; AReaL itself cannot be installed here) on the same float64
tokens: real store tokens plus extreme ones. Loss, gradient wrt log π, keep mask, weight and every logged
metric at 1e-9 relative; the rejection options no preset names (kl metrics, sum/max aggregates, a lower bound,
dual clip, GSPO's sequence ratio) through the same function.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from frameworks_reference import areal as ref
from frameworks_reference.inputs import (
    assert_same_result,
    fresh,
    rows,
    tokens,
)

from mismatch_lab.corrections.frameworks.areal import PRESETS, ppo_actor_loss


@pytest.fixture(scope="module")
def t():
    return tokens(rows())


def _compare(t, settings):
    leaf = fresh(t)
    loss, stat, metrics = ref.grpo_loss(leaf.logp, t.logp_old, t.logp_rollout, t.advantages, t.mask, settings)
    loss.backward()
    w = stat.get("behave_imp_weight")
    weight = (torch.ones_like(t.logp_old) if w is None else w.to(t.logp_old.dtype)) * t.mask
    ours_t = fresh(t)
    ours = ppo_actor_loss(ours_t, settings)
    ours.loss.backward()
    assert_same_result(ours_t, ours, loss.item(), leaf.logp.grad, stat["loss_mask"] & t.mask, weight, metrics)
    return ours


@pytest.mark.parametrize("preset", PRESETS, ids=[p.name for p in PRESETS])
def test_each_areal_preset_matches_the_transcribed_loss_weights_masks_gradient_and_metrics(preset, t):
    _compare(t, preset.settings)


OPTIONS = [
    {"level": "token", "action": "mask", "metric": "kl_k3", "upper": 0.01},
    {"level": "token", "action": "mask", "metric": "kl_k1", "upper": 0.05, "lower": -0.05},
    {"level": "token", "action": "clamp", "metric": "ratio", "upper": 2.0, "lower": 0.5},
    {"level": "sequence", "action": "mask", "metric": "kl_k2", "agg": "sum", "upper": 0.01},
    {"level": "sequence", "action": "mask", "metric": "kl_k3", "agg": "max", "upper": 0.05},
    {"level": "sequence", "action": "clamp", "metric": "kl_k3", "agg": "mean", "upper": 1.2, "lower": 0.8},
    {"level": "sequence", "action": "mask", "metric": "ratio", "agg": "sum", "upper": 2.0, "lower": 0.5},
    {"level": "sequence", "action": "clamp", "metric": "ratio", "agg": "max", "upper": 1.5},
]


@pytest.mark.parametrize("rs", OPTIONS, ids=lambda rs: "-".join(str(v) for v in rs.values()))
def test_every_rejection_option_matches_the_transcription_with_dual_clip_and_sequence_ratio(rs, t):
    settings = {**ref.ACTOR_DEFAULTS, "use_decoupled_loss": True, "recompute_logprob": True, "c_clip": 3.0,
                "eps_clip_higher": 0.28, "rejection_sampling": {**ref.RS_DEFAULTS, **rs}}
    ours = _compare(t, settings)
    assert 0 < ours.metrics["rs_filtered_fraction"] < 1, ours.metrics["rs_filtered_fraction"]
    _compare(t, {**settings, "importance_sampling_level": "sequence"})


def test_the_areal_presets_carry_areals_config_defaults_and_legacy_modes():
    by_name = {p.name: p for p in PRESETS}
    assert dict(by_name["areal/default"].settings) == ref.ACTOR_DEFAULTS and by_name["areal/default"].default
    assert [p.name for p in PRESETS if p.default] == ["areal/default"]
    for mode, mapped in ref.LEGACY.items():
        rs = by_name[f"areal/{mode}"].settings["rejection_sampling"]
        assert rs == {**ref.RS_DEFAULTS, **mapped, "upper": 5.0}


def test_token_mask_drops_tokens_but_still_divides_by_every_response_token(t):
    by_name = {p.name: p for p in PRESETS}
    out = by_name["areal/token_mask"](fresh(t))
    dropped = t.mask & ~out.keep
    assert dropped.any() and out.metrics["n_valid_tokens"] == float(t.mask.sum())
    assert out.metrics["rs_filtered_fraction"] > 0


def test_rejection_sampling_without_the_decoupled_loss_is_ignored_as_areal_warns(t):
    rs = {**ref.RS_DEFAULTS, "upper": 1.0001}
    ignored = ppo_actor_loss(fresh(t), {**ref.ACTOR_DEFAULTS, "rejection_sampling": rs})
    plain = PRESETS[0](fresh(t))
    assert ignored.loss.item() == plain.loss.item() and torch.equal(ignored.keep, t.mask)
    assert "rs_filtered_fraction" not in ignored.metrics
