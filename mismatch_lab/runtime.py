"""What every run needs before its first token, shared by `collect` and the training loop: the tokenizer and
context length, chat-templated prompt ids, per-sample seeds, the device's name, the library versions, and
the rule that turns a run's configuration into its id.

Cheap to import: the heavy libraries load inside the functions that use them.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
from pathlib import Path

from mismatch_lab.errors import UserError


def load_model_info(model: str, trust_remote_code: bool):
    """(tokenizer, HF config as a dict): read before any weights, for the prompts and the memory plan."""
    from transformers import AutoConfig, AutoTokenizer

    try:
        conf = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
        tok = AutoTokenizer.from_pretrained(model, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise UserError(f"--model {model}: cannot load config/tokenizer ({str(exc).splitlines()[0]}); "
                        "pass a complete HF checkpoint directory, 'default', or a hub id with network access") from exc
    return tok, conf.to_dict()


def load_tokenizer(model: str, trust_remote_code: bool = False):
    """(tokenizer, the model's context length or None)."""
    tok, conf = load_model_info(model, trust_remote_code)
    return tok, conf.get("max_position_embeddings")


def encode_prompts(tokenizer, prompts: list[dict]) -> tuple[list[list[int]], bool]:
    """Token ids of each prompt with the model's chat template (raw text when it has none)."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    ids = []
    for p in prompts:
        if has_template:
            text = tokenizer.apply_chat_template([{"role": "user", "content": p["prompt"]}], tokenize=False,
                                                 add_generation_prompt=True)
        else:
            text = p["prompt"]
        ids.append(tokenizer(text, add_special_tokens=not has_template)["input_ids"])
    return ids, has_template


def run_identity(cfg, *, leave_out=(), unless_default=()) -> dict:
    """The fields of a config dataclass that name its run: every field but `leave_out`, and the fields of
    `unless_default` only where they differ from the class default (options added after runs were stored:
    at their default the ids of those runs stay what they were)."""
    from dataclasses import asdict

    defaults = type(cfg)()
    return {k: v for k, v in asdict(cfg).items()
            if k not in leave_out and not (k in unless_default and v == getattr(defaults, k))}


def config_key(identity: dict) -> str:
    """The 10 hex digits a run id ends with: SHA-256 of the identity as sorted JSON."""
    import json

    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:10]


def sample_seed(seed: int, prompt_index: int, sample_idx: int) -> int:
    """A per-sample seed independent of batching, so resumed runs regenerate the same samples."""
    h = hashlib.sha256(f"{seed}/{prompt_index}/{sample_idx}".encode()).digest()
    return int.from_bytes(h[:4], "little") & 0x7FFFFFFF


def device_name(device: str) -> str:
    """'cuda (<GPU name>)' or 'cpu (<model name>, <n> cores)', as runs.device records it."""
    if device.startswith("cuda"):
        import torch

        return f"cuda ({torch.cuda.get_device_name(torch.device(device))})"
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cpu ({cpu}, {os.cpu_count()} cores)"


def versions() -> dict[str, str]:
    """Library versions recorded with every run (runs.versions); vLLM whenever it is installed."""
    import duckdb
    import torch
    import transformers

    out = {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
           "duckdb": duckdb.__version__}
    try:
        from mismatch_lab.engines.vllm_engine import _import_vllm

        out["vllm"] = _import_vllm().__version__
    except UserError:
        pass
    return out
