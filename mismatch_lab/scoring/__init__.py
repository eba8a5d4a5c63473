"""Trainer-side teacher-forced scoring (HF) and the optional vLLM prefill scorer."""

from mismatch_lab.scoring.hf_scorer import (
    REF_DTYPE,
    SCORE_BATCH_TOKENS,
    SCORE_CHUNK_ROWS,
    HFScorer,
    Ragged,
    ScoredTokens,
    ScoreItem,
)
from mismatch_lab.scoring.positions import predicting_positions, response_rows

__all__ = ["REF_DTYPE", "SCORE_BATCH_TOKENS", "SCORE_CHUNK_ROWS", "HFScorer", "Ragged", "ScoreItem", "ScoredTokens",
           "parse_scorers", "predicting_positions", "response_rows"]


def parse_scorers(specs) -> tuple[list[str], list[str]]:
    """Split scorer specs into HF dtypes and vLLM prefill dtypes.

    'bf16' or 'hf:bf16' -> HF scorer at bf16; 'vllm:bf16' -> vLLM prefill scorer at bf16.
    """
    hf, vl = [], []
    for spec in specs:
        eng, _, dt = spec.rpartition(":")
        eng = eng or "hf"
        if dt not in ("bf16", "fp16", "fp32") or eng not in ("hf", "vllm"):
            raise ValueError(f"unknown scorer {spec!r}; use bf16|fp16|fp32, hf:<dtype> or vllm:<dtype>")
        (hf if eng == "hf" else vl).append(dt)
    return list(dict.fromkeys(hf)), list(dict.fromkeys(vl))
