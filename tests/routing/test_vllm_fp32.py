"""vLLM CPU fp32 on the tiny MoE against HF fp32: it loads and generates, routes as HF does except at near-ties,
and HF replaying vLLM's routing agrees with it on every token."""

from __future__ import annotations

import numpy as np
import pytest

FP32_EPS = 2.0 ** -23


@pytest.fixture(scope="module")
def vllm_fp32(tiny_moe):
    from mismatch_lab.engines.base import make_engine

    engine = make_engine("vllm", tiny_moe, "fp32", seed=0, max_model_len=512, kv_cache_bytes=256 << 20)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def routed(vllm_fp32, hf_fp32, token_seqs):
    from mismatch_lab.routing.hf import hf_routing
    from mismatch_lab.routing.vllm_side import vllm_routing

    return [(vllm_routing(vllm_fp32, ids), hf_routing(hf_fp32, ids)) for ids in token_seqs]


def test_vllm_loads_the_tiny_moe_and_generates(vllm_fp32, token_seqs):
    from mismatch_lab.engines.base import GenRequest

    sample = vllm_fp32.generate([GenRequest(token_seqs[0], seed=0)], max_tokens=6, top_k=0)[0]
    assert len(sample.token_ids) == 6 and np.isfinite(sample.logps).all()


def test_vllm_fp32_routes_every_token_as_hf_fp32_except_at_near_ties(routed):
    from mismatch_lab.routing.compare import compare, concat

    mu, pi = concat([v for (v, _), _ in routed]), concat([h for _, (h, _) in routed])
    result = compare(pi, mu)
    # the two fp32 forwards differ by accumulated fp32 rounding only (their log-probs agree to ~1e-4): a flip
    # is allowed only where HF's router margin is within 1e4 fp32 epsilons of the logits' scale (1e-3 logit)
    near_tie = 1e4 * FP32_EPS * np.abs(pi.margin).max()
    assert result["max_margin_of_a_flip"] is None or result["max_margin_of_a_flip"] < near_tie, result
    np.testing.assert_allclose(mu.weights, pi.weights, rtol=1e-4, atol=1e-6)


def test_vllm_prefill_log_probs_match_hf_fp32_on_the_same_tokens(routed):
    lv = np.concatenate([lp for (_, lp), _ in routed])
    lh = np.concatenate([lp for _, (_, lp) in routed])
    np.testing.assert_allclose(np.exp(lv), np.exp(lh), rtol=1e-3, atol=1e-6)


def test_hf_replaying_vllms_routing_routes_every_token_as_vllm_did(routed, hf_fp32, token_seqs):
    from mismatch_lab.routing.hf import hf_routing

    for ((v, _), _), ids in zip(routed, token_seqs):
        replayed, _ = hf_routing(hf_fp32, ids, replay=v, use_weights=True)
        assert (replayed.ids == v.ids).all()
        np.testing.assert_allclose(replayed.weights, v.weights, rtol=FP32_EPS)


def test_a_batched_prefill_maps_each_sequences_routing_back_as_its_own_prefill(vllm_fp32, token_seqs, routed):
    """vllm_routings packs the sequences into one forward and splits its rows by the embedded token ids: the
    batched routing equals each sequence's own prefill (ids; weights and margins to fp32 rounding)."""
    from mismatch_lab.routing import vllm_side
    from mismatch_lab.routing.vllm_side import vllm_routings

    seqs = [*token_seqs, token_seqs[0][:7]]
    blocks = vllm_side.vllm_moe_blocks(vllm_fp32)
    assert vllm_side._group_routing(vllm_fp32, blocks, seqs) is not None  # one forward, rows mapped
    alone = [v[0] for v, _ in routed] + [vllm_side.vllm_routing(vllm_fp32, seqs[-1])[0]]
    for got, want in zip(vllm_routings(vllm_fp32, seqs), alone):
        np.testing.assert_array_equal(got.ids, want.ids)
        np.testing.assert_allclose(got.weights, want.weights, rtol=1e4 * np.finfo(np.float32).eps)
