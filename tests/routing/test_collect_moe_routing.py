"""`collect` on the tiny MoE records routing (routing table) and scores with the R3 replay scorer: one small real
collect (vLLM rollouts at bf16 and fp32, HF scorers hf:fp32 and hf:fp32-r3) shared by the tests of this module."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mismatch_lab.cli import main
from mismatch_lab.collect.config import CollectConfig
from mismatch_lab.collect.job import routing_on
from mismatch_lab.errors import UserError
from mismatch_lab.models import TINY_MOE
from mismatch_lab.routing.hf import hf_routing
from mismatch_lab.scoring import HFScorer, ScoreItem
from mismatch_lab.store.reader import open_store

NEAR_TIE = 1e-3
"""Router margin (logit units) below which an fp32-vs-fp32 flip is a near-tie: two fp32 forwards of the same
tokens differ by a few fp32 ulps of logits of order 1, far below it."""


@pytest.fixture(scope="module")
def moe_store(tiny_moe, tmp_path_factory):
    folder = tmp_path_factory.mktemp("moe-collect")
    prompts = folder / "p.jsonl"
    texts = ["What is 7 + 7?", "Write a haiku about rain.", "def add(a, b):", "Name three colours."]
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": t}) + "\n" for i, t in enumerate(texts)))
    db = folder / "moe.duckdb"
    assert main(["collect", "--model", tiny_moe, "--prompts", str(prompts), "--db", str(db), "--samples", "1",
                 "--max-tokens", "12", "--rollout-dtypes", "bf16,fp32", "--scorer-dtypes", "fp32,fp32-r3",
                 "--top-k", "0", "--no-progress"]) == 0  # the memory plan counts the experts
    con = open_store(db)
    yield con
    con.close()


def _flips(con, dtype: str, side: str) -> list[tuple[float, bool]]:
    """(rollout margin, expert set differs) of every stored (token, layer) of the `dtype` rollout vs `side`."""
    return con.execute("""
        SELECT a.margin, list_sort(a.expert_ids) <> list_sort(b.expert_ids)
        FROM routing a JOIN routing b USING (run_id, seq_id, pos, layer) JOIN runs USING (run_id)
        WHERE a.side = 'rollout' AND b.side = ? AND runs.engine_dtype = ?""", [side, dtype]).fetchall()


def test_every_response_token_has_routing_of_every_layer_on_each_side(moe_store):
    tokens = moe_store.execute("SELECT count(*) FROM tokens").fetchone()[0]
    layers = moe_store.execute("SELECT count(DISTINCT layer) FROM routing").fetchone()[0]
    per_side = dict(moe_store.execute("SELECT side, count(*) FROM routing GROUP BY side").fetchall())
    assert tokens > 0 and layers >= 2
    assert per_side == {"rollout": tokens * layers, "hf:fp32": tokens * layers, "hf:fp32-r3": tokens * layers}


def test_an_fp32_rollout_and_the_fp32_trainer_route_alike_except_at_router_near_ties(moe_store):
    cells = _flips(moe_store, "fp32", "hf:fp32")
    assert cells and all(margin < NEAR_TIE for margin, flip in cells if flip), [m for m, f in cells if f]


def test_a_bf16_rollout_routes_some_tokens_to_other_experts_than_the_fp32_trainer(moe_store):
    assert sum(flip for _, flip in _flips(moe_store, "bf16", "hf:fp32")) > 0


def test_the_r3_scorer_uses_the_rollouts_expert_set_on_every_token_and_layer(moe_store):
    for dtype in ("bf16", "fp32"):
        cells = _flips(moe_store, dtype, "hf:fp32-r3")
        assert cells and not any(flip for _, flip in cells)


def test_r3_replay_brings_the_trainer_closer_to_the_bf16_rollout(moe_store):
    dp = dict(moe_store.execute("""
        SELECT scorer, avg(abs(exp(logp) - exp(logp_rollout))) FROM scores JOIN tokens USING (run_id, seq_id, pos)
        JOIN runs USING (run_id) WHERE runs.engine_dtype = 'bf16' GROUP BY scorer""").fetchall())
    assert dp["hf:fp32-r3"] < dp["hf:fp32"]


def test_the_scorers_routing_of_a_packed_batch_is_each_sequences_own_forward(tiny_moe, hf_fp32, token_seqs):
    """The scorer pads several sequences into one forward; its routing rows map back to (sequence, position):
    the expert ids equal those of routing.hf's one-sequence forward and the weights agree to fp32 rounding. The
    two forwards' kernels add the same products in other orders: a router logit drifts by ~sqrt(hidden) roundings
    of its magnitude a layer (within 4 standard deviations: 4 x router_scale), through every layer before it; a
    weight's log moves by its logit's drift (softmax), so the logs are compared to that absolute tolerance."""
    cfg = hf_fp32.config
    logit = 4 * TINY_MOE["router_scale"]
    atol = cfg.num_hidden_layers * np.sqrt(cfg.hidden_size) * np.finfo(np.float32).eps * logit
    items = [ScoreItem(ids[:5], ids[5:]) for ids in token_seqs]
    scorer = HFScorer(tiny_moe, ["fp32"], device="cpu", top_k=0, models={"fp32": hf_fp32}, routing=True)
    assert len(scorer.micro_batches(items)) == 1  # both sequences in one padded forward
    st = scorer.score(items)["hf:fp32"]
    for s, ids in enumerate(token_seqs):
        alone, _ = hf_routing(hf_fp32, ids)
        rows = slice(4, len(ids) - 1)  # input positions prompt_len - 1 .. predicting the response tokens
        np.testing.assert_array_equal(st.routing.ids[st.rows(s)], alone.ids[rows])
        np.testing.assert_allclose(np.log(st.routing.weights[st.rows(s)]), np.log(alone.weights[rows]), rtol=0,
                                   atol=atol)


def test_routing_on_a_dense_model_or_r3_without_routing_is_refused_in_one_line():
    with pytest.raises(UserError, match="not an MoE model"):
        routing_on(CollectConfig(routing="on"), {"num_hidden_layers": 2}, ["fp32"])
    with pytest.raises(UserError, match="not an MoE model"):
        routing_on(CollectConfig(), {"num_hidden_layers": 2}, ["fp32-r3"])
    with pytest.raises(UserError, match="drop --routing off"):
        routing_on(CollectConfig(routing="off"), {"num_experts": 8}, ["fp32-r3"])
    assert routing_on(CollectConfig(), {"num_experts": 8}, ["fp32"])
    assert not routing_on(CollectConfig(routing="off"), {"num_experts": 8}, ["fp32"])
