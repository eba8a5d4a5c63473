"""mismatch_lab.integrations.verl against verl 0.9.1's own code: the registered loss is called the way verl's actor
calls it (verl/workers/utils/losses.py::ppo_loss: keywords old_log_prob, log_prob, advantages, response_mask (bool),
loss_agg_mode, config, rollout_is_weights, with config.global_batch_info filled), returns verl's loss bitwise, and the
store holds exactly the tensors passed.

verl is imported as tests/corrections/test_verl_presets.py imports it: the wheel that scripts/setup.sh installs with
--no-deps into .venv/verl-0.9.1, put on sys.path for the import only, with a stub `ray` module (verl/protocol.py
imports ray; the loss code never calls it)."""

from __future__ import annotations

import types
import warnings
from pathlib import Path

import pytest
import torch
from verl_wheel import import_verl

from mismatch_lab.errors import UserError
from mismatch_lab.integrations import verl as hook
from mismatch_lab.record import Recorder
from mismatch_lab.store.reader import open_store


@pytest.fixture(scope="module")
def verl():
    core_algos, workers_config = import_verl("verl.trainer.ppo.core_algos", "verl.workers.config")
    return types.SimpleNamespace(core=core_algos, Actor=workers_config.ActorConfig,
                                 PolicyLoss=workers_config.PolicyLossConfig)


@pytest.fixture
def registered(verl):
    """The names this test registers, removed from verl's registry afterwards (stock entries put back)."""
    before = dict(verl.core.POLICY_LOSS_REGISTRY)
    yield
    verl.core.POLICY_LOSS_REGISTRY.clear()
    verl.core.POLICY_LOSS_REGISTRY.update(before)


def batch(seed: int = 0, B: int = 5, T: int = 11):
    """float32 log-probs as verl's actor holds them: μ (rollout), π_old, π (current, requires grad); a right-padded
    response mask (row 3 empty), GRPO per-token advantages (one value per row, broadcast)."""
    g = torch.Generator().manual_seed(seed)
    mu = torch.log(torch.rand(B, T, generator=g) * 0.95 + 0.05)
    old = (mu + 0.05 * torch.randn(B, T, generator=g)).clamp(max=0.0)
    lp = (old + 0.02 * torch.randn(B, T, generator=g)).clamp(max=0.0)
    lengths = torch.tensor([T, 7, 1, 0, 4])[:B]
    mask = torch.arange(T)[None, :] < lengths[:, None]
    adv = torch.randn(B, 1, generator=g).expand(B, T).contiguous()
    return mu, old, lp.requires_grad_(True), mask, adv


def actor(verl, mask, loss_mode: str):
    config = verl.Actor(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                        policy_loss=verl.PolicyLoss(loss_mode=loss_mode))
    config.global_batch_info.update(dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=mask.shape[0],
                                    loss_scale_factor=None)
    return config


def call(verl, name: str, config, old, lp, adv, mask, **extra):
    """The policy loss of `name`, called as verl 0.9.1's ppo_loss calls it; (loss, metrics, d loss / d log π)."""
    lp = lp.detach().clone().requires_grad_(True)
    loss, metrics = verl.core.get_policy_loss_fn(name)(
        old_log_prob=old, log_prob=lp, advantages=adv, response_mask=mask, loss_agg_mode=config.loss_agg_mode,
        config=config, rollout_is_weights=None, **extra)
    loss.backward()
    return loss.detach(), metrics, lp.grad


def stored(path: Path, run: str) -> list[tuple]:
    """(step, sequence's order in its step, pos, log μ, log π, per-token advantage, scorer, token id) of every token
    of `run`, in order."""
    con = open_store(path)
    rows = con.execute("""
        SELECT q.step, dense_rank() OVER (PARTITION BY q.step ORDER BY q.seq_id) - 1, t.pos, t.logp_rollout, s.logp,
               t.advantage, s.scorer, t.token_id
        FROM tokens t JOIN scores s USING (run_id, seq_id, pos) JOIN sequences q USING (run_id, seq_id)
        WHERE t.run_id = ? ORDER BY q.step, q.seq_id, t.pos""", [run]).fetchall()
    con.close()
    return rows


def expected(step: int, mu, pi, adv, mask, scorer: str) -> list[tuple]:
    """The rows `stored` must return for one call: every masked position's values, float32 -> float64 (exact);
    rows without a response token are not stored, so the others are numbered in order; no token ids."""
    out, kept = [], [b for b in range(mask.shape[0]) if mask[b].any()]
    for i, b in enumerate(kept):
        first = int(torch.nonzero(mask[b])[0])
        for t in torch.nonzero(mask[b]).flatten().tolist():
            out.append((step, i, t - first, float(mu[b, t]), float(pi[b, t]), float(adv[b, t]), scorer, None))
    return out


def test_the_recording_bypass_loss_returns_verls_loss_bitwise_and_stores_mu_and_the_current_pi(verl, registered,
                                                                                                tmp_path):
    mu, _, lp, mask, adv = batch()
    config = actor(verl, mask, hook.BYPASS)
    want = call(verl, hook.BYPASS, config, mu, lp, adv, mask)  # verl's own bypass loss: old_log_prob := μ
    rec = Recorder(tmp_path / "s", "bypass", framework="verl", rollout_engine="vllm", trainer_dtype="bf16")
    name = hook.register(rec, base=hook.BYPASS, name=hook.BYPASS)  # in place: verl sets loss_mode itself
    got = [call(verl, name, config, mu, lp, adv, mask) for _ in range(2)]  # two micro-batches: steps 0 and 1
    rec.close()
    for loss, metrics, grad in got:
        assert torch.equal(loss, want[0]) and torch.equal(grad, want[2])
        assert metrics.keys() == want[1].keys() and all(str(metrics[k]) == str(want[1][k]) for k in metrics)
    assert stored(tmp_path / "s", "bypass") == [r for step in (0, 1)
                                                 for r in expected(step, mu, lp.detach(), adv, mask, "verl:bf16")]


def test_rollout_log_probs_handed_to_the_loss_are_mu_and_old_log_prob_is_pi(verl, registered, tmp_path):
    mu, old, lp, mask, adv = batch(1)
    config = actor(verl, mask, "vanilla")
    want = call(verl, "vanilla", config, old, lp, adv, mask)
    main = Recorder(tmp_path / "s", "old", framework="verl", rollout_engine="vllm", trainer_dtype="bf16")
    current = Recorder(tmp_path / "s", "current", framework="verl-current", rollout_engine="vllm",
                       trainer_dtype="bf16")
    name = hook.register(lambda: main, current=lambda: current, step=lambda: 40)
    assert name == "vanilla_recorded"
    got = call(verl, name, config, old, lp, adv, mask, rollout_log_probs=mu)  # as verl versions passing it do
    main.close()
    current.close()
    # verl 0.9.1's vanilla takes no rollout_log_probs keyword: the wrapper does not hand it on
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
    assert {k: str(v) for k, v in got[1].items()} == {k: str(v) for k, v in want[1].items()}
    assert stored(tmp_path / "s", "old") == expected(40, mu, old, adv, mask, "verl:bf16")
    assert stored(tmp_path / "s", "current") == expected(40, mu, lp.detach(), adv, mask, "verl-current:bf16")


def test_a_decoupled_call_without_rollout_log_probs_records_nothing_and_returns_verls_loss(verl, registered,
                                                                                          tmp_path):
    _, old, lp, mask, adv = batch(2)
    config = actor(verl, mask, "vanilla")
    want = call(verl, "vanilla", config, old, lp, adv, mask)
    rec = Recorder(tmp_path / "s", "decoupled", framework="verl", rollout_engine="vllm", trainer_dtype="bf16")
    name = hook.register(rec)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [call(verl, name, config, old, lp, adv, mask) for _ in range(2)]
    rec.close()
    assert [str(w.message).split(":")[0] for w in caught] == ["mismatch_lab.integrations.verl"]
    for loss, _, grad in got:
        assert torch.equal(loss, want[0]) and torch.equal(grad, want[2])
    con = open_store(tmp_path / "s")
    assert con.execute("SELECT count(*) FROM tokens WHERE run_id = 'decoupled'").fetchone() == (0,)
    con.close()
    assert rec.tokens_written == 0


def test_wrapping_a_loss_verl_lacks_or_one_that_already_records_is_a_one_line_error(verl, registered, tmp_path):
    rec = Recorder(tmp_path / "s", "errors", framework="verl")
    with pytest.raises(UserError, match="verl has no policy loss 'no_such_loss'"):
        hook.register(rec, base="no_such_loss")
    hook.register(rec, base="vanilla", name="vanilla")  # in place
    with pytest.raises(UserError, match="'vanilla' already records"):
        hook.register(rec, base="vanilla")
    rec.close()
