"""One chunk's contract rows as Arrow tables: the rollout's samples and every scorer's `ScoredTokens`.

Scores go from numpy buffers to Arrow without Python lists: non-finite floats become NULL through
validity masks (`record.arrow.floats`), ragged top-K lists become Arrow list arrays from one flat buffer
and offsets (`record.arrow.lists`). Column names and types are the contract's (`store.schema.COLUMNS`).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from mismatch_lab.record.arrow import contract_table, floats, lists, repeat
from mismatch_lab.scoring import Ragged, ScoredTokens
from mismatch_lab.store.writer import SCORE_TYPES, SEQUENCE_TYPES, TOKEN_TYPES


def build_tables(run_id: str, seq_rows: list[dict], samples, scored: dict[str, ScoredTokens], texts, *, step=None):
    """Arrow tables (sequences, tokens, scores) of one chunk.

    seq_rows: dicts with seq_id, prompt_id, sample_idx, prompt_len (optional reward, advantage);
    samples: engine Samples aligned with seq_rows; scored: scorer name -> ScoredTokens over the same sequences;
    texts: `record.flat.TextLookup` (token id array -> text and category arrays).
    """
    lens = np.array([len(s.token_ids) for s in samples], dtype=np.int64)
    seq_id = np.array([r["seq_id"] for r in seq_rows], dtype=np.int64)
    seq_of_token = np.repeat(seq_id, lens)
    pos = np.concatenate([np.arange(n) for n in lens]) if len(lens) else np.zeros(0, np.int64)
    keys = {"seq_id": pa.array(seq_of_token), "pos": pa.array(pos.astype(np.int32))}
    tokens = _tokens(run_id, samples, keys, texts)
    scores = [_scores(run_id, name, sc, keys) for name, sc in scored.items()]
    empty = contract_table({"run_id": pa.array([], pa.string())}, SCORE_TYPES)
    return (_sequences(run_id, seq_rows, samples, step), tokens,
            pa.concat_tables([_full(t, SCORE_TYPES) for t in scores]) if scores else _full(empty, SCORE_TYPES))


def _full(table: pa.Table, types: dict) -> pa.Table:
    """Every contract column present (NULL where the chunk has none), in contract order."""
    n = table.num_rows
    cols = {c: table.column(c) if c in table.column_names else pa.nulls(n, t) for c, t in types.items()}
    return pa.table({c: v.cast(types[c]) for c, v in cols.items()})


def _sequences(run_id, seq_rows, samples, step) -> pa.Table:
    col = lambda key: [r.get(key) for r in seq_rows]
    seq = {"run_id": repeat(run_id, len(seq_rows), pa.string()), "seq_id": pa.array(col("seq_id"), pa.int64()),
           "prompt_id": pa.array(col("prompt_id"), pa.string()), "sample_idx": pa.array(col("sample_idx"), pa.int32()),
           "step": repeat(step, len(seq_rows), pa.int32()), "response_text": pa.array([s.text for s in samples], pa.string()),
           "response_len": pa.array([len(s.token_ids) for s in samples], pa.int32()),
           "finish_reason": pa.array([s.finish_reason for s in samples], pa.string()),
           "reward": pa.array(col("reward"), pa.float64()), "advantage": pa.array(col("advantage"), pa.float64()),
           "prompt_len": pa.array(col("prompt_len"), pa.int32())}
    return _full(contract_table(seq, SEQUENCE_TYPES), SEQUENCE_TYPES)


def _tokens(run_id, samples, keys, texts) -> pa.Table:
    n = len(keys["pos"])
    ids = np.fromiter((t for s in samples for t in s.token_ids), dtype=np.int64, count=n)
    mu = np.fromiter((x for s in samples for x in s.logps), dtype=np.float64, count=n)
    tok = {"run_id": repeat(run_id, n, pa.string()), **keys, "token_id": pa.array(ids.astype(np.int32))}
    tok["token_text"], tok["category"] = texts(ids)
    tok["logp_rollout"], _ = floats(mu)
    if samples and all(s.topk_ids is not None for s in samples):  # the engine's lists: flattened once
        tok["topk_ids_rollout"] = _nested([row for s in samples for row in s.topk_ids], TOKEN_TYPES["topk_ids_rollout"])
        tok["topk_logps_rollout"] = _nested([row for s in samples for row in s.topk_logps],
                                            TOKEN_TYPES["topk_logps_rollout"])
    return _full(contract_table(tok, TOKEN_TYPES), TOKEN_TYPES)


def _nested(rows: list[list], typ: pa.DataType) -> pa.Array:
    """Per-token Python lists from an engine -> a list array (non-finite floats NULL), via one flat buffer."""
    lens = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    flat = np.fromiter((x for r in rows for x in r), dtype=np.float64 if pa.types.is_floating(typ.value_type)
                       else np.int64, count=int(lens.sum()))
    return _list_array(flat, lens, typ)


def _list_array(flat: np.ndarray, lens: np.ndarray, typ: pa.DataType, valid: np.ndarray | None = None) -> pa.Array:
    inner = floats(flat)[0] if pa.types.is_floating(typ.value_type) else pa.array(flat.astype(np.int32))
    offsets = pa.array(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    mask = None if valid is None or valid.all() else pa.array(~valid)
    return pa.ListArray.from_arrays(offsets, inner, type=typ, mask=mask)


def ragged_array(r: Ragged | None, typ: pa.DataType, n: int) -> pa.Array:
    """A `Ragged` [N, W] matrix with row lengths -> a list array; rows marked invalid are NULL."""
    if r is None:
        return pa.nulls(n, typ)
    lens = np.where(r.valid, r.lens, 0) if r.valid is not None else r.lens
    keep = np.arange(r.values.shape[1])[None, :] < lens[:, None]
    if r.valid is None or r.valid.all():
        return lists(r.values, keep, typ)
    return _list_array(r.values[keep], lens, typ, r.valid)


def _scores(run_id: str, name: str, sc: ScoredTokens, keys) -> pa.Table:
    n = len(sc.logp)
    opt = lambda v: floats(v)[0] if v is not None else pa.nulls(n, pa.float64())
    cols = {"run_id": repeat(run_id, n, pa.string()), **keys, "scorer": repeat(name, n, pa.string()),
            "logp": opt(sc.logp), "entropy": opt(sc.entropy), "tv_exact_vs_ref": opt(sc.tv_exact_vs_ref),
            "kl_exact_vs_ref": opt(sc.kl_exact_vs_ref), "nonfinite": pa.array(sc.nonfinite, pa.bool_()),
            "log_support": opt(sc.log_support), "logp_support": opt(sc.logp_support)}
    for col, attr in (("topk_ids", "topk_ids"), ("topk_logps", "topk_logps"),
                      ("logps_at_rollout_topk", "logps_at_rollout_topk"), ("logps_at_ref_topk", "logps_at_ref_topk")):
        cols[col] = ragged_array(getattr(sc, attr), SCORE_TYPES[col], n)
    return contract_table(cols, SCORE_TYPES)


def prefill_scores(engine, items, top_k: int) -> ScoredTokens:
    """The `vllm:<dtype>` scorer: π and top-K from vLLM prefill, as numpy buffers (no entropy or divergences)."""
    res = engine.prefill_logprobs([(it.prompt_ids, it.response_ids) for it in items], top_k=top_k)
    lens = np.array([len(it.response_ids) for it in items], dtype=np.int64)
    logp = np.fromiter((x for r in res for x in r[0]), dtype=np.float64, count=int(lens.sum()))
    out = ScoredTokens(offsets=np.concatenate([[0], np.cumsum(lens)]), logp=logp, nonfinite=~np.isfinite(logp))
    if top_k > 0:
        rows = [row for r in res for row in r[1]]
        width = max((len(x) for x in rows), default=0)
        row_lens = np.fromiter((len(x) for x in rows), dtype=np.int64, count=len(rows))
        keep = np.arange(width)[None, :] < row_lens[:, None]
        ids, lps = np.zeros((len(rows), width), np.int64), np.zeros((len(rows), width))
        ids[keep] = np.fromiter((t for x in rows for t in x), dtype=np.int64, count=int(row_lens.sum()))
        lps[keep] = np.fromiter((v for r in res for x in r[2] for v in x), dtype=np.float64, count=int(row_lens.sum()))
        out.topk_ids, out.topk_logps = Ragged(ids, row_lens), Ragged(lps, row_lens)
    return out
