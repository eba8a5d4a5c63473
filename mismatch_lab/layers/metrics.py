"""The numbers of `mismatch-lab layers`, in numpy float64 (no torch): relative Frobenius error per layer,
token-level TV and KL of the logits' softmax, and the layer where the error grows fastest.

Notation: T tokens, D the width of a layer's output (hidden size, or the vocabulary at the logits);
`h` the low-precision model's output, `ref` the fp32 model's, on the same T tokens.
"""

from __future__ import annotations

import math
from itertools import pairwise

import numpy as np


def squared_norms(h: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """(||h − ref||_F², ||ref||_F²) of two [T, D] arrays, in float64: the two sums a layer's rel_err
    accumulates over sequences (`rel_err_from_sums`)."""
    h64, ref64 = np.asarray(h, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    if h64.shape != ref64.shape:
        raise ValueError(f"shapes differ: {h64.shape} vs {ref64.shape}")
    return float(np.sum((h64 - ref64) ** 2)), float(np.sum(ref64 ** 2))


def rel_err_from_sums(diff_sq: float, ref_sq: float) -> float:
    """sqrt(diff_sq / ref_sq) = ||h − ref||_F / ||ref||_F over every token summed; 0 when both are 0,
    nan when only the reference is 0 (no scale to compare against)."""
    if diff_sq == 0.0:
        return 0.0
    return math.sqrt(diff_sq / ref_sq) if ref_sq > 0.0 else math.nan


def rel_err(h: np.ndarray, ref: np.ndarray) -> float:
    """||h − ref||_F / ||ref||_F of two [T, D] arrays (float64)."""
    return rel_err_from_sums(*squared_norms(h, ref))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax of [T, V] logits in float64 (max subtracted first)."""
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def token_tv_kl(logits: np.ndarray, ref_logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per token ([T] each): TV = ½ Σ_v |p_v − q_v| and KL(q ‖ p) = Σ_v q_v (log q_v − log p_v), where
    q = softmax(ref_logits) (fp32 model) and p = softmax(logits) (low-precision model); inputs [T, V]."""
    log_p, log_q = log_softmax(logits), log_softmax(ref_logits)
    p, q = np.exp(log_p), np.exp(log_q)
    tv = 0.5 * np.abs(p - q).sum(axis=-1)
    kl = (q * (log_q - log_p)).sum(axis=-1)
    return tv, np.maximum(kl, 0.0)  # a KL below 0 is float64 rounding of a zero


def growth_ratios(errors: list[float]) -> list[float | None]:
    """errors[i] / errors[i−1] for each layer in input-to-output order ([L] in, [L] out): None for the first
    layer and where the previous error is 0 or not finite (no ratio to take)."""
    out: list[float | None] = [None]
    for prev, cur in pairwise(errors):
        ok = prev is not None and math.isfinite(prev) and prev > 0.0 and cur is not None and math.isfinite(cur)
        out.append(cur / prev if ok else None)
    return out


def fastest_growth(errors: list[float]) -> int | None:
    """The index of the layer with the largest `growth_ratios` value (the first on a tie); None when no
    ratio exists (e.g. every error is 0: the same computation on both sides)."""
    ratios = growth_ratios(errors)
    found = [(r, -i) for i, r in enumerate(ratios) if r is not None]
    return -max(found)[1] if found else None
