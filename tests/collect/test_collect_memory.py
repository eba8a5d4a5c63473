"""The memory plan's arithmetic against sizes computed by hand, on real 1.5B and 8B shapes (config dicts, no
download), and a plan that cannot fit refused with one line naming the fix, before anything is written."""

from __future__ import annotations

import pytest

from mismatch_lab.collect.memory import GiB, Shapes, Workload, plan_memory
from mismatch_lab.collect.real_shapes import REAL_SHAPES
from mismatch_lab.errors import UserError

LLAMA_8B, QWEN_1_5B = REAL_SHAPES["llama-3.1-8b"], REAL_SHAPES["qwen2.5-1.5b"]


def test_parameter_counts_of_real_shapes_match_the_hand_computed_and_published_ones():
    # 8B per layer: q 4096*4096 + k,v 2*4096*1024 + o 4096*4096 = 41,943,040; MLP 3*4096*14336 = 176,160,768;
    # norms 2*4096 -> 218,112,000; x32 = 6,979,584,000; embedding and lm_head 128256*4096 = 525,336,576 each;
    # final norm 4096 -> 8,030,261,248 (Llama-3.1-8B's published count)
    s8 = Shapes.from_config(LLAMA_8B)
    assert s8.layer_params() == 218_112_000
    assert s8.params() == 8_030_261_248
    # 1.5B per layer: q 1536*1536 + 1536 bias, k/v 2*(1536*256 + 256), o 1536*1536, MLP 3*1536*8960 = 41,287,680,
    # norms 3072 -> 46,797,824; x28 = 1,310,339,072; tied embedding 151936*1536 = 233,373,696 once;
    # final norm 1536 -> 1,543,714,304 (Qwen2.5-1.5B's published count)
    s15 = Shapes.from_config(QWEN_1_5B)
    assert s15.layer_params() == 46_797_824
    assert s15.params() == 1_543_714_304
    # KV cache per token: 2 (K and V) x layers x kv heads x head dim x bytes
    assert s8.kv_bytes_per_token("bf16") == 2 * 32 * 8 * 128 * 2 == 131_072
    assert s15.kv_bytes_per_token("fp32") == 2 * 28 * 2 * 128 * 4 == 57_344


@pytest.mark.parametrize("config", list(REAL_SHAPES.values()), ids=list(REAL_SHAPES))
def test_the_plans_count_equals_the_real_architecture_built_on_the_meta_device(config):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    conf = AutoConfig.for_model(**config)
    with torch.device("meta"):  # shapes only: no memory, no download
        model = AutoModelForCausalLM.from_config(conf)
    assert Shapes.from_config(config).params() == sum(p.numel() for p in model.parameters())


def _workload(**kw):
    base = {"engine": "vllm", "rollout_dtypes": ["bf16"], "scorer_dtypes": ["bf16", "fp16", "fp32"], "prefill_dtypes": [],
            "max_model_len": 2048, "seq_len": 2048, "batch_tokens": 8192, "chunk_rows": 1024, "chunk_tokens": 65536,
            "gen_batch": 512}
    return Workload(**(base | kw))


def test_8b_at_three_scorer_dtypes_fits_one_80_gib_gpu_with_decoders_in_turn():
    total = 80 * GiB
    plan = plan_memory(Shapes.from_config(LLAMA_8B), _workload(), "cuda:0", total, gpus=1)
    assert plan.fits and plan.placement == "in_turn"  # resident: 64.2 GB of scorers + a 16 GB engine do not fit
    got = {i.label: i for i in plan.items}
    assert got["HF scorer decoder in its turn"].bytes == 8_030_261_248 * 4  # fp32, the largest
    assert got["HF scorer lm_head fp32"].bytes == 525_336_576 * 4
    assert got["HF scorer fp32"].where == "host"
    # activations of one micro-batch at fp32: 8192 tokens x (2*4096 + 2*(32+8)*128 + 3*14336 + 32 heads * 2048 wide)
    # x 4 B = 4,160,749,568; vocabulary chunk 1024 x 128256 x (4 + 20) = 3,152,019,456; kept hidden states
    # 8192 x 4096 x (2+2+4) = 268,435,456
    assert got["scorer activations per micro-batch"].bytes == 4_160_749_568 + 3_152_019_456 + 268_435_456
    # left for vLLM: 0.95 x 80 GiB - 32,121,044,992 - 4 x 525,336,576 x 2 (heads: 2+2+4 B) - 7,581,204,480 - 1 GiB
    # = 36,625,694,720 = 42.6 % of the GPU -> 0.42
    assert plan.gpu_memory_utilization == 0.42
    assert got["vLLM engine bf16"].bytes == int(0.42 * total)
    assert plan.device_bytes <= plan.capacity


def test_a_1_5b_model_keeps_every_scorer_dtype_resident_on_a_24_gib_gpu():
    plan = plan_memory(Shapes.from_config(QWEN_1_5B), _workload(batch_tokens=4096), "cuda:0", 24 * GiB)
    assert plan.fits and plan.placement == "resident"
    assert {i.label: i.bytes for i in plan.items}["HF scorer fp32"] == 1_543_714_304 * 4


def test_a_plan_that_cannot_fit_names_the_flags_that_fix_it():
    plan = plan_memory(Shapes.from_config(LLAMA_8B), _workload(rollout_dtypes=["fp32"]), "cuda:0", 40 * GiB)
    assert not plan.fits
    with pytest.raises(UserError) as err:
        plan.check()
    msg = str(err.value)
    assert "\n" not in msg
    for flag in ("--scorer-dtypes", "--tensor-parallel-size", "--score-batch-tokens"):
        assert flag in msg
    # a given --gpu-memory-utilization too small for the engine's weights is named as well
    small = plan_memory(Shapes.from_config(QWEN_1_5B), _workload(gpu_memory_utilization=0.05), "cuda:0", 24 * GiB)
    assert not small.fits and "--gpu-memory-utilization" in small.fix
    # the HF engine keeps each sequence's logits: 256 sequences of 8B at 2048 tokens do not fit, 8 do
    hf = _workload(engine="hf", gen_batch=256, rollout_dtypes=["bf16", "fp16", "fp32"])
    refused = plan_memory(Shapes.from_config(LLAMA_8B), hf, "cuda:0", 80 * GiB)
    assert not refused.fits and refused.fix.startswith("a smaller --gen-batch (the HF engine keeps the logits of all 256")
    fewer = _workload(engine="hf", gen_batch=8, seq_len=512, rollout_dtypes=["bf16", "fp16", "fp32"])
    assert plan_memory(Shapes.from_config(LLAMA_8B), fewer, "cuda:0", 80 * GiB).fits


def test_the_cpu_plan_counts_vllms_explicit_kv_cache_and_refuses_a_small_machine():
    shapes = Shapes.from_config(QWEN_1_5B)
    plan = plan_memory(shapes, _workload(scorer_dtypes=["fp32"]), "cpu", 64 * GiB)
    got = {i.label: i.bytes for i in plan.items}
    assert plan.fits and plan.gpu_memory_utilization is None
    engine_act = shapes.forward_activation_bytes(8192, 2048, "bf16")
    assert got["vLLM engine bf16"] == 1_543_714_304 * 2 + GiB + engine_act
    assert not plan_memory(shapes, _workload(), "cpu", 8 * GiB).fits


def test_collect_refuses_an_unfitting_plan_in_one_line_before_writing(tmp_path, tiny_model, capsys, monkeypatch):
    from mismatch_lab.cli import main
    from mismatch_lab.collect import job

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "What is 2 + 2?"}\n')
    monkeypatch.setattr(job, "device_capacity", lambda device: (256 << 20, 0))  # a 256 MiB machine
    db = tmp_path / "x.duckdb"
    assert main(["collect", "--model", tiny_model, "--prompts", str(prompts), "--db", str(db), "--rollout-dtypes", "fp32",
                 "--device", "cpu", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "memory plan" in err[0] and "--scorer-dtypes" in err[0], err
    assert not db.exists()


MOE_SHAPES = {  # published configs (config.json of each checkpoint), shapes only
    "qwen3-30b-a3b": {"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 48,
                      "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
                      "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
                      "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False},
    "mixtral-8x7b": {"model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
                     "num_local_experts": 8, "num_experts_per_tok": 2, "tie_word_embeddings": False},
    "qwen1.5-moe-a2.7b": {"model_type": "qwen2_moe", "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 24,
                          "num_attention_heads": 16, "num_key_value_heads": 16, "intermediate_size": 5632,
                          "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, "num_experts": 60,
                          "num_experts_per_tok": 4, "decoder_sparse_step": 1, "mlp_only_layers": [],
                          "tie_word_embeddings": False},
    "sparse-step-2": {"model_type": "qwen3_moe", "vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 4,
                      "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96,
                      "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
                      "decoder_sparse_step": 2, "mlp_only_layers": [3], "tie_word_embeddings": True},
}


@pytest.mark.parametrize("config", list(MOE_SHAPES.values()), ids=list(MOE_SHAPES))
def test_the_plans_count_of_an_moe_decoder_equals_the_real_architecture_built_on_the_meta_device(config):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    conf = AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(conf)
    assert Shapes.from_config(config).params() == sum(p.numel() for p in model.parameters())
