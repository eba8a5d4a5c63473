"""The roll/* presets against a transcription of ROLL's RLVR actor loss and train-infer correction
(tests/corrections/frameworks_reference/roll.py, read at alibaba/ROLL @8eb27cc2; ROLL itself cannot be installed
here) on the same float64 tokens: real store tokens plus extreme ones. Loss, gradient wrt log π, keep mask,
weight and every logged metric at 1e-9 relative; IS-weight and filter granularities no preset names, the dual
clip and the sequence ratio through the same function.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from frameworks_reference import roll as ref
from frameworks_reference.inputs import (
    assert_same_result,
    fresh,
    rel_close,
    rows,
    tokens,
)

from mismatch_lab.corrections.frameworks.roll import PRESETS, actor_loss

NAMED = ("enabled", "agg_type", "ratio_enabled", "diff_enabled")
"""The filter options a preset's name states; every other filter option is at ROLL's default."""


@pytest.fixture(scope="module")
def t():
    return tokens(rows())


def _compare(t, settings):
    leaf = fresh(t)
    loss, w, kept, metrics = ref.loss_func(leaf.logp, t.logp_old, t.logp_rollout, t.advantages * t.mask, t.mask,
                                           settings)
    loss.backward()
    ours_t = fresh(t)
    ours = actor_loss(ours_t, settings)
    ours.loss.backward()
    assert_same_result(ours_t, ours, loss.item(), leaf.logp.grad, kept.bool() & t.mask,
                       (w * t.mask).to(ours.weight.dtype),
                       metrics)
    return ours


@pytest.mark.parametrize("preset", PRESETS, ids=[p.name for p in PRESETS])
def test_each_roll_preset_matches_the_transcribed_loss_weights_masks_gradient_and_metrics(preset, t):
    _compare(t, preset.settings)


@pytest.mark.parametrize("agg", ["geometric", "sequence", "segment"])
def test_every_granularity_of_is_weight_and_filters_matches_with_dual_clip_and_sequence_ratio(agg, t):
    correction = {"is_weight": {**ref.IS_WEIGHT, "enabled": True, "weight_type": agg},
                  "filters": [{**ref.FILTER, "enabled": True, "agg_type": agg, "diff_enabled": True},
                              {**ref.FILTER, "enabled": False, "ratio_low": 2.0}]}
    settings = {**ref.PPO, "dual_clip_loss": True, "train_infer_correction": correction}
    ours = _compare(t, settings)
    assert (t.mask & ~ours.keep).any() and ours.keep.any()
    _compare(t, {**settings, "importance_sampling": "seq"})


def test_the_roll_presets_carry_rolls_config_defaults():
    by_name = {p.name: p for p in PRESETS}
    default = by_name["roll/default"]
    assert default.default and [p.name for p in PRESETS if p.default] == ["roll/default"]
    assert {k: v for k, v in default.settings.items() if k != "train_infer_correction"} == ref.PPO
    assert default.settings["train_infer_correction"] == {"is_weight": ref.IS_WEIGHT, "filters": []}
    for p in PRESETS:
        for f in p.settings["train_infer_correction"]["filters"]:
            assert {k: v for k, v in f.items() if k not in NAMED} == \
                {k: v for k, v in ref.FILTER.items() if k not in NAMED}


def test_a_fully_filtered_sequence_adds_nothing_but_still_counts_in_the_sequence_mean():
    # two sequences, the second with π_old/μ = e (outside [0.8, 1.2]) on its only token
    t = tokens([([-0.5, -0.7], [-0.5, -0.7], [-0.5, -0.7], 1.0), ([-1.0], [-1.0], [-2.0], 1.0)])
    by_name = {p.name: p for p in PRESETS}
    out = by_name["roll/filter-token-ratio"](fresh(t))
    assert out.keep[0].all() and not out.keep[1].any()
    assert out.metrics["actor/valid_sample_ratio@sum"] == 0.5
    assert rel_close(out.loss.item(), -1.0 / (2 + 1e-8))  # (−1 + 0) over both sequences


def test_token_mean_keeps_the_filtered_tokens_in_the_loss_as_roll_does(t):
    by_name = {p.name: p for p in PRESETS}
    filtered = by_name["roll/filter-token-ratio"](fresh(t))
    token_mean = by_name["roll/token-mean-filter-token-ratio"](fresh(t))
    assert (t.mask & ~filtered.keep).any() and torch.equal(token_mean.keep, t.mask)
    assert rel_close(token_mean.loss.item(), by_name["roll/token-mean"](fresh(t)).loss.item())
    assert token_mean.metrics["actor/train_infer_final_mask_mean"] < 1


def test_the_delta_p_filter_alone_keeps_low_probability_tokens_the_ratio_filter_drops(t):
    by_name = {p.name: p for p in PRESETS}
    diff = by_name["roll/filter-token-diff"](fresh(t))
    ratio = by_name["roll/filter-token-ratio"](fresh(t))
    assert (diff.keep & ~ratio.keep).any() and (t.mask & ~diff.keep).any()
    assert "actor/train_infer_token_ratio_mask_mean@sum" not in diff.metrics


def test_the_corrections_docs_table_has_a_row_for_each_of_these_presets():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "corrections.md").read_text()
    assert [p.name for p in PRESETS if f"| `{p.name}`" not in text] == []
