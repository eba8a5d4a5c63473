"""vLLM CPU bf16 on the tiny MoE against HF fp32: expert choices flip, and R3 replay removes the flips and
shrinks |π − μ|."""

from __future__ import annotations

import numpy as np
import pytest

GEN_TOKENS = 64  # each prompt continued by the bf16 rollout: ~170 tokens x 4 layers in all


@pytest.fixture(scope="module")
def rollouts_bf16(tiny_moe, token_seqs):
    """Each prompt with the bf16 engine's sampled continuation, and the engine's routing of it."""
    from mismatch_lab.engines.base import GenRequest, make_engine
    from mismatch_lab.routing.vllm_side import vllm_routing

    engine = make_engine("vllm", tiny_moe, "bf16", seed=0, max_model_len=512, kv_cache_bytes=256 << 20)
    try:
        seqs = [ids + engine.generate([GenRequest(ids, seed=i)], max_tokens=GEN_TOKENS, top_k=0)[0].token_ids
                for i, ids in enumerate(token_seqs)]
        return [(ids, vllm_routing(engine, ids)) for ids in seqs]
    finally:
        engine.close()


@pytest.fixture(scope="module")
def routed_bf16(rollouts_bf16, hf_fp32):
    from mismatch_lab.routing.hf import hf_routing

    return [(v, hf_routing(hf_fp32, ids)) for ids, v in rollouts_bf16]


def test_vllm_bf16_flips_some_expert_choices_of_hf_fp32_mostly_at_small_margins(routed_bf16):
    from mismatch_lab.routing.compare import compare, concat

    mu, pi = concat([v for (v, _), _ in routed_bf16]), concat([h for _, (h, _) in routed_bf16])
    result = compare(pi, mu)
    assert result["any_layer_differs"] > 0, result
    near = [b for b in result["flips_by_margin"] if b["hi"] <= 0.1]
    clear = [b for b in result["flips_by_margin"] if b["lo"] >= 1.0]
    rate = [sum(b["flips"] for b in bs) / max(1, sum(b["cells"] for b in bs)) for bs in (near, clear)]
    assert rate[0] > rate[1], result["flips_by_margin"]  # near-ties flip more often than clear choices


def test_replay_of_the_bf16_routing_agrees_on_every_token_and_brings_pi_closer_to_mu(rollouts_bf16, routed_bf16,
                                                                                   hf_fp32):
    from mismatch_lab.routing.hf import hf_routing

    dp_own, dp_replay = [], []
    for ((v, lv), (_, lh)), (ids, _) in zip(routed_bf16, rollouts_bf16):
        replayed, lr = hf_routing(hf_fp32, ids, replay=v)
        assert (replayed.ids == v.ids).all()
        dp_own.append(np.abs(np.exp(lh) - np.exp(lv)))
        dp_replay.append(np.abs(np.exp(lr) - np.exp(lv)))
    assert np.mean(np.concatenate(dp_replay)) < np.mean(np.concatenate(dp_own))
