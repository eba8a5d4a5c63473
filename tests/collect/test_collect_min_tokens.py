"""`min_tokens` (collect --min-tokens): the engines forbid the end of sequence before N tokens, on the embedded
model with a prompt it answers in a few tokens, so the test fails if the option does nothing."""

from __future__ import annotations

import math

import pytest
from transformers import AutoTokenizer

from mismatch_lab.engines.base import GenRequest, make_engine
from mismatch_lab.runtime import encode_prompts

MIN, MAX, N = 12, 16, 8
PROMPT = "Answer with one word only, yes or no: is water wet?"


@pytest.fixture(scope="module")
def requests(embedded_model):
    tok = AutoTokenizer.from_pretrained(embedded_model)
    (ids,), _ = encode_prompts(tok, [{"id": "p", "prompt": PROMPT}])  # as collect encodes them
    return [GenRequest(prompt_ids=list(ids), seed=s) for s in range(N)], tok.eos_token_id


@pytest.mark.parametrize("engine_name", ["hf", "vllm"])
def test_min_tokens_keeps_every_response_going_and_mu_stays_the_raw_distribution(engine_name, embedded_model,
                                                                                   requests):
    reqs, eos = requests
    kwargs = {"kv_cache_bytes": 128 << 20} if engine_name == "vllm" else {}
    engine = make_engine(engine_name, embedded_model, "fp32", seed=0, max_model_len=256, **kwargs)
    try:
        free = engine.generate(reqs, max_tokens=MAX, top_k=0)
        held = engine.generate(reqs, max_tokens=MAX, top_k=0, min_tokens=MIN)
    finally:
        engine.close()
    # without the option the model ends most answers early (else this test could not fail)
    assert sum(len(s.token_ids) < MIN for s in free) >= N // 2, [len(s.token_ids) for s in free]
    assert all(len(s.token_ids) >= MIN for s in held), [len(s.token_ids) for s in held]
    assert not any(eos in s.token_ids[:MIN] for s in held)
    # μ is the raw distribution, before the EOS mask: where the free answer (same seed, same prefix) ended
    # with EOS at position j < MIN, the token the held answer sampled there has μ <= 1 − p(EOS) (a μ taken
    # after the mask would be renormalised over the other tokens and could exceed it)
    checked = 0
    for f, h in zip(free, held):
        j = len(f.token_ids) - 1
        assert all(math.isfinite(x) and x <= 0.0 for x in h.logps) and len(h.logps) == len(h.token_ids)
        if f.token_ids[-1] == eos and j < MIN and h.token_ids[:j] == f.token_ids[:j]:
            assert h.logps[j] <= math.log1p(-math.exp(f.logps[j])) + 1e-6
            checked += 1
    assert checked >= 1
