"""Arrow building blocks of the contract rows (numpy in, Arrow out; no per-token Python lists), and the
sequence ids of recorded and imported runs."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

RANK_BITS = 12
INDEX_BITS = 20
MAX_RANKS = 1 << RANK_BITS
MAX_SEQUENCES = 1 << INDEX_BITS
"""seq_id = step << 32 | rank << 20 | index: unique within a run across ranks and steps without any
coordination (4096 ranks, 2^20 sequences per rank and step)."""


INT_END = 1 << 31
INT_RANGE = "[0, 2^31)"
"""Steps and token ids are stored as INTEGER: each is a whole number in INT_RANGE = [0, INT_END)."""
TOKEN_ID_END = STEP_END = INT_END


def seq_ids(step: int, rank: int, first_index: int, n: int) -> np.ndarray:
    """[n] int64 sequence ids of `n` sequences of (step, rank) starting at `first_index`."""
    if not 0 <= rank < MAX_RANKS:
        raise ValueError(f"rank {rank} outside [0, {MAX_RANKS})")
    if first_index + n > MAX_SEQUENCES:
        raise ValueError(f"more than {MAX_SEQUENCES} sequences for one (step, rank)")
    if not 0 <= step < STEP_END:
        raise ValueError(f"step {step} outside {INT_RANGE}")
    return (np.int64(step) << 32) | (np.int64(rank) << INDEX_BITS) | np.arange(first_index, first_index + n, dtype=np.int64)


def is_token_id(x) -> bool:
    """One value (a Python or numpy scalar, e.g. from JSON) that is a token id: an integer, not a boolean,
    in [0, TOKEN_ID_END)."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_)) and 0 <= x < TOKEN_ID_END


def bad_token_ids(ids) -> np.ndarray:
    """bool array shaped like `ids` (any numeric dtype; Python ints of any size): True where an entry is
    not a whole number in [0, TOKEN_ID_END) -- negative, too large, fractional, NaN, a boolean."""
    a = np.asarray(ids)
    if a.dtype.kind in "iu":
        return (a < 0) | (a >= TOKEN_ID_END)
    if a.dtype.kind == "f":
        with np.errstate(invalid="ignore"):
            return ~((a >= 0) & (a < TOKEN_ID_END) & (a == np.floor(a)))
    if a.dtype.kind == "O":
        return ~np.array([is_token_id(x) for x in a.reshape(-1)], dtype=bool).reshape(a.shape)
    return np.ones(a.shape, dtype=bool)


def describe_bad_ids(ids, bad: np.ndarray) -> str:
    """The first entry of `ids` where `bad` is true, and how many more there are, for an error message."""
    vals = np.asarray(ids)[bad].reshape(-1)
    first = vals[0].item() if hasattr(vals[0], "item") else vals[0]
    return f"{first!r}" + (f" (and {len(vals) - 1} more)" if len(vals) > 1 else "")


def check_token_ids(ids, what: str, also: str = "") -> None:
    """ValueError "<what> must be whole numbers in [0, 2^31)<also>; got <first bad> (and n more)" when an
    entry of `ids` is not a token id (`bad_token_ids`)."""
    bad = bad_token_ids(ids)
    if bad.any():
        raise ValueError(f"{what} must be whole numbers in {INT_RANGE}{also}; got {describe_bad_ids(ids, bad)}")


def floats(values: np.ndarray) -> tuple[pa.Array, np.ndarray]:
    """float64 Arrow array with NULL where not finite, and the [n] non-finite flags."""
    v = np.asarray(values, dtype=np.float64)
    bad = ~np.isfinite(v)
    return pa.array(v, mask=bad if bad.any() else None, type=pa.float64()), bad


def repeat(value, n: int, typ: pa.DataType) -> pa.Array:
    """`value` (or NULL) n times as an array of `typ`. Constant strings of a written table are
    dictionary-encoded once, when the table is finished (`flat._dictionary`)."""
    return pa.repeat(pa.scalar(value, type=typ), n)


def lists(values: np.ndarray, keep: np.ndarray, typ: pa.DataType) -> pa.Array:
    """[n, K] values -> a list array of n lists holding the entries where `keep` [n, K] is true, in order
    (ragged top-K: padding entries are dropped); NULL elements where a float is not finite."""
    flat = values[keep]
    if pa.types.is_floating(typ.value_type):
        inner, _ = floats(flat)
    else:
        inner = pa.array(flat.astype(np.int32), type=typ.value_type)
    offsets = pa.array(np.concatenate([[0], np.cumsum(keep.sum(axis=1))]).astype(np.int32))
    return pa.ListArray.from_arrays(offsets, inner, type=typ)


def contract_table(columns: dict[str, pa.Array], types: dict[str, pa.DataType]) -> pa.Table:
    """Contract columns in contract order (cast to their types), extra columns after them."""
    order = [c for c in types if c in columns] + [c for c in columns if c not in types]
    return pa.table({c: columns[c].cast(types[c]) if c in types else columns[c] for c in order})
