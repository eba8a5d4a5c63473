"""Freeing one in-process vLLM engine leaves the other engines of the process running (engines/vllm_teardown.py).

Before the fix, vLLM's EngineCore.shutdown destroyed the process-wide model-parallel groups, and the engine still
alive failed its next forward with "pipeline model parallel group is not initialized"."""

from __future__ import annotations

import gc

from mismatch_lab.engines.base import GenRequest, make_engine
from mismatch_lab.engines.vllm_teardown import live_engine_cores


def test_an_engine_still_alive_generates_the_same_tokens_after_another_engine_is_freed(vllm_tiny_fp32, tiny_model):
    request = [GenRequest([1, 2, 3, 4], seed=5)]
    before = vllm_tiny_fp32.generate(request, max_tokens=6, top_k=0)[0]
    other = make_engine("vllm", tiny_model, "bf16", seed=0, max_model_len=256, kv_cache_bytes=128 << 20)
    assert len(other.generate(request, max_tokens=2, top_k=0)[0].token_ids) == 2
    other.close()
    del other
    gc.collect()
    after = vllm_tiny_fp32.generate(request, max_tokens=6, top_k=0)[0]
    assert after.token_ids == before.token_ids
    assert after.logps == before.logps
    assert live_engine_cores() >= 1  # the session engine, registered
