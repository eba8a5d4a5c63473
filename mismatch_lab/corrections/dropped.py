"""The tokens one method drops on one (rollout, scorer) pair, by (run_id, seq_id, pos): the app's click-through
from the comparison to the token inspector.

The method's rule runs exactly as in compare.py (the same chunks of whole sequences, the same [B, T] layout,
the same parameters with `overrides`), so the rows returned are the `frac_tokens_masked · n_tokens` tokens
of that row of the comparison.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pandas as pd

COLUMNS = ["run_id", "seq_id", "pos", "log_ratio", "seq_dropped"]


def dropped_tokens(con, method: str, rollout: str, scorer: str, *,
                   overrides: Mapping[str, Mapping[str, float]] | None = None,
                   chunk_tokens: int = 1 << 20) -> pd.DataFrame:
    """One row per finite token of the pair that `method` (a label of compare.variants: 'grpo',
    'grpo_clip_higher', 'seq_mis', ...) drops (M = 0), in (run_id, seq_id, pos) order.

    Columns: run_id, seq_id, pos, log_ratio (log π − log μ), seq_dropped (every finite token of its sequence
    dropped). Empty when the pair has no finite token, or when the method needs top-K lists the pair lacks
    (the comparison has no numbers for it either). ValueError for an unknown method or parameter."""
    from mismatch_lab.corrections.compare import _run, variants
    from mismatch_lab.corrections.layout import chunks, pair_info

    by_label = {v.label: v for v in variants(overrides)}
    if method not in by_label:
        raise ValueError(f"no method named {method!r}; methods: {', '.join(by_label)}")
    v = by_label[method]
    info = pair_info(con, (rollout, scorer))
    empty = pd.DataFrame({c: pd.Series(dtype=t) for c, t in
                          zip(COLUMNS, ("object", "int64", "int64", "float64", "bool"))})
    if info.empty or ("topk" in v.method.needs and not bool(info["has_topk"].iloc[0])):
        return empty
    parts = []
    # only the top-K rules read the top-K lists (batch.py): the others' rows are read without them
    info = info.assign(has_topk=info["has_topk"] & ("topk" in v.method.needs))
    for chunk in chunks(con, info, chunk_tokens=chunk_tokens):
        # each token its own group: the per-group masked count is the token's own mask, in flat order
        seqs = np.zeros(len(chunk.seq_start), dtype=np.int64)
        sums, _, _ = _run(v, list(chunk.parts(np.arange(chunk.n), chunk.n, seqs)), chunk.n, 1)
        keep = sums["n_masked"] == 0
        kept_any = np.logical_or.reduceat(keep, chunk.seq_start)
        seq_dropped = np.repeat(~kept_any, chunk.lengths)
        hit = np.flatnonzero(~keep)
        # the keys of the dropped tokens, from the rows the chunk was laid out from
        part = chunk.rows.select(["run_id", "seq_id", "pos"]).take(hit).to_pandas()
        part["log_ratio"] = (chunk.lpi - chunk.lmu)[hit]
        part["seq_dropped"] = seq_dropped[hit]
        parts.append(part)
    out = pd.concat(parts, ignore_index=True) if parts else empty
    return out.astype({"seq_id": "int64", "pos": "int64", "seq_dropped": "bool"})[COLUMNS]


def dropped_sequences(tokens: pd.DataFrame) -> pd.DataFrame:
    """The sequences of `dropped_tokens`' rows: run_id, seq_id, n_dropped, first_pos (the first dropped
    position), max_abs_log_ratio, seq_dropped; whole sequences first, then by tokens dropped."""
    if tokens.empty:
        return pd.DataFrame({"run_id": pd.Series(dtype="object"), "seq_id": pd.Series(dtype="int64"),
                             "n_dropped": pd.Series(dtype="int64"), "first_pos": pd.Series(dtype="int64"),
                             "max_abs_log_ratio": pd.Series(dtype="float64"), "seq_dropped": pd.Series(dtype="bool")})
    g = tokens.assign(abs_lr=tokens["log_ratio"].abs()).groupby(["run_id", "seq_id"], sort=False)
    out = g.agg(n_dropped=("pos", "size"), first_pos=("pos", "min"), max_abs_log_ratio=("abs_lr", "max"),
                seq_dropped=("seq_dropped", "all")).reset_index()
    return out.sort_values(["seq_dropped", "n_dropped", "run_id", "seq_id"], ascending=[False, False, True, True],
                           ignore_index=True)
