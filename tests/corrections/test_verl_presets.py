"""Every verl preset against verl 0.9.1's own code on the same float64 tokens.

verl's code is the PyPI wheel verl==0.9.1, installed by scripts/setup.sh into .venv/verl-0.9.1 without its
dependency tree (`pip install --no-deps --target`, with tensordict, omegaconf, codetiming, orjson that its
loss modules import). The test puts that folder on sys.path while importing verl, and puts a stub `ray` module
(one class, ObjectRef) in sys.modules for the import only: verl/protocol.py imports ray at module level and
annotates with ray.ObjectRef, but the loss and rollout-correction code never calls ray. Both are removed again
after the import.

verl is called the way its trainer and actor call it: decoupled presets through
`compute_rollout_correction_and_add_to_batch` on a DataProto (ray_trainer.py), then the policy loss of
`policy_loss.loss_mode` with the batch's (rejection-masked) response mask as bool and `rollout_is_weights`,
`global_batch_info` filled as verl/workers/utils/losses.py::ppo_loss fills it (dp_size 1, batch_num_tokens =
tokens of that mask, global_batch_size = rows); bypass presets with old_log_probs := rollout_log_probs and
loss_mode = bypass_mode (rollout_corr_helper.apply_bypass_mode).

Inputs: frameworks_reference.inputs (300 stored sequences of the precision-sweep study and its extreme rows)
plus rows on verl's own bands. Compared: the loss, d loss / d log π (autograd), every logged metric (same
names; verl's `actor/pg_loss` is the returned loss), the kept tokens, and the weights; 1e-9 relative.
"""

from __future__ import annotations

import dataclasses
import math
import types

import pytest
import torch
from frameworks_reference import inputs
from verl_wheel import VERL_DIR, import_verl

from mismatch_lab.corrections import frameworks
from mismatch_lab.corrections.frameworks import verl as V

RTOL = 1e-9
PRESETS = frameworks.of_framework("verl")

BANDS = [
    # (log π, log π_old, log μ, A): verl's own boundaries, one-token rows
    ([0.0], [-math.log(1.001)], [0.0], 1.0),         # −ℓ = log 1.001: the geo-RS upper bound, exactly
    ([0.0], [0.0], [math.log(0.999)], -1.0),         # −ℓ = log 0.999: the geo-RS lower bound, exactly
    ([-math.log(2.0)], [-math.log(2.0)], [0.0], 1.0),  # Σ −ℓ = log 2: seq_sum_k1's upper bound
    ([0.0], [0.0], [-math.log(2.0)], -1.0),          # Σ −ℓ = −log 2: its lower bound (ratio 0.5)
    ([-0.5], [-2.0], [-2.0], -1.0),                  # ρ = e^1.5 > 3, A < 0: the dual clip
    ([math.log(0.7)], [math.log(0.5)], [math.log(0.5)], 1.0),   # p − q = 0.2: DPPO-TV's bound, A > 0
    ([math.log(0.3)], [math.log(0.5)], [math.log(0.5)], -1.0),  # p − q = −0.2, A < 0
    ([math.log(5.0) - 2.0], [math.log(5.0) - 2.0], [-2.0], 1.0),  # w = 5: IcePop's upper bound
]


@pytest.fixture(scope="module")
def verl():
    """verl's modules: core_algos, rollout_corr_helper, the configs and DataProto."""
    verl_pkg, config, core_algos, rollout_corr_helper, workers_config = import_verl(
        "verl", "verl.trainer.config", "verl.trainer.ppo.core_algos", "verl.trainer.ppo.rollout_corr_helper",
        "verl.workers.config")
    return types.SimpleNamespace(DataProto=verl_pkg.DataProto, RC=config.RolloutCorrectionConfig, core=core_algos,
                                 helper=rollout_corr_helper, Actor=workers_config.ActorConfig,
                                 PolicyLoss=workers_config.PolicyLossConfig)


@pytest.fixture(scope="module")
def tokens():
    return inputs.tokens(inputs.rows() + BANDS)


RC_FIELDS = ("rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize", "rollout_rs",
             "rollout_rs_threshold", "bypass_mode", "loss_type")


def configs(verl, settings):
    """verl's (ActorConfig, RolloutCorrectionConfig) for a preset's settings."""
    s = {**V.DEFAULTS, **settings}
    rc = verl.RC(**{k: s[k] for k in RC_FIELDS})
    loss_mode = "bypass_mode" if s["bypass_mode"] else s["loss_mode"]
    policy = verl.PolicyLoss(loss_mode=loss_mode, rollout_correction=rc,
                             **{k: s[k] for k in ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio",
                                                   "ppo_kl_coef")})
    actor = verl.Actor(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, policy_loss=policy,
                       **{k: s[k] for k in ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "loss_agg_mode",
                                            "tau_pos", "tau_neg")})
    return actor, rc


def run_verl(verl, t, settings):
    """(loss, d loss/d log π, the mask the actor saw as bool, the IS weights or None, metrics) from verl."""
    s = {**V.DEFAULTS, **settings}
    actor, rc = configs(verl, settings)
    response_mask = t.mask.to(torch.int64)  # the trainer's response_mask: a slice of the attention mask
    lp = t.logp.detach().clone().requires_grad_(True)
    metrics, weights = {}, None
    if s["bypass_mode"]:
        old, mask = t.logp_rollout, response_mask
        weights, kept = verl_bypass_correction(verl, lp, t, response_mask, s)
    else:
        batch = verl.DataProto.from_dict(tensors={"old_log_probs": t.logp_old, "rollout_log_probs": t.logp_rollout,
                                                  "response_mask": response_mask})
        batch, metrics = verl.helper.compute_rollout_correction_and_add_to_batch(batch, rc)
        old, mask = t.logp_old, batch.batch["response_mask"]
        weights = batch.batch.get("rollout_is_weights", None)
    actor.global_batch_info.update(dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=mask.shape[0],
                                   loss_scale_factor=None)
    loss_fn = verl.core.get_policy_loss_fn(actor.policy_loss.loss_mode)
    loss, pg = loss_fn(old_log_prob=old, log_prob=lp, advantages=t.advantages, response_mask=mask.to(bool),
                       loss_agg_mode=actor.loss_agg_mode, config=actor,
                       rollout_is_weights=None if s["bypass_mode"] else weights)
    loss.backward()
    if s["bypass_mode"]:
        mask = kept
        weights = weights if s["loss_type"] == "reinforce" else None
    return loss.detach(), lp.grad, mask.bool(), weights, {**metrics, **pg, "actor/pg_loss": loss.item()}


def verl_bypass_correction(verl, lp, t, response_mask, s):
    """(IS weights or None, rejection-masked mask) that verl's bypass loss computes inside and does not
    return: the same helper call it makes (on the current π, detached, against μ)."""
    proto, kept, _ = verl.helper.compute_rollout_correction_and_rejection_mask(
        old_log_prob=lp.detach(), rollout_log_prob=t.logp_rollout, response_mask=response_mask.bool(),
        rollout_is=s["rollout_is"], rollout_is_threshold=s["rollout_is_threshold"],
        rollout_is_batch_normalize=s["rollout_is_batch_normalize"], rollout_rs=s["rollout_rs"],
        rollout_rs_threshold=s["rollout_rs_threshold"])
    return (None if proto is None else proto.batch["rollout_is_weights"]), kept


def same(a: float, b: float) -> bool:
    """Equal to 1e-9 relative; inf equal to inf of the same sign, NaN to NaN."""
    if math.isinf(a) or math.isinf(b):
        return a == b
    return inputs.rel_close(a, b, RTOL)


def assert_tensors(ours: torch.Tensor, theirs: torch.Tensor, where: torch.Tensor, what: str) -> None:
    a, b = ours[where], theirs[where].to(ours.dtype)
    bad = (a - b).abs() > RTOL * torch.maximum(a.abs(), b.abs())
    assert not bad.any(), f"{what}: {int(bad.sum())} tokens differ, e.g. {a[bad][:3].tolist()} vs {b[bad][:3].tolist()}"


def check(verl, tokens, preset_settings, loss_fn=V.verl_loss):
    t = inputs.fresh(tokens)
    torch.manual_seed(0)  # clip_cov draws its tokens with torch.randperm: the same draw on both sides
    ours = loss_fn(t, preset_settings)
    ours.loss.backward()
    torch.manual_seed(0)
    loss, grad, mask, weights, metrics = run_verl(verl, tokens, preset_settings)
    assert same(float(ours.loss.detach()), float(loss)), (float(ours.loss.detach()), float(loss))
    assert_tensors(t.logp.grad, grad, tokens.mask, "d loss / d log π")
    assert set(ours.metrics) == set(metrics), set(ours.metrics) ^ set(metrics)
    wrong = {k: (ours.metrics[k], metrics[k]) for k in metrics if not same(ours.metrics[k], metrics[k])}
    assert not wrong, wrong
    assert not (grad[tokens.mask & ~ours.keep] != 0).any(), "verl gives a gradient to a token the preset drops"
    return ours, mask, weights


@pytest.mark.parametrize("preset", PRESETS, ids=[p.name for p in PRESETS])
def test_each_verl_preset_gives_verls_loss_gradient_and_metrics_on_stored_and_extreme_tokens(verl, tokens, preset):
    ours, mask, weights = check(verl, tokens, preset.settings)
    s = {**V.DEFAULTS, **preset.settings}
    if s["loss_mode"] == "vanilla" or s["bypass_mode"]:
        expected_keep = mask if weights is None else mask & (weights != 0)
        assert torch.equal(ours.keep & tokens.mask, expected_keep & tokens.mask)
        old = tokens.logp_rollout if s["bypass_mode"] else tokens.logp_old
        ratio = (torch.ones_like(old) if s["loss_type"] == "reinforce" and s["bypass_mode"]
                 else torch.exp((tokens.logp.detach() - old).clamp(-20, 20)))
        expected = ratio if weights is None else ratio * weights
        assert_tensors(ours.weight, expected, tokens.mask, "weight")


@pytest.mark.parametrize("name", ["default", "decoupled_token_is", "decoupled_seq_is", "bypass_pg_is",
                                  "bypass_pg_geo_rs_token_tis", "decoupled_k3_rs_token_tis"])
def test_batch_normalized_is_weights_match_verl(verl, tokens, name):
    settings = {**frameworks.get(f"verl/{name}").settings, "rollout_is_batch_normalize": True}
    if settings.get("rollout_is") is None:
        settings["rollout_is"] = "token"
    check(verl, tokens, settings)


@pytest.mark.parametrize("mode", ["token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("name", ["default", "decoupled_geo_rs", "bypass_pg_is", "dppo_tv", "gspo", "cispo"])
def test_every_loss_agg_mode_matches_verl(verl, tokens, name, mode):
    check(verl, tokens, {**frameworks.get(f"verl/{name}").settings, "loss_agg_mode": mode})


@pytest.mark.parametrize("rs", ["token_k1", "token_k2,seq_max_k3", "seq_sum_k2", "seq_sum_k3", "seq_mean_k2",
                                "seq_max_k2", "token_k3,seq_mean_k1"])
def test_every_rejection_option_matches_verl(verl, tokens, rs):
    threshold = {"token_k1": "0.5_2.0", "token_k2,seq_max_k3": "0.5,2.0", "seq_mean_k2": 0.05,
                 "token_k3,seq_mean_k1": "0.5,0.99_1.01"}.get(rs, 1.0)
    for bypass in (False, True):
        check(verl, tokens, {"rollout_is": "token", "rollout_rs": rs, "rollout_rs_threshold": threshold,
                             "bypass_mode": bypass, "loss_type": "reinforce"})


@pytest.mark.parametrize("settings", [{"loss_mode": "kl_cov", "kl_cov_ratio": 0.05},
                                      {"loss_mode": "clip_cov", "clip_cov_ratio": 0.05},
                                      {"loss_mode": "clip_cov", "clip_cov_ratio": 0.05, "rollout_is": "token"}])
def test_the_covariance_losses_match_verl_when_they_select_hundreds_of_tokens(verl, tokens, settings):
    ours, _, _ = check(verl, tokens, settings)
    if settings["loss_mode"] == "clip_cov":
        assert int((tokens.mask & ~ours.keep).sum()) > 100


def test_every_rollout_correction_classmethod_of_verl_has_a_preset_with_its_settings(verl):
    methods = [n for n, f in vars(verl.RC).items() if isinstance(f, classmethod)]
    assert len(methods) >= 19
    for name in methods:
        theirs = dataclasses.asdict(getattr(verl.RC, name)())
        ours = {**V.DEFAULTS, **frameworks.get(f"verl/{name}").settings}
        assert {k: ours[k] for k in RC_FIELDS} == {k: theirs[k] for k in RC_FIELDS}, name


def test_verl_defaults_are_verls_actor_policy_loss_and_rollout_correction_yaml_defaults(verl):
    import yaml

    fresh = verl.Actor(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1)
    for key in ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "loss_agg_mode", "tau_pos", "tau_neg"):
        assert V.DEFAULTS[key] == getattr(fresh, key), key
    for key in ("loss_mode", "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef"):
        assert V.DEFAULTS[key] == getattr(fresh.policy_loss, key), key
    yaml_file = VERL_DIR / "verl" / "trainer" / "config" / "algorithm" / "rollout_correction.yaml"
    assert {k: V.DEFAULTS[k] for k in RC_FIELDS} == yaml.safe_load(yaml_file.read_text())
    assert frameworks.of_framework("verl")[0].name == "verl/default"


def test_a_batch_whose_tokens_are_all_padding_is_refused_like_verl(verl, tokens):
    t = inputs.tokens([([-1.0], [-1.0], [-1.0], 1.0)])
    empty = type(t)(t.logp, t.logp_old, t.logp_rollout, t.advantages, torch.zeros_like(t.mask))
    with pytest.raises(ValueError, match="at least one"):
        V.verl_loss(empty, {})
    with pytest.raises(ValueError, match="at least one"):
        run_verl(verl, empty, {})
