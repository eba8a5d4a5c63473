"""Group-baseline advantages: every prompt is sampled `group_size` times and each response is scored
against the responses to the same prompt.

    GRPO (DeepSeekMath, arXiv 2402.03300)  A_i = (R_i − mean_g R) / (std_g R + eps)
    Dr. GRPO (arXiv 2503.20783)            A_i =  R_i − mean_g R      (normalize_std=False; the
                                           std division up-weights near-uniform groups, a bias)
    group-size correction (leave_one_out)  R_i − mean_g R is multiplied by G / (G − 1), which makes it
                                           R_i − mean_{j≠i} R_j: the baseline of the other G − 1 responses
                                           (RLOO). The group mean contains R_i itself, so the plain residual
                                           shrinks every advantage by (G − 1)/G, a bias that depends on the
                                           group size (−50 % at G = 2, −25 % at G = 4). With normalize_std
                                           the same factor applies before the division.

std is the unbiased sample std of the group (torch.std's default, as GRPO implementations use). A group
whose rewards are all equal (all right or all wrong) gets A = 0 for every response: no learning signal,
which `group/uniform_reward/frac` counts.
"""

from __future__ import annotations

import torch

METRICS = {
    "reward/mean": "mean reward over all responses",
    "reward/group_std/mean": "mean over groups of the within-group reward std (unbiased)",
    "group/uniform_reward/frac": "groups whose rewards are all equal (zero advantage), over groups",
    "advantage/mean": "mean advantage over responses (0 up to rounding by construction)",
    "advantage/abs/mean": "mean |A| over responses",
    "advantage/min": "min advantage",
    "advantage/max": "max advantage",
    "advantage/zero/frac": "responses with A == 0, over responses",
}


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    normalize_std: bool = True,
    leave_one_out: bool = False,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Advantages of N = G · group_size responses laid out group by group.

    rewards       [N] float (or anything torch.as_tensor accepts); responses i·group_size … (i+1)·group_size − 1
                  answer the same prompt
    group_size    responses per prompt, >= 2 (a baseline needs company)
    normalize_std divide by the group's std + eps (GRPO); False is Dr. GRPO
    leave_one_out baseline of the other responses only: the residual times G / (G − 1)
    eps           added to the std; a uniform group then gets exactly 0
    Returns (adv [N] float32, metrics dict of floats named as in METRICS).
    """
    rewards = torch.as_tensor(rewards)
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be a 1-D tensor [N]; got shape {tuple(rewards.shape)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
        raise ValueError(f"group_size={group_size!r} must be an int >= 2: the baseline is the mean of the other "
                         "samples of the same prompt; sample each prompt at least twice")
    n = rewards.shape[0]
    if n == 0 or n % group_size:
        raise ValueError(f"{n} rewards do not split into groups of {group_size}; pass prompts x samples-per-prompt "
                         "rewards, grouped by prompt")
    if not eps >= 0:
        raise ValueError(f"eps={eps} must be >= 0")
    rewards = rewards.to(torch.float32)
    if not torch.isfinite(rewards).all():
        raise ValueError(f"rewards contain {int((~torch.isfinite(rewards)).sum())} non-finite values; "
                         "the verifier must return finite numbers")

    groups = rewards.view(-1, group_size)
    mean = groups.mean(dim=1, keepdim=True)
    std = groups.std(dim=1, keepdim=True)  # unbiased
    adv = groups - mean
    if leave_one_out:
        adv = adv * (group_size / (group_size - 1))
    if normalize_std:
        adv = adv / (std + eps)
    adv = adv.reshape(-1)
    uniform = (groups == groups[:, :1]).all(dim=1)
    # a uniform group's residual is exactly 0 in any case; pin it so rounding in the mean cannot leak
    adv = torch.where(uniform.repeat_interleave(group_size), torch.zeros_like(adv), adv)

    values = torch.stack([
        rewards.mean(), std.mean(), uniform.float().mean(), adv.mean(), adv.abs().mean(),
        adv.min(), adv.max(), (adv == 0).float().mean(),
    ]).tolist()
    return adv, dict(zip(METRICS, values))
