"""Contract rows of one recorded step, built from numpy arrays (no per-token Python lists).

Shapes: B sequences, T positions, K top-K entries. A position is stored when its mask is true (the loss
mask: response tokens the trainer trains on); `pos` counts from the sequence's first masked position, so
a hole in the mask (tool output in a multi-turn reply) keeps its place and is simply absent.

    logp_rollout  [B, T]  log mu: the rollout engine's log-prob of token_ids[b, t]
    logp_trainer  [B, T]  log pi: the trainer's log-prob of the same token
A value that is NaN or +-inf is stored as NULL; its score row gets `nonfinite = true` (never zeroed).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from mismatch_lab.store.writer import (
    METRIC_TYPES,
    SCORE_TYPES,
    SEQUENCE_TYPES,
    TOKEN_TYPES,
)

RANK_BITS = 12
INDEX_BITS = 20
MAX_RANKS = 1 << RANK_BITS
MAX_SEQUENCES = 1 << INDEX_BITS
"""seq_id = step << 32 | rank << 20 | index: unique within a run across ranks and steps without any
coordination (4096 ranks, 2^20 sequences per rank and step)."""


def seq_ids(step: int, rank: int, first_index: int, n: int) -> np.ndarray:
    """[n] int64 sequence ids of `n` sequences of (step, rank) starting at `first_index`."""
    if not 0 <= rank < MAX_RANKS:
        raise ValueError(f"rank {rank} outside [0, {MAX_RANKS})")
    if first_index + n > MAX_SEQUENCES:
        raise ValueError(f"more than {MAX_SEQUENCES} sequences for one (step, rank)")
    if not 0 <= step < (1 << 31):
        raise ValueError(f"step {step} outside [0, 2^31)")
    return (np.int64(step) << 32) | (np.int64(rank) << INDEX_BITS) | np.arange(first_index, first_index + n, dtype=np.int64)


@dataclass
class StepArrays:
    """One step's inputs as numpy arrays (see the module docstring for the shapes)."""

    token_ids: np.ndarray  # [B, T] integer
    mask: np.ndarray  # [B, T] bool
    logp_rollout: np.ndarray  # [B, T] float
    logp_trainer: np.ndarray  # [B, T] float
    advantages: np.ndarray | None = None  # [B] per sequence, or [B, T] per token
    rewards: np.ndarray | None = None  # [B]
    rollout_topk_ids: np.ndarray | None = None  # [B, T, K]; ragged lists padded with id -1
    rollout_topk_logps: np.ndarray | None = None  # [B, T, K]
    entropy: np.ndarray | None = None  # [B, T] the trainer's entropy, nats
    group_ids: np.ndarray | None = None  # [B] prompt group of each sequence (GRPO groups)
    sequence_columns: dict | None = None  # further sequences columns, name -> [B] values

    def check(self) -> None:
        """Shapes agree; a ValueError names the field that does not."""
        B, T = np.shape(self.token_ids) if np.ndim(self.token_ids) == 2 else (None, None)
        if B is None:
            raise ValueError(f"token_ids must be [B, T], got shape {np.shape(self.token_ids)}")
        want = {"mask": (B, T), "logp_rollout": (B, T), "logp_trainer": (B, T), "rewards": (B,),
                "entropy": (B, T), "group_ids": (B,)}  # fmt: skip
        for name, shape in want.items():
            v = getattr(self, name)
            if v is not None and np.shape(v) != shape:
                raise ValueError(f"{name} has shape {np.shape(v)}, expected {shape} like token_ids")
        if self.advantages is not None and np.shape(self.advantages) not in ((B,), (B, T)):
            raise ValueError(f"advantages has shape {np.shape(self.advantages)}, expected ({B},) or ({B}, {T})")
        if (self.rollout_topk_ids is None) != (self.rollout_topk_logps is None):
            raise ValueError("rollout_topk_ids and rollout_topk_logps go together: pass both or neither")
        if self.rollout_topk_ids is not None:
            a, b = np.shape(self.rollout_topk_ids), np.shape(self.rollout_topk_logps)
            if len(a) != 3 or a[:2] != (B, T) or a != b:
                raise ValueError(f"rollout_topk_ids / rollout_topk_logps have shapes {a} / {b}, expected [B, T, K]")
        for name, values in (self.sequence_columns or {}).items():
            if len(values) != B:
                raise ValueError(f"sequence column {name} has {len(values)} values, expected {B}")

    def first_rows(self, n: int) -> StepArrays:
        """The first n sequences (max_sequences_per_step)."""
        cut = {k: (None if v is None else v[:n]) for k, v in vars(self).items() if k != "sequence_columns"}
        extra = {k: list(v)[:n] for k, v in (self.sequence_columns or {}).items()} or None
        return StepArrays(**cut, sequence_columns=extra)


def _floats(values: np.ndarray) -> tuple[pa.Array, np.ndarray]:
    """float64 Arrow array with NULL where not finite, and the [n] non-finite flags."""
    v = np.asarray(values, dtype=np.float64)
    bad = ~np.isfinite(v)
    return pa.array(v, mask=bad if bad.any() else None, type=pa.float64()), bad


def _repeat(value, n: int, typ: pa.DataType) -> pa.Array:
    """`value` n times, dictionary-encoded for strings (one copy of the string, not n)."""
    if value is None:
        return pa.nulls(n, type=typ)
    if pa.types.is_string(typ):
        return pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, dtype=np.int32)), pa.array([value])).cast(typ)
    return pa.array(np.full(n, value), type=typ)


def _lists(values: np.ndarray, keep: np.ndarray, typ: pa.DataType) -> pa.Array:
    """[n, K] values -> a list array of n lists holding the entries where `keep` [n, K] is true, in order
    (ragged top-K: padding entries are dropped); NULL elements where a float is not finite."""
    flat = values[keep]
    if pa.types.is_floating(typ.value_type):
        inner, _ = _floats(flat)
    else:
        inner = pa.array(flat.astype(np.int32), type=typ.value_type)
    offsets = pa.array(np.concatenate([[0], np.cumsum(keep.sum(axis=1))]).astype(np.int32))
    return pa.ListArray.from_arrays(offsets, inner, type=typ)


def step_tables(run_id: str, step: int, ids: np.ndarray, a: StepArrays, scorer: str, texts=None) -> dict[str, pa.Table]:
    """The sequences, tokens and scores rows of one step. `ids` [B] are the sequences' seq_id values;
    `texts` (token id array -> (texts, categories) arrays) fills token_text / category when given."""
    a.check()
    mask = np.asarray(a.mask, dtype=bool)
    B = mask.shape[0]
    b, t = np.nonzero(mask)  # row-major: sequence by sequence, position order
    n = len(b)
    has = mask.any(axis=1)
    first = np.where(has, mask.argmax(axis=1), 0)
    lens = mask.sum(axis=1).astype(np.int32)

    tok = {
        "run_id": _repeat(run_id, n, pa.string()),
        "seq_id": pa.array(ids[b], type=pa.int64()),
        "pos": pa.array((t - first[b]).astype(np.int32)),
        "token_id": pa.array(np.asarray(a.token_ids)[b, t].astype(np.int32)),
    }
    lmu, bad_mu = _floats(np.asarray(a.logp_rollout)[b, t])
    lpi, bad_pi = _floats(np.asarray(a.logp_trainer)[b, t])
    if texts is not None:
        text, cat = texts(np.asarray(a.token_ids)[b, t])
        tok["token_text"], tok["category"] = pa.array(text, type=pa.string()), pa.array(cat, type=pa.string())
    tok["logp_rollout"] = lmu
    if a.rollout_topk_ids is not None:
        k_ids = np.asarray(a.rollout_topk_ids)[b, t]
        keep = k_ids >= 0  # ragged top-K lists come padded with id -1
        tok["topk_ids_rollout"] = _lists(k_ids, keep, TOKEN_TYPES["topk_ids_rollout"])
        tok["topk_logps_rollout"] = _lists(np.asarray(a.rollout_topk_logps)[b, t], keep,
                                           TOKEN_TYPES["topk_logps_rollout"])
    adv = None if a.advantages is None else np.asarray(a.advantages, dtype=np.float64)
    if adv is not None and adv.ndim == 2:
        tok["advantage"], _ = _floats(adv[b, t])  # extra column: the per-token advantage as trained on

    sc = {"run_id": tok["run_id"], "seq_id": tok["seq_id"], "pos": tok["pos"], "scorer": _repeat(scorer, n, pa.string()),
          "logp": lpi}
    if a.entropy is not None:
        sc["entropy"], _ = _floats(np.asarray(a.entropy)[b, t])
    sc["nonfinite"] = pa.array(bad_mu | bad_pi, type=pa.bool_())

    seq = {
        "run_id": _repeat(run_id, B, pa.string()),
        "seq_id": pa.array(ids, type=pa.int64()),
        "prompt_id": None if a.group_ids is None else pa.array([str(g) for g in np.asarray(a.group_ids)], pa.string()),
        "step": _repeat(int(step), B, pa.int32()),
        "response_len": pa.array(lens),
    }
    for name, values in (a.sequence_columns or {}).items():
        seq[name] = pa.array(list(values), type=SEQUENCE_TYPES.get(name))
    if a.rewards is not None:
        seq["reward"], _ = _floats(np.asarray(a.rewards))
    if adv is not None:
        if adv.ndim == 2:  # the sequence's mean advantage over its response tokens (GRPO: the one value)
            with np.errstate(invalid="ignore", divide="ignore"):
                adv = np.where(lens > 0, np.where(mask, adv, 0.0).sum(axis=1) / np.maximum(lens, 1), np.nan)
        seq["advantage"], _ = _floats(adv)
    return {
        "sequences": _table({k: v for k, v in seq.items() if v is not None}, SEQUENCE_TYPES),
        "tokens": _table(tok, TOKEN_TYPES),
        "scores": _table(sc, SCORE_TYPES),
    }


def metric_table(run_id: str, step: int, metrics: dict[str, float]) -> pa.Table:
    """train_metrics rows (run_id, step, name, value) of one step."""
    names = sorted(metrics)
    vals = np.array([float(metrics[k]) for k in names], dtype=np.float64)
    value, _ = _floats(vals)
    return pa.table({"run_id": _repeat(run_id, len(names), pa.string()), "step": _repeat(int(step), len(names), pa.int32()),
                     "name": pa.array(names, type=pa.string()), "value": value}, schema=pa.schema(METRIC_TYPES))


def _table(columns: dict[str, pa.Array], types: dict[str, pa.DataType]) -> pa.Table:
    """Contract columns in contract order (cast to their types), extra columns after them."""
    order = [c for c in types if c in columns] + [c for c in columns if c not in types]
    return pa.table({c: columns[c].cast(types[c]) if c in types else columns[c] for c in order})
