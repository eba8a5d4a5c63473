"""`mismatch-lab layers --engine vllm`: forward hooks inside the in-process vLLM engine on the tiny model,
against the HF fp32 reference on the same tokens."""

from __future__ import annotations

import pytest

from mismatch_lab.layers import measure

PROMPTS = [{"id": "a", "prompt": "What is 7 + 7?"}, {"id": "b", "prompt": "Write a haiku about autumn leaves."}]
FP32_UNIT_ROUNDOFF = 2.0 ** -24


@pytest.fixture(scope="module")
def vllm_rows(tiny_model):
    """dtype -> the rows of vLLM at that dtype against HF fp32 (the prompts of test_layers_hf, 3 greedy tokens)."""
    out = {}
    for dtype in ("fp32", "bf16"):
        layers, acc = measure.measure(tiny_model, dtype, PROMPTS, continuation=3, engine="vllm", device="cpu")
        out[dtype] = {r["layer"]: r for r in measure.rows(layers, acc)}
    return out


def test_vllm_fp32_has_the_same_embeddings_as_hf_fp32_and_differs_after_only_by_fp32_accumulation_order(vllm_rows):
    rows = vllm_rows["fp32"]
    assert list(rows) == ["embed", "attn.0", "mlp.0", "attn.1", "mlp.1", "norm", "logits"]
    assert rows["embed"]["rel_err"] == 0.0  # a lookup of the same fp32 weights
    # vLLM's own fp32 kernels sum in another order than HF's: each reduction of n <= 256 terms (the tiny
    # model's widest) is off by at most n * u_fp32 relative, and the 7 layers compound at most that many.
    bound = 256 * FP32_UNIT_ROUNDOFF * len(rows)
    assert all(0.0 <= r["rel_err"] <= bound for r in rows.values())
    assert rows["logits"]["tv_mean"] <= bound


def test_vllm_bf16_rounds_the_embeddings_exactly_as_hf_bf16_and_grows_toward_the_logits(vllm_rows, tiny_model):
    hf_layers, hf_acc = measure.measure(tiny_model, "bf16", PROMPTS, continuation=3, engine="hf", device="cpu")
    hf = {r["layer"]: r for r in measure.rows(hf_layers, hf_acc)}
    rows = vllm_rows["bf16"]
    # Both engines round the same fp32 embedding table to bf16 (nearest, ties to even) and look it up exactly.
    assert rows["embed"]["rel_err"] == hf["embed"]["rel_err"] > 0
    # Rounding compounds through the blocks and the bf16 lm_head (test_layers_hf states why).
    assert rows["logits"]["rel_err"] > rows["attn.0"]["rel_err"] > 0
    assert rows["logits"]["tv_mean"] > vllm_rows["fp32"]["logits"]["tv_mean"]
