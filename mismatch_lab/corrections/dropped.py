"""The tokens one method drops on one (rollout, scorer) pair, by (run_id, seq_id, pos): the app's click-through
from the comparison to the token inspector.

The method's rule runs exactly as in compare.py (the same chunks of whole sequences, the same [B, T] layout,
the same parameters with `overrides`), so the rows returned are the `frac_tokens_masked · n_tokens` tokens
of that row of the comparison. The comparison itself evaluates every rule on every token: `compare_with_drops`
keeps those decisions per pair (`PairDrops`: one bit per token and method), so the tokens any method drops are
then read off without running its rule again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

COLUMNS = ["run_id", "seq_id", "pos", "log_ratio", "seq_dropped"]
KEYS = ["run_id", "seq_id", "pos"]


def _empty() -> pd.DataFrame:
    return pd.DataFrame({c: pd.Series(dtype=t) for c, t in zip(COLUMNS, ("object", "int64", "int64", "float64", "bool"))})


@dataclass
class PairDrops:
    """Every compared method's decisions on the finite tokens of one pair, in (run_id, seq_id, pos) order: each
    sequence's keys (run_id dictionary-encoded, seq_id; None: the pair has no finite token) and first offset,
    each token's position and log π − log μ, and per method label its dropped flags, packed (np.packbits; a
    method without an entry was not computed on the pair: it needs top-K lists the pair lacks). 12 bytes a token
    (a position as int32, a float64) plus 1 bit a token and method, and ~12 bytes a sequence: a token's run and
    sequence ids are its sequence's (keys a token took ~25 bytes: the comparison of 10 M tokens of 3 pairs kept
    ~0.8 GB)."""

    seqs: pa.Table | None
    pos: np.ndarray
    log_ratio: np.ndarray
    seq_start: np.ndarray
    dropped: dict[str, np.ndarray] = field(default_factory=dict)

    def tokens(self, method: str) -> pd.DataFrame:
        """`dropped_tokens` of `method` on this pair (the same rows, columns and dtypes)."""
        if self.seqs is None or method not in self.dropped:
            return _empty()
        n = len(self.log_ratio)
        drop = np.unpackbits(self.dropped[method], count=n).astype(bool)
        kept_any = np.logical_or.reduceat(~drop, self.seq_start)
        hit = np.flatnonzero(drop)
        seq = np.searchsorted(self.seq_start, hit, side="right") - 1  # each dropped token's sequence
        keys = self.seqs.take(seq)
        run = keys.column("run_id")
        if pa.types.is_dictionary(run.type):
            keys = keys.set_column(0, "run_id", run.cast(run.type.value_type))
        out = keys.to_pandas()
        out["pos"] = self.pos[hit]
        out["log_ratio"] = self.log_ratio[hit]
        out["seq_dropped"] = ~kept_any[seq]
        return out.astype({"seq_id": "int64", "pos": "int64", "seq_dropped": "bool"})[COLUMNS]


class DropRecorder:
    """compare's `record`: called with each chunk (pair by pair), it returns where each method's keep flags of
    the chunk's tokens go; `result()` packs them into one PairDrops per (rollout, scorer)."""

    def __init__(self):
        self._open: dict | None = None  # the pair being read: its keys, log-ratios, offsets and keep flags
        self._done: dict[tuple[str, str], PairDrops] = {}

    def __call__(self, chunk) -> Callable[[str], np.ndarray]:
        pair = (chunk.rows.column("rollout")[0].as_py(), chunk.rows.column("scorer")[0].as_py())
        if self._open is None or self._open["pair"] != pair:
            self._close()
            self._open = {"pair": pair, "seqs": [], "pos": [], "log_ratio": [], "seq_start": [], "n": 0, "keep": {}}
        p = self._open
        p["seqs"].append(chunk.rows.select(KEYS[:2]).take(chunk.seq_start))  # (chunks hold whole sequences)
        pos = chunk.rows.column("pos").to_numpy()
        if len(pos) and (pos.min() < 0 or pos.max() > np.iinfo(np.int32).max):
            raise ValueError(f"token positions outside int32 ({pos.min()}..{pos.max()})")
        p["pos"].append(pos.astype(np.int32))
        p["log_ratio"].append(chunk.lpi - chunk.lmu)
        p["seq_start"].append(chunk.seq_start + p["n"])
        p["n"] += chunk.n

        def keep_of(label: str) -> np.ndarray:
            p["keep"].setdefault(label, []).append(out := np.empty(chunk.n, dtype=bool))
            return out

        return keep_of

    def _close(self) -> None:
        p, self._open = self._open, None
        if p is not None:
            seqs = pa.Table.from_batches(p["seqs"]).combine_chunks()
            seqs = seqs.set_column(0, "run_id", pc.dictionary_encode(seqs.column("run_id")))
            self._done[p["pair"]] = PairDrops(
                seqs, np.concatenate(p["pos"]), np.concatenate(p["log_ratio"]), np.concatenate(p["seq_start"]),
                {label: np.packbits(~np.concatenate(keep)) for label, keep in p["keep"].items()})

    def result(self) -> dict[tuple[str, str], PairDrops]:
        self._close()
        return self._done


@dataclass
class Compared:
    """compare_with_drops' result: the comparison's tables, each pair's PairDrops, and the sums and pair info
    the tables were built from (the base of a comparison with overrides on the same tokens)."""

    tables: dict[str, pd.DataFrame]
    drops: dict[tuple[str, str], PairDrops]
    sums: object  # compare.Sums
    info: pd.DataFrame


def compare_with_drops(con, *, overrides: Mapping[str, Mapping[str, float]] | None = None,
                       chunk_tokens: int = 1 << 20, base: Compared | None = None) -> Compared:
    """compare.compare's tables and, from the same pass, a PairDrops per (rollout, scorer) of its main table
    (a pair without a finite token: keys None). `base`: this function's result on the same tokens at the
    published defaults; then only the methods whose parameters `overrides` changes are run, and their sums and
    drops replace the base's: the same tables as a run of every method, bit for bit."""
    from mismatch_lab.corrections.compare import accumulate, variants
    from mismatch_lab.corrections.layout import pair_info

    vs = variants(overrides)
    defaults = {v.label: v.params for v in variants()}
    changed = [v for v in vs if v.params != defaults[v.label]]
    if base is not None and not changed:  # (overrides that restate the defaults)
        return base
    info = base.info if base is not None else pair_info(con)
    record = DropRecorder()
    if base is None:
        acc = accumulate(con, vs, info, record=record, chunk_tokens=chunk_tokens)
    else:  # the top-K lists read only if a changed method reads them (the chunks are of the same tokens)
        topk = any("topk" in v.method.needs for v in changed)
        acc = accumulate(con, changed, info.assign(has_topk=info["has_topk"] & topk), record=record,
                         chunk_tokens=chunk_tokens).spliced(base.sums, vs)
        if acc is None:  # (other chunks: never expected) every method, as without a base
            return compare_with_drops(con, overrides=overrides, chunk_tokens=chunk_tokens)
    drops = record.result()
    nothing = PairDrops(None, np.zeros(0, dtype=np.int32), np.zeros(0), np.zeros(0, dtype=np.int64))
    if base is not None:
        drops = {pair: PairDrops(d.seqs, d.pos, d.log_ratio, d.seq_start, {m: bits for m, bits in d.dropped.items()
                                                                    if m not in {v.label for v in changed}}
                                 | drops.get(pair, nothing).dropped) for pair, d in base.drops.items()}
    tables = acc.tables(info)
    pairs = tables["corrections"][["rollout", "scorer"]].drop_duplicates().itertuples(index=False)
    return Compared(tables, {(r, s): drops.get((r, s), nothing) for r, s in pairs}, acc.sums(), info)


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
    # only the top-K rules read the top-K lists (batch.py): the others' rows are read without them, and without
    # the pair's info (one more scan of its tokens): a pair without finite tokens then gives no chunk
    if "topk" in v.method.needs:
        info = pair_info(con, (rollout, scorer))
        if info.empty or not bool(info["has_topk"].iloc[0]):
            return _empty()
    else:
        info = pd.DataFrame({"rollout": [rollout], "scorer": [scorer], "n_tokens": [0], "has_topk": [False]})
    record = DropRecorder()
    for chunk in chunks(con, info, chunk_tokens=chunk_tokens):
        one = np.zeros(chunk.n, dtype=np.int64)  # a single token group and sequence group: only keep_out is read
        _run(v, list(chunk.parts(one, 1, one[:len(chunk.seq_start)])), 1, 1, record(chunk)(method))
    drops = record.result().get((rollout, scorer))
    return _empty() if drops is None else drops.tokens(method)



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
