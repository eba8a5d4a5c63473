"""The app's Overview of a shard store still being written, per unit (run_id, step) as the Training page
(`store.units`): the run list, the precision table and the doctor's view, each equal to its whole-store query,
merged from parts kept per unit, so that a refresh computes the new or changed steps only.

What is kept per unit (`QUERIES`, computed together on one connection over the units, cached one entry a unit):
    unit_counts    per (run_id, step): sequences, rewarded sequences, tokens (the run list's counts)
    scorer_counts  per (run_id, step, scorer): score rows and non-finite ones (the run list's scorers)
    pair_sums      per (rollout, scorer, run_id, step): the additive sums of the precision table's token columns
                   (`rows.Rows.step_sums`: counts, sums, maxima); rolled up per pair they are the precision table's
                   token columns, per step the doctor's per-step series (its growth check)
    seq_drift      per (pair, sequence): `Rows.sequences` (the precision table's sequence drift summary: a least
                   squares fit over every sequence, computed from these rows in the whole-store order)
    seq_doctor     per (pair, sequence): the doctor's per-sequence sums (`measure.per_sequence_sql`)
    nemo_rl        `nemo_rl_metric.nemo_rl_table` (per run, pair and step)
    flags          per unit: rows of what a per-unit merge does not reproduce (routing rows, a stored exact TV,
                   a stored log S); where any unit has one, the doctor falls back to the whole store
    groups         per unit: the hash of each prompt group (which units a sample of prompt groups reads)
pair_sums, seq_drift and seq_doctor split one per-sequence pass over the rows (`_per_sequence`), unit_counts and
flags one per-unit pass (`_unit_rows`): what a refresh pays whatever its size is mostly DuckDB planning each query
(~15 ms of CPU for one over the per-token metrics).
Every sequence of a shard unit carries the unit's step, and its token and score rows lie in the unit (the writers
write them together): a unit's rows are split off by the sequences' (run_id, step). The runs' own columns, the
skipped prompts and the batch-invariance runs come from the run rows alone (a connection over no unit). A unit
with a damaged shard is read without that shard's rows, as the whole-store reader reads it, and its lines are
kept per unit fingerprint (`_damaged`).

The advice's dropped shares (`measure.corrections`) are counts of sequences per (method, pair) on a sample of
whole prompt groups, 1 in `measure.sample_every` (a power of two: it changes only when the store doubles). A
method's rule decides each sequence from its prompt group alone (`corrections.compare` runs it chunk by chunk
of whole sequences), and a prompt group lies in one unit, so the counts of disjoint sets of units add up
(`_corrections`): each set of units computed together (the first load: all; a refresh: its new units) is kept
as one part, under its units' fingerprints and the stride; a part whose unit changed is computed again. Only
the units holding a sampled prompt group are compared (the hashes of each unit's groups are kept per unit,
`groups`): a refresh whose new steps hold none compares nothing.
"""

from __future__ import annotations

import threading

import pandas as pd

from mismatch_lab.store import cache
from mismatch_lab.store.units import ShardUnits, UnitQuery, _on, by_unit


def _rows(con):
    """The rollout row set of the units on `con`, one per connection (`relations.once`)."""
    from mismatch_lab.analysis.relations import Filters, once
    from mismatch_lab.analysis.rows import Rows

    return once(con, "overview_rows", lambda: Rows(con, Filters(), topk=False))


def _unit_rows(con) -> pd.DataFrame:
    """Per (run_id, step) in one query: the run list's counts (`unit_counts`) and the rows a per-unit merge does
    not reproduce (`flags`)."""
    from mismatch_lab.analysis.relations import col, once, query, table_columns

    def run():
        reward = col(table_columns(con, "sequences"), "q", "reward", "DOUBLE")
        scols = table_columns(con, "scores")
        count = {name: f"count(s.{name})" if name in scols else "0"
                 for name in ("tv_exact_vs_ref", "log_support", "logps_at_rollout_topk")}
        return query(con, f"""
            WITH t AS (SELECT run_id, seq_id, count(*) AS n FROM tokens GROUP BY ALL),
                 s AS (SELECT s.run_id, s.seq_id, {count['tv_exact_vs_ref']} AS n_exact,
                              {count['log_support']} AS n_log_s, {count['logps_at_rollout_topk']} AS n_topk
                       FROM scores s GROUP BY ALL),
                 r AS (SELECT run_id, seq_id, count(*) AS n_routing FROM routing GROUP BY ALL)
            SELECT q.run_id, q.step, count(*) AS n_sequences, count({reward}) AS n_rewarded,
                   coalesce(sum(t.n), 0)::BIGINT AS n_tokens, coalesce(sum(s.n_exact), 0)::BIGINT AS n_exact,
                   coalesce(sum(s.n_log_s), 0)::BIGINT AS n_log_s, coalesce(sum(s.n_topk), 0)::BIGINT AS n_topk,
                   coalesce(sum(r.n_routing), 0)::BIGINT AS n_routing
            FROM sequences q LEFT JOIN t USING (run_id, seq_id) LEFT JOIN s USING (run_id, seq_id)
                 LEFT JOIN r USING (run_id, seq_id) GROUP BY ALL""")

    return once(con, "overview_unit_rows", run)


def unit_counts(con) -> pd.DataFrame:
    return _unit_rows(con)[["run_id", "step", "n_sequences", "n_rewarded", "n_tokens"]]


def scorer_counts(con) -> pd.DataFrame:
    from mismatch_lab.analysis.relations import query

    return query(con, """
        SELECT s.run_id, q.step, s.scorer, count(*) AS n, count(*) FILTER (WHERE s.nonfinite) AS n_nonfinite
        FROM scores s JOIN sequences q USING (run_id, seq_id) GROUP BY ALL""")


def _per_sequence(con) -> pd.DataFrame:
    """One pass over the rollout row set, per (pair, sequence) in the whole-store order, with its step: the
    columns of `Rows.sequences` (`rows.SEQUENCE_SUMS`, adv_sign), of the doctor's `measure.PER_SEQUENCE` and the
    precision sums (`rows.PRECISION_SUMS`). The three look-ups below split it: one plan a refresh instead of
    three (a plan of the per-token metrics' SQL costs ~15 ms of CPU; the rows of a few steps, ~1 ms)."""
    from mismatch_lab.analysis.relations import once, query
    from mismatch_lab.analysis.rows import (
        PRECISION_SUMS,
        SEQUENCE_SUMS,
        Thresholds,
        column_name,
        sums_parts,
    )
    from mismatch_lab.doctor.measure import PER_SEQUENCE

    def run():
        rows = _rows(con)
        rel, params = rows.sql["rollout"]
        parts: dict[str, str] = {}  # name -> '<expression> AS <name>' (n_nonfinite is in two of the lists)
        for part in (*SEQUENCE_SUMS, *PER_SEQUENCE, *sums_parts(Thresholds(), PRECISION_SUMS, absent=rows.absent)):
            if parts.setdefault(column_name(part), part) != part:
                raise ValueError(f"two definitions of the per-sequence column {column_name(part)!r}")
        keys = ", ".join(SEQ_ORDER)
        return query(con, f"""SELECT {keys}, any_value(step) AS step, any_value(adv_sign) AS adv_sign,
                                     {', '.join(parts.values())}
                              FROM ({rel}) GROUP BY {keys} ORDER BY {keys}""", params).astype({"run_id": "object"})

    return once(con, "overview_per_sequence", run)


def _columns_of(con, columns: list[str]) -> pd.DataFrame:
    """Some columns of `_per_sequence`, with the sequence's keys and step."""
    if not _rows(con).ok:
        return pd.DataFrame(columns=[*SEQ_ORDER, "step"])
    return _per_sequence(con)[[*SEQ_ORDER, *columns, "step"]]


def pair_sums(con) -> pd.DataFrame:
    """The precision sums per (pair, run, step) of the sequences with a step (`Rows.step_sums`, added up here
    from the sequences' sums)."""
    from mismatch_lab.analysis.rows import PRECISION_SUMS, rollup

    keys = ["rollout", "scorer", "run_id", "step"]
    if not _rows(con).ok:
        return pd.DataFrame(columns=[*keys, *PRECISION_SUMS])
    seqs = _per_sequence(con)
    sums = rollup(seqs[seqs["step"].notna()], keys)
    return sums.sort_values(keys, kind="stable").reset_index(drop=True)[[*keys, *PRECISION_SUMS]]


def seq_drift(con) -> pd.DataFrame:
    from mismatch_lab.analysis.rows import SEQUENCE_SUMS, column_name

    return _columns_of(con, [column_name(p) for p in SEQUENCE_SUMS] + ["adv_sign"])


def seq_doctor(con) -> pd.DataFrame:
    from mismatch_lab.analysis.rows import column_name
    from mismatch_lab.doctor.measure import PER_SEQUENCE

    return _columns_of(con, [column_name(p) for p in PER_SEQUENCE])


def nemo_rl(con) -> pd.DataFrame:
    from mismatch_lab.analysis.nemo_rl_metric import nemo_rl_table

    return nemo_rl_table(con)


def flags(con) -> pd.DataFrame:
    return _unit_rows(con)[["run_id", "step", "n_exact", "n_log_s", "n_topk", "n_routing"]]


def groups(con) -> pd.DataFrame:
    """Per unit, the hash of each of its prompt groups (`sample.group_key_sql`): which units a sample keeps rows of."""
    from mismatch_lab.analysis.relations import query
    from mismatch_lab.analysis.sample import group_key_sql

    return query(con, f"SELECT DISTINCT q.run_id, q.step, {group_key_sql(con)} AS h FROM sequences q")


SEQ_ORDER = ("rollout", "scorer", "run_id", "seq_id")
QUERIES = {
    "unit_counts": UnitQuery(unit_counts, ("run_id", "step")),
    "scorer_counts": UnitQuery(scorer_counts, ("run_id", "step", "scorer")),
    "pair_sums": UnitQuery(pair_sums, ("rollout", "scorer", "run_id", "step")),
    "seq_drift": UnitQuery(seq_drift, SEQ_ORDER),
    "seq_doctor": UnitQuery(seq_doctor, SEQ_ORDER),
    "nemo_rl": UnitQuery(nemo_rl, ("run_id", "rollout", "scorer", "step")),
    "flags": UnitQuery(flags, ("run_id", "step")),
    "groups": UnitQuery(groups, ("run_id", "step", "h")),
}


class OverviewUnits(ShardUnits):
    """The units of a shard store as the Overview reads them (`QUERIES`)."""

    queries = tuple(QUERIES)


# --- the Overview's look-ups ------------------------------------------------------------------------------------


def _on_runs(source: ShardUnits, results: cache.ResultsCache, name: str, fn):
    """`fn(con)` on a connection over the store's run rows alone, cached under those rows' files."""
    key = cache._digest((cache.code_fingerprint(), sorted(source.snap.runs.items())))
    return results.get_or_compute(("overview.runs", name), key, lambda: _on(source, [], fn))


def list_runs(source: ShardUnits, results: cache.ResultsCache) -> pd.DataFrame:
    """`browse.list_runs` of a shard store: each run's columns from its rows, its counts from the units' parts."""
    from mismatch_lab.analysis import browse

    runs = _on_runs(source, results, "list_runs", browse.list_runs)
    counts = by_unit(source, results, "unit_counts")
    counts = counts[counts["n_sequences"] > 0]
    by_run = counts.groupby("run_id")
    scorers = by_unit(source, results, "scorer_counts").groupby(["run_id", "scorer"])[["n", "n_nonfinite"]].sum()
    by_scorer = scorers.reset_index().groupby("run_id")
    per_run = {"n_sequences": by_run["n_sequences"].sum(), "n_tokens": by_run["n_tokens"].sum(),
               "n_rewarded": by_run["n_rewarded"].sum(), "steps": by_run.size(),
               "n_scores": by_scorer["n"].sum(), "n_nonfinite": by_scorer["n_nonfinite"].sum()}
    out = runs.copy()
    for column, values in per_run.items():
        out[column] = out["run_id"].map(values).fillna(0).astype(runs[column].dtype)
    names = by_scorer["scorer"].agg(lambda s: ", ".join(sorted(s)))
    out["scorers"] = out["run_id"].map(names).fillna("").astype(runs["scorers"].dtype)
    return out


def _sequences(source, results, name: str) -> pd.DataFrame:
    """The per-sequence rows of every unit (`seq_drift` / `seq_doctor`) in the whole-store order (`by_unit` keeps
    them sorted by SEQ_ORDER, their query's order), without step."""
    return by_unit(source, results, name).drop(columns="step")


def precision_table(source: ShardUnits, results: cache.ResultsCache) -> pd.DataFrame:
    """`precision.precision_table` of a shard store, from the units' sums and sequences (merged once per
    snapshot: the page's table and the doctor's pairs read the same)."""
    from mismatch_lab.analysis.precision import precision_from

    fps = source.fingerprints()
    with _MEMO_LOCK:
        memo = _MEMO.get(source.key)
    if memo is None or memo[0] != fps:
        sums = by_unit(source, results, "pair_sums")
        memo = (fps, precision_from(sums, _sequences(source, results, "seq_drift")))
        with _MEMO_LOCK:
            _MEMO[source.key] = memo
    return memo[1].copy()


_MEMO: dict[str, tuple[dict, pd.DataFrame]] = {}  # store -> (fingerprints, its precision table)
_MEMO_LOCK = threading.Lock()


def _exact(source: ShardUnits, results: cache.ResultsCache) -> bool:
    """Whether the doctor merged from parts equals the whole store's (module doc): no unit holds routing rows,
    an exact TV, a log S or the trainer's top-K (the top-K rules are skipped for a pair where any finite token
    lacks the lists: not a sum of parts), and no two collect runs of a rollout differ in their generation batch
    alone."""
    from mismatch_lab.figures.batch import batch_groups, batch_runs

    found = by_unit(source, results, "flags")[["n_exact", "n_log_s", "n_topk", "n_routing"]]
    return not found.to_numpy().any() and not _on_runs(source, results, "batch_groups",
                                                       lambda con: bool(batch_groups(batch_runs(con))))


def doctor_view(source: ShardUnits, results: cache.ResultsCache):
    """`report.doctor_view` of a shard store merged from the units' parts, or None where a part it reads is not
    kept per unit (`_exact`: the caller then asks the whole store)."""
    from mismatch_lab.doctor import measure
    from mismatch_lab.doctor.report import judged, view_of

    if not _exact(source, results):
        return None
    m = measure.Measured(_frames(source, results), {})
    return view_of(judged(m, attribution=False, incomplete=lambda: _incomplete(source, results)))


def _frames(source: ShardUnits, results: cache.ResultsCache) -> dict:
    """measurement -> a function giving its frame (`measure.MEASUREMENTS`' names) from the units' parts."""
    from mismatch_lab.analysis import steps
    from mismatch_lab.analysis.nemo_rl_metric import pair_summary
    from mismatch_lab.doctor import attribution, measure

    def pairs():
        tokens = precision_table(source, results)
        if tokens.empty:
            return tokens
        return measure.pair_measures(tokens, _on_frame(_sequences(source, results, "seq_doctor"),
                                                       measure.pair_sequence_sql("seq")))

    def growth():
        sums = by_unit(source, results, "pair_sums")
        return steps.growth(steps.series_of(sums[sums["step"].notna()]), "abs_dp_mean")

    def nemo():
        table = by_unit(source, results, "nemo_rl")
        return pair_summary(table.sort_values(["run_id", "rollout", "scorer", "step"]).reset_index(drop=True))

    def runs_only(fn):
        return lambda: _on_runs(source, results, fn.__name__, lambda con: fn(_Con(con)))

    return {"pairs": pairs, "steps": growth, "nemo_rl": nemo, "corrections": lambda: _corrections(source, results),
            "support": lambda: attribution.support_table(
                pd.DataFrame(columns=["rollout", "scorer", "lmu", "lpi", "finite", "log_s"])),
            **{name: runs_only(getattr(measure, name)) for name in ("batch", "skipped", "approximation", "routing")}}


class _Con:
    """What a measurement reading the run rows alone needs of `measure.Measurements`: its connection."""

    def __init__(self, con):
        self.con = con


def _on_frame(frame: pd.DataFrame, sql: str) -> pd.DataFrame:
    """`sql` over `frame` registered as the relation `seq`, on a cursor of the process's one-thread database."""
    from mismatch_lab.store.units import _small

    cur = _small()
    try:
        cur.register("seq", frame)
        return cur.execute(sql).df()
    finally:
        cur.close()


# --- damaged shards --------------------------------------------------------------------------------------------

_DAMAGED: dict[tuple, tuple] = {}  # (store, unit) -> (its fingerprint, [(run_id, path, line)] of its damaged shards)
_DAMAGED_LOCK = threading.Lock()


def _damaged(source: ShardUnits) -> list[tuple[str, str, str]]:
    """(run_id, path, line) of each damaged committed shard of the store (`reader.damaged_units`), by run and path:
    a unit's files checked once per fingerprint."""
    from mismatch_lab.store.shards import Damaged, parquet_damage

    snap, root, out = source.snap, source.scan.root, []
    for unit, fp in snap.fingerprints.items():
        key = (source.key, unit)
        with _DAMAGED_LOCK:
            checked, found = _DAMAGED.get(key, (None, None))
        if checked != fp:  # (one entry a unit: a unit rewritten at every refresh does not add one each time)
            whys = [(t, p, parquet_damage(p)) for t, ps in source.scan.committed(snap, unit).items() for p in ps]
            found = [(d.run_id, d.path, d.line()) for d in (Damaged(root, t, str(p), why) for t, p, why in whys
                                                            if why is not None)]
            with _DAMAGED_LOCK:
                _DAMAGED[key] = (fp, found)
        out += found
    return sorted(out)


def _incomplete(source: ShardUnits, results: cache.ResultsCache) -> dict[str, list[str]]:
    """`report._incomplete` of a shard store: pair -> the damaged-shard lines of the runs with rows of it."""
    damaged = _damaged(source)
    if not damaged:
        return {}
    sums = by_unit(source, results, "pair_sums")
    out: dict[str, list[str]] = {}
    for run_id, _, line in damaged:
        found = sums[sums["run_id"] == run_id][["rollout", "scorer"]].drop_duplicates()
        for rollout, scorer in found.itertuples(index=False):
            out.setdefault(f"{rollout}/{scorer}", []).append(line)
    return out


# --- the advice's dropped shares --------------------------------------------------------------------------------

_PARTS: dict[tuple, list] = {}  # (store, stride) -> [(unit -> fingerprint, counts)]: the parts of `_corrections`
_PARTS_LOCK = threading.Lock()


def _corrections(source: ShardUnits, results: cache.ResultsCache) -> pd.DataFrame:
    """`measure.corrections` of the app's doctor on a shard store (module doc): the parts whose units are all
    unchanged kept (in memory, and on disk for a fresh process), one new part over every other unit."""
    from mismatch_lab.analysis.sample import SAMPLE_TOKENS
    from mismatch_lab.doctor.measure import sample_every
    from mismatch_lab.extras import missing

    if missing(("torch",)):
        return pd.DataFrame()
    fps = source.fingerprints()
    every = sample_every(int(by_unit(source, results, "unit_counts")["n_tokens"].sum()), SAMPLE_TOKENS)
    key, query = (source.key, every), ("overview.corrections", every)
    with _PARTS_LOCK:
        parts = _PARTS.get(key)
    if parts is None:
        parts = results.get(query, "parts")
        parts = [] if parts is cache.MISSING else parts
    kept = [(units, counts) for units, counts in parts if all(fps.get(u) == fp for u, fp in units.items())]
    todo = sorted(set(fps) - {u for units, _ in kept for u in units})
    if todo or not kept:
        found = by_unit(source, results, "groups")
        found = found[found["h"].astype("uint64") % every == 0]  # the units holding a sampled prompt group
        sampled = sorted(set(todo) & set(zip(found["run_id"], found["step"].astype("int64"))))
        kept.append(({u: fps[u] for u in todo}, _counts(source, sampled, every)))
        if len(kept) > MAX_PARTS:  # one part of them all: a refresh then merges few frames
            kept = [({u: fp for units, _ in kept for u, fp in units.items()}, _summed([c for _, c in kept]))]
        results.put(query, "parts", kept)
    with _PARTS_LOCK:
        _PARTS[key] = kept
    return _merged(_summed([counts for _, counts in kept]), every)


MAX_PARTS = 16
"""`_corrections` keeps at most this many parts: past it they are added up into one (exact: counts)."""


COUNT_KEYS = ["method", "rollout", "scorer"]


def _counts(source: ShardUnits, todo: list, every: int) -> pd.DataFrame:
    """Per (method, pair): sequences compared and dropped whole, and the note, on the units `todo` sampled 1 in
    `every` prompt groups (`corrections.compare` at the published defaults, the methods doctor may advise): on a
    connection of their own, the sample's views over the units' views."""
    from mismatch_lab.analysis import sample
    from mismatch_lab.corrections.compare import compare
    from mismatch_lab.doctor.recommend import ADVISABLE
    from mismatch_lab.store import reader

    if not todo:  # no sampled prompt group among them: nothing compared
        return pd.DataFrame(columns=[*COUNT_KEYS, "note", "n_seqs", "n_seqs_masked"])
    con = reader._open_parquet_dir(source.scan.root, source.scan.files(source.snap, todo))
    try:
        table = compare(con if every == 1 else sample.sampled(con.cursor(), every), methods=ADVISABLE)["corrections"]
    finally:
        con.close()
    masked = (table["frac_seqs_masked"].fillna(0) * table["n_seqs"]).round()
    return table[[*COUNT_KEYS, "note"]].assign(n_seqs=table["n_seqs"].astype("int64"),
                                              n_seqs_masked=masked.astype("int64"))


def _summed(parts: list[pd.DataFrame]) -> pd.DataFrame:
    """The counts of `_counts` parts added up per (method, pair) (a pair's note is the same in every part: the
    registry's)."""
    found = [p for p in parts if len(p)]
    if not found:
        return parts[0] if parts else pd.DataFrame(columns=[*COUNT_KEYS, "note", "n_seqs", "n_seqs_masked"])
    if len(found) == 1:  # (a refresh whose new steps hold no sampled prompt group adds an empty part)
        return found[0]
    rows = pd.concat(found, ignore_index=True)
    return rows.groupby(COUNT_KEYS, sort=False).agg(note=("note", "first"), n_seqs=("n_seqs", "sum"),
                                                    n_seqs_masked=("n_seqs_masked", "sum")).reset_index()


def _merged(counts: pd.DataFrame, every: int) -> pd.DataFrame:
    """The doctor's corrections table from the summed counts: frac_seqs_masked = dropped / compared (as
    `corrections.report.rates`), n_seqs, note, sample_every."""
    frac = counts["n_seqs_masked"].astype("float64") / counts["n_seqs"].astype("float64")
    return counts.assign(frac_seqs_masked=frac, sample_every=every).drop(columns="n_seqs_masked")


OVERVIEW = {  # the Overview's look-ups: the whole-store function's module -> its per-unit form on a shard store
    "list_runs": ("mismatch_lab.analysis.browse", list_runs),
    "precision_table": ("mismatch_lab.analysis.precision", precision_table),
    "doctor_view": ("mismatch_lab.doctor.report", doctor_view),
}
