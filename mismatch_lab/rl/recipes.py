"""Training recipes of the seeds, as TrainConfig options and named presets.

    DAPO dynamic sampling (arXiv 2503.14476 §3.2)  drop prompt groups whose task rewards are all equal (no
        signal) and sample new prompts until the batch holds `prompts_per_step` informative groups, at most
        `max_rounds` generation rounds; short of that, the batch is filled with dropped groups (A = 0) so its
        shape (and `minibatches`) holds, and `dynamic_sampling/groups_refilled/count` says how many.
    DAPO soft overlong punishment (§3.4)  reward += penalty(L): 0 for L <= L_max − L_cache, (L_max − L_cache − L)
        / L_cache up to L_max (linear to −1), −1 beyond. Paper: L_max 20480, L_cache 4096 (a fifth); ours
        `overlong_max` (0 = max_tokens) and `overlong_cache` (the 'dapo' preset: a fifth of max_tokens).
    Dr. GRPO (arXiv 2503.20783)  no std normalisation of the advantages, a constant normaliser (the loss
        sums over tokens and divides by B · max_tokens).
"""

from __future__ import annotations


def overlong_penalty(length: int, max_len: int, cache: int) -> float:
    """DAPO's soft overlong punishment of a response of `length` tokens (0 when cache = 0: off)."""
    if cache <= 0 or length <= max_len - cache:
        return 0.0
    if length > max_len:
        return -1.0
    return (max_len - cache - length) / cache


def informative(rewards: list[float]) -> bool:
    """A group carries a learning signal when its rewards are not all equal."""
    return any(r != rewards[0] for r in rewards)


# preset -> the fields it sets (from the config, for values that depend on it); a field the user set away from
# its default keeps the user's value
PRESETS = {
    "none": lambda cfg: {},
    "dr_grpo": lambda cfg: {"normalize_std": False, "aggregation": "constant", "constant_norm": float(cfg.max_tokens)},
    "dapo": lambda cfg: {"dynamic_sampling": True, "eps_high": 0.28, "aggregation": "token-mean",
                         "overlong_cache": max(1, cfg.max_tokens // 5)},
}


def apply_preset(cfg) -> None:
    """Set the preset's fields on `cfg` where they still hold the TrainConfig default (idempotent)."""
    from mismatch_lab.errors import UserError

    if cfg.preset not in PRESETS:
        raise UserError(f"--preset {cfg.preset}: unknown; use one of {', '.join(PRESETS)}")
    defaults = type(cfg)()
    for name, value in PRESETS[cfg.preset](cfg).items():
        if getattr(cfg, name) == getattr(defaults, name):
            setattr(cfg, name, value)
