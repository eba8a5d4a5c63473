"""Group advantages against a per-group Python reference."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from mismatch_lab.rl.advantages import METRICS, group_advantages


def naive(rewards, group_size, normalize_std, eps, leave_one_out=False):
    out = []
    for start in range(0, len(rewards), group_size):
        group = rewards[start:start + group_size]
        mean = sum(group) / len(group)
        std = statistics.stdev(group)  # unbiased, like torch.std
        for i, r in enumerate(group):
            others = group[:i] + group[i + 1:]
            a = r - sum(others) / len(others) if leave_one_out else r - mean
            out.append(a / (std + eps) if normalize_std else a)
    return out


REWARDS = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.25, 0.5, 1.0, 0.0]


@pytest.mark.parametrize("normalize_std", [True, False], ids=["grpo-std", "dr-grpo"])
def test_group_advantages_match_the_per_group_reference(normalize_std):
    adv, _ = group_advantages(torch.tensor(REWARDS), 4, normalize_std=normalize_std, eps=1e-6)
    ref = naive(REWARDS, 4, normalize_std, 1e-6)
    torch.testing.assert_close(adv, torch.tensor(ref, dtype=torch.float32))


@pytest.mark.parametrize("group_size", [2, 4, 8])
@pytest.mark.parametrize("normalize_std", [True, False], ids=["grpo-std", "dr-grpo"])
def test_leave_one_out_is_the_baseline_of_the_other_responses(normalize_std, group_size):
    adv, _ = group_advantages(torch.tensor(REWARDS), group_size, normalize_std=normalize_std, leave_one_out=True)
    ref = naive(REWARDS, group_size, normalize_std, 1e-6, leave_one_out=True)
    torch.testing.assert_close(adv, torch.tensor(ref, dtype=torch.float32))
    plain, _ = group_advantages(torch.tensor(REWARDS), group_size, normalize_std=normalize_std)
    nonzero = plain != 0
    assert nonzero.any()  # the (G - 1)/G shrink of the plain residual, undone
    torch.testing.assert_close(adv[nonzero] / plain[nonzero], torch.full((int(nonzero.sum()),), group_size / (group_size - 1)))


def test_dr_grpo_keeps_the_reward_scale_and_grpo_rescales_each_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0])
    plain, _ = group_advantages(rewards, 4, normalize_std=False)
    scaled, _ = group_advantages(rewards, 4)
    assert plain.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25, 0.25, 0.25, 0.25, -0.75])
    # both groups have std 0.5 (unbiased): GRPO doubles every advantage
    torch.testing.assert_close(scaled, plain / (0.5 + 1e-6))


def test_uniform_groups_get_exactly_zero_advantage_and_are_counted():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.1, 0.1, 0.1, 0.0, 1.0, 0.0])
    adv, metrics = group_advantages(rewards, 3)
    assert adv[:6].tolist() == [0.0] * 6  # 0.1 is not exact in binary; the mean's rounding must not leak
    assert (adv[6:] != 0).all()
    assert metrics["group/uniform_reward/frac"] == pytest.approx(2 / 3)
    assert metrics["advantage/zero/frac"] == pytest.approx(6 / 9)


def test_metrics_are_the_documented_floats():
    adv, metrics = group_advantages(REWARDS, 4)  # a plain list is accepted too
    assert list(metrics) == list(METRICS)
    assert all(isinstance(v, float) for v in metrics.values())
    assert metrics["reward/mean"] == pytest.approx(sum(REWARDS) / len(REWARDS))
    stds = [statistics.stdev(REWARDS[i:i + 4]) for i in range(0, 16, 4)]
    assert metrics["reward/group_std/mean"] == pytest.approx(sum(stds) / 4)
    assert metrics["advantage/mean"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["advantage/abs/mean"] == pytest.approx(adv.abs().mean().item())
    assert metrics["advantage/max"] == adv.max().item() and metrics["advantage/min"] == adv.min().item()


@pytest.mark.parametrize("rewards, group_size, fix", [
    ([1.0, 0.0], 1, "at least twice"),
    ([1.0, 0.0, 1.0], 2, "do not split into groups of 2"),
    ([], 2, "do not split"),
    ([[1.0, 0.0]], 2, "1-D"),
    ([1.0, math.nan], 2, "non-finite"),
])
def test_bad_rewards_raise_value_errors_naming_the_fix(rewards, group_size, fix):
    with pytest.raises(ValueError, match=fix):
        group_advantages(torch.tensor(rewards), group_size)
