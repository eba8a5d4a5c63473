"""Published architectures users train, as config fields, and random-weight models of them built on the spot.

No model hub is needed: `REAL_SHAPES` holds the fields of each model's config.json that fix its tensor shapes
(the memory plan reads the same fields, `memory.Shapes.from_config`). `build_random_model` writes an HF
checkpoint of such a shape with random weights and the embedded model's tokenizer, for measuring memory and
throughput at real sizes (benchmarks/bench_collect_gpu.py). Its numbers are meaningless as text: the
tokenizer knows the first 49,152 ids only (texts of larger ids are stored NULL), and random weights sample
a near-uniform distribution over the vocabulary.
"""

from __future__ import annotations

from pathlib import Path

from mismatch_lab.engines.base import TORCH_DTYPES as DTYPES
from mismatch_lab.errors import UserError

REAL_SHAPES: dict[str, dict] = {
    "llama-3.1-8b": {  # Llama-3.1-8B config.json (the fields the plan reads)
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 14336,
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "max_position_embeddings": 131072,
    },
    "qwen2.5-1.5b": {  # Qwen2.5-1.5B config.json: tied embeddings, bias on q/k/v
        "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 1536, "num_hidden_layers": 28,
        "num_attention_heads": 12, "num_key_value_heads": 2, "intermediate_size": 8960, "tie_word_embeddings": True,
        "max_position_embeddings": 131072,
    },
    "tiny-wide": {  # 2 layers with a vocabulary past the tokenizer's: the benchmark's own check on a CPU
        "model_type": "llama", "vocab_size": 60000, "hidden_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64, "intermediate_size": 256,
        "tie_word_embeddings": False, "max_position_embeddings": 4096,
    },
}  # fmt: skip
"""Shape name -> config fields. Parameter counts: tests/collect/test_collect_memory.py checks them against the
published ones and against the architecture transformers builds."""

def write_config(out: str | Path, shape: str, dtype: str = "bf16") -> Path:
    """`out` with REAL_SHAPES[shape]'s config.json and the embedded model's tokenizer, no weights: enough for
    collect's memory plan (`collect.job.prepare` + `memory_plan`), before any weight is built."""
    from transformers import AutoConfig, AutoTokenizer

    from mismatch_lab.models import resolve_model

    if shape not in REAL_SHAPES:
        raise UserError(f"unknown shape {shape!r}: one of {', '.join(REAL_SHAPES)}")
    if dtype not in DTYPES:
        raise UserError(f"dtype {dtype!r}: one of {', '.join(DTYPES)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    AutoConfig.for_model(**REAL_SHAPES[shape], dtype=DTYPES[dtype]).save_pretrained(out)
    AutoTokenizer.from_pretrained(resolve_model("default")).save_pretrained(out)
    return out


def build_random_model(out: str | Path, shape: str, *, device: str = "cpu", dtype: str = "bf16", seed: int = 0) -> Path:
    """Write a random-weight checkpoint of REAL_SHAPES[shape] at `dtype` to `out` with the embedded model's
    tokenizer; initialised on `device` (a GPU builds an 8B model in seconds), stored as safetensors. Re-used
    when `out` already holds a complete one of the same shape and dtype."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(out)
    stamp = f"{shape} {dtype} seed {seed}\n"
    if (out / ".complete").is_file() and (out / ".complete").read_text() == stamp:
        return out
    write_config(out, shape, dtype)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out), dtype=getattr(torch, DTYPES[dtype]))
    model.save_pretrained(out, safe_serialization=True)
    del model
    (out / ".complete").write_text(stamp)
    return out
