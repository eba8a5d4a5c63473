"""verl: record μ and π from inside verl's policy loss, which verl's actor calls on every micro-batch.

    from mismatch_lab.integrations import verl as mverl
    from mismatch_lab.record import Recorder

    name = mverl.register(lambda: Recorder("/shared/runs/verl", "exp-7", framework="verl", rollout_engine="vllm",
                                           rollout_dtype="bf16", trainer_dtype="bf16"),
                          base=mverl.BYPASS, name=mverl.BYPASS)  # with algorithm.rollout_correction.bypass_mode=True

`register` wraps the policy loss verl registered under `base` (verl.trainer.ppo.core_algos.POLICY_LOSS_REGISTRY)
in one that records, then calls it with the same arguments and returns its (loss, metrics) unchanged, and registers
the wrapper with verl's own `register_policy_loss` under `name` (default `<base>_recorded`; `name=base` replaces
the entry in place, which bypass mode needs: verl sets `policy_loss.loss_mode = "bypass_mode"` itself).

What the loss is handed decides what is recorded (verl 0.9.1, verl/workers/utils/losses.py::ppo_loss, calls it
with old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights):

    rollout_log_probs=  (verl versions whose actor passes it)  μ = rollout_log_probs, π = old_log_prob
                        (handed on to the wrapped loss only if it takes that keyword)
    bypass mode (base "bypass_mode": verl set old_log_probs := rollout_log_probs)  μ = old_log_prob, π = log_prob
    otherwise (0.9.1's decoupled mode: only rollout_is_weights, truncated)  nothing; a warning, once

(In bypass mode log_prob is the trainer before any update only in a step's first mini-batch; later mini-batches and
epochs see the weights move.)

π goes to the Recorder's scorer `<framework>:<trainer_dtype>`; with `current=` a second Recorder (another run name)
gets μ against the current log_prob where π is old_log_prob. Stored per call: the response mask (bool), the
per-token advantages, no token ids (the loss never sees them). The step: verl hands the loss no training step, so it
is `step()` when given, else the index of the call on this worker (one per micro-batch, epochs included). The rank:
the Recorder's ($RANK, which verl's workers set); pass a factory, as above, so that each worker makes its own on
its first recorded call.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable

from mismatch_lab.errors import UserError
from mismatch_lab.record import Recorder

BYPASS = "bypass_mode"
"""verl's loss for bypass mode, where old_log_prob is the rollout's log-prob (rollout_corr_helper.apply_bypass_mode)."""


class _Hook:
    """The recording half of a registered loss: which tensors are μ and π (module doc), the step, the Recorders."""

    def __init__(self, recorder, current, step, bypass: bool):
        self._make = {"main": recorder, "current": current}
        self._made: dict[str, Recorder] = {}
        self.step, self.bypass, self.calls, self.warned = step, bypass, 0, False

    def recorder(self, which: str) -> Recorder | None:
        make = self._make[which]
        if which not in self._made and make is not None:
            self._made[which] = make if isinstance(make, Recorder) else make()
        return self._made.get(which)

    def sides(self, old_log_prob, log_prob, rollout_log_probs):
        """(μ, π, the current π or None), or None where verl handed the loss no rollout log-prob."""
        if rollout_log_probs is not None:
            return rollout_log_probs, old_log_prob, log_prob
        if self.bypass:
            return old_log_prob, log_prob, None
        if not self.warned:
            warnings.warn("mismatch_lab.integrations.verl: this policy loss is handed no rollout log-probs (verl's "
                          "decoupled mode passes rollout_is_weights only): nothing is recorded; register with "
                          f"base='{BYPASS}' under rollout_correction.bypass_mode=True", stacklevel=3)
            self.warned = True
        return None

    def record(self, old_log_prob, log_prob, advantages, response_mask, rollout_log_probs) -> None:
        sides = self.sides(old_log_prob, log_prob, rollout_log_probs)
        step = self.step() if self.step is not None else self.calls
        self.calls += 1
        if sides is None:
            return
        mu, pi, current = (None if t is None else t.detach() for t in sides)
        mask, adv = response_mask.detach().bool(), advantages.detach()
        main = self.recorder("main")
        if main.wants(step):
            main.log_step(step, None, mask, mu, pi, advantages=adv)
        other = self.recorder("current") if current is not None else None
        if other is not None and other.wants(step):
            other.log_step(step, None, mask, mu, current, advantages=adv)


def _accepts(fn: Callable, keyword: str) -> bool:
    """Whether `fn` takes `keyword`: verl versions whose losses list rollout_log_probs get it handed on, 0.9.1's
    losses (which do not take it) never see it."""
    params = inspect.signature(fn).parameters.values()
    return any(p.name == keyword or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def register(recorder: Recorder | Callable[[], Recorder], *, base: str = "vanilla", name: str | None = None,
             current: Recorder | Callable[[], Recorder] | None = None,
             step: Callable[[], int] | None = None) -> str:
    """Register, with verl's `register_policy_loss`, a policy loss that records (module doc) and returns verl's
    `base` loss unchanged; returns the name to set as `actor_rollout_ref.actor.policy_loss.loss_mode`."""
    try:
        from verl.trainer.ppo.core_algos import get_policy_loss_fn, register_policy_loss
    except ImportError as exc:
        raise UserError(f"mismatch_lab.integrations.verl needs verl importable ({exc}); run it in verl's "
                        "environment") from exc
    try:
        wrapped = get_policy_loss_fn(base)
    except ValueError as exc:
        raise UserError(f"verl has no policy loss '{base}': pass base= one of verl's loss modes") from exc
    if getattr(wrapped, "mismatch_lab_hook", None) is not None:
        raise UserError(f"verl's policy loss '{base}' already records (registered by this module); wrap the loss "
                        "it wraps instead")
    hook = _Hook(recorder, current, step, bypass=base == BYPASS)
    hands_on = _accepts(wrapped, "rollout_log_probs")

    def policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                    rollout_is_weights=None, **kwargs):
        rollout = kwargs.get("rollout_log_probs") if hands_on else kwargs.pop("rollout_log_probs", None)
        hook.record(old_log_prob, log_prob, advantages, response_mask, rollout)
        return wrapped(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages,
                       response_mask=response_mask, loss_agg_mode=loss_agg_mode, config=config,
                       rollout_is_weights=rollout_is_weights, **kwargs)

    policy_loss.mismatch_lab_hook = hook
    name = name or f"{base}_recorded"
    register_policy_loss(name)(policy_loss)
    return name


__all__ = ["BYPASS", "register"]
