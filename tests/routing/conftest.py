"""The tiny MoE model (`model tiny-moe`, seed 0), built once per session, and the token ids routed by tests."""

from __future__ import annotations

import pytest

TEXTS = ("The history of the printing press begins in the fifteenth century, when",
         "def fibonacci(n):\n    if n < 2:\n        return n\n    return")


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory, embedded_model) -> str:
    from mismatch_lab.models import make_tiny_moe_model

    return str(make_tiny_moe_model(tmp_path_factory.mktemp("moe") / "tiny-moe", base=embedded_model, seed=0))


@pytest.fixture(scope="session")
def token_seqs(tiny_moe) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_moe)
    return [tok(t).input_ids for t in TEXTS]


@pytest.fixture(scope="session")
def hf_fp32(tiny_moe):
    from mismatch_lab.routing.hf import load_hf

    return load_hf(tiny_moe, "fp32")
