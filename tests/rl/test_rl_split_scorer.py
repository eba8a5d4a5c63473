"""`--split-scorer <rounding>`: the weight-rounding part of the mismatch, per step, on the real tiny model (the
rollout engine and the store writer are fakes: orchestration only)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from mismatch_lab.engines.base import Sample
from mismatch_lab.errors import UserError
from mismatch_lab.rl import step as parts
from mismatch_lab.rl.loop import TrainConfig

KEY = "mismatch/weight_rounding/abs_dlogp/mean"


class _FakeEngine:
    def generate(self, reqs, *, max_tokens, top_k):
        return [Sample(token_ids=[5 + r.seed % 7] * (1 + r.seed % 3), logps=[-1.0] * (1 + r.seed % 3),
                       text=str(r.seed % 2), finish_reason="stop") for r in reqs]

    def load_state_dict(self, state):
        pass


class _FakeWriter:
    def __init__(self):
        self.metrics = []

    def write_chunk(self, run_id, chunk, *, metrics, **tables):
        self.metrics.append({n: v for _, n, v in metrics})


def _batch(lengths):
    samples = [Sample(token_ids=list(range(3, 3 + n)), logps=[-0.5] * n, text="", finish_reason="stop") for n in lengths]
    rows = [{"seq_id": i, "prompt_id": f"p{i // 2}", "sample_idx": i % 2, "prompt_len": 3} for i in range(len(lengths))]
    return parts.make_batch(samples, rows, [[1, 2, 4]] * len(lengths), [1.0, 0.0] * (len(lengths) // 2), group_size=2,
                            normalize_std=True)


def test_weight_rounding_metric_equals_a_fresh_model_on_the_rounded_state_dict(tiny_model):
    from transformers import AutoModelForCausalLM

    from mismatch_lab.engines.weights import round_state

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    batch = _batch([3, 5, 2, 4])
    state = {k: v.clone() for k, v in model.state_dict().items()}
    cache = {}
    got = parts.weight_rounding_metrics(model, batch, "bf16", cache)
    # naive: two fresh fp32 models, the checkpoint's weights and their bf16 rounding, each model's own forward
    fresh, rounded = (AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval() for _ in range(2))
    rounded.load_state_dict(round_state(state, "bf16"))
    diffs, scale = [], 0.0
    with torch.no_grad():
        for p, r in zip(batch.prompt_ids, batch.responses):
            ids = torch.tensor([list(p) + list(r)])
            logits = [m(ids).logits.float()[0] for m in (fresh, rounded)]
            scale = max([scale, *(float((x.abs().amax(-1) + torch.logsumexp(x, -1).abs()).max()) for x in logits)])
            a, b = (torch.log_softmax(x, -1) for x in logits)
            rows, tgt = torch.arange(len(p) - 1, len(p) + len(r) - 1), torch.tensor(r)
            diffs.append((a[rows, tgt] - b[rows, tgt]).abs())
    d = torch.cat(diffs)  # denominator: every response token of the batch
    # fp32 forwards that reduce in another order (batch shape, CPU kernels) differ by up to
    # 4 · eps_fp32 · sqrt(hidden 128) · (|logit| + |logsumexp|) per log-prob (the reason is written out in
    # tests/collect/test_collect_weight_rounding_scorer.py, REL); |Δ log p| carries two such errors
    tol = 2 * 4 * torch.finfo(torch.float32).eps * 128**0.5 * scale
    assert got[KEY] == pytest.approx(float(d.mean()), rel=0, abs=tol)
    assert got["mismatch/weight_rounding/abs_dlogp/max"] == pytest.approx(float(d.max()), rel=0, abs=tol)
    assert float(d.mean()) > 10 * tol  # the rounding's effect stands well above the tolerance
    assert got[KEY] > 1e-6  # bf16 rounding of the tiny model's fp32 weights moves π
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())  # the trainer keeps its weights
    copy = cache["split_model"]
    parts.weight_rounding_metrics(model, batch, "bf16", cache)
    assert cache["split_model"] is copy  # one rounded copy, refilled each step


def test_a_real_step_logs_the_split_next_to_the_mismatch_metrics(tiny_model):
    from transformers import AutoModelForCausalLM

    from mismatch_lab.record.flat import TextLookup
    from mismatch_lab.rl.loop import LaggedSync, run_step
    from mismatch_lab.rl.tasks import TASKS
    from mismatch_lab.runtime import load_tokenizer

    cfg = TrainConfig(model=tiny_model, loss="grpo", prompts_per_step=2, samples_per_prompt=2, max_tokens=4,
                      lr=1e-3, split_scorer="bf16", topk=1)
    cfg.validate()
    tok = load_tokenizer(tiny_model)[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    ctx = {"engine": _FakeEngine(), "tokenizer": tok, "task": TASKS[cfg.task], "model": model,
           "optimizer": torch.optim.AdamW(model.parameters(), lr=cfg.lr), "loss_cfg": cfg.loss_config(),
           "use_topk": False, "writer": _FakeWriter(), "run_id": "r", "scorer": "hf:fp32", "texts": TextLookup(tok)}
    ctx["sync"] = LaggedSync(ctx["engine"], model, cfg.rollout_weights, cfg.policy_lag)  # as loop.train sets it
    m1 = run_step(cfg, ctx, 1)
    m2 = run_step(cfg, ctx, 2)
    for m in (m1, m2):
        assert m[KEY] > 0 and "mismatch/abs_dlogp/mean" in m and "time/split_score/seconds" in m
    assert ctx["writer"].metrics[0][KEY] == m1[KEY]
    assert m1[KEY] != m2[KEY]  # scored on each step's own weights
    cfg_off = TrainConfig(model=tiny_model, loss="grpo", prompts_per_step=2, samples_per_prompt=2, max_tokens=4,
                          lr=1e-3, topk=1)
    assert KEY not in run_step(cfg_off, ctx, 3)


def test_the_option_stays_out_of_the_run_id_at_its_default_and_needs_an_fp32_trainer():
    assert TrainConfig().run_id() == TrainConfig(split_scorer="none").run_id()
    assert TrainConfig().run_id() != TrainConfig(split_scorer="bf16").run_id()
    with pytest.raises(UserError, match="trainer-dtype fp32"):
        TrainConfig(split_scorer="bf16", trainer_dtype="bf16").validate()
    with pytest.raises(UserError, match="split-scorer"):
        TrainConfig(split_scorer="int4").validate()
