"""verl 0.9.1: the actor's policy losses and the rollout correction, as verl computes them (the rollout correction
in verl_rollout_corr.py, the policy losses in verl_losses.py; here the two modes and the presets).

Sources (volcengine/verl, PyPI wheel verl==0.9.1):
    verl/trainer/ppo/core_algos.py          the policy losses (`policy_loss.loss_mode`), `agg_loss`
    verl/trainer/ppo/rollout_corr_helper.py IS weights, rejection masks and the `rollout_corr/` metrics
    verl/trainer/config/algorithm.py        RolloutCorrectionConfig and its preset classmethods
    verl/workers/config/actor.py            ActorConfig / PolicyLossConfig defaults
    verl/workers/utils/losses.py            how the actor calls the loss (`ppo_loss`)
    verl/trainer/ppo/ray_trainer.py         where the rollout correction runs (decoupled vs bypass)

Notation: π = Tokens.logp (current policy, gradient), π_old = Tokens.logp_old, μ = Tokens.logp_rollout, m the
response mask, ℓ = log-ratio. Every exponent of a log-ratio is taken after clamping it to ±20 where verl
does (`SAFETY`); every masked mean divides by (count + 1e-8) as verl's `masked_mean` does (`GUARD`).

Two modes (`bypass_mode`):
    decoupled  the trainer runs the correction once on (π_old, μ): IS weight w from ℓ = log π_old − log μ,
               the rejection mask replaces m before the actor sees the batch (so token-mean divides by the
               kept tokens); the actor's loss (loss_mode) then multiplies its per-token loss by w.
    bypass     π_old := μ. The correction runs inside the loss on (π detached, μ); `loss_type` ppo_clip is the
               vanilla loss on π/μ without w, `reinforce` is −A·w·log π (or −A·log π when rollout_is is None);
               rejected tokens leave the numerator but the token-mean still divides by all response tokens
               (the engine counts `batch_num_tokens` before the loss rejects).
A store's tokens are one [B, T] batch per call: `batch_num_tokens` = tokens of the mask given to the actor,
`global_batch_size` = B, one micro-batch (verl averages the actor metrics of micro-batches).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mismatch_lab.corrections.frameworks.base import Preset, Result, Tokens
from mismatch_lab.corrections.frameworks.verl_losses import (
    POLICY_LOSSES,
    Actor,
    aggregate,
    vanilla,
)
from mismatch_lab.corrections.frameworks.verl_rollout_corr import (
    DEFAULTS,
    SOURCE,
    _item,
    _mean,
    rollout_correction,
)

# --------------------------------------------------------------------------- the two modes

def verl_loss(t: Tokens, settings: Mapping[str, Any]) -> Result:
    """What verl does to the tokens under `settings` (DEFAULTS updated by them): module docstring."""
    s = {**DEFAULTS, **settings}
    m = t.mask.bool()
    if not m.any():
        raise ValueError("verl's rollout correction needs at least one response token")
    if s["bypass_mode"]:
        return _bypass(t, s, m)
    if s["loss_mode"] not in POLICY_LOSSES:
        raise ValueError(f"no verl loss_mode {s['loss_mode']!r} here (known: {', '.join(POLICY_LOSSES)})")
    w, kept, metrics = rollout_correction(t.logp_old, t.logp_rollout, m, s)
    actor = Actor(t.logp, t.logp_old, t.advantages, kept, w, int(kept.sum()), m.shape[0])
    loss, weight, extra, pg = POLICY_LOSSES[s["loss_mode"]](actor, s)
    return _result(loss, kept, extra, w, weight, metrics | pg)


def _bypass(t: Tokens, s: Mapping[str, Any], m: torch.Tensor) -> Result:
    """compute_policy_loss_bypass_mode: π_old := μ; the correction runs on (sg π, μ); `reinforce`:
    L = −A·w·log π (−A·log π without IS), ppo_kl = mean over kept tokens of log μ − log π; `ppo_clip`: the
    vanilla loss on ρ = π/μ without w. Aggregated over the kept tokens, the token-mean dividing by all
    response tokens."""
    w, kept, metrics = rollout_correction(t.logp.detach(), t.logp_rollout, m, s)
    n_tokens = int(m.sum())
    if s["loss_type"] == "reinforce":
        a = Actor(t.logp, t.logp_rollout, t.advantages, kept, w, n_tokens, m.shape[0])
        loss = aggregate(a.weigh(-t.advantages * t.logp), a, s["loss_agg_mode"])
        pg = {"actor/ppo_kl": _item(_mean(-(t.logp - t.logp_rollout), kept))}
        weight = a.times_w(torch.ones_like(t.logp))
    elif s["loss_type"] == "ppo_clip":
        a = Actor(t.logp, t.logp_rollout, t.advantages, kept, None, n_tokens, m.shape[0])
        loss, weight, _, pg = vanilla(a, s)
    else:
        raise ValueError(f"verl has no bypass loss_type {s['loss_type']!r} (reinforce, ppo_clip)")
    return _result(loss, kept, None, w if s["loss_type"] == "reinforce" else None, weight, pg | metrics)


def _result(loss, kept, extra, w, weight, metrics: dict[str, float]) -> Result:
    """keep = the actor's mask, minus the loss's own mask (DPPO validity) and the tokens whose IS weight is 0
    (IcePop outside its band): they stay in the token-mean's denominator but add no gradient."""
    keep = kept if extra is None else kept & extra
    if w is not None:
        keep = keep & (w != 0)
    metrics["actor/pg_loss"] = _item(loss)
    return Result(loss=loss, keep=keep, weight=weight.detach(), metrics=metrics)


# --------------------------------------------------------------------------- presets

_CORE = "verl/trainer/ppo/core_algos.py"
_RC = "verl/trainer/ppo/rollout_corr_helper.py + verl/trainer/config/algorithm.py (RolloutCorrectionConfig.{})"
_PPO = "PPO-clip 0.2 + dual clip c=3 on ρ = π/π_old"
_GEO = {"rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.999_1.001"}
_K3 = {"rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.01}
_BYPASS_PG = {"bypass_mode": True, "loss_type": "reinforce"}
_BYPASS_PPO = {"bypass_mode": True, "loss_type": "ppo_clip"}

_CORRECTIONS: dict[str, tuple[dict[str, Any], str]] = {
    # RolloutCorrectionConfig.<classmethod>() at its default arguments -> (settings, summary)
    "disabled": ({}, f"{_PPO}; rollout_corr/ metrics only"),
    "decoupled_token_is": ({"rollout_is": "token"}, f"{_PPO}, × min(π_old/μ, 2) per token"),
    "decoupled_seq_is": ({"rollout_is": "sequence"}, f"{_PPO}, × min(∏ π_old/μ, 2) per sequence"),
    "decoupled_token_icepop": ({"rollout_is": "token", "rollout_is_threshold": "0.5_5.0"},
                               f"{_PPO}, × π_old/μ, 0 outside [0.5, 5] (token)"),
    "decoupled_seq_is_rs": ({"rollout_is": "sequence", "rollout_rs": "seq_sum_k1", "rollout_rs_threshold": "0.5_2.0"},
                            f"{_PPO}, × min(∏ π_old/μ, 2); drop sequences with ∏ μ/π_old outside [0.5, 2]"),
    "decoupled_geo_rs": (dict(_GEO), f"{_PPO}, no IS; drop sequences with geo-mean μ/π_old outside [0.999, 1.001]"),
    "decoupled_geo_rs_seq_tis": ({"rollout_is": "sequence", **_GEO},
                                 f"{_PPO}, × min(∏ π_old/μ, 2); geo-mean μ/π_old band [0.999, 1.001]"),
    "decoupled_geo_rs_token_tis": ({"rollout_is": "token", **_GEO},
                                   f"{_PPO}, × min(π_old/μ, 2) per token; geo-mean band [0.999, 1.001]"),
    "decoupled_k3_rs": (dict(_K3), f"{_PPO}, no IS; drop sequences with mean k3(π_old/μ) > 0.01"),
    "decoupled_k3_rs_seq_tis": ({"rollout_is": "sequence", **_K3},
                                f"{_PPO}, × min(∏ π_old/μ, 2); drop sequences with mean k3 > 0.01"),
    "decoupled_k3_rs_token_tis": ({"rollout_is": "token", **_K3},
                                  f"{_PPO}, × min(π_old/μ, 2) per token; drop sequences with mean k3 > 0.01"),
    "bypass_ppo_clip": (dict(_BYPASS_PPO), "PPO-clip 0.2 + dual clip 3 on ρ = π/μ (π_old := μ), no IS"),
    "bypass_ppo_clip_geo_rs": ({**_BYPASS_PPO, **_GEO},
                               "PPO-clip on π/μ; drop sequences with geo-mean μ/π outside [0.999, 1.001]"),
    "bypass_ppo_clip_k3_rs": ({**_BYPASS_PPO, **_K3}, "PPO-clip on π/μ; drop sequences with mean k3(π/μ) > 0.01"),
    "bypass_pg_is": ({**_BYPASS_PG, "rollout_is": "sequence"}, "−A·min(∏ sg(π)/μ, 2)·log π (REINFORCE + seq-TIS)"),
    "bypass_pg_token_icepop": ({**_BYPASS_PG, "rollout_is": "token", "rollout_is_threshold": "0.5_5.0"},
                               "−A·w·log π, w = sg(π)/μ, 0 outside [0.5, 5] (token)"),
    "bypass_pg_geo_rs": ({**_BYPASS_PG, **_GEO},
                         "−A·log π (no IS); drop sequences with geo-mean μ/π outside [0.999, 1.001]"),
    "bypass_pg_geo_rs_seq_tis": ({**_BYPASS_PG, "rollout_is": "sequence", **_GEO},
                                 "−A·min(∏ sg(π)/μ, 2)·log π; geo-mean band [0.999, 1.001]"),
    "bypass_pg_geo_rs_token_tis": ({**_BYPASS_PG, "rollout_is": "token", **_GEO},
                                   "−A·min(sg(π)/μ, 2)·log π per token; geo-mean band [0.999, 1.001]"),
}

_LOSSES: dict[str, tuple[dict[str, Any], str]] = {
    # policy_loss.loss_mode=<name>, everything else at verl's defaults -> (settings, summary)
    "dppo_tv": ({"loss_mode": "dppo_tv"},
                "−A·sg(min(π/π_old, 3))·log π, masked where π − π_old moves past ±0.2 with A's sign"),
    "dppo_kl": ({"loss_mode": "dppo_kl"},
                "−A·sg(min(π/π_old, 3))·log π, masked where the binary KL > 0.2 moving with A's sign"),
    "gspo": ({"loss_mode": "gspo"}, "PPO-clip 0.2 on the sequence's geometric-mean ratio (token-mean)"),
    "sapo": ({"loss_mode": "sapo"}, "−A·σ(τ(ρ − 1))·4/τ, τ = 1 (A > 0) / 1.05, seq-mean-token-mean"),
    "gpg": ({"loss_mode": "gpg"}, "−A·log π (no ratio)"),
    "cispo": ({"loss_mode": "cispo"}, "−A·sg(clip(π/π_old, 0.8, 1.2))·log π"),
    "geo_mean": ({"loss_mode": "geo_mean"}, "GMPO: −Ā·exp(mean of sign-clipped log π/π_old) per sequence"),
    "clip_cov": ({"loss_mode": "clip_cov"},
                 "PPO-clip 0.2 (no dual clip); max(1, ⌊2e-4·n⌋) random unclipped tokens, cov(A, log π) in (1, 5), dropped"),
    "kl_cov": ({"loss_mode": "kl_cov"},
               "−A·π/π_old; + 0.1·|log π/π_old| on the max(1, ⌊2e-4·n⌋) tokens of largest cov(A, log π)"),
}


def _preset(name: str, settings: dict[str, Any], summary: str, source: str, default: bool = False) -> Preset:
    return Preset(name=f"verl/{name}", framework="verl", source=SOURCE + source, summary=summary,
                  settings=settings, loss=verl_loss, default=default)


PRESETS: tuple[Preset, ...] = (
    _preset("default", {}, f"{_PPO}, token-mean; rollout_corr/ metrics only (rollout_correction all null)",
            f"{_CORE} compute_policy_loss_vanilla + config/algorithm/rollout_correction.yaml", default=True),
    *(_preset(name, st, summary, _RC.format(name)) for name, (st, summary) in _CORRECTIONS.items()),
    *(_preset(name, st, summary, f"{_CORE} compute_policy_loss_{name}") for name, (st, summary) in _LOSSES.items()),
)
"""verl's out-of-the-box configuration, every RolloutCorrectionConfig preset classmethod of 0.9.1 at its
default arguments, and the policy loss modes (other settings at their defaults)."""
