"""The slime/* presets against a transcription of slime's policy loss (tests/corrections/frameworks_reference/
slime.py, read at THUDM/slime @624b824a; slime itself cannot be installed here) on the same float64 tokens:
real store tokens plus extreme ones. Loss, gradient wrt log π, keep mask, weight and every reported metric at
1e-9 relative — except the fractions slime accumulates in float32 (bool and int metrics over torch.int masks),
compared at B·2⁻²⁴ relative, B the number of float32 terms slime sums.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from frameworks_reference import slime as ref
from frameworks_reference.inputs import (
    assert_same_result,
    fresh,
    rows,
    tokens,
)

from mismatch_lab.corrections.frameworks.slime import DEFAULTS, MIS_YAML, PRESETS

FLOAT32_SUMS = ("pg_clipfrac", "tis_clipfrac", "opsm_clipfrac")


@pytest.fixture(scope="module")
def t():
    return tokens(rows())


def _reference(t, settings):
    leaf = fresh(t).logp
    lengths = t.mask.sum(-1).tolist()

    def split(x):
        return [x[b, :n] for b, n in enumerate(lengths)]

    masks = [torch.ones(n, dtype=torch.int) for n in lengths]
    loss, metrics, weight, keep = ref.slime_step(dict(settings), split(leaf), split(t.logp_old),
                                                 split(t.logp_rollout), split(t.advantages), masks,
                                                 ref_lp=split(t.logp_old))
    loss.backward()
    grid_w, grid_k = torch.zeros_like(t.logp_old), torch.zeros_like(t.mask)
    grid_w[t.mask], grid_k[t.mask] = weight, keep
    return loss.item(), leaf.grad, grid_k, grid_w, metrics


def _float32_sum(name: str) -> bool:
    return name in FLOAT32_SUMS or (name.startswith("mis_") and "fraction" in name)


@pytest.mark.parametrize("preset", PRESETS, ids=[p.name for p in PRESETS])
def test_each_slime_preset_matches_the_transcribed_loss_weights_masks_gradient_and_metrics(preset, t):
    loss, grad, keep, weight, metrics = _reference(t, preset.settings)
    ours_t = fresh(t)
    ours = preset(ours_t)
    ours.loss.backward()
    float32_rtol = t.mask.shape[0] * 2.0 ** -24
    assert_same_result(ours_t, ours, loss, grad, keep, weight, metrics,
                       lambda name: float32_rtol if _float32_sum(name) else 1e-9)


def test_the_slime_presets_carry_slimes_argument_defaults_and_the_mis_yaml():
    for key, value in DEFAULTS.items():
        theirs = ref.ARGUMENT_DEFAULTS[key]
        assert (ref.ARGUMENT_DEFAULTS["eps_clip"] if key == "eps_clip_high" and theirs is None else theirs) == value
    assert [p.name for p in PRESETS if p.default] == ["slime/ppo"] and dict(PRESETS[0].settings) == DEFAULTS
    mis = next(p for p in PRESETS if p.name == "slime/mis")
    assert {k: mis.settings[k] for k in ref.MIS_YAML} == ref.MIS_YAML == {**MIS_YAML, "use_tis": True}


def test_the_inputs_reach_the_bands_the_slime_presets_read(t):
    by_name = {p.name: p for p in PRESETS}
    ice = by_name["slime/icepop"](fresh(t))
    assert (t.mask & ~ice.keep).any()
    assert by_name["slime/opsm"](fresh(t)).metrics["opsm_clipfrac"] > 0
    assert by_name["slime/tis"](fresh(t)).metrics["tis_clipfrac"] > 0
    mis = by_name["slime/mis"](fresh(t)).metrics
    assert mis["mis_rs_catastrophic_seq_fraction"] > 0 and mis["mis_rs_mask_fraction_low"] > 0


def test_slimes_icepop_keeps_its_tis_clip_band_not_our_icepops_band(t):
    """What the registry says of icepop: slime's icepop_function reads --tis-clip-low / --tis-clip, [0, 2]."""
    from mismatch_lab.corrections.batch import Batch
    from mismatch_lab.corrections.registry import CORRECTIONS

    slime = next(p for p in PRESETS if p.name == "slime/icepop")(fresh(t))
    b = Batch(t.logp.detach(), t.logp_rollout, t.logp_rollout, t.logp_old, t.mask, t.advantages)
    ours = CORRECTIONS["icepop"].rule(b, CORRECTIONS["icepop"].params)
    assert not torch.equal(ours.keep, slime.keep)
    assert "[0, 2]" in CORRECTIONS["icepop"].framework


def test_the_inputs_reach_what_gspo_cispo_and_the_kl_loss_read(t):
    by_name = {p.name: p for p in PRESETS}
    gspo = by_name["slime/gspo"]
    per_token = gspo.loss(fresh(t), {**gspo.settings, "advantage_estimator": "grpo"})
    assert 0 < gspo(fresh(t)).metrics["pg_clipfrac"] < 1
    assert gspo(fresh(t)).metrics["pg_clipfrac"] != per_token.metrics["pg_clipfrac"]
    assert by_name["slime/cispo"](fresh(t)).metrics["pg_clipfrac"] > 0
    kls = {by_name[f"slime/kl-loss-{k}"](fresh(t)).metrics["kl_loss"] for k in ("k1", "k2", "k3")}
    assert len(kls) == 3 and 0.0 not in kls


def test_a_token_far_from_the_reference_meets_low_var_kls_clamp_as_in_slime():
    # log π − log π_ref = −3: k3 = e³ − 4 ≈ 16.1, clamped to 10 by low_var_kl, not by k3
    t = tokens([([-3.5, -0.2], [-0.5, -0.2], [-0.5, -0.3], 1.0), ([-1.0], [-1.2], [-1.1], -1.0)])
    losses = {}
    for preset in (p for p in PRESETS if p.settings["use_kl_loss"]):
        loss, grad, keep, weight, metrics = _reference(t, preset.settings)
        ours_t = fresh(t)
        ours = preset(ours_t)
        ours.loss.backward()
        assert_same_result(ours_t, ours, loss, grad, keep, weight, metrics)
        losses[preset.name] = metrics["kl_loss"]
    assert losses["slime/kl-loss-low_var_kl"] < losses["slime/kl-loss-k3"]


def test_the_corrections_docs_table_has_a_row_for_each_of_these_presets():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "corrections.md").read_text()
    assert [p.name for p in PRESETS if f"| `{p.name}`" not in text] == []
