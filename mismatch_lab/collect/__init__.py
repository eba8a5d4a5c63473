"""`mismatch-lab collect`: one checkpoint through the rollout engine and the trainer scorer, into DuckDB.

    mismatch-lab collect --study studies/default/study.toml
    mismatch-lab collect --model default --prompts data/default_prompts.jsonl --samples 4 \
        --max-tokens 64 --rollout-dtypes bf16,fp32 --scorer-dtypes bf16,fp16,fp32,vllm:bf16 --db out.duckdb

The parts: `config` (flags and study file), `prompts` (prompt file, token ids, seeds, chunks by token
budget), `memory` (the memory plan from the HF config), `job` (prepare -> plan -> chunks), `tables` (Arrow
rows of a chunk), `summary` (rewards and the one-screen summary). This module is the CLI entry point and
stays cheap to import (the heavy imports happen where they run).
"""

from __future__ import annotations

from mismatch_lab.categories import TokenTexts
from mismatch_lab.collect.config import CollectConfig, add_arguments, load_config
from mismatch_lab.collect.prompts import (
    encode_prompts,
    make_chunks,
    read_prompts,
    sample_seed,
)

__all__ = ["CollectConfig", "TokenTexts", "add_arguments", "build_tables", "collect", "encode_prompts", "fill_rewards",
           "load_config", "make_chunks", "print_summary", "read_prompts", "run", "sample_seed"]


def __getattr__(name: str):
    """The heavier parts on first use: `from mismatch_lab.collect import collect, build_tables, ...` still works."""
    homes = {"collect": "job", "_load_tokenizer": "job", "build_tables": "tables",
             "prefill_scores": "tables", "fill_rewards": "summary", "print_summary": "summary"}
    if name == "_device_name":  # moved to mismatch_lab.runtime; kept for old imports
        from mismatch_lab.runtime import device_name

        return device_name
    if name not in homes:
        raise AttributeError(f"module 'mismatch_lab.collect' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"mismatch_lab.collect.{homes[name]}"), name)


def run(args) -> int:
    import os

    if not getattr(args, "verbose", False):  # torch's C++ log level is read once, when torch loads
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    from mismatch_lab.collect.job import collect

    cfg = load_config(args)
    collect(cfg, progress=not getattr(args, "no_progress", False), verbose=bool(getattr(args, "verbose", False)))
    return 0
