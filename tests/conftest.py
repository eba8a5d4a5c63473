"""Shared fixtures: models and engines are loaded once per test session.

- `tiny_model`: a 2-layer random Llama with the embedded model's real tokenizer (built in seconds);
  real vLLM and real HF load it fast, so most engine tests use it.
- `embedded_model`: the real SmolLM2-135M-Instruct, for the tests where the numbers matter.
- `vllm_tiny_fp32`: one in-process vLLM CPU engine on the tiny model, shared by every test that needs it.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: 3 s start, no spawn
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def embedded_model() -> str:
    from mismatch_lab.models import resolve_model

    return resolve_model("default")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, embedded_model) -> str:
    from mismatch_lab.models import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("models") / "tiny", base=embedded_model))


@pytest.fixture(scope="session")
def vllm_tiny_fp32(tiny_model):
    from mismatch_lab.engines.base import make_engine

    engine = make_engine("vllm", tiny_model, "fp32", seed=0, max_model_len=512, kv_cache_bytes=256 << 20)
    yield engine
    engine.close()
