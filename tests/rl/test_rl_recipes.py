"""DAPO dynamic sampling (planted all-equal groups dropped and refilled, the round cap), the soft overlong
punishment against its formula, and the presets (Dr. GRPO, DAPO)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from mismatch_lab.engines.base import Sample
from mismatch_lab.errors import UserError
from mismatch_lab.rl import step as parts
from mismatch_lab.rl.loop import TrainConfig
from mismatch_lab.rl.recipes import apply_preset, informative, overlong_penalty


@pytest.mark.parametrize("length, expected", [
    (0, 0.0), (15, 0.0), (16, 0.0),      # up to L_max − L_cache = 16: no penalty
    (17, -0.25), (18, -0.5), (19, -0.75),  # linear to −1 at L_max
    (20, -1.0), (21, -1.0), (99, -1.0),    # −1 beyond
])
def test_overlong_penalty_follows_the_dapo_formula(length, expected):
    assert overlong_penalty(length, 20, 4) == pytest.approx(expected)


def test_overlong_penalty_matches_the_paper_at_its_scale_and_is_off_without_a_cache():
    L_max, L_cache = 20480, 4096
    for L in (0, 16384, 16385, 18000, 20480, 20481):
        ref = 0.0 if L <= L_max - L_cache else (-1.0 if L > L_max else ((L_max - L_cache) - L) / L_cache)
        assert overlong_penalty(L, L_max, L_cache) == ref
    assert overlong_penalty(50, 20, 0) == 0.0


def _group(name, rewards):
    return parts.Group(problem=type("P", (), {"id": name, "answer": 0})(), prompt_ids=[1, 2],
                       samples=[Sample([3] * (i + 1), [-1.0] * (i + 1), "", "stop") for i in range(len(rewards))],
                       rewards=list(rewards))


def _draws(rounds):
    calls = []

    def draw(r):
        calls.append(r)
        return rounds[r]
    return draw, calls


def test_dynamic_sampling_drops_planted_uniform_groups_and_refills():
    cfg = TrainConfig(prompts_per_step=3, samples_per_prompt=2, dynamic_sampling=True, max_rounds=5)
    rounds = [[_group("a", [1, 1]), _group("b", [0, 1]), _group("c", [0, 0])],
              [_group("d", [0, 0]), _group("e", [1, 0]), _group("f", [1, 1])],
              [_group("g", [0, 1]), _group("h", [1, 0]), _group("i", [1, 1])],
              [_group("never", [0, 1])] * 3]
    draw, calls = _draws(rounds)
    groups, m = parts.select_groups(cfg, draw)
    assert [g.problem.id for g in groups] == ["b", "e", "g"]
    assert calls == [0, 1, 2]  # stops as soon as the batch is full
    assert m == {"dynamic_sampling/rounds/count": 3.0, "dynamic_sampling/groups_dropped/count": 5.0,
                 "dynamic_sampling/groups_refilled/count": 0.0}


def test_dynamic_sampling_cap_holds_and_fills_with_dropped_groups():
    cfg = TrainConfig(prompts_per_step=2, samples_per_prompt=2, dynamic_sampling=True, max_rounds=2)
    draw, calls = _draws([[_group("a", [1, 1]), _group("b", [0, 0])], [_group("c", [0, 1]), _group("d", [0, 0])],
                          [_group("x", [0, 1]), _group("y", [1, 0])]])
    groups, m = parts.select_groups(cfg, draw)
    assert calls == [0, 1]
    assert [g.problem.id for g in groups] == ["c", "a"]
    assert m["dynamic_sampling/groups_refilled/count"] == 1.0 and m["dynamic_sampling/rounds/count"] == 2.0


def test_without_dynamic_sampling_round_zero_is_taken_as_it_is():
    draw, calls = _draws([[_group("a", [1, 1]), _group("b", [0, 0])]])
    groups, m = parts.select_groups(TrainConfig(prompts_per_step=2), draw)
    assert calls == [0] and [g.problem.id for g in groups] == ["a", "b"] and m == {}


class _SeedEngine:
    def __init__(self):
        self.calls = 0

    def generate(self, reqs, *, max_tokens, top_k):
        self.calls += 1
        return [Sample([4] * (1 + r.seed % max_tokens), [-1.0] * (1 + r.seed % max_tokens), str(r.seed % 2), "stop")
                for r in reqs]


class _OddAnswerTask:
    """Planted: every group of a problem with an odd answer is all 1, with an even answer all 0."""

    @staticmethod
    def reward(text, answer):
        return float(answer % 2)


def test_rollout_batch_with_dynamic_sampling_on_planted_uniform_rewards(tiny_model):
    from mismatch_lab.runtime import load_tokenizer

    tok = load_tokenizer(tiny_model)[0]
    cfg = TrainConfig(prompts_per_step=2, samples_per_prompt=3, dynamic_sampling=True, max_rounds=3, max_tokens=10,
                      overlong_cache=4)
    engine = _SeedEngine()
    batch = parts.rollout_batch(cfg, engine, tok, _OddAnswerTask, 1, top_k=20)
    assert engine.calls == 3  # no group is ever informative: the cap ends it
    assert batch.rollout_metrics["dynamic_sampling/groups_dropped/count"] == 6.0
    assert batch.rollout_metrics["dynamic_sampling/groups_refilled/count"] == 2.0
    assert len(batch.samples) == 6
    assert all(len(set(batch.task_rewards[i:i + 3])) == 1 for i in (0, 3))  # the refilled groups are uniform
    # the shaped reward is the task reward plus the penalty of each response's length
    for s, r, t in zip(batch.samples, batch.rewards, batch.task_rewards):
        assert r == pytest.approx(t + overlong_penalty(len(s.token_ids), 10, 4))
    assert [r["seq_id"] for r in batch.seq_rows] == list(range(6))


def test_presets_set_their_fields_unless_the_user_did():
    cfg = TrainConfig(preset="dr_grpo", max_tokens=48)
    apply_preset(cfg)
    assert (cfg.normalize_std, cfg.aggregation, cfg.constant_norm) == (False, "constant", 48.0)
    cfg.validate()
    dapo = TrainConfig(preset="dapo", eps_high=0.3, max_tokens=40)
    dapo.validate()
    assert dapo.dynamic_sampling and dapo.overlong_cache == 8 and dapo.eps_high == 0.3
    assert TrainConfig(preset="dapo").run_id() != TrainConfig().run_id()
    with pytest.raises(UserError, match="preset"):
        TrainConfig(preset="nope").validate()
    with pytest.raises(UserError, match="overlong-cache"):
        TrainConfig(overlong_cache=64, max_tokens=32).validate()


def test_new_fields_at_their_defaults_leave_stored_run_ids_alone():
    import hashlib
    import json
    from dataclasses import asdict

    from mismatch_lab.rl.loop import _IN_RUN_ID_UNLESS_DEFAULT, _NOT_IN_RUN_ID

    new = ("preset", "dynamic_sampling", "max_rounds", "overlong_cache", "overlong_max")
    cfg = TrainConfig()
    old = {k: v for k, v in asdict(cfg).items() if k not in _NOT_IN_RUN_ID and k not in _IN_RUN_ID_UNLESS_DEFAULT}
    key = hashlib.sha256(json.dumps(old, sort_keys=True, default=str).encode()).hexdigest()[:10]
    assert cfg.run_id() == f"adhoc-train-dppo_binary_tv-{key}" and set(new) <= set(_IN_RUN_ID_UNLESS_DEFAULT)


def test_informative():
    assert informative([0.0, 1.0]) and not informative([1.0, 1.0]) and not informative([0.0, 0.0])
