"""The position shift of teacher forcing, in one place: position p of the input predicts token p + 1.

A sequence is `prompt_ids + response_ids`; response token j sits at position len(prompt) + j and is
predicted by the hidden state at position len(prompt) + j - 1. Every scorer (and the training loop)
takes the rows that predict response tokens from here.
"""

from __future__ import annotations

import numpy as np


def predicting_positions(prompt_len: int, response_len: int) -> np.ndarray:
    """[response_len] int64: the input positions whose outputs predict response tokens 0..response_len-1."""
    if prompt_len < 1:
        raise ValueError("teacher forcing needs at least one prompt token (position -1 predicts nothing)")
    return np.arange(prompt_len - 1, prompt_len - 1 + response_len, dtype=np.int64)


def response_rows(prompt_lens, response_lens) -> tuple[np.ndarray, np.ndarray]:
    """(batch index [N], position [N]) of the N = sum(response_lens) rows predicting the response tokens of a
    right-padded batch, sequence after sequence."""
    prompt_lens = np.asarray(prompt_lens, dtype=np.int64)
    response_lens = np.asarray(response_lens, dtype=np.int64)
    if (prompt_lens < 1).any():
        raise ValueError("teacher forcing needs at least one prompt token (position -1 predicts nothing)")
    b = np.repeat(np.arange(len(response_lens)), response_lens)
    starts = np.concatenate([[0], np.cumsum(response_lens)[:-1]]) if len(response_lens) else np.zeros(0, np.int64)
    j = np.arange(int(response_lens.sum())) - np.repeat(starts, response_lens)
    return b, prompt_lens[b] - 1 + j
