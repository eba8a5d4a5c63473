"""Policy objectives against naive per-token Python references (math module, explicit loops)."""

from __future__ import annotations

import math

import corrections_reference as ref
import pytest
import torch

from mismatch_lab.corrections.registry import CORRECTIONS
from mismatch_lab.corrections.registry import OBJECTIVES as REGISTRY
from mismatch_lab.rl.losses import (
    AGGREGATIONS,
    METRICS,
    OBJECTIVES,
    LossConfig,
    TopK,
    aggregate,
    bad_update_metrics,
    binary_kl,
    binary_tv,
    policy_loss,
    topk_kl,
    topk_tv,
)

DT = torch.float64
TRUST_REGION = ref.TOKEN_OBJECTIVES_ANCHORED


# ---------------------------------------------------------------------------------------------------
# naive references: one token at a time, floats only


def naive_policy_loss(name, lp, lmu, adv, mask, cfg, lold=None, topk=None):
    """Returns (loss, dloss/dlogp [B][T], flagged [B][T]) computed sequence by sequence, token by token."""
    po = cfg.objective_params(REGISTRY[name])
    pc = CORRECTIONS[cfg.correction].resolve(cfg.correction_args)
    keep, weight, flagged = ref.decisions(name, cfg.correction, po, pc, lp, lmu, adv, mask, anchor=cfg.anchor,
                                          lold=lold, topk=topk)
    loss, grad = ref.loss_and_grad(keep, weight, adv, mask, cfg.aggregation, cfg.constant_norm, cfg.is_cap)
    return loss, grad, flagged


# ---------------------------------------------------------------------------------------------------
# inputs


def random_batch(seed, B=8, T=12, K=5, spread=1.0):
    """Sampled-token log-probs with a wide train/rollout mismatch, ragged masks, mixed-sign advantages, top-K."""
    g = torch.Generator().manual_seed(seed)
    lp = torch.nn.functional.logsigmoid(torch.randn(B, T, generator=g, dtype=DT) * 2 + 0.5)
    lmu = torch.nn.functional.logsigmoid(torch.logit(lp.exp()) + spread * torch.randn(B, T, generator=g, dtype=DT))
    lold = torch.nn.functional.logsigmoid(torch.logit(lp.exp()) + 0.5 * spread * torch.randn(B, T, generator=g, dtype=DT))
    adv = torch.tensor([1.5, -0.7, 0.0, -1.2] * B, dtype=DT)[:B]
    adv_bt = adv[:, None].repeat(1, T)
    adv_bt[3, 2] = 0.4  # per-token advantages are allowed
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 5:] = False
    mask[2, 3:] = False
    # top-K: slot 0 is the sampled token; the other slots come from a random anchor distribution
    anchor = torch.log_softmax(torch.randn(B, T, K + 3, generator=g, dtype=DT) * 1.5, -1)
    policy = torch.log_softmax(anchor + spread * torch.randn(B, T, K + 3, generator=g, dtype=DT), -1)
    # rescale so that slot 0 carries exactly the sampled token's log-probs and the rest keep their shape
    a_rest = anchor[..., 1:K] + torch.log1p(-lmu.exp())[..., None] - torch.logsumexp(anchor[..., 1:], -1, keepdim=True)
    p_rest = policy[..., 1:K] + torch.log1p(-lp.exp())[..., None] - torch.logsumexp(policy[..., 1:], -1, keepdim=True)
    valid = torch.ones(B, T, K, dtype=torch.bool)
    valid[1, :, K - 1] = False  # a padding slot (this row's top-K had the sampled token inside)
    topk = {"anchor_logps": torch.cat([lmu[..., None], a_rest], -1), "logps": torch.cat([lp[..., None], p_rest], -1),
            "valid": valid}
    return lp, lmu, lold, adv_bt, mask, topk


def as_lists(topk):
    return {k: v.tolist() for k, v in topk.items()}


def run(name, lp, lmu, adv, mask, cfg, **kw):
    leaf = lp.clone().requires_grad_(True)
    loss, metrics = policy_loss(name, leaf, lmu, adv, mask, cfg=cfg, **kw)
    loss.backward()
    return loss, leaf.grad, metrics


# ---------------------------------------------------------------------------------------------------
# every objective x aggregation x anchor against the naive loop


CONFIGS = [
    LossConfig(),
    LossConfig(eps_high=0.28, aggregation="seq-mean-token-sum"),
    LossConfig(aggregation="seq-mean-token-mean", delta=0.08),
    LossConfig(aggregation="constant", constant_norm=16, is_cap=2.0),
    LossConfig(anchor="old", tis_cap=1.5, cispo_eps_low=0.3, cispo_eps_high=0.2),
    LossConfig(anchor="old", aggregation="constant", constant_norm=9, delta=0.02, is_cap=1.7),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.aggregation}-{c.anchor}-cap{c.is_cap}")
@pytest.mark.parametrize("name", OBJECTIVES)
def test_loss_value_gradient_and_mask_match_the_naive_loop(name, cfg):
    for seed in (0, 1):
        lp, lmu, lold, adv, mask, topk = random_batch(seed)
        loss, grad, metrics = run(name, lp, lmu, adv, mask, cfg, topk=topk, logp_old=lold)
        ref_loss, ref_grad, flagged = naive_policy_loss(name, lp.tolist(), lmu.tolist(), adv.tolist(), mask.tolist(),
                                                        cfg, lold.tolist(), as_lists(topk))
        torch.testing.assert_close(loss, torch.tensor(ref_loss, dtype=DT), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(grad, torch.tensor(ref_grad, dtype=DT), rtol=1e-10, atol=1e-12)
        n_flag = sum(f for row, mrow in zip(flagged, mask.tolist()) for f, m in zip(row, mrow) if m)
        assert metrics["mask/all/frac"] == pytest.approx(n_flag / int(mask.sum()))


def test_random_batches_exercise_masking_in_both_directions():
    """Guards the test above: the inputs must actually trigger masks, or it would compare zeros with zeros."""
    for name in sorted(TRUST_REGION | {"tis"}):
        for cfg in (CONFIGS[0], CONFIGS[4]):  # anchored on μ and on π_old
            pos = neg = False
            for seed in (0, 1):  # the seeds used above
                lp, lmu, lold, adv, mask, topk = random_batch(seed)
                _, flagged = naive_policy_loss(name, lp.tolist(), lmu.tolist(), adv.tolist(), mask.tolist(), cfg,
                                               lold.tolist(), as_lists(topk))[1:]
                pos |= any(f and a > 0 for fr, ar in zip(flagged, adv.tolist()) for f, a in zip(fr, ar))
                neg |= any(f and a < 0 for fr, ar in zip(flagged, adv.tolist()) for f, a in zip(fr, ar))
            assert pos and neg, (name, cfg.anchor)


# ---------------------------------------------------------------------------------------------------
# hand-built cases


def probs_batch(pairs, advs):
    """One sequence per (μ, π) pair, one response token each."""
    lmu = torch.tensor([[math.log(m)] for m, _ in pairs], dtype=DT)
    lp = torch.tensor([[math.log(p)] for _, p in pairs], dtype=DT)
    return lp, lmu, torch.tensor(advs, dtype=DT), torch.ones(len(pairs), 1, dtype=torch.bool)


# (μ, π, A, masked?) — binary TV, δ = 0.15
DPPO_CASES = [
    ((0.30, 0.60), 1.0, True),    # A > 0, r > 1, D = 0.30 > δ: leaves the region upwards -> masked
    ((0.30, 0.40), 1.0, False),   # A > 0, r > 1, D = 0.10 <= δ: inside the region
    ((0.60, 0.30), 1.0, False),   # A > 0, r < 1, D = 0.30: moving back towards μ, never masked
    ((0.60, 0.30), -1.0, True),   # A < 0, r < 1, D = 0.30 > δ: leaves the region downwards -> masked
    ((0.60, 0.50), -1.0, False),  # A < 0, r < 1, D = 0.10: inside
    ((0.30, 0.60), -1.0, False),  # A < 0, r > 1, D = 0.30: moving back, never masked
    ((0.001, 0.01), 1.0, False),  # rare token, r = 10 (PPO clips it), D = 0.009: DPPO keeps it
    ((0.99, 0.80), -1.0, True),   # frequent token, r = 0.81 (inside PPO's 0.8), D = 0.19: DPPO masks it
]


def test_dppo_binary_tv_masks_only_tokens_leaving_the_region_in_their_advantage_direction():
    lp, lmu, adv, mask = probs_batch([c[0] for c in DPPO_CASES], [c[1] for c in DPPO_CASES])
    _, grad, metrics = run("dppo_binary_tv", lp, lmu, adv, mask, LossConfig())
    masked = [c[2] for c in DPPO_CASES]
    for i, is_masked in enumerate(masked):
        r = math.exp(lp[i, 0].item() - lmu[i, 0].item())
        assert (grad[i, 0].item() == 0.0) == is_masked, DPPO_CASES[i]
        if not is_masked:  # d loss / d log π = −r·A/N on a kept token
            assert grad[i, 0].item() == pytest.approx(-r * adv[i].item() / len(masked))
    assert metrics["mask/all/frac"] == pytest.approx(sum(masked) / len(masked))
    neg_masked = sum(1 for c in DPPO_CASES if c[2] and c[1] < 0)
    assert metrics["mask/negative_adv/frac"] == pytest.approx(neg_masked / len(masked))


def test_grpo_clips_the_rare_token_dppo_keeps_and_keeps_the_frequent_one_dppo_masks():
    lp, lmu, adv, mask = probs_batch([(0.001, 0.01), (0.99, 0.80)], [1.0, -1.0])
    _, g_grpo, _ = run("grpo", lp, lmu, adv, mask, LossConfig())
    _, g_dppo, _ = run("dppo_binary_tv", lp, lmu, adv, mask, LossConfig())
    assert g_grpo[0, 0] == 0 and g_dppo[0, 0] != 0  # r = 10 > 1.2: PPO clips; |Δp| = 0.009: DPPO keeps
    assert g_grpo[1, 0] != 0 and g_dppo[1, 0] == 0  # r = 0.81 > 0.8: PPO keeps; |Δp| = 0.19: DPPO masks


def test_dppo_binary_kl_uses_the_bernoulli_kl_with_default_delta():
    # KL(Bern(0.5) || Bern(0.8)) = 0.5 ln(0.5/0.8) + 0.5 ln(0.5/0.2) = 0.2231 > 0.05; (0.5 -> 0.55): 0.0050 < 0.05
    lp, lmu, adv, mask = probs_batch([(0.5, 0.8), (0.5, 0.55)], [1.0, 1.0])
    _, grad, metrics = run("dppo_binary_kl", lp, lmu, adv, mask, LossConfig())
    assert grad[0, 0] == 0 and grad[1, 0] != 0
    expected = 0.5 * math.log(0.5 / 0.8) + 0.5 * math.log(0.5 / 0.2)
    assert metrics["trust_region/divergence/max"] == pytest.approx(expected)


def test_binary_kl_handles_certain_tokens_without_nan():
    la = torch.tensor([0.0, math.log(0.3), math.log(0.3)], dtype=DT)
    lp = torch.tensor([math.log(0.9), 0.0, math.log(1e-30)], dtype=DT)
    d = binary_kl(lp, la)
    assert d[0].item() == pytest.approx(math.log(1 / 0.9))  # a = 1: the (1−a) term is 0·log 0 = 0
    assert d[1].item() == math.inf  # π = 1 while the anchor leaves 0.7 elsewhere
    assert math.isfinite(d[2].item()) and d[2].item() > 10
    torch.testing.assert_close(binary_tv(lp, la), (lp.exp() - la.exp()).abs())


def test_topk_other_bucket_carries_mass_moved_outside_the_slots():
    # anchor slots (0.5, 0.3), other 0.2; π keeps slot 0, moves 0.2 from slot 1 to the tail: other 0.4
    topk = TopK(torch.tensor([[[math.log(0.5), math.log(0.3)]]], dtype=DT),
                torch.tensor([[[math.log(0.5), math.log(0.1)]]], dtype=DT))
    assert topk_tv(topk).item() == pytest.approx(0.5 * (0.2 + 0.2))  # without the bucket it would be 0.1
    kl = 0.3 * math.log(0.3 / 0.1) + 0.2 * math.log(0.2 / 0.4)
    assert topk_kl(topk).item() == pytest.approx(kl)


def test_topk_divergence_is_exact_when_the_slots_cover_all_but_one_token():
    g = torch.Generator().manual_seed(3)
    a = torch.log_softmax(torch.randn(2, 3, 6, generator=g, dtype=DT), -1)
    p = torch.log_softmax(torch.randn(2, 3, 6, generator=g, dtype=DT), -1)
    topk = TopK(a[..., :5], p[..., :5])  # the sixth token alone is the 'other' bucket
    exact_tv = 0.5 * (a.exp() - p.exp()).abs().sum(-1)
    exact_kl = (a.exp() * (a - p)).sum(-1)
    torch.testing.assert_close(topk_tv(topk), exact_tv)
    torch.testing.assert_close(topk_kl(topk), exact_kl)


def test_topk_with_only_the_sampled_token_reduces_to_the_binary_divergence():
    lp, lmu, *_ = random_batch(5)
    single = TopK(lmu[..., None], lp[..., None])
    torch.testing.assert_close(topk_tv(single), binary_tv(lp, lmu))
    torch.testing.assert_close(topk_kl(single), binary_kl(lp, lmu))


def test_topk_mask_sees_a_head_token_moving_that_binary_misses():
    # sampled token unchanged-ish (0.30 -> 0.31), but the top token drops 0.60 -> 0.30, the tail gains
    lp, lmu, adv, mask = probs_batch([(0.30, 0.31)], [1.0])
    topk = {"anchor_logps": torch.tensor([[[math.log(0.30), math.log(0.60)]]], dtype=DT),
            "logps": torch.tensor([[[math.log(0.31), math.log(0.30)]]], dtype=DT)}
    _, g_bin, _ = run("dppo_binary_tv", lp, lmu, adv, mask, LossConfig())
    _, g_top, m_top = run("dppo_topk_tv", lp, lmu, adv, mask, LossConfig(), topk=topk)
    assert g_bin[0, 0] != 0 and g_top[0, 0] == 0
    assert m_top["trust_region/divergence/max"] == pytest.approx(0.5 * (0.01 + 0.30 + 0.29))


def test_topk_padding_slots_are_ignored_whatever_they_hold():
    lp, lmu, _, adv, mask, topk = random_batch(2)
    garbage = dict(topk)
    garbage["anchor_logps"] = torch.where(topk["valid"], topk["anchor_logps"], torch.tensor(math.nan, dtype=DT))
    garbage["logps"] = torch.where(topk["valid"], topk["logps"], torch.tensor(-math.inf, dtype=DT))
    for name in ("dppo_topk_tv", "dppo_topk_kl"):
        l1, g1, _ = run(name, lp, lmu, adv, mask, LossConfig(), topk=topk)
        l2, g2, _ = run(name, lp, lmu, adv, mask, LossConfig(), topk=garbage)
        torch.testing.assert_close(l1, l2)
        torch.testing.assert_close(g1, g2)


# ---------------------------------------------------------------------------------------------------
# anchor switch


def test_anchor_switch_moves_the_trust_region_but_not_the_importance_weight():
    # μ = 0.3, π_old = π = 0.6: far from μ (r = 2, |Δp| = 0.3) but on top of π_old (ρ = 1)
    lp, lmu, adv, mask = probs_batch([(0.3, 0.6)], [1.0])
    lold = lp.clone()
    for name in ("dppo_binary_tv", "dppo_binary_kl", "grpo"):
        _, g_roll, _ = run(name, lp, lmu, adv, mask, LossConfig())
        _, g_old, _ = run(name, lp, lmu, adv, mask, LossConfig(anchor="old"), logp_old=lold)
        assert g_roll[0, 0] == 0, name  # anchored on μ: masked
        assert g_old[0, 0].item() == pytest.approx(-2.0), name  # anchored on π_old: kept, weight still r = π/μ = 2
    loss, _, _ = run("cispo", lp, lmu, adv, mask, LossConfig(anchor="old", cispo_eps_high=0.1), logp_old=lold)
    assert loss.item() == pytest.approx(-2.0)  # clip(ρ = 1) · π_old/μ = 2


def test_anchor_old_without_logp_old_names_the_fix():
    lp, lmu, adv, mask = probs_batch([(0.3, 0.6)], [1.0])
    with pytest.raises(ValueError, match="logp_old"):
        policy_loss("dppo_binary_tv", lp, lmu, adv, mask, cfg=LossConfig(anchor="old"))
    # objectives without a trust region ignore the anchor
    loss, _ = policy_loss("pg_is", lp, lmu, adv, mask, cfg=LossConfig(anchor="old"))
    assert loss.item() == pytest.approx(-2.0)


# ---------------------------------------------------------------------------------------------------
# textbook forms: same gradients


def test_grpo_gradient_equals_the_textbook_clipped_min_objective():
    lp, lmu, _, adv, mask, _ = random_batch(4, spread=0.4)
    for cfg in (LossConfig(), LossConfig(eps_high=0.28)):
        _, grad, _ = run("grpo", lp, lmu, adv, mask, cfg)
        leaf = lp.clone().requires_grad_(True)
        ratio = (leaf - lmu).exp()
        surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high) * adv)
        (-(surrogate * mask).sum() / mask.sum()).backward()
        torch.testing.assert_close(grad, leaf.grad)


def test_cispo_gradient_equals_the_minimax_stop_gradient_form():
    lp, lmu, _, adv, mask, _ = random_batch(6, spread=0.8)
    cfg = LossConfig(cispo_eps_low=0.5, cispo_eps_high=0.2)
    _, grad, metrics = run("cispo", lp, lmu, adv, mask, cfg)
    leaf = lp.clone().requires_grad_(True)
    w = (leaf - lmu).exp().clamp(1 - cfg.cispo_eps_low, 1 + cfg.cispo_eps_high).detach()
    (-(w * adv * leaf * mask).sum() / mask.sum()).backward()
    torch.testing.assert_close(grad, leaf.grad)
    assert metrics["mask/all/frac"] > 0


def test_pg_is_value_is_the_importance_sampled_surrogate():
    lp, lmu, _, adv, mask, _ = random_batch(7)
    loss, grad, _ = run("pg_is", lp, lmu, adv, mask, LossConfig())
    leaf = lp.clone().requires_grad_(True)
    ref = -((leaf - lmu).exp() * adv * mask).sum() / mask.sum()
    ref.backward()
    torch.testing.assert_close(loss, ref.detach())
    torch.testing.assert_close(grad, leaf.grad)


# ---------------------------------------------------------------------------------------------------
# gradients flow only where they should


@pytest.mark.parametrize("name", OBJECTIVES)
def test_gradient_is_exactly_zero_on_masked_and_padded_tokens_even_with_garbage_there(name):
    lp, lmu, _, adv, mask, topk = random_batch(8, spread=1.2)
    # garbage where the mask is false: the loss must neither read it nor leak nan into the gradient
    lmu = torch.where(mask, lmu, torch.tensor(-math.inf, dtype=DT))
    adv = torch.where(mask, adv, torch.tensor(math.nan, dtype=DT))
    cfg = LossConfig()
    loss, grad, metrics = run(name, lp, lmu, adv, mask, cfg, topk=topk)
    assert torch.isfinite(loss)
    assert (grad[~mask] == 0).all()
    _, _, flagged = naive_policy_loss(name, lp.tolist(), lmu.tolist(), adv.nan_to_num().tolist(), mask.tolist(), cfg,
                                      topk=as_lists(topk))
    flagged = torch.tensor(flagged)
    masked = flagged & mask if name not in ("cispo", "tis", "pg_is") else torch.zeros_like(mask)  # clipped, kept
    assert (grad[masked] == 0).all()
    live = mask & ~masked & (adv != 0)
    assert (grad[live] != 0).all()
    assert metrics["nonfinite/tokens/count"] == 0


def test_an_infinite_ratio_on_a_masked_token_does_not_poison_the_gradient():
    # μ underflowed to 0 on a token with A > 0: r = inf, |Δp| = 0.5 -> DPPO masks it; its gradient must be 0, not nan
    lp = torch.tensor([[math.log(0.5), math.log(0.4)]], dtype=DT)
    lmu = torch.tensor([[-math.inf, math.log(0.4)]], dtype=DT)
    adv = torch.tensor([1.0], dtype=DT)
    mask = torch.ones(1, 2, dtype=torch.bool)
    _, grad, metrics = run("dppo_binary_tv", lp, lmu, adv, mask, LossConfig())
    assert grad[0, 0] == 0 and torch.isfinite(grad).all()
    assert metrics["nonfinite/tokens/count"] == 1  # counted, not hidden
    assert metrics["ratio/max"] == math.inf


# ---------------------------------------------------------------------------------------------------
# aggregation and truncation


def test_each_aggregation_divides_by_its_documented_count():
    x = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=DT)
    mask = torch.tensor([[True, True, False], [True, False, False], [False, False, False]])
    expected = {
        "token-mean": (1 + 2 + 3) / 3,
        "seq-mean-token-sum": (3 + 3) / 2,
        "seq-mean-token-mean": (3 / 2 + 3 / 1) / 2,
        "constant": (1 + 2 + 3) / (3 * 4),
    }
    assert set(expected) == set(AGGREGATIONS)
    for mode, value in expected.items():
        cfg = LossConfig(aggregation=mode, constant_norm=4 if mode == "constant" else None)
        assert aggregate(x, mask, cfg).item() == pytest.approx(value)
    assert aggregate(x, mask, LossConfig(), denominator=12).item() == pytest.approx(6 / 12)


def test_micro_batches_with_a_global_denominator_add_up_to_the_full_batch():
    lp, lmu, _, adv, mask, _ = random_batch(9)
    cfg = LossConfig()
    full, _ = policy_loss("dppo_binary_tv", lp, lmu, adv, mask, cfg=cfg)
    n = float(mask.sum())
    parts = [policy_loss("dppo_binary_tv", lp[s], lmu[s], adv[s], mask[s], cfg=cfg, denominator=n)[0]
             for s in (slice(0, 3), slice(3, None))]
    torch.testing.assert_close(parts[0] + parts[1], full)


def test_is_cap_truncates_the_weight_and_is_counted():
    lp, lmu, adv, mask = probs_batch([(0.1, 0.5), (0.4, 0.5)], [1.0, 1.0])
    loss, grad, metrics = run("pg_is", lp, lmu, adv, mask, LossConfig(is_cap=3.0))
    assert grad[0, 0].item() == pytest.approx(-3.0 / 2)  # r = 5 truncated at 3
    assert grad[1, 0].item() == pytest.approx(-1.25 / 2)
    assert loss.item() == pytest.approx(-(3.0 + 1.25) / 2)
    assert metrics["ratio/capped/frac"] == pytest.approx(0.5)
    _, _, m_tis = run("tis", lp, lmu, adv, mask, LossConfig(tis_cap=2.0))
    assert m_tis["mask/all/frac"] == pytest.approx(0.5)  # 'clipped' for tis = truncated


# ---------------------------------------------------------------------------------------------------
# metrics


def test_metrics_match_direct_computations_and_are_documented():
    lp, lmu, _, adv, mask, topk = random_batch(10)
    for name in OBJECTIVES:
        _, metrics = policy_loss(name, lp, lmu, adv, mask, cfg=LossConfig(), topk=topk)
        assert set(metrics) <= set(METRICS)
        assert all(isinstance(v, float) for v in metrics.values())
        assert ("trust_region/divergence/mean" in metrics) == ("delta" in REGISTRY[name].params)
    _, metrics = policy_loss("grpo", lp, lmu, adv, mask, cfg=LossConfig(), topk=topk)
    pairs = [(math.exp(a), math.exp(b)) for a, b, m in zip(lp.flatten().tolist(), lmu.flatten().tolist(),
                                                            mask.flatten().tolist()) if m]
    n = len(pairs)
    ratios = [p / m for p, m in pairs]
    assert metrics["tokens/valid/count"] == n
    assert metrics["ratio/mean"] == pytest.approx(sum(ratios) / n)
    assert metrics["ratio/max"] == pytest.approx(max(ratios))
    assert metrics["ratio/min"] == pytest.approx(min(ratios))
    assert metrics["mismatch/abs_dp/mean"] == pytest.approx(sum(abs(p - m) for p, m in pairs) / n)
    assert metrics["mismatch/abs_dp/max"] == pytest.approx(max(abs(p - m) for p, m in pairs))
    assert metrics["mismatch/kl_k3/mean"] == pytest.approx(sum(r - math.log(r) - 1 for r in ratios) / n)
    assert metrics["mismatch/abs_dlogp/max"] == pytest.approx(max(abs(math.log(r)) for r in ratios))
    nz = int(((adv != 0) & mask).sum())
    assert metrics["tokens/nonzero_adv/count"] == nz
    # every masked token with A != 0 is either positive or negative
    assert metrics["mask/nonzero_adv/frac"] == pytest.approx(metrics["mask/negative_adv/frac"]
                                                              + metrics["mask/positive_adv/frac"])
    assert metrics["mask/nonzero_adv/frac"] * nz == pytest.approx(metrics["mask/all/frac"] * n)


def test_fractions_over_an_empty_population_are_zero_and_the_count_says_so():
    lp, lmu, _, mask = probs_batch([(0.3, 0.9)], [0.0])
    _, metrics = policy_loss("dppo_binary_tv", lp, lmu, torch.zeros(1, dtype=DT), mask, cfg=LossConfig())
    assert metrics["tokens/nonzero_adv/count"] == 0 and metrics["mask/nonzero_adv/frac"] == 0.0


def test_bad_update_share_counts_negative_tokens_whose_probability_fell_by_delta():
    lp_before = torch.log(torch.tensor([[0.9, 0.9, 0.9, 0.2]], dtype=DT))
    lp_after = torch.log(torch.tensor([[0.3, 0.5, 0.2, 0.01]], dtype=DT))
    adv = torch.tensor([[-1.0, -1.0, 1.0, -1.0]], dtype=DT)
    mask = torch.ones(1, 4, dtype=torch.bool)
    m = bad_update_metrics(lp_after, lp_before, adv, mask, delta=0.5)
    # drops: 0.6 (A<0, bad), 0.4 (A<0, not), 0.7 (A>0, not counted), 0.19 (A<0, not)
    assert m == {"bad_update/negative_adv/frac": pytest.approx(1 / 3), "bad_update/all/frac": pytest.approx(1 / 4),
                 "bad_update/all/count": 1.0}


# ---------------------------------------------------------------------------------------------------
# user mistakes


@pytest.mark.parametrize("kwargs, fix", [
    ({"eps_low": 1.2}, "eps_low"),
    ({"eps_high": 0}, "eps_high"),
    ({"delta": -0.1}, "delta"),
    ({"is_cap": 0.5}, "inf to switch truncation off"),
    ({"tis_cap": 0.9}, "tis_cap"),
    ({"cispo_eps_low": 2.0}, "cispo_eps_low"),
    ({"cispo_eps_high": -1.0}, "cispo_eps_high"),
    ({"aggregation": "mean"}, "token-mean"),
    ({"aggregation": "constant"}, "constant_norm > 0"),
    ({"constant_norm": 512}, "set aggregation='constant'"),
    ({"anchor": "recomputed"}, "rollout, old"),
    ({"topk": 0}, "topk"),
])
def test_loss_config_rejects_bad_values_naming_the_fix(kwargs, fix):
    with pytest.raises(ValueError, match=fix):
        LossConfig(**kwargs)


def test_loss_config_defaults_follow_the_papers():
    cfg = LossConfig()
    assert (cfg.eps_low, cfg.eps_high, cfg.is_cap, cfg.anchor, cfg.topk) == (0.2, 0.2, math.inf, "rollout", 20)
    assert cfg.delta_for("dppo_binary_tv") == 0.15 and cfg.delta_for("dppo_topk_kl") == 0.05
    assert LossConfig(delta=0.3).delta_for("dppo_binary_kl") == 0.3


def test_bad_inputs_raise_value_errors_naming_the_fix():
    lp, lmu, adv, mask = probs_batch([(0.3, 0.6), (0.2, 0.2)], [1.0, -1.0])
    cfg = LossConfig()
    with pytest.raises(ValueError, match="choose one of"):
        policy_loss("ppo", lp, lmu, adv, mask, cfg=cfg)
    with pytest.raises(ValueError, match="mask.bool"):
        policy_loss("grpo", lp, lmu, adv, mask.float(), cfg=cfg)
    with pytest.raises(ValueError, match="advantages must be"):
        policy_loss("grpo", lp, lmu, adv[:1], mask, cfg=cfg)
    with pytest.raises(ValueError, match="logp_rollout must be"):
        policy_loss("grpo", lp, lmu[:1], adv, mask, cfg=cfg)
    with pytest.raises(ValueError, match="no response tokens"):
        policy_loss("grpo", lp, lmu, adv, torch.zeros_like(mask), cfg=cfg)
    with pytest.raises(ValueError, match="needs `topk`"):
        policy_loss("dppo_topk_tv", lp, lmu, adv, mask, cfg=cfg)
    wide = TopK(torch.zeros(2, 1, 22, dtype=DT), torch.zeros(2, 1, 22, dtype=DT))
    with pytest.raises(ValueError, match="LossConfig.topk"):
        policy_loss("dppo_topk_kl", lp, lmu, adv, mask, cfg=cfg, topk=wide)
    with pytest.raises(ValueError, match=r"\[B, T, K\]"):
        policy_loss("dppo_topk_kl", lp, lmu, adv, mask, cfg=cfg, topk={"anchor_logps": lp, "logps": lp})
    with pytest.raises(ValueError, match="LossConfig"):
        policy_loss("grpo", lp, lmu, adv, mask, cfg={"eps_low": 0.2})


def test_no_gradient_flows_through_the_topk_divergence():
    lp, lmu, _, adv, mask, topk = random_batch(11)
    logps = topk["logps"].clone().requires_grad_(True)
    leaf = lp.clone().requires_grad_(True)
    loss, _ = policy_loss("dppo_topk_tv", leaf, lmu, adv, mask, cfg=LossConfig(),
                          topk=TopK(topk["anchor_logps"], logps, topk["valid"]))
    loss.backward()
    assert logps.grad is None and leaf.grad is not None


def test_binary_kl_reads_a_log_prob_rounded_above_zero_as_certainty():
    la = torch.tensor([math.log(0.5)], dtype=DT)
    d = binary_kl(torch.tensor([1e-7], dtype=DT), la)
    assert d.item() == math.inf  # π = 1: the anchor's other half has no mass under π; not nan
