"""The app's Clipping page and the token inspector's worst sequences on a shard store still being written, per unit
(run_id, step) as the Training page (`store.units`): each look-up equal to its whole-store function, merged from
parts kept per unit, so that a refresh computes the new or changed steps only.

What is kept per unit (`QUERIES`, computed together on one connection over the units, cached one entry a unit):
    clip_grid        per (rollout, scorer, run_id, step, adv_sign, category): the additive sums of the clipping
                     rules at the published thresholds (`Rows.grid` without its μ buckets); added up per
                     (rollout, scorer, adv_sign, category) they are the grid `clipping.clipping_by_category`
                     rolls up
    clip_token_ids   per (rollout, scorer, run_id, step, token_id, category): the sums `clipping.ranked_tokens`
                     reads (`Rows.token_id_sums`); added up over the steps they are the store's sums per id
    clip_names       per (run_id, step, token_id): the least text of the id in the unit; the least over the units
                     is the store's (`rows.token_names`), which names the ids' sums (`rows.named_token_sums`)
    pair_counts      per (run_id, step, scorer): score rows (`browse.list_pairs`' counts, by the runs' rollout)
    categories       per (run_id, step): the token categories present (`browse.list_categories`)
    worst            per (run_id, step) and scope (every scorer: NULL; one scorer): the WORST_N sequences of
                     `browse.worst_sequences` on the units computed together (`WorstUnits`, its own entries:
                     computed when the inspector's Worst sequences mode is opened, not at every refresh)
The sums of every unit are added up once and kept (`units.summed`): a refresh adds its new units' sums to them.
The top clipped tokens are then ranked over every token's sums (the whole-store query ranks the contenders of a
first pass: the same n rows). The worst sequences: a sequence's numbers come from its own rows, which lie in its
unit, and a sequence among the n worst of the store is among the n worst of any set of units holding it, so
the n worst of the kept parts are the store's.
"""

from __future__ import annotations

import pandas as pd

from mismatch_lab.store import cache
from mismatch_lab.store.units import ShardUnits, UnitQuery, _on, by_unit, summed

WORST_N = 50
"""The worst sequences kept per unit and scope: the inspector's Worst sequences mode lists as many."""
GRID_KEYS = ["rollout", "scorer", "run_id", "step", "adv_sign", "category"]
PAIR_KEYS = ["rollout", "scorer"]


def _thresholds():
    """The clipping rules' thresholds the page shows: the published ones (`clipping_by_category`'s defaults)."""
    from mismatch_lab.analysis import clipping
    from mismatch_lab.analysis import definitions as d

    return clipping._thresholds(d.EPS_LOW, d.EPS_HIGH, d.DELTA_TV, d.DELTA_KL)


def _rows(con):
    """The rollout row set of every pair of the units on `con`, one per connection (`relations.once`)."""
    from mismatch_lab.analysis.relations import Filters, once
    from mismatch_lab.analysis.rows import Rows

    return once(con, "clipping_rows", lambda: Rows(con, Filters()))


def clip_grid(con) -> pd.DataFrame:
    from mismatch_lab.analysis.rows import rollup

    rows = _rows(con)
    return rollup(rows.grid(_thresholds()), GRID_KEYS) if rows.ok else pd.DataFrame(columns=GRID_KEYS)


def clip_token_ids(con) -> pd.DataFrame:
    from mismatch_lab.analysis.clipping import TWO_SIDED_SUMS
    from mismatch_lab.analysis.rows import TOKEN_ID_KEYS

    rows, keys = _rows(con), [*TOKEN_ID_KEYS, "step"]
    return rows.token_id_sums(_thresholds(), TWO_SIDED_SUMS, keys=tuple(keys)) if rows.ok else pd.DataFrame(
        columns=keys)


def clip_names(con) -> pd.DataFrame:
    from mismatch_lab.analysis.rows import token_names

    return token_names(con, ("run_id", "step", "token_id"))


def pair_counts(con) -> pd.DataFrame:
    from mismatch_lab.analysis.relations import query

    return query(con, """SELECT s.run_id, q.step, s.scorer, count(*) AS n
                         FROM scores s JOIN sequences q USING (run_id, seq_id) GROUP BY ALL""")


def categories(con) -> pd.DataFrame:
    from mismatch_lab.analysis.relations import col, query, table_columns

    category = col(table_columns(con, "tokens"), "t", "category", "VARCHAR")
    return query(con, f"""SELECT DISTINCT q.run_id, q.step, coalesce({category}, 'uncategorized') AS category
                          FROM tokens t JOIN sequences q USING (run_id, seq_id)""")


def worst(con) -> pd.DataFrame:
    """`browse.worst_sequences` of the units on `con`, WORST_N a scope (every scorer: scope NULL; each scorer),
    with each sequence's step."""
    from mismatch_lab.analysis import browse
    from mismatch_lab.analysis.relations import query

    scorers = query(con, "SELECT DISTINCT scorer FROM scores ORDER BY 1")["scorer"].tolist()
    found = [browse.worst_sequences(con, scorer=s, n=WORST_N).assign(scope=s) for s in [None, *scorers]]
    steps = query(con, "SELECT run_id, seq_id, step FROM sequences")
    return pd.concat(found, ignore_index=True).merge(steps, on=["run_id", "seq_id"], how="left")


QUERIES = {
    "clip_grid": UnitQuery(clip_grid, tuple(GRID_KEYS)),
    "clip_token_ids": UnitQuery(clip_token_ids, ("run_id", "step", "rollout", "scorer", "token_id", "category")),
    "clip_names": UnitQuery(clip_names, ("run_id", "step", "token_id")),
    "pair_counts": UnitQuery(pair_counts, ("run_id", "step", "scorer")),
    "categories": UnitQuery(categories, ("run_id", "step", "category")),
    "worst": UnitQuery(worst, ("run_id", "step", "seq_id")),
}
"""The per-unit queries of this module (`units._queries` holds them with the others)."""


class ClippingUnits(ShardUnits):
    """The units of a shard store as the Clipping page reads them."""

    queries = ("clip_grid", "clip_token_ids", "clip_names", "pair_counts", "categories")


class WorstUnits(ShardUnits):
    """The units of a shard store as the inspector's Worst sequences mode reads them."""

    queries = ("worst",)


# --- the look-ups ----------------------------------------------------------------------------------------------


def _run_labels(source: ShardUnits, results: cache.ResultsCache) -> pd.DataFrame:
    """(run_id, rollout): each run's rollout label, from the run rows alone (cached under their files)."""
    from mismatch_lab.analysis.definitions import rollout_label_sql
    from mismatch_lab.analysis.relations import query

    key = cache._digest((cache.code_fingerprint(), sorted(source.snap.runs.items())))
    return results.get_or_compute(("clipping.run_labels",), key, lambda: _on(
        source, [], lambda con: query(con, f"SELECT run_id, {rollout_label_sql('r')} AS rollout FROM runs r")))


def list_pairs(source: ShardUnits, results: cache.ResultsCache) -> pd.DataFrame:
    """`browse.list_pairs` of a shard store: the units' score counts per run and scorer, by the runs' rollout."""
    counts = by_unit(source.like(ClippingUnits), results, "pair_counts")
    found = counts.merge(_run_labels(source, results), on="run_id")  # (as the whole store's join with the runs)
    out = found.groupby(PAIR_KEYS, sort=True)["n"].sum().astype("int64").reset_index()
    return out.rename(columns={"n": "n_tokens"})


def list_categories(source: ShardUnits, results: cache.ResultsCache) -> list[str]:
    """`browse.list_categories` of a shard store: the categories of every unit."""
    return sorted(set(by_unit(source.like(ClippingUnits), results, "categories")["category"]))


def clipping_by_category(source: ShardUnits, results: cache.ResultsCache, rollout: str, scorer: str) -> pd.DataFrame:
    """`clipping.clipping_by_category(rollout=, scorer=)` at the published thresholds, from the units' sums."""
    from mismatch_lab.analysis.clipping import category_table

    grid = summed(source.like(ClippingUnits), results, "clip_grid", [*PAIR_KEYS, "adv_sign", "category"])
    return category_table(grid[(grid["rollout"] == rollout) & (grid["scorer"] == scorer)])


def top_clipped_tokens(source: ShardUnits, results: cache.ResultsCache, n: int, rollout: str, scorer: str
                       ) -> pd.DataFrame:
    """`clipping.top_clipped_tokens(n, rollout=, scorer=)` at the published thresholds, ranked over the units'
    sums of every token id, named by the least text of each id over the units."""
    from mismatch_lab.analysis.clipping import ranked_tokens
    from mismatch_lab.analysis.rows import TOKEN_ID_KEYS, named_token_sums

    clipping = source.like(ClippingUnits)
    by_id = summed(clipping, results, "clip_token_ids", list(TOKEN_ID_KEYS))
    by_id = by_id[(by_id["rollout"] == rollout) & (by_id["scorer"] == scorer)]
    names = by_unit(clipping, results, "clip_names")
    names = names.groupby(["run_id", "token_id"], sort=False)["token_text"].min().reset_index()
    return ranked_tokens(named_token_sums(by_id, names), int(n))


def worst_sequences(source: ShardUnits, results: cache.ResultsCache, *, scorer: str | None = None, n: int = 20
                    ) -> pd.DataFrame:
    """`browse.worst_sequences(scorer=scorer, n=n)` of a shard store (n at most WORST_N): the n worst of the
    units' kept parts."""
    if n > WORST_N:
        raise ValueError(f"at most {WORST_N} worst sequences are kept per unit; asked for {n}")
    found = by_unit(source.like(WorstUnits), results, "worst")
    found = found[found["scope"].isna()] if scorer is None else found[found["scope"] == scorer]
    found = found.sort_values(["max_abs_dp", "run_id", "seq_id"], ascending=[False, True, True], kind="stable")
    return found.drop(columns=["scope", "step"]).head(int(n)).reset_index(drop=True)
