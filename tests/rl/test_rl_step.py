"""The loop's parts alone: rollout -> batch (fake engine: orchestration only), score/update/rescore on the real
tiny HF model, the weight push, the pure step_metrics, the exact mini-batch reduction, the write of a step."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from mismatch_lab.engines.base import Sample
from mismatch_lab.rl import step as parts
from mismatch_lab.rl.loop import TrainConfig, response_logps
from mismatch_lab.rl.losses import LossConfig, policy_loss


def _sample(tokens, logps=None, text="", finish="stop"):
    return Sample(token_ids=list(tokens), logps=list(logps or [-1.0] * len(tokens)), text=text, finish_reason=finish)


class _FakeEngine:
    """Answers each request with a reply that depends on its seed only; records what it was asked."""

    def __init__(self):
        self.requests, self.states = [], []

    def generate(self, reqs, *, max_tokens, top_k):
        self.requests.extend(reqs)
        return [_sample([5 + r.seed % 7] * (1 + r.seed % 3), text=str(r.seed % 2)) for r in reqs]

    def load_state_dict(self, state):
        self.states.append(state)


class _EvenTask:
    @staticmethod
    def reward(text, answer):
        return float(text == "0")


def _tokenizer(tiny_model):
    from mismatch_lab.runtime import load_tokenizer

    return load_tokenizer(tiny_model)[0]


def test_rollout_batch_seeds_rows_rewards_and_advantages(tiny_model):
    from mismatch_lab.rl.advantages import group_advantages
    from mismatch_lab.rl.loop import problems_for_step
    from mismatch_lab.runtime import sample_seed

    cfg = TrainConfig(prompts_per_step=3, samples_per_prompt=4, seed=7)
    engine = _FakeEngine()
    batch = parts.rollout_batch(cfg, engine, _tokenizer(tiny_model), _EvenTask, 2, top_k=20)
    problems = problems_for_step(cfg, 2)
    assert [r.seed for r in engine.requests] == [sample_seed(7, 3 + g, s) for g in range(3) for s in range(4)]
    assert [r["seq_id"] for r in batch.seq_rows] == list(range(12, 24))
    assert [r["prompt_id"] for r in batch.seq_rows] == [p.id for p in problems for _ in range(4)]
    assert batch.rewards == [float(r.seed % 2 == 0) for r in engine.requests]
    expected, _ = group_advantages(torch.tensor(batch.rewards), 4)
    assert torch.equal(batch.adv, expected)
    assert batch.mask.sum(1).tolist() == [len(s.token_ids) for s in batch.samples]
    assert all(batch.prompt_ids[i] == engine.requests[i].prompt_ids for i in range(12))


def _batch(rewards, lengths, group_size=2):
    samples = [_sample(range(3, 3 + n), [-0.5 - 0.1 * j for j in range(n)]) for n in lengths]
    rows = [{"seq_id": i, "prompt_id": f"p{i // group_size}", "sample_idx": i % group_size, "prompt_len": 3}
            for i in range(len(lengths))]
    return parts.make_batch(samples, rows, [[1, 2, 4]] * len(lengths), rewards, group_size=group_size,
                            normalize_std=True)


def test_score_update_rescore_on_the_real_model(tiny_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = _batch([1.0, 0.0, 0.0, 1.0], [3, 5, 2, 4])
    cfg = TrainConfig(loss="grpo", minibatches=2)
    with torch.no_grad():
        ref, _, _, _ = response_logps(model, batch.prompt_ids, batch.responses, trainer_dtype="fp32")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    times = {}
    scored = parts.train_on_batch(model, opt, batch, cfg, cfg.loss_config(), topk=False, times=times)
    # mini-batch 1 was scored before any update: its π is the base model's; mini-batch 2 after one step
    assert torch.allclose(scored.logp_before[:2], ref[:2], atol=1e-6)
    assert not torch.allclose(scored.logp_before[2:], ref[2:], atol=1e-4)
    assert len(scored.minibatch_metrics) == 2 and all(g > 0 for g in scored.grad_norms)
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert {"time/score/seconds", "time/update/seconds", "time/loss/seconds"} <= set(times)
    assert [m["sequences/valid/count"] for m in scored.minibatch_metrics] == [2.0, 2.0]
    bad = parts.rescore(model, batch, scored.logp_before, trainer_dtype="fp32", delta=0.5)
    assert {"bad_update/negative_adv/frac", "bad_update_vs_pi/negative_adv/frac"} <= set(bad)


def test_sync_weights_pushes_the_state_through_the_transform():
    engine, model = _FakeEngine(), torch.nn.Linear(3, 2)
    parts.sync_weights(engine, model)
    parts.sync_weights(engine, model, transform=lambda sd: {k: v * 0 for k, v in sd.items()})
    assert torch.equal(engine.states[0]["weight"], model.weight.detach())
    assert torch.count_nonzero(engine.states[1]["weight"]) == 0


def _random_inputs(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    B, T = len(lengths), max(lengths)
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    mu = -torch.rand(B, T, generator=gen) * 3
    lp = mu + torch.randn(B, T, generator=gen) * 0.3
    adv = torch.tensor([1.0, -1.0, 0.0, 0.5, -0.5, 0.0, 2.0, -2.0])[:B]
    return lp, mu, adv, mask


@pytest.mark.parametrize("loss, correction", [("grpo", "none"), ("dppo_binary_tv", "none"), ("cispo", "seq_mis")])
def test_minibatch_reduction_equals_the_whole_batch(loss, correction):
    """Token shares and means over mini-batches of unequal token counts equal the whole batch's (the naive
    reference: one policy_loss call over all tokens); a mean of means would not."""
    lengths = [1, 9, 2, 8, 3, 3, 7, 1]
    lp, mu, adv, mask = _random_inputs(lengths)
    cfg = LossConfig(correction=correction) if correction != "none" else LossConfig()
    _, whole = policy_loss(loss, lp, mu, adv, mask, cfg=cfg)
    per_mb = []
    for sl in (slice(0, 2), slice(2, 5), slice(5, 8)):
        _, m = policy_loss(loss, lp[sl], mu[sl], adv[sl], mask[sl], cfg=cfg)
        m["sequences/valid/count"] = float(mask[sl].any(-1).sum())
        per_mb.append(m)
    reduced = parts.reduce_minibatches(per_mb)
    exact = [k for k in whole if k not in parts._PER_MINIBATCH]
    for k in exact:
        assert reduced[k] == pytest.approx(whole[k], rel=1e-6, abs=1e-9), k
    naive = {k: sum(m[k] for m in per_mb) / 3 for k in whole}
    assert abs(naive["mismatch/abs_dp/mean"] - whole["mismatch/abs_dp/mean"]) > 1e-3  # the old rule was off


def test_reduction_of_an_empty_denominator_is_zero():
    per_mb = [{"tokens/valid/count": 0.0, "tokens/nonzero_adv/count": 0.0, "mask/nonzero_adv/frac": 0.0,
               "mismatch/abs_dp/mean": 0.0}] * 2
    assert parts.reduce_minibatches(per_mb)["mask/nonzero_adv/frac"] == 0.0


def test_step_metrics_is_pure_and_counts_what_it_is_given():
    batch = _batch([1.0, 0.0, 1.0, 1.0], [2, 4, 1, 1])
    batch.samples[1].finish_reason = "length"
    entropy = torch.zeros_like(batch.logp_mu)
    entropy[batch.mask] = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])
    per_mb = [{"tokens/valid/count": 6.0, "mismatch/abs_dp/mean": 0.1, "loss/value": 1.0},
              {"tokens/valid/count": 2.0, "mismatch/abs_dp/mean": 0.5, "loss/value": 3.0}]
    scored = parts.Scored(torch.zeros_like(batch.logp_mu), entropy, per_mb, [2.0, 4.0])
    times = {"time/rollout/seconds": 1.5}
    m = parts.step_metrics(batch, scored, {"bad_update/all/frac": 0.25}, times, lr=1e-5)
    assert m["mismatch/abs_dp/mean"] == pytest.approx((0.6 + 1.0) / 8)
    assert m["loss/value"] == 2.0 and m["tokens/valid/count"] == 8.0
    assert m["reward/accuracy/mean"] == 0.75 and m["response/length/mean"] == 2.0
    assert m["response/length/max"] == 4.0 and m["response/truncated/frac"] == 0.25
    assert m["entropy/mean"] == pytest.approx(4.5)
    assert m["grad/norm/value"] == 3.0 and m["grad/norm/max"] == 4.0 and m["lr/value"] == 1e-5
    assert m["bad_update/all/frac"] == 0.25 and m["time/rollout/seconds"] == 1.5
    assert m["group/uniform_reward/frac"] == 0.5  # from the advantages: group 2 is all 1


def test_timed_adds_up_repeated_blocks():
    times = {}
    for _ in range(2):
        with parts.timed(times, "x"):
            pass
    assert list(times) == ["time/x/seconds"] and 0 <= times["time/x/seconds"] < 1


def test_write_step_commits_one_chunk(tmp_path, tiny_model):
    import duckdb

    from mismatch_lab.record.flat import TextLookup
    from mismatch_lab.store.writer import StoreWriter

    batch = _batch([1.0, 0.0], [2, 3])
    scored = parts.Scored(batch.logp_mu - 0.01, torch.ones_like(batch.logp_mu), [], [1.0])
    writer = StoreWriter(str(tmp_path / "w.duckdb"))
    writer.start_run("r", study="t", kind="train", model="m", weights_sha256="x", engine="vllm", engine_dtype="bf16",
                     device="cpu", versions={}, config={})
    parts.write_step(writer, "r", 1, batch, scored, {"a/mean": 0.5}, scorer="hf:fp32",
                     texts=TextLookup(_tokenizer(tiny_model)), seconds=0.1)
    writer.close()
    con = duckdb.connect(str(tmp_path / "w.duckdb"), read_only=True)
    assert con.execute("SELECT chunk FROM chunks_done").fetchall() == [(1,)]
    assert con.execute("SELECT count(*) FROM tokens").fetchone() == (5,)
    assert con.execute("SELECT scorer, count(*) FROM scores GROUP BY scorer").fetchall() == [("hf:fp32", 5)]
    assert con.execute("SELECT step, name, value FROM train_metrics").fetchall() == [(1, "a/mean", 0.5)]
    lp = con.execute("SELECT logp FROM scores ORDER BY seq_id, pos").fetchall()
    assert [round(x[0], 4) for x in lp] == [round(x - 0.01, 4) for x in (-0.5, -0.6, -0.5, -0.6, -0.7)]
    assert not math.isnan(lp[0][0])


def test_a_rollout_correction_reaches_the_real_update(tiny_model):
    """`train --correction`: the correction's metrics come with every mini-batch, and a correction that drops
    every sequence (veto with a floor above every ratio) leaves the
    model untouched, while the same batch without it updates the model."""
    from transformers import AutoModelForCausalLM

    batch = _batch([1.0, 0.0, 0.0, 1.0], [3, 5, 2, 4])
    for correction, args, moves in (("token_tis", "cap=1.5", True), ("veto", "floor=1e9", False)):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)  # as the loop (weight_decay 0)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        cfg = TrainConfig(loss="grpo", correction=correction, correction_args=args)
        scored = parts.train_on_batch(model, opt, batch, cfg, cfg.loss_config(), topk=False, times={})
        m = scored.minibatch_metrics[0]
        assert {"correction/masked/frac", "correction/modified/frac", "correction/ess", "weight/ess"} <= set(m)
        changed = any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
        assert changed is moves, correction
        if not moves:
            assert m["correction/seqs_masked/frac"] == 1.0
