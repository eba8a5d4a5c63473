"""A batch of sequences as flat arrays, and the contract rows it becomes: the one place the row rules live.

The positions of S samples are laid end to end (N positions in all), `offsets` marking where each sample
starts. Importers read their sources into `FlatBatch`es; the Recorder and the train loop hand [B, T]
padded arrays to `record.tables.step_tables`, which lays them out flat and calls `batch_tables`. Rules:

* a position is stored when `mask` is true (the loss mask: the response tokens the trainer trains on);
  `pos` counts from the sample's first stored position, so a hole in the mask keeps its place;
* log μ (`logp_rollout`) and log π (`logp_trainer`) that are NaN, +-inf or missing are stored as NULL and
  the score row gets `nonfinite = true` (never zeroed);
* a finite log μ, log π or rollout top-K log-prob above LOGP_TOLERANCE at a stored position is refused
  (`check_batch_logprobs`, ValueError): no log-softmax gives it, most often it is a probability;
* a per-token advantage goes to the extra `tokens.advantage` column and its mean over the sample's
  stored tokens to `sequences.advantage`;
* MoE routing (`routing`, optional): row i holds the rollout engine's expert ids of the forward whose output
  gives position i's token (input position i - 1), one [L, k] block per position; the stored positions where
  `routing_mask` is true become `routing` rows (side ROUTING_ROLLOUT_SIDE, one row per layer, ids in the
  order given; weights and margin NULL), with the tokens rows' (seq_id, pos).

A sample without any stored position is not written by default (nothing of it was trained on;
prime-rl's packing pads with such samples); `keep_empty=True` (the Recorder, the train loop) writes it
with response_len 0, so a step's sequence count is what the loop generated.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from mismatch_lab.record.arrow import (
    check_token_ids,
    contract_table,
    floats,
    repeat,
    seq_ids,
)
from mismatch_lab.store.schema import MAX_LOG_RATIO, ROUTING_ROLLOUT_SIDE
from mismatch_lab.store.writer import (
    ROUTING_TYPES,
    SCORE_TYPES,
    SEQUENCE_TYPES,
    TOKEN_TYPES,
)

LOGP_TOLERANCE = 2.0**-20
"""The most a log-prob may exceed 0 (2^-20 ~ 9.5e-7: 8 ULPs of 1.0 in fp32, exact in fp32 and float64).
An exact log-softmax is <= 0: log pi(t) = x_t - max(x) - log(sum exp(x - max(x))) and the sum is >= 1.
A computed one exceeds 0 only through that last log rounding below 0: a log or exp evaluated
approximately (GPU fast-math log2 errs by ~2^-22 absolute near 1), or a sum/division rounded in fp32,
puts log(sum) a few fp32 ULPs of 1 (2^-23 each) under 0; bf16/fp16 logits are promoted to fp32 for the
log-softmax, and storing the result in bf16/fp16 keeps its sign and size. So a log-prob above 2^-20 is
no rounding: most often probabilities passed by mistake (refused with PROBABILITIES_FIX)."""
PROBABILITIES_FIX = "these look like probabilities: pass log-probabilities, e.g. log(p)"

TOKENS_STORED = "loss-mask (response) tokens only; pos counts from the first one"
"""What a recorded or imported run's `runs.config` says about its tokens (the rule above, in one line)."""


def logp_excess(values, stored=None) -> np.ndarray:
    """bool flags shaped like `values`: a finite log-prob above LOGP_TOLERANCE (at `stored` positions only,
    when given). NaN and +-inf are not flagged: non-finite values are stored as NULL and counted."""
    v = np.asarray(values)
    bad = (v > LOGP_TOLERANCE) & (v != np.inf)  # NaN compares false; float32 compares exactly (2^-20)
    return bad if stored is None else bad & np.asarray(stored, dtype=bool)


def describe_excess(values, bad: np.ndarray) -> str:
    """'N value(s) above 0 (the largest X)' of the flagged values, for an error message."""
    n, largest = int(np.count_nonzero(bad)), float(np.max(np.asarray(values)[bad]))
    return (f"{n:,} value{'s' if n != 1 else ''} above 0 (the largest {largest:.6g}; a log-prob exceeds 0 "
            f"by rounding only, at most {LOGP_TOLERANCE:.2g})")


def check_logprobs(values, what: str, stored=None, *, fix: str = PROBABILITIES_FIX, error: type = ValueError) -> None:
    """Raise `error` "<what> has N values above 0 (the largest X; ...): <fix>" when a finite log-prob of
    `values` (at `stored` positions when given) exceeds LOGP_TOLERANCE; vectorised: ~0.4 ms per million
    float64 values with a mask on the 2-core EPYC, against ~200 ms to build their rows."""
    bad = logp_excess(values, stored)
    if bad.any():
        raise error(f"{what} has {describe_excess(values, bad)}: {fix}")


@dataclass
class FlatBatch:
    """S samples of one (step, rank), N positions in all. Arrays marked [S] hold one value per sample."""

    step: int
    rank: int
    offsets: np.ndarray  # [S + 1] int64: sample s holds positions offsets[s]:offsets[s + 1]
    token_ids: np.ndarray | None  # [N] integer; None: not known (a loss function sees no ids), stored as NULL
    mask: np.ndarray  # [N] bool: stored (response, loss-mask) positions
    logp_rollout: np.ndarray  # [N] float64, NaN where missing
    logp_trainer: np.ndarray  # [N] float64, NaN where missing
    advantage: np.ndarray | None = None  # [N] per token
    seq_advantage: np.ndarray | None = None  # [S] one number per sample (NaN: use the per-token mean)
    entropy: np.ndarray | None = None  # [N] the trainer's entropy, nats
    reward: np.ndarray | None = None  # [S]
    token_reward: np.ndarray | None = None  # [N] reward repeated on every position: the value at the first stored one
    prompt_id: np.ndarray | None = None  # [S] object: str or None
    prompt_len: np.ndarray | None = None  # [S] integer
    prompt_before_mask: bool = False  # prompt_len = positions before the first stored one (source holds the prompt)
    topk_ids: pa.Array | None = None  # [N] list<int>: the rollout engine's top-K token ids
    topk_logps: pa.Array | None = None  # [N] list<double>
    extra: dict[str, pa.Array] = field(default_factory=dict)  # [S] extra sequences columns (e.g. env_name)
    routing: np.ndarray | None = None  # [N, L, k] integer: the rollout's expert ids of the forward giving position i
    routing_mask: np.ndarray | None = None  # [N] bool: a route was captured there (None: everywhere)

    @property
    def n_samples(self) -> int:
        return len(self.offsets) - 1


@dataclass
class BatchStats:
    sequences: int = 0
    skipped_samples: int = 0  # samples without a stored position
    tokens: int = 0
    nonfinite: int = 0  # tokens not finite as the analyses count them (log mu, log pi or r not finite)
    abs_diff_sum: float = 0.0  # sum |log pi - log mu| over the finite tokens
    finite: int = 0

    def add(self, other: BatchStats) -> None:
        for k in vars(self):
            setattr(self, k, getattr(self, k) + getattr(other, k))


class TextLookup:
    """token id array -> (token_text, category) Arrow arrays through `categories.TokenTexts`, decoding each
    distinct id once and building dictionary arrays (no per-token Python strings)."""

    def __init__(self, tokenizer):
        from mismatch_lab.categories import TokenTexts

        self.texts = TokenTexts(tokenizer)

    def __call__(self, ids: np.ndarray) -> tuple[pa.Array, pa.Array]:
        uniq, inverse = np.unique(np.asarray(ids, dtype=np.int64), return_inverse=True)
        pairs = [self.texts(int(u)) for u in uniq]
        inverse = inverse.astype(np.int32).reshape(-1)
        unknown = np.array([p[0] is None for p in pairs], dtype=bool)[inverse]  # ids past the vocabulary: NULL
        index = pa.array(inverse, mask=unknown if unknown.any() else None)
        text = pa.DictionaryArray.from_arrays(index, pa.array([p[0] or "" for p in pairs], pa.string()))
        cat = pa.DictionaryArray.from_arrays(index, pa.array([p[1] or "" for p in pairs], pa.string()))
        return text, cat


def _float_lists(lists: pa.Array) -> pa.Array:
    """A list<double> array with NaN / +-inf elements turned into NULL elements."""
    lists = lists.cast(TOKEN_TYPES["topk_logps_rollout"])
    offsets = lists.offsets
    values = lists.values.slice(offsets[0].as_py(), offsets[-1].as_py() - offsets[0].as_py())
    inner, _ = floats(values.to_numpy(zero_copy_only=False))
    rebased = pa.array(offsets.to_numpy() - offsets[0].as_py(), type=pa.int32())
    mask = lists.is_null() if lists.null_count else None
    return pa.ListArray.from_arrays(rebased, inner, type=lists.type, mask=mask)


@dataclass(frozen=True)
class _Layout:
    """Where the stored positions of a FlatBatch go: `sel` [n] their flat indices, `row` [n] each one's
    sequence row among the kept samples, `kept` [K] the kept samples, `first` [K] each kept sample's first
    stored position (its start if none), `ids` [K] seq_ids, `lens` [K] stored positions per kept sample."""

    sel: np.ndarray
    row: np.ndarray
    kept: np.ndarray
    first: np.ndarray
    ids: np.ndarray
    lens: np.ndarray


def _layout(f: FlatBatch, first_index: int, ids: np.ndarray | None, keep_empty: bool) -> _Layout:
    S = f.n_samples
    sample_of = np.repeat(np.arange(S), np.diff(f.offsets))
    sel = np.flatnonzero(np.asarray(f.mask, dtype=bool))
    b = sample_of[sel]  # non-decreasing: positions are laid out sample after sample
    lens_all = np.bincount(b, minlength=S)
    kept = np.arange(S) if keep_empty else np.flatnonzero(lens_all > 0)
    K, n = len(kept), len(sel)
    row_of = np.full(S, -1, dtype=np.int64)
    row_of[kept] = np.arange(K)
    starts = np.searchsorted(b, kept)  # flat index of each kept sample's first stored position (its start if none)
    first = np.where(lens_all[kept] > 0, sel[np.minimum(starts, max(n - 1, 0))] if n else 0, f.offsets[kept])
    ids = seq_ids(f.step, f.rank, first_index, K) if ids is None else np.asarray(ids, dtype=np.int64)[kept]
    return _Layout(sel, row_of[b], kept, first, ids, lens_all[kept].astype(np.int32))


def batch_tables(run_id: str, f: FlatBatch, first_index: int, scorer: str, texts: TextLookup | None = None,
                 *, ids: np.ndarray | None = None, keep_empty: bool = False) -> tuple[dict[str, pa.Table], BatchStats]:
    """The sequences, tokens and scores rows of `f`. Its kept samples (those with a stored position, or
    all with keep_empty) get sequence indices `first_index, first_index + 1, ...` of (f.step, f.rank)
    (`record.arrow.seq_ids`), or the seq_id values `ids` [S] when given."""
    check_batch_logprobs(f)
    L = _layout(f, first_index, ids, keep_empty)
    n, K = len(L.sel), len(L.kept)
    keys = {"run_id": repeat(run_id, n, pa.string()), "seq_id": pa.array(L.ids[L.row], type=pa.int64()),
            "pos": pa.array((L.sel - L.first[L.row]).astype(np.int32))}
    tok, adv_tok = _token_columns(f, L, keys, texts)
    sc, stats = _score_columns(f, L, keys, scorer)
    stats.sequences, stats.skipped_samples = K, f.n_samples - K
    tables = {
        "sequences": contract_table(_sequence_columns(f, L, run_id, adv_tok), SEQUENCE_TYPES),
        "tokens": _dictionary(contract_table(tok, TOKEN_TYPES), {"run_id": run_id}),
        "scores": _dictionary(contract_table(sc, SCORE_TYPES), {"run_id": run_id, "scorer": scorer}),
    }
    if f.routing is not None:
        tables["routing"] = _routing_table(f, L, run_id)
    return tables, stats


EXPERT_ID_END = 1 << 15
"""`routing.expert_ids` and `routing.layer` are SMALLINT: an expert id or layer index is a whole number in
[0, 2^15)."""


def _routing_table(f: FlatBatch, L: _Layout, run_id: str) -> pa.Table:
    """The `routing` rows of the stored positions whose route was captured: one row per (position, layer),
    ordered (seq, pos, layer); ValueError when the shape is not [N, L, k] or an id or layer index is not a
    whole number in [0, EXPERT_ID_END)."""
    routes = np.asarray(f.routing)
    where = f"step {f.step}, rank {f.rank}: routing"
    if routes.ndim != 3 or len(routes) != f.offsets[-1] or routes.dtype.kind not in "iu":
        raise ValueError(f"{where} has shape {list(routes.shape)} of {routes.dtype}, expected integer expert ids "
                         f"[{int(f.offsets[-1])}, layers, k] (one block per position)")
    keep = np.ones(len(L.sel), bool) if f.routing_mask is None else np.asarray(f.routing_mask, bool)[L.sel]
    _, layers, k = routes.shape
    ids = routes[L.sel[keep]].reshape(-1, k)
    bad = (ids < 0) | (ids >= EXPERT_ID_END)
    if bad.any() or layers > EXPERT_ID_END:
        what = f"{layers} layers" if not bad.any() else f"{ids[bad][0]} ({int(bad.sum())} in all)"
        raise ValueError(f"{where} expert ids and layers must be whole numbers in [0, 2^15); got {what}")
    n, rows = int(keep.sum()), len(ids)
    cols = {"run_id": repeat(run_id, rows, pa.string()),
            "seq_id": pa.array(np.repeat(L.ids[L.row][keep], layers), type=pa.int64()),
            "pos": pa.array(np.repeat((L.sel - L.first[L.row])[keep].astype(np.int32), layers)),
            "side": repeat(ROUTING_ROLLOUT_SIDE, rows, pa.string()),
            "layer": pa.array(np.tile(np.arange(layers, dtype=np.int16), n)),
            "expert_ids": pa.ListArray.from_arrays(pa.array(np.arange(rows + 1, dtype=np.int32) * k),
                                                   pa.array(ids.reshape(-1).astype(np.int16))),
            "expert_weights": pa.nulls(rows, ROUTING_TYPES["expert_weights"]),  # not recorded by a dump
            "margin": pa.nulls(rows, ROUTING_TYPES["margin"])}
    return _dictionary(contract_table(cols, ROUTING_TYPES), {"run_id": run_id, "side": ROUTING_ROLLOUT_SIDE})


def check_batch_logprobs(f: FlatBatch) -> None:
    """ValueError "step S, rank R: <column> has N values above 0 ..." when a log-prob of `f` at a stored
    position exceeds LOGP_TOLERANCE (`check_logprobs`); the rule every writer of rows meets here."""
    stored = np.asarray(f.mask, dtype=bool)
    for name, values in (("logp_rollout", f.logp_rollout), ("logp_trainer", f.logp_trainer)):
        check_logprobs(values, f"step {f.step}, rank {f.rank}: {name}", stored)
    if f.topk_logps is not None and len(f.topk_logps):
        inner = pc.list_flatten(f.topk_logps.filter(pa.array(stored)))
        check_logprobs(inner.to_numpy(zero_copy_only=False), f"step {f.step}, rank {f.rank}: rollout_topk_logps")


def _token_columns(f: FlatBatch, L: _Layout, keys: dict, texts: TextLookup | None) -> tuple[dict, np.ndarray | None]:
    """The tokens columns of the stored positions, and their per-token advantages [n] (None if not given)."""
    sel, n = L.sel, len(L.sel)
    tok = {**keys, "token_id": pa.nulls(n, pa.int32())}
    if f.token_ids is not None:
        token_ids = np.asarray(f.token_ids)[sel]
        check_token_ids(token_ids, "token ids at stored positions")
        tok["token_id"] = pa.array(token_ids.astype(np.int32))
        if texts is not None:
            tok["token_text"], tok["category"] = texts(token_ids)
    tok["logp_rollout"], _ = floats(np.asarray(f.logp_rollout, dtype=np.float64)[sel])
    if f.topk_ids is not None:
        take = pa.array(sel)
        topk_ids = f.topk_ids.take(take)
        check_token_ids(pc.list_flatten(topk_ids).to_numpy(zero_copy_only=False), "rollout top-K ids")
        tok["topk_ids_rollout"] = topk_ids.cast(TOKEN_TYPES["topk_ids_rollout"])
        tok["topk_logps_rollout"] = _float_lists(f.topk_logps.take(take))
    adv_tok = None if f.advantage is None else np.asarray(f.advantage, dtype=np.float64)[sel]
    if adv_tok is not None:
        tok["advantage"], _ = floats(adv_tok)
    return tok, adv_tok


def _score_columns(f: FlatBatch, L: _Layout, keys: dict, scorer: str) -> tuple[dict, BatchStats]:
    """The scores columns of the stored positions (`nonfinite` where log mu or log pi is not finite), and
    the batch's token counts and sum |log pi - log mu| over the rows the analyses count as finite."""
    mu = np.asarray(f.logp_rollout, dtype=np.float64)[L.sel]
    pi = np.asarray(f.logp_trainer, dtype=np.float64)[L.sel]
    n = len(L.sel)
    logp, bad_pi = floats(pi)
    sc = {**keys, "scorer": repeat(scorer, n, pa.string()), "logp": logp}
    if f.entropy is not None:
        sc["entropy"], _ = floats(np.asarray(f.entropy, dtype=np.float64)[L.sel])
    bad = ~np.isfinite(mu) | bad_pi
    sc["nonfinite"] = pa.array(bad, type=pa.bool_())
    with np.errstate(invalid="ignore"):  # the summary counts rows as the analyses do: r must not overflow
        good = ~bad & (pi - mu < MAX_LOG_RATIO)
    stats = BatchStats(tokens=n, nonfinite=int(n - good.sum()), finite=int(good.sum()),
                       abs_diff_sum=float(np.abs(pi[good] - mu[good]).sum()))
    return sc, stats


def _sequence_columns(f: FlatBatch, L: _Layout, run_id: str, adv_tok: np.ndarray | None) -> dict:
    """The sequences columns of the kept samples."""
    kept, K = L.kept, len(L.kept)
    seq = {"run_id": repeat(run_id, K, pa.string()), "seq_id": pa.array(L.ids, type=pa.int64())}
    if f.prompt_id is not None:
        seq["prompt_id"] = pa.array(np.asarray(f.prompt_id, dtype=object)[kept], type=pa.string())
    seq["step"] = repeat(int(f.step), K, pa.int32())
    seq["response_len"] = pa.array(L.lens)
    if f.reward is not None:
        seq["reward"], _ = floats(np.asarray(f.reward, dtype=np.float64)[kept])
    elif f.token_reward is not None:
        seq["reward"], _ = floats(np.asarray(f.token_reward, dtype=np.float64)[L.first])
    seq_adv = None if f.seq_advantage is None else np.asarray(f.seq_advantage, dtype=np.float64)[kept]
    if adv_tok is not None:  # the sample's mean advantage over its stored tokens (NaN if one is missing)
        with np.errstate(invalid="ignore", divide="ignore"):  # an empty kept sample: NaN -> NULL
            mean = np.bincount(L.row, weights=adv_tok, minlength=K) / L.lens
        seq_adv = mean if seq_adv is None else np.where(np.isnan(seq_adv), mean, seq_adv)
    if seq_adv is not None:
        seq["advantage"], _ = floats(seq_adv)
    if f.prompt_before_mask:
        seq["prompt_len"] = pa.array((L.first - f.offsets[kept]).astype(np.int32))
    elif f.prompt_len is not None:
        seq["prompt_len"] = pa.array(np.asarray(f.prompt_len)[kept].astype(np.int32))
    take_kept = pa.array(kept)
    for name, values in f.extra.items():
        seq[name] = values.take(take_kept)
    return seq


def _dictionary(table: pa.Table, constants: dict[str, str]) -> pa.Table:
    """`table` with its constant string columns dictionary-encoded: Parquet then stores the one string
    once instead of hashing it on every row (~0.1 s per million rows and column); DuckDB reads the
    column as VARCHAR all the same."""
    n = table.num_rows
    for name, value in constants.items():
        col = pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, dtype=np.int32)), pa.array([value], pa.string()))
        table = table.set_column(table.schema.get_field_index(name), name, col)
    return table
