"""The rollout-engine Protocol and the records it returns.

Lifecycle of an engine: construct (loads the checkpoint at one dtype) -> generate / prefill_logprobs
-> optionally load_state_dict (weight sync during training) -> close.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
INTERNAL_FIX = ("no log-softmax gives that: an internal error (of mismatch_lab or the engine), not a mistake in "
                "the input; please report it with the model, engine and dtype")
"""The end of the error when our own engines or scorers return a log-prob above 0 (record.flat.LOGP_TOLERANCE)."""


def check_engine_logprobs(what: str, rows) -> None:
    """RuntimeError "<what> has N values above 0 (...): <INTERNAL_FIX>" when a finite value of `rows` (lists
    of log-probs, None for a missing list) exceeds `record.flat.LOGP_TOLERANCE`. NaN and -inf pass."""
    from itertools import chain

    import numpy as np

    from mismatch_lab.record.flat import check_logprobs

    values = np.fromiter(chain.from_iterable(r for r in rows if r is not None), dtype=np.float64)
    check_logprobs(values, what, fix=INTERNAL_FIX, error=RuntimeError)


def check_samples(samples: list[Sample], label: str) -> list[Sample]:
    """`samples`, once their log-probs (sampled tokens and top-K) passed `check_engine_logprobs`."""
    check_engine_logprobs(f"{label} rollout: the sampled tokens' log mu", (s.logps for s in samples))
    check_engine_logprobs(f"{label} rollout: the top-K log-probs",
                          (row for s in samples for row in (s.topk_logps or ())))
    return samples


@dataclass
class GenRequest:
    """One sampled response to produce: the prompt's token ids and a per-sample seed."""

    prompt_ids: list[int]
    seed: int


@dataclass
class Sample:
    """One generated response with the rollout engine's log-probs (μ) of every sampled token.

    `logps[i]` is log μ(token_ids[i]); it may be -inf or nan (stored as NULL downstream).
    `topk_ids[i]` / `topk_logps[i]` hold the engine's top-K at step i with the sampled token included
    (K or K+1 entries), or are None when top-K was not requested.
    """

    token_ids: list[int]
    logps: list[float]
    text: str
    finish_reason: str
    topk_ids: list[list[int]] | None = None
    topk_logps: list[list[float]] | None = None
    extra: dict = field(default_factory=dict)


class RolloutEngine(Protocol):
    name: str  # 'vllm' | 'hf'
    dtype: str  # 'bf16' | 'fp16' | 'fp32'
    logprobs_mode: str  # how μ is defined, e.g. vLLM 'raw_logprobs' (before any logit processing)
    device: str

    def generate(self, requests: Sequence[GenRequest], *, max_tokens: int, top_k: int,
                 min_tokens: int = 0) -> list[Sample]:
        """Sample one response per request at T=1, top_p=1 and return μ for each sampled token.

        `min_tokens` > 0 forbids the end of sequence before that many tokens (the engine masks EOS while
        sampling); μ stays the raw distribution, before that mask, like the trainer's π.
        """
        ...

    def load_state_dict(self, state_dict: dict) -> None:
        """Replace the weights in place (training weight sync)."""
        ...

    def sampling_config(self) -> dict:
        """The sampling parameters and logprob definition, stored in runs.config."""
        ...

    def close(self) -> None: ...


def make_engine(name: str, model: str, dtype: str, **kwargs) -> RolloutEngine:
    """Build the rollout engine `name` ('vllm' | 'hf') on `model` at `dtype`."""
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of bf16, fp16, fp32")
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; use one of {', '.join(ENGINES)}")
    module, cls, accepted = ENGINES[name]
    import importlib

    engine_cls = getattr(importlib.import_module(module), cls)
    return engine_cls(model, dtype, **{k: v for k, v in kwargs.items() if accepted is None or k in accepted})


# engine name -> (module, class, keyword arguments it accepts; None = all)
ENGINES = {
    "vllm": ("mismatch_lab.engines.vllm_engine", "VLLMEngine", None),
    "hf": ("mismatch_lab.engines.hf_engine", "HFEngine", ("device", "seed", "max_model_len", "verbose", "sampling")),
}
