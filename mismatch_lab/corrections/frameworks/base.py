"""What a framework preset is: one named configuration of an RL framework's policy loss, reproduced as that
framework's code computes it, on the same tokens our own rules read.

A preset is data (its name, its source, the framework's settings) plus the loss function that reproduces the
framework's code for those settings. Our generic rules (`corrections.registry`) keep their textbook
definitions; a preset answers "what does my framework, configured so, do to these tokens".

    name       '<framework>/<the framework's own name for the configuration>', e.g. 'verl/decoupled_k3_rs'
    framework  one of FRAMEWORKS
    source     repository, file(s) and version or commit the loss reproduces
    summary    the formula in one line, in the project's notation (μ, π, π_old, r = π/μ)
    settings   the framework's own option names and values this preset sets (shown by --list-presets)
    loss       (Tokens, settings) -> Result
    default    True for the framework's out-of-the-box configuration
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

FRAMEWORKS = ("verl", "trl", "slime", "prime-rl", "nemo-rl", "skyrl", "areal", "roll")
"""The frameworks `corrections --framework` accepts (a framework without presets yet reports so)."""


@dataclass(frozen=True)
class Tokens:
    """The inputs of a framework loss: [B, T] tensors of one floating dtype (float64 in the tests).

    logp          log π: the trainer's current log-probs of the sampled tokens; the gradient flows through it
    logp_old      log π_old: the trainer's log-probs at the rollout's weights (a store's scorer: equal to
                  logp.detach() when nothing else was stored)
    logp_rollout  log μ: the rollout engine's log-probs of the same tokens
    advantages    [B, T] advantages (a per-sequence advantage broadcast over its tokens)
    mask          [B, T] bool, True on response tokens
    """

    logp: torch.Tensor
    logp_old: torch.Tensor
    logp_rollout: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor


@dataclass
class Result:
    """What a framework's loss does to the tokens.

    loss     scalar, the value the framework's loss function returns (its own aggregation and sign)
    keep     [B, T] bool: response tokens left in the loss by the framework's masks (rejection, sequence
             masks, DPPO/prime-rl masks); clipping that zeroes the gradient of a kept token is not a mask
    weight   [B, T]: the importance weight the framework multiplies into the policy-gradient term (detached;
             1 where it applies none), after its truncation
    metrics  the metrics the framework logs for this loss, under the framework's own names, as it
             defines them (denominators included)
    """

    loss: torch.Tensor
    keep: torch.Tensor
    weight: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Preset:
    name: str
    framework: str
    source: str
    summary: str
    settings: Mapping[str, Any]
    loss: Callable[[Tokens, Mapping[str, Any]], Result]
    default: bool = False

    def __call__(self, tokens: Tokens) -> Result:
        return self.loss(tokens, self.settings)
