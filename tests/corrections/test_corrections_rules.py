"""Every (objective, rollout correction) pair of the registry against the naive loops of
corrections_reference: loss values, gradients, keep masks; two-sided rules; edge cases."""

from __future__ import annotations

import math

import corrections_reference as ref
import pytest
import torch
from test_rl_losses import DT, as_lists, random_batch

from mismatch_lab.corrections.batch import Batch
from mismatch_lab.corrections.registry import CORRECTIONS, OBJECTIVES, get, help_text
from mismatch_lab.rl.losses import LossConfig, TopK, policy_loss

# thresholds moved so that the small-spread batch lands on both sides of every rule
OVERRIDES = {"token_tis": {"cap": 1.05}, "seq_tis": {"cap": 1.1}, "token_mis": {"cap": 1.05},
             "icepop": {"low": 0.95, "high": 1.05}, "seq_mis": {"cap": 1.1}, "geo_mis": {"low": 0.99, "high": 1.01},
             "k3_rs": {"threshold": 1e-3}, "veto": {"floor": 0.9}, "opsm": {"delta": 0.01},
             "prime_rl_mask": {"threshold": 0.02}}


def batches():
    """A wide mismatch (spread 1) and a narrow one (spread 0.05), with a length-1 sequence and a fully
    masked one in each."""
    out = []
    for seed, spread in ((0, 1.0), (1, 0.05), (2, 0.05)):
        lp, lmu, lold, adv, mask, topk = random_batch(seed, spread=spread)
        mask[4] = False  # a sequence without any response token
        mask[5, 1:] = False  # a sequence of length 1
        out.append((lp, lmu, lold, adv, mask, topk))
    return out


def naive(obj, corr, cfg, lp, lmu, lold, adv, mask, topk, use_old):
    po = cfg.objective_params(OBJECTIVES[obj])
    pc = CORRECTIONS[corr].resolve(cfg.correction_args)
    keep, weight, _ = ref.decisions(obj, corr, po, pc, lp.tolist(), lmu.tolist(), adv.tolist(), mask.tolist(),
                                    anchor=cfg.anchor, lold=lold.tolist() if use_old else None, topk=as_lists(topk))
    return keep, ref.loss_and_grad(keep, weight, adv.tolist(), mask.tolist(), cfg.aggregation, cfg.constant_norm,
                                   cfg.is_cap)


@pytest.mark.parametrize("corr", list(CORRECTIONS))
@pytest.mark.parametrize("obj", list(OBJECTIVES))
def test_every_pair_matches_the_naive_loops(obj, corr):
    if OBJECTIVES[obj].level == "sequence" and CORRECTIONS[corr].reweights:
        lp, lmu, _, adv, mask, _ = batches()[0]
        with pytest.raises(ValueError, match="does not combine"):
            policy_loss(obj, lp, lmu, adv, mask, cfg=LossConfig(correction=corr))
        return
    configs = [(LossConfig(correction=corr, correction_args=OVERRIDES.get(corr, {})), False),
               (LossConfig(correction=corr, anchor="old", aggregation="seq-mean-token-mean"), True)]
    for cfg, use_old in configs:
        for lp, lmu, lold, adv, mask, topk in batches():
            leaf = lp.clone().requires_grad_(True)
            loss, _ = policy_loss(obj, leaf, lmu, adv, mask, cfg=cfg, topk=topk,
                                        logp_old=lold if use_old else None)
            loss.backward()
            _, (ref_loss, ref_grad) = naive(obj, corr, cfg, lp, lmu, lold, adv, mask, topk, use_old)
            torch.testing.assert_close(loss, torch.tensor(ref_loss, dtype=DT), rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(leaf.grad, torch.tensor(ref_grad, dtype=DT), rtol=1e-10, atol=1e-12)
            assert torch.isfinite(loss)


def _rule_keep(method, b, params):
    return method.rule(b, params).keep


@pytest.mark.parametrize("name", [n for n in CORRECTIONS if n != "none"])
def test_each_correction_keeps_and_drops_on_the_test_batches(name):
    """Guards the comparison above: every correction fires somewhere and spares something."""
    m = CORRECTIONS[name]
    params = m.resolve(OVERRIDES.get(name, {}))
    fired = spared = False
    for lp, lmu, _, adv, mask, _ in batches():
        b = Batch(lp=lp, lmu=lmu, la=lmu, lref=lp, mask=mask, adv=torch.where(mask, adv, 0.0))
        d = m.rule(b, params)
        changed = (mask & ~d.keep) | (d.keep & (d.weight != b.rc))
        fired |= bool(changed.any())
        spared |= bool((mask & d.keep & (d.weight == b.rc)).any())
    assert fired and spared, name


@pytest.mark.parametrize("method", [*OBJECTIVES.values(), *CORRECTIONS.values()], ids=lambda m: m.name)
def test_two_sided_rules_match_the_naive_loops_without_advantages(method):
    lp, lmu, _, adv, mask, topk = batches()[1]
    b = Batch(lp=lp, lmu=lmu, la=lmu, lref=lp, mask=mask, adv=None, topk=TopK.coerce(topk))
    params = method.resolve(OVERRIDES.get(method.name, {}))
    keep = method.rule(b, params).keep
    obj, corr = (method.name, "none") if method.axis == "objective" else ("pg_is", method.name)
    po = params if method.axis == "objective" else {}
    pc = params if method.axis == "correction" else {}
    ref_keep, _, _ = ref.decisions(obj, corr, po, pc, lp.tolist(), lmu.tolist(), adv.tolist(), mask.tolist(),
                                   topk=as_lists(topk), two_sided=True)
    assert keep.tolist() == [[k and m for k, m in zip(kr, mr)] for kr, mr in zip(ref_keep, mask.tolist())]
    if method.sign:  # two-sided drops at least what either sign drops
        signed = method.rule(Batch(lp=lp, lmu=lmu, la=lmu, lref=lp, mask=mask, adv=torch.where(mask, adv, 0.0),
                                   topk=TopK.coerce(topk)), params).keep
        assert bool((keep <= signed).all())


def one_seq(mus, pis, adv=1.0):
    """One sequence with the given μ and π per token."""
    lmu = torch.tensor([[math.log(m) for m in mus]], dtype=DT)
    lp = torch.tensor([[math.log(p) for p in pis]], dtype=DT)
    return Batch(lp=lp, lmu=lmu, la=lmu, lref=lp, mask=torch.ones_like(lp, dtype=torch.bool),
                 adv=torch.full_like(lp, adv))


# (rule, μ per token, π per token, A, kept?) at the published defaults
HAND_CASES = [
    ("seq_mis", [0.1, 0.1], [0.2, 0.2], 1.0, False),    # product ratio 4 > 3 (TRL default)
    ("seq_mis", [0.1, 0.1], [0.15, 0.15], 1.0, True),   # 2.25 <= 3
    ("geo_mis", [0.5] * 4, [0.5005] * 4, 1.0, True),    # geometric mean 1.001 (edge kept)
    ("geo_mis", [0.5] * 4, [0.502] * 4, 1.0, False),    # 1.004 > 1.001
    ("k3_rs", [0.5], [0.4], 1.0, False),                # k3(0.8) = 0.023 > 0.01
    ("k3_rs", [0.5], [0.48], 1.0, True),                # k3(0.96) = 0.0008
    ("veto", [0.5, 0.5], [0.5, 1e-5], 1.0, False),      # one token r = 2e-5 < 1e-4
    ("opsm", [0.5], [0.4], -1.0, False),                # A < 0, log μ − log π = 0.22 > 1e-4
    ("opsm", [0.5], [0.4], 1.0, True),                  # A > 0: never
    ("prime_rl_mask", [0.3], [0.6], 1.0, False),        # Δp 0.3 > 0.2 with A > 0
    ("prime_rl_mask", [0.3], [0.6], -1.0, True),        # moving back: kept
    ("icepop", [0.1], [0.6], 1.0, False),               # r = 6 > 5
    ("icepop", [0.1], [0.45], 1.0, True),               # r = 4.5
    ("token_mis", [0.1], [0.35], 1.0, False),           # r = 3.5 > 3
]


@pytest.mark.parametrize("case", HAND_CASES, ids=lambda c: f"{c[0]}-{c[4]}")
def test_published_defaults_on_hand_built_sequences(case):
    name, mus, pis, adv, kept = case
    m = CORRECTIONS[name]
    d = m.rule(one_seq(mus, pis, adv), m.resolve())
    assert bool(d.keep.all()) is kept and bool(d.keep.any()) is kept


def test_truncations_at_their_published_caps():
    b = one_seq([0.1, 0.1], [0.25, 0.15])  # r = 2.5, 1.5; product 3.75
    tis = get("correction", "token_tis")
    assert tis.rule(b, tis.resolve()).weight[0].tolist() == pytest.approx([2.0, 1.5])
    seq = get("correction", "seq_tis")
    assert seq.rule(b, seq.resolve()).weight[0].tolist() == pytest.approx([2.0, 2.0])
    assert seq.rule(b, seq.resolve({"cap": 5})).weight[0].tolist() == pytest.approx([3.75, 3.75])


def test_gspo_masks_whole_sequences_in_the_advantages_direction_and_gmpo_clips_in_log_space():
    gspo, gmpo = OBJECTIVES["gspo"], OBJECTIVES["gmpo"]
    up = one_seq([0.5, 0.5], [0.5003, 0.5003])  # s = 1.0006 > 1 + 4e-4
    assert not gspo.rule(up, gspo.resolve()).keep.any()
    assert gspo.rule(one_seq([0.5, 0.5], [0.5003, 0.5003], adv=-1.0), gspo.resolve()).keep.all()
    g = gmpo.rule(one_seq([0.2, 0.2], [0.4, 0.2]), gmpo.resolve())  # log r = 0.69 > 0.4: clipped, no gradient
    assert g.keep.tolist() == [[False, True]]
    assert g.weight[0, 0].item() == pytest.approx(math.exp((0.4 + 0.0) / 2))


def test_non_finite_inputs_are_counted_and_reach_the_loss():
    lp, lmu, _, adv, mask, _ = random_batch(1, spread=0.05)
    lmu[1, 2] = math.nan
    for corr in ("none", "token_tis", "seq_mis", "geo_mis"):
        loss, metrics = policy_loss("pg_is", lp, lmu, adv, mask, cfg=LossConfig(correction=corr))
        assert metrics["nonfinite/tokens/count"] == 1
        assert math.isnan(loss.item()), corr  # never zeroed


def test_unknown_names_and_parameters_name_the_choices():
    with pytest.raises(ValueError, match="token_tis"):
        LossConfig(correction="tis_token")
    with pytest.raises(ValueError, match="cap"):
        LossConfig(correction="token_tis", correction_args={"threshold": 2})
    with pytest.raises(ValueError, match="below high"):
        CORRECTIONS["icepop"].resolve({"low": 6})
    assert "seq_mis (cap 3)" in help_text("correction")


def test_correction_metrics_count_shares_and_ess():
    b_lp = torch.log(torch.tensor([[0.3, 0.3], [0.1, 0.1]], dtype=DT))
    b_mu = torch.log(torch.tensor([[0.1, 0.1], [0.1, 0.1]], dtype=DT))  # sequence 0: product 9 -> seq_mis drops it
    mask = torch.ones(2, 2, dtype=torch.bool)
    _, m = policy_loss("pg_is", b_lp, b_mu, torch.ones(2, dtype=DT), mask, cfg=LossConfig(correction="seq_mis"))
    assert m["correction/masked/frac"] == 0.5 and m["correction/seqs_masked/frac"] == 0.5
    assert m["correction/modified/frac"] == 0.0 and m["correction/ess"] == pytest.approx(1.0)
    _, m = policy_loss("pg_is", b_lp, b_mu, torch.ones(2, dtype=DT), mask, cfg=LossConfig(correction="token_tis"))
    # weights min(r, 2): 2, 2 (truncated from 3), 1, 1 -> ESS = 36 / (4 · 10)
    assert m["correction/modified/frac"] == 0.5 and m["correction/ess"] == pytest.approx(36 / 40)
    assert m["correction/truncated/frac"] == 0.5
    _, m = policy_loss("pg_is", b_lp, b_mu, torch.ones(2, dtype=DT), mask, cfg=LossConfig(correction="seq_tis"))
    # sequence 0's product 9 is truncated at 2 (2 tokens); sequence 1's product 1 is not, yet its weight is the
    # sequence's (1.0 here, equal to r: unchanged)
    assert m["correction/truncated/frac"] == 0.5 and m["correction/modified/frac"] == 0.5


def test_docs_list_every_method_with_its_defaults():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "corrections.md").read_text()
    for m in [*OBJECTIVES.values(), *CORRECTIONS.values()]:
        assert f"| `{m.name}`" in text, m.name
    for name in CORRECTIONS:  # the train command's help is built from the same registry
        assert name in help_text("correction")


def test_a_truncation_stays_finite_where_the_ratio_overflows():
    """log r = 94 overflows r = π/μ in fp32; pg_is + token_tis must give min(r, C) = C, as the legacy tis does."""
    lp = torch.tensor([[-1.0]])
    lmu = torch.tensor([[-95.0]])
    adv, mask = torch.ones(1), torch.ones(1, 1, dtype=torch.bool)
    a, _ = policy_loss("pg_is", lp, lmu, adv, mask, cfg=LossConfig(correction="token_tis", correction_args={"cap": 3}))
    b, _ = policy_loss("tis", lp, lmu, adv, mask, cfg=LossConfig())
    assert a.item() == b.item() == -3.0


def test_non_finite_log_probs_on_padding_leave_the_gradient_finite():
    lp = torch.tensor([[-1.0, -math.inf], [-0.5, math.nan]], requires_grad=True)
    lmu = torch.tensor([[-1.1, -2.0], [-0.4, -2.0]])
    mask = torch.tensor([[True, False], [True, False]])
    for name in ("pg_is", "grpo", "gspo", "gmpo"):
        lp.grad = None
        loss, _ = policy_loss(name, lp, lmu, torch.tensor([1.0, -1.0]), mask, cfg=LossConfig())
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(lp.grad).all(), name
