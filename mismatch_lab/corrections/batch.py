"""What every rule reads: one batch of response tokens laid out [B, T], detached, and the per-sequence
reductions the sequence-level rules use.

Notation (docs/design.md): μ = rollout probability of the sampled token, π = trainer probability (the
current policy), a = the trust region's anchor (μ, or π_old with anchor 'old'), π_ref = the policy whose
ratio to μ a rollout correction reads (π_old when the trainer recomputed it, else π itself: in a store,
and at the first mini-batch of a step, π = π_old). r = π/μ, ρ = π/a, r_c = π_ref/μ.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


def seq_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Σ_t x over each sequence's response tokens: [B, T] -> [B] (values off the mask ignored)."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum(-1)


def seq_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x over each sequence's response tokens: [B, T] -> [B]; 0 for a sequence without any."""
    return seq_sum(x, mask) / mask.sum(-1).clamp(min=1).to(x.dtype)


def seq_any(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Whether x holds on any response token of each sequence: [B, T] bool -> [B] bool."""
    return (x & mask).any(-1)


def spread(per_seq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A per-sequence value [B] on every token of its row: -> [B, T] (shaped like mask)."""
    return per_seq[:, None].expand(mask.shape)


@dataclass
class Batch:
    """Inputs of the rules, detached and in one floating dtype (fp32 or wider).

    lp    [B, T] log π          lmu [B, T] log μ          la [B, T] log a (trust-region anchor)
    lref  [B, T] log π_ref      mask [B, T] bool, True on response tokens
    adv   [B, T] advantages (0 off the mask), or None when the store has none: every sign-dependent rule
          then fires for either sign (two-sided)
    topk  mismatch_lab.rl.losses.TopK or None (dppo_topk_* only)
    """

    lp: torch.Tensor
    lmu: torch.Tensor
    la: torch.Tensor
    lref: torch.Tensor
    mask: torch.Tensor
    adv: torch.Tensor | None = None
    topk: object | None = None

    @cached_property
    def log_r(self) -> torch.Tensor:
        return self.lp - self.lmu

    @cached_property
    def r(self) -> torch.Tensor:
        return self.log_r.exp()

    @cached_property
    def log_rho(self) -> torch.Tensor:
        return self.log_r if self.la is self.lmu else self.lp - self.la

    @cached_property
    def rho(self) -> torch.Tensor:
        return self.r if self.la is self.lmu else self.log_rho.exp()

    @cached_property
    def log_rc(self) -> torch.Tensor:
        return self.log_r if self.lref is self.lp else self.lref - self.lmu

    @cached_property
    def rc(self) -> torch.Tensor:
        return self.r if self.lref is self.lp else self.log_rc.exp()

    @cached_property
    def pos(self) -> torch.Tensor:
        """[B, T] bool: tokens whose advantage-direction rule is 'up' (A > 0; every token when A is unknown)."""
        return self.mask if self.adv is None else self.mask & (self.adv > 0)

    @cached_property
    def neg(self) -> torch.Tensor:
        """[B, T] bool: tokens whose rule is 'down' (A < 0; every token when A is unknown)."""
        return self.mask if self.adv is None else self.mask & (self.adv < 0)

    @cached_property
    def seq_adv(self) -> torch.Tensor | None:
        """[B] a sequence's advantage: the mean of A over its response tokens (its A when broadcast)."""
        return None if self.adv is None else seq_mean(self.adv, self.mask)

    @cached_property
    def seq_pos(self) -> torch.Tensor:
        """[B] bool: sequences with A > 0 (all sequences when A is unknown)."""
        return torch.ones_like(self.mask[:, 0]) if self.adv is None else self.seq_adv > 0

    @cached_property
    def seq_neg(self) -> torch.Tensor:
        """[B] bool: sequences with A < 0 (all sequences when A is unknown)."""
        return torch.ones_like(self.mask[:, 0]) if self.adv is None else self.seq_adv < 0


@dataclass
class Decision:
    """What one rule does to a batch.

    keep     [B, T] bool, M: True where the token stays in the loss (always inside the response mask)
    weight   [B, T] the token's weight w (its value; the gradient flows through log π, see losses)
    flagged  [B, T] bool: tokens the rule masked, clipped or truncated (`mask/*` metrics)
    divergence [B, T] or None: the trust-region divergence D of dppo_* (metrics)
    """

    keep: torch.Tensor
    weight: torch.Tensor
    flagged: torch.Tensor
    divergence: torch.Tensor | None = None

    @classmethod
    def masking(cls, b: Batch, dropped: torch.Tensor, weight: torch.Tensor) -> Decision:
        """A rule that only drops tokens (dropped [B, T] bool) and keeps `weight`."""
        dropped = dropped & b.mask
        return cls(b.mask & ~dropped, weight, dropped)

    @classmethod
    def dropping_sequences(cls, b: Batch, dropped: torch.Tensor, weight: torch.Tensor) -> Decision:
        """A rule that drops whole sequences (dropped [B] bool)."""
        return cls.masking(b, spread(dropped, b.mask), weight)
