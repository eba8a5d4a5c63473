"""Fixtures for the analysis tests: small synthetic stores with planted answers, and a naive reference.

`naive_rows(store)` recomputes every per-token quantity from the frames the generator wrote, with
numpy and plain Python loops and no SQL, so each test compares the SQL analyses against it.
"""

from __future__ import annotations

import pytest

from mismatch_lab.store.reader import open_store
from mismatch_lab.store.synthetic import SyntheticSpec, synthetic_store

FULL_SPEC = SyntheticSpec(
    rollouts=("vllm:bf16", "vllm:fp16"),
    scorers=("hf:fp32", "hf:bf16"),
    n_sequences=18,
    n_one_token=3,
    n_planted=8,
    n_nonfinite=3,
    n_rollout_nonfinite=2,
    rewards="advantage",
    topk=5,
    exact_tv=True,
    train_steps=6,
    seed=1,
)


@pytest.fixture(scope="session")
def full_store(tmp_path_factory):
    """Every optional part present: rewards, top-K, exact TV, train_metrics, planted ratios, NULLs."""
    return synthetic_store(tmp_path_factory.mktemp("full") / "full.duckdb", FULL_SPEC)


@pytest.fixture(scope="session")
def plain_store(tmp_path_factory):
    """Only the required columns filled: no rewards, no top-K, no exact TV, no training run."""
    spec = SyntheticSpec(rollouts=("vllm:bf16",), scorers=("hf:fp32",), n_sequences=10, n_planted=4, seed=2)
    return synthetic_store(tmp_path_factory.mktemp("plain") / "plain.duckdb", spec)


@pytest.fixture()
def con(full_store):
    c = open_store(full_store.path)
    yield c
    c.close()


@pytest.fixture()
def plain_con(plain_store):
    c = open_store(plain_store.path)
    yield c
    c.close()


# -- the naive reference ---------------------------------------------------------------------------
