"""`mismatch-lab layers` on real transformers models: the hooks find the layers, fp32 against fp32 is
bitwise the same computation, bf16 departs from fp32 and the departure grows toward the logits."""

from __future__ import annotations

import math

import pytest

from mismatch_lab.errors import UserError
from mismatch_lab.layers import hooks, measure

PROMPTS = [{"id": "a", "prompt": "What is 7 + 7?"}, {"id": "b", "prompt": "Write a haiku about autumn leaves."}]
BF16_UNIT_ROUNDOFF = 2.0 ** -8  # round to nearest with 8 significand bits: |fl(x) - x| <= 2^-8 |x|


@pytest.fixture(scope="module")
def measured(tiny_model):
    """dtype -> the rows of the tiny model at that dtype against fp32 (two prompts, 3 greedy tokens)."""
    out = {}
    for dtype in ("fp32", "bf16"):
        layers, acc = measure.measure(tiny_model, dtype, PROMPTS, continuation=3, device="cpu")
        out[dtype] = (measure.rows(layers, acc), acc)
    return out


def test_the_layers_of_a_llama_are_embed_then_attn_and_mlp_per_block_then_norm_and_logits(tiny_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    names = [(la.name, la.path) for la in hooks.find_layers(model)]
    assert names == [("embed", "model.embed_tokens"), ("attn.0", "model.layers.0.self_attn"),
                     ("mlp.0", "model.layers.0.mlp"), ("attn.1", "model.layers.1.self_attn"),
                     ("mlp.1", "model.layers.1.mlp"), ("norm", "model.norm"), ("logits", "lm_head")]


def test_a_gpt2_maps_by_the_same_rules_through_its_own_attribute_names():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50, n_positions=16))
    assert [la.path for la in hooks.find_layers(model)] == [
        "transformer.wte", "transformer.h.0.attn", "transformer.h.0.mlp", "transformer.ln_f", "lm_head"]


def test_an_architecture_without_a_block_list_at_its_base_is_a_user_error_naming_the_role():
    from transformers import BertConfig, BertLMHeadModel

    model = BertLMHeadModel(BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                       intermediate_size=64, vocab_size=50, is_decoder=True))
    with pytest.raises(UserError, match="BertLMHeadModel: no blocks module under the base model"):
        hooks.find_layers(model)


def test_fp32_against_fp32_is_bitwise_equal_at_every_layer_and_the_logits_tv_is_zero(measured):
    rows, acc = measured["fp32"]
    assert [r["rel_err"] for r in rows] == [0.0] * len(rows)
    assert set(acc.tv) == {0.0} and set(acc.kl) == {0.0}
    assert acc.sequences == 2 and acc.tokens > 2 * 3


def test_bf16_departs_from_fp32_at_every_layer_and_more_at_the_logits_than_at_the_first_block(measured):
    rows, acc = measured["bf16"]
    by = {r["layer"]: r["rel_err"] for r in rows}
    assert all(e > 0 and math.isfinite(e) for e in by.values())
    # The embeddings are a lookup of weights rounded to bf16: one rounding per element, so at most the unit
    # roundoff in relative Frobenius norm.
    assert by["embed"] <= BF16_UNIT_ROUNDOFF
    # The first block's attention output carries the embedding rounding and one block's bf16 matmuls; the
    # logits carry those compounded through every block's residual stream plus the lm_head's own bf16 sums
    # over the hidden size, so their relative error is larger.
    assert by["logits"] > by["attn.0"]
    assert 0 < min(acc.tv) and max(acc.tv) < 1


def test_a_dtype_outside_bf16_fp16_fp32_is_a_user_error_naming_the_choices():
    with pytest.raises(UserError, match="--dtype int8: use one of bf16, fp16, fp32"):
        measure.check_dtype("int8")
