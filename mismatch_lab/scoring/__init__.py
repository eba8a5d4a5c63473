"""Trainer-side teacher-forced scoring (HF) and the optional vLLM prefill scorer."""

from mismatch_lab.scoring.hf_scorer import (
    REF_DTYPE,
    SCORE_BATCH_TOKENS,
    SCORE_CHUNK_ROWS,
    HFScorer,
    Ragged,
    ScoredTokens,
    ScoreItem,
    is_replay,
    split_dtype,
)
from mismatch_lab.scoring.positions import predicting_positions, response_rows

__all__ = ["REF_DTYPE", "SCORE_BATCH_TOKENS", "SCORE_CHUNK_ROWS", "HFScorer", "Ragged", "ScoreItem", "ScoredTokens",
           "is_replay", "parse_scorers", "predicting_positions", "response_rows", "split_dtype"]


def parse_scorers(specs) -> tuple[list[str], list[str]]:
    """Split scorer specs into HF dtypes and vLLM prefill dtypes.

    'bf16' or 'hf:bf16' -> HF scorer at bf16; 'vllm:bf16' -> vLLM prefill scorer at bf16;
    'fp32-wbf16' or 'hf:fp32-wbf16' -> HF scorer computing in fp32 on weights rounded to bf16 (HF only);
    'fp32-r3' or 'hf:fp32-r3' -> HF scorer at fp32 replaying the rollout's MoE expert ids (R3; HF only).
    """
    hf, vl = [], []
    for spec in specs:
        eng, _, dt = spec.rpartition(":")
        eng = eng or "hf"
        try:
            rounding = split_dtype(dt)[1] if eng == "hf" else ("none" if dt in ("bf16", "fp16", "fp32") else None)
        except ValueError:
            rounding = None
        if rounding is None or eng not in ("hf", "vllm"):
            raise ValueError(f"unknown scorer {spec!r}; use bf16|fp16|fp32, hf:<dtype>, hf:<dtype>-w<rounding> "
                             "(rounding bf16|fp16|fp8, e.g. hf:fp32-wbf16), hf:<dtype>-r3 (R3 routing replay, MoE) "
                             "or vllm:<dtype>")
        (hf if eng == "hf" else vl).append(dt)
    return list(dict.fromkeys(hf)), list(dict.fromkeys(vl))
