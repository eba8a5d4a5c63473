"""The app's Corrections comparison of a shard store still being written, per unit (run_id, step) as the Overview
(`units_overview`): the tables of `corrections.compare` at the published defaults and each pair's dropped tokens
(`dropped.PairDrops`), of every token or of the page's sample of prompt groups, merged from parts kept per set
of units, so that a refresh compares the new or changed steps only.

Why the parts add up: the comparison runs each method's rule chunk by chunk of whole sequences, and a rule
decides a sequence from that sequence alone, its advantage derived within its prompt group (same run, step and
prompt id); a shard unit holds whole prompt groups (every sequence of a unit carries its step), so comparing
disjoint sets of units and adding their sums (`report.TOKEN_SUMS`: counts and sums added, the maximum weight by
max; sequence counts added) gives the whole store's sums, up to the order floating-point sums are added in. The
pair rows (`layout.pair_info`) merge too (`merged_info`): counts added, has_topk an AND over the units with a
finite token of the pair, advantage_source the union of the sources. A unit is compared under the merged
has_topk of each pair (it decides whether the top-K rules run): a part compared under another value is compared
again with the new units (`_compute`). A pair's dropped flags are in (run_id, seq_id, pos) order: the parts'
sequences are put in that order again (`merged_drops`), the same PairDrops content as one pass over the store.

Kinds of parts (`Key`): ("compare", None, None) every token, every pair (the page's *Every token*, the
warm-up's comparison); ("compare", every, pair) the page's sample, 1 in `every` prompt groups
(`analysis.sample`), of one pair; ("info", every, None) the sample's pair rows and size, which the page lists
the pairs from. A sample's parts hold only the units with a sampled prompt group (their group hashes are the
Overview's per-unit `groups`): a refresh whose new steps hold none compares nothing.

Each set of units computed together (the first load: all; a refresh: its new units) is one part, kept under its
units' fingerprints in memory and in the store's results cache (one entry a part, and an index of them), so a
fresh process reuses them; past MAX_PARTS parts they are merged into one. Overrides of the methods' parameters
are not kept per unit: the app compares them on the whole store (`lab_ui`), every method, since the parts' sums
are not one pass's chunks for an override's rules to be spliced into (`compare._Accumulator.spliced`).

Measured (2-core EPYC, loaded; one run of 200 steps of 16 × 312 tokens, 1 M tokens, one pair): the first
comparison of every token 4.8 CPU s; after 5 new steps 0.5-0.8 CPU s (the rules on the new steps ~0.4, the
tables from the merged sums ~0.15, the Overview's per-unit counts of the new steps ~0.1); a fresh process
reading the parts back 0.1 s.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from mismatch_lab.store import cache
from mismatch_lab.store.units import Unit, by_unit
from mismatch_lab.store.units_overview import OverviewUnits

MAX_PARTS = 16
"""Parts kept per kind: past it they are merged into one (a refresh then merges few parts)."""
PAIR = ["rollout", "scorer"]
TOKEN_KEYS = ["adv_sign", "mu_bucket", "category"]
INFO_COLUMNS = {"rollout": "object", "scorer": "object", "n_tokens": "int64", "n_nonfinite": "int64",
                "has_topk": "bool", "advantage_source": "object"}
Key = tuple  # (kind, every, pair): see the module doc


@dataclass
class Part:
    """The comparison of one set of units compared together."""

    fps: dict[Unit, str]  # its units and their fingerprints
    info: pd.DataFrame  # layout.pair_info of its units (their own has_topk)
    topk: dict[tuple, bool] = field(default_factory=dict)  # pair -> the has_topk it was compared under
    tok: pd.DataFrame | None = None  # token sums per (label, rollout, scorer, TOKEN_KEYS): report.TOKEN_SUMS
    seq: pd.DataFrame | None = None  # sequences and those dropped whole per (label, rollout, scorer, adv_sign)
    drops: dict = field(default_factory=dict)  # pair -> dropped.PairDrops of its finite tokens
    size: dict = field(default_factory=dict)  # sequences and tokens of its units (`sample.sample_size`)
    id: str = ""  # a digest of the key and fps
    slot: int = 0  # its entry in the results cache


# --- the pair rows and the dropped flags, merged -------------------------------------------------------------


def empty_info() -> pd.DataFrame:
    """pair_info's columns without rows (a set of no units)."""
    return pd.DataFrame({c: pd.Series(dtype=t) for c, t in INFO_COLUMNS.items()})


def merged_info(infos: list[pd.DataFrame]) -> pd.DataFrame:
    """`layout.pair_info` of the union of disjoint sets of units from each set's rows: n_tokens and n_nonfinite
    added, has_topk true where every set with a finite token of the pair has it (false without any),
    advantage_source the distinct sources joined by ' + ' in order; rows by (rollout, scorer)."""
    rows = [i for i in infos if len(i)]
    if not rows:
        return next((i.iloc[:0] for i in infos if len(i.columns)), empty_info())
    found = pd.concat(rows, ignore_index=True)
    found["topk_ok"] = found["has_topk"] | (found["n_tokens"] == 0)
    found["any_finite"] = found["n_tokens"] > 0
    g = found.groupby(PAIR, sort=True)
    out = g.agg(n_tokens=("n_tokens", "sum"), n_nonfinite=("n_nonfinite", "sum"), topk_ok=("topk_ok", "all"),
                any_finite=("any_finite", "any"),
                advantage_source=("advantage_source", lambda s: " + ".join(sorted({x for v in s
                                                                                     for x in v.split(" + ")}))))
    out = out.reset_index()
    out["has_topk"] = out["topk_ok"] & out["any_finite"]
    return out[list(INFO_COLUMNS)].astype({c: rows[0][c].dtype for c in INFO_COLUMNS})  # (DuckDB's dtypes)


def merged_topk(merged: pd.DataFrame) -> dict[tuple, bool]:
    """pair -> has_topk of merged pair rows: whether the top-K rules run on the pair."""
    return {(r, s): bool(t) for r, s, t in zip(merged["rollout"], merged["scorer"], merged["has_topk"])}


def _topk_of(merged: pd.DataFrame, info: pd.DataFrame) -> dict[tuple, bool]:
    """pair -> merged's has_topk, for the pairs of `info` with a finite token (the ones a part compares)."""
    at = merged_topk(merged)
    return {(r, s): at[(r, s)] for r, s, n in zip(info["rollout"], info["scorer"], info["n_tokens"]) if n > 0}


def merged_drops(found: list):
    """One pair's PairDrops of disjoint sets of sequences, with the content of one pass over them all: the
    sequences in (run_id, seq_id) order, their tokens after them in their order, each method's flags so
    reordered (the methods every set has: the same under one has_topk)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from mismatch_lab.corrections.dropped import PairDrops
    from mismatch_lab.corrections.layout import ragged

    found = [d for d in found if d.seqs is not None]
    if len(found) <= 1:
        return found[0] if found else PairDrops(None, np.zeros(0, dtype=np.int32), np.zeros(0),
                                                np.zeros(0, dtype=np.int64))
    seqs = pa.concat_tables([_plain(d.seqs) for d in found])
    lengths = np.concatenate([np.diff(np.append(d.seq_start, len(d.pos))) for d in found])
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    order = pc.sort_indices(seqs, sort_keys=[("run_id", "ascending"), ("seq_id", "ascending")]).to_numpy()
    in_order = bool((order == np.arange(len(order))).all())  # (a refresh's new steps after the kept ones)
    tokens = slice(None) if in_order else np.repeat(starts[order], lengths[order]) + ragged(lengths[order])[1]
    labels = set.intersection(*(set(d.dropped) for d in found))
    n = [len(d.pos) for d in found]
    flags = {m: np.packbits(np.concatenate([np.unpackbits(d.dropped[m], count=k) for d, k in zip(found, n)])[tokens])
             for m in sorted(labels)}
    out = seqs if in_order else seqs.take(order)
    out = out.set_column(0, "run_id", pc.dictionary_encode(out.column("run_id"))).combine_chunks()
    new_start = np.concatenate([[0], np.cumsum(lengths[order])[:-1]]).astype(found[0].seq_start.dtype)
    pos = np.concatenate([d.pos for d in found])[tokens]
    log_ratio = np.concatenate([d.log_ratio for d in found])[tokens]
    return PairDrops(out, pos, log_ratio, new_start, {m: flags[m] for m in found[0].dropped if m in labels})


def _plain(seqs):
    """A PairDrops' sequence keys with run_id as plain strings (each set encodes its own dictionary)."""
    import pyarrow as pa

    run = seqs.column("run_id")
    return seqs.set_column(0, "run_id", run.cast(run.type.value_type)) if pa.types.is_dictionary(run.type) else seqs




# --- computing a part ----------------------------------------------------------------------------------------


@contextlib.contextmanager
def _view(source: OverviewUnits, units, every: int | None, pair: tuple | None):
    """The store of `units` alone (and the run rows), as the comparison reads it: every token, or the sample's
    views (`sample.sampled`: on a connection of their own, as they read the store's views by name)."""
    from mismatch_lab.analysis.sample import sampled
    from mismatch_lab.store import reader

    if every is None:
        with source.connection(units) as con:
            yield con
        return
    con = reader._open_parquet_dir(source.scan.root, source.scan.files(source.snap, units))
    try:
        yield sampled(con.cursor(), every, pair)
    finally:
        con.close()


def _compared(view, info: pd.DataFrame, topk: dict[tuple, bool]) -> tuple:
    """(token sums, sequence counts, pair -> PairDrops) of every method at its published defaults on the view,
    its pairs compared under `topk`'s has_topk."""
    from mismatch_lab.corrections.compare import accumulate, variants
    from mismatch_lab.corrections.dropped import DropRecorder

    todo = info[info["n_tokens"] > 0].reset_index(drop=True)
    todo = todo.assign(has_topk=[topk[(r, s)] for r, s in zip(todo["rollout"], todo["scorer"])])
    record = DropRecorder()
    sums = accumulate(view, variants(), todo, record=record).sums()
    return _frame(sums.tokens, todo), _frame(sums.seqs, todo), record.result()


def _frame(parts: list, info: pd.DataFrame) -> pd.DataFrame | None:
    """An accumulator's entries (keys, {column: array or scalar}) as one frame, the pair index named by its
    (rollout, scorer) of `info`, rolled up per key (the sums of one part: fewer rows to keep and merge)."""
    from mismatch_lab.corrections.compare import entries_frame
    from mismatch_lab.corrections.report import TOKEN_SUMS

    keys = entries_frame(parts)
    if keys is None:
        return None
    keys["rollout"] = info["rollout"].to_numpy()[keys["pair"].to_numpy()]
    keys["scorer"] = info["scorer"].to_numpy()[keys["pair"].to_numpy()]
    by = ["label", *PAIR, *[k for k in TOKEN_KEYS if k in keys]]
    how = {c: TOKEN_SUMS.get(c, "sum") for c in keys.columns if c not in (*by, "pair")}
    return keys.groupby(by, sort=False, dropna=False).agg(how).reset_index()


def _compute(source: OverviewUnits, key: Key, todo: list[Unit], kept: list[Part]) -> tuple[Part | None, list[Part]]:
    """(the new part of the units `todo`, None without any; the kept parts still good): with a comparison, the
    kept parts compared under another has_topk than the merged one now are compared again within the new part."""
    from mismatch_lab.analysis.sample import sample_size
    from mismatch_lab.corrections.layout import pair_info

    kind, every, pair = key
    fps = source.fingerprints()
    info, stale = empty_info(), []
    with _view(source, todo, every, pair) if todo else contextlib.nullcontext() as view:
        if todo:
            info = pair_info(view)
            if kind == "info":
                return Part({u: fps[u] for u in todo}, info, size=sample_size(view)), kept
        merged = merged_info([*(p.info for p in kept), info])
        stale = [p for p in kept if p.topk != _topk_of(merged, p.info)]
        if todo and not stale:
            return Part({u: fps[u] for u in todo}, info, _topk_of(merged, info),
                        *_compared(view, info, merged_topk(merged))), kept
    if not stale:
        return None, kept
    units = sorted({*todo, *(u for p in stale for u in p.fps)})
    info = merged_info([info, *(p.info for p in stale)])
    with _view(source, units, every, pair) as view:
        part = Part({u: fps[u] for u in units}, info, _topk_of(merged, info),
                    *_compared(view, info, merged_topk(merged)))
    return part, [p for p in kept if p not in stale]


def _merged_part(parts: list[Part], key: Key) -> Part:
    """One part of the parts' units: their rows, sums and drops merged (what MAX_PARTS keeps)."""
    from mismatch_lab.corrections.report import TOKEN_SUMS

    info = merged_info([p.info for p in parts])
    out = Part({u: fp for p in parts for u, fp in p.fps.items()}, info)
    out.size = {k: sum(p.size.get(k, 0) for p in parts) for k in ("sequences", "tokens")} if key[0] == "info" else {}
    if key[0] == "compare":
        out.topk = _topk_of(info, info)
        for name, by in (("tok", TOKEN_KEYS), ("seq", ["adv_sign"])):
            frames = [getattr(p, name) for p in parts if getattr(p, name) is not None]
            if frames:
                rows = pd.concat(frames, ignore_index=True)
                how = {c: TOKEN_SUMS.get(c, "sum") for c in rows.columns if c not in ("label", *PAIR, *by)}
                setattr(out, name, rows.groupby(["label", *PAIR, *by], sort=False, dropna=False).agg(how).reset_index())
        pairs = dict.fromkeys(pr for p in parts for pr in p.drops)
        out.drops = {pr: merged_drops([p.drops[pr] for p in parts if pr in p.drops]) for pr in pairs}
    return out


# --- the parts kept --------------------------------------------------------------------------------------------

_PARTS: dict[tuple, list[Part]] = {}  # (store, key) -> its parts
_MERGED: dict[tuple, tuple] = {}  # (store, key, what) -> (the parts' ids, the merged result)
_LOCK = threading.Lock()


def _wanted(source: OverviewUnits, results: cache.ResultsCache, every: int | None) -> dict[Unit, str]:
    """unit -> fingerprint of the units a kind reads: every unit, or those holding a prompt group of the sample."""
    fps = source.fingerprints()
    if every is None:
        return dict(fps)
    found = by_unit(source, results, "groups")
    found = found[found["h"].astype("uint64") % every == 0]
    return {u: fps[u] for u in zip(found["run_id"], found["step"].astype("int64").tolist()) if u in fps}


def _kept(source: OverviewUnits, results: cache.ResultsCache, key: Key) -> list[Part]:
    """The parts of `key` in memory, else those the results cache holds (its index, then each part)."""
    with _LOCK:
        parts = _PARTS.get((source.key, key))
    if parts is not None:
        return parts
    index = results.get(("corrections.parts", *key), "parts")
    found = [] if index is cache.MISSING else [results.get(("corrections.part", *key, slot), pid)
                                               for slot, pid, _ in index]
    return [p for p in found if p is not cache.MISSING]


def _covered(source: OverviewUnits, results: cache.ResultsCache, key: Key) -> list[dict[Unit, str]]:
    """The units (with their fingerprints) of each part of `key` kept in memory, else of the results cache's
    index (without reading the parts)."""
    with _LOCK:
        found = _PARTS.get((source.key, key))
    if found is not None:
        return [p.fps for p in found]
    index = results.get(("corrections.parts", *key), "parts")
    return [] if index is cache.MISSING else [fps for _, _, fps in index]


def parts(source: OverviewUnits, results: cache.ResultsCache, key: Key) -> list[Part]:
    """The parts of `key` (module doc) as of the store's snapshot: those whose units are all unchanged kept, one
    new part over every other unit (and over the kept ones compared under a has_topk merged otherwise now)."""
    wanted = _wanted(source, results, key[1])
    old = _kept(source, results, key)
    kept = [p for p in old if all(wanted.get(u) == fp for u, fp in p.fps.items())]
    todo = sorted(set(wanted) - {u for p in kept for u in p.fps})
    if not todo and len(kept) == len(old):
        with _LOCK:
            _PARTS[(source.key, key)] = kept
        return kept
    new, kept = _compute(source, key, todo, kept)
    if new is not None:
        kept = [*kept, _named(new, key, {p.slot for p in kept})]
        results.put(("corrections.part", *key, kept[-1].slot), kept[-1].id, kept[-1])
    if len(kept) > MAX_PARTS:
        kept = [_named(_merged_part(kept, key), key, set())]
        results.put(("corrections.part", *key, 0), kept[0].id, kept[0])
    results.put(("corrections.parts", *key), "parts", [(p.slot, p.id, p.fps) for p in kept])
    with _LOCK:
        _PARTS[(source.key, key)] = kept
    return kept


def _named(part: Part, key: Key, taken: set[int]) -> Part:
    part.id = cache._digest((key, sorted(part.fps.items())))
    part.slot = min(set(range(len(taken) + 1)) - taken)
    return part


def _memo(source: OverviewUnits, key: Key, what, found: list[Part], make):
    """`make()` once per set of parts (by their ids): the merged result of `key`'s parts."""
    ids = tuple(p.id for p in found)
    with _LOCK:
        memo = _MERGED.get((source.key, key, what))
    if memo is not None and memo[0] == ids:
        return memo[1]
    value = make()
    with _LOCK:
        _MERGED[(source.key, key, what)] = (ids, value)
    return value


# --- the look-ups ------------------------------------------------------------------------------------------------


def comparison(source: OverviewUnits, results: cache.ResultsCache, every: int | None = None,
               pair: tuple | None = None) -> dict[str, pd.DataFrame]:
    """`compare.compare` (published defaults) of every token (every None) or of the sample 1 in `every` prompt
    groups of `pair` (`sample.sampled(cur, every, pair)`), merged from the parts (module doc)."""
    key = ("compare", every, None if pair is None else tuple(pair))
    found = parts(source, results, key)
    return {name: t.copy() for name, t in _memo(source, key, "tables", found, lambda: _tables(found)).items()}


def _tables(found: list[Part]) -> dict[str, pd.DataFrame]:
    """report.tables of the parts' sums under their merged pair rows."""
    from mismatch_lab.corrections.compare import variants
    from mismatch_lab.corrections.report import tables

    info = merged_info([p.info for p in found])
    index = {pr: i for i, pr in enumerate(zip(info["rollout"], info["scorer"]))}

    def frame(name: str):
        frames = [getattr(p, name) for p in found if getattr(p, name) is not None]
        if not frames:
            return None
        rows = pd.concat(frames, ignore_index=True)
        rows.insert(0, "pair", [index[pr] for pr in zip(rows["rollout"], rows["scorer"])])
        return rows.drop(columns=PAIR).astype({"pair": "int64"})

    tok, seq = frame("tok"), frame("seq")
    return tables(variants(), tok, seq if tok is not None else None, info)


def pair_drops(source: OverviewUnits, results: cache.ResultsCache, every: int | None, pair: tuple):
    """The PairDrops of `pair` of the comparison `comparison(every, pair)` reads (every token: of every pair's)."""
    key = ("compare", every, None if every is None else tuple(pair))
    found = parts(source, results, key)
    return _memo(source, key, ("drops", tuple(pair)), found,
                 lambda: merged_drops([p.drops[tuple(pair)] for p in found if tuple(pair) in p.drops]))


def sample_info(source: OverviewUnits, results: cache.ResultsCache, every: int) -> pd.DataFrame:
    """`layout.pair_info` of the sample 1 in `every` prompt groups."""
    key = ("info", every, None)
    found = parts(source, results, key)
    return _memo(source, key, "info", found, lambda: merged_info([p.info for p in found])).copy()


def sample_size(source: OverviewUnits, results: cache.ResultsCache, every: int | None = None) -> dict:
    """`sample.sample_size` of the store (every None: its sequences and tokens from the Overview's per-unit
    counts) or of its sample 1 in `every` prompt groups."""
    if every is None:
        counts = by_unit(source, results, "unit_counts")
        return {"sequences": int(counts["n_sequences"].sum()), "tokens": int(counts["n_tokens"].sum())}
    found = parts(source, results, ("info", every, None))
    return {k: int(sum(p.size[k] for p in found)) for k in ("sequences", "tokens")}


def exact_kept(source: OverviewUnits, results: cache.ResultsCache, tokens: int) -> bool:
    """Whether the comparison of every token is kept but for units of at most `tokens` tokens in all (a
    refresh then compares about as many tokens as a sample would): the page then shows it, not a sample."""
    found = _covered(source, results, ("compare", None, None))
    if not found:
        return False
    fps = source.fingerprints()
    covered = {u for units in found if all(fps.get(u) == fp for u, fp in units.items()) for u in units}
    counts = by_unit(source, results, "unit_counts")
    new = [(r, int(s)) not in covered for r, s in zip(counts["run_id"], counts["step"])]
    return int(counts.loc[new, "n_tokens"].sum()) <= tokens
