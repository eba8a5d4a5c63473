"""The app's Clipping page and the token inspector's worst sequences on a shard store still being written: each
look-up equal to its whole-store function, computed over the new or changed steps only at a refresh.

The Clipping page's queries combine over sets of units (`units_merged`: kept as parts, one a set of units computed
together, and combined):
    clip_grid        per (rollout, scorer, adv_sign, category): the additive sums of the clipping rules at the
                     published thresholds that `clipping.category_table` reads (`clipping.CATEGORY_SUMS`; the
                     whole-store function rolls them up from `Rows.grid`)
    clip_token_ids   per (rollout, scorer, run_id, token_id, category): the sums `clipping.ranked_tokens` reads
                     (both in one pass: `Rows.sums_by_sets`)
    clipped_token_ids  the clip counts of clip_token_ids' clipped rows (what ranks the contenders)
    token_names      per (run_id, token_id): the least text of the id (`rows.token_names`)
    categories       the token categories present (`browse.list_categories`)
    pair_counts      per (run_id, scorer): score rows (`browse.list_pairs`' counts, by the runs' rollout labels;
                     `PairUnits`, its own parts: the Volatility page lists the pairs too)
The top clipped tokens are ranked in the whole-store query's two steps: the contenders from the combined clip counts
of the clipped rows (`clipped_token_ids`), then every sum of the contenders' ids from each part's rows of those ids.

The worst sequences are kept per unit (`store.units`, `WorstUnits`: its own entries, computed when the inspector's
Worst sequences mode is opened): per unit and scope (every scorer: NULL; each scorer) the WORST_N sequences of
`browse.worst_sequences` on the units computed together. A sequence's numbers come from its own rows, which lie in
its unit, and a sequence among the n worst of the store is among the n worst of any set of units holding it, so
the n worst of the kept parts are the store's.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from mismatch_lab.store import cache
from mismatch_lab.store.units import ShardUnits, UnitQuery, _on, by_unit
from mismatch_lab.store.units_merged import merged, merged_parts

WORST_N = 50
"""The worst sequences kept per unit and scope: the inspector's Worst sequences mode lists as many."""
GRID_KEYS = ("rollout", "scorer", "adv_sign", "category")
PAIR_KEYS = ["rollout", "scorer"]
NO_ID = np.iinfo(np.int64).min
"""A NULL token id where ids are compared as int64 (no token's id)."""


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


def _clip_sums(con) -> dict[str, pd.DataFrame]:
    """The page's sums in one pass over the units' rows: per GRID_KEYS the sums of its table by category
    (`clipping.CATEGORY_SUMS`), per `rows.TOKEN_ID_KEYS` the sums of its ranked tokens (`clipping.TWO_SIDED_SUMS`)."""
    from mismatch_lab.analysis.clipping import CATEGORY_SUMS, TWO_SIDED_SUMS
    from mismatch_lab.analysis.relations import once
    from mismatch_lab.analysis.rows import TOKEN_ID_KEYS

    def run():
        rows = _rows(con)
        if not rows.ok:
            return {"grid": pd.DataFrame(columns=list(GRID_KEYS)), "ids": pd.DataFrame(columns=list(TOKEN_ID_KEYS))}
        found = rows.sums_by_sets(_thresholds(), {"grid": (GRID_KEYS, CATEGORY_SUMS),
                                                  "ids": (TOKEN_ID_KEYS, TWO_SIDED_SUMS)})
        found["ids"]["token_id"] = found["ids"]["token_id"].astype("Int64")  # (NULL in the other set's rows)
        return found

    return once(con, "clipping_sums", run)


def clip_grid(con) -> pd.DataFrame:
    return _clip_sums(con)["grid"]


def clip_token_ids(con) -> pd.DataFrame:
    return _clip_sums(con)["ids"]


def clipped_token_ids(con) -> pd.DataFrame:
    """`clip_token_ids`' clip counts (c_hi, c_lo) of its clipped rows: what ranks the top clipped tokens' contenders
    (as the whole-store query's first step, over the clipped rows alone)."""
    from mismatch_lab.analysis.rows import TOKEN_ID_KEYS

    ids = clip_token_ids(con)
    if "c_hi" not in ids:  # (no rows to sum)
        return pd.DataFrame(columns=[*TOKEN_ID_KEYS, "c_hi", "c_lo"])
    return ids.loc[ids["c_hi"] + ids["c_lo"] > 0, [*TOKEN_ID_KEYS, "c_hi", "c_lo"]].reset_index(drop=True)


def token_names(con) -> pd.DataFrame:
    """Per (run_id, token_id) of the tokens with a text: the least one (`rows.token_names`)."""
    from mismatch_lab.analysis.relations import query, table_columns

    if "token_text" not in table_columns(con, "tokens"):
        return pd.DataFrame({"run_id": pd.Series(dtype=object), "token_id": pd.Series(dtype="int64"),
                             "token_text": pd.Series(dtype=object)})
    return query(con, "SELECT run_id, token_id, min(token_text) AS token_text FROM tokens "
                      "WHERE token_text IS NOT NULL GROUP BY ALL")


def categories(con) -> pd.DataFrame:
    """The token categories present (`browse.list_categories`' rule)."""
    from mismatch_lab.analysis.relations import col, query, table_columns

    category = col(table_columns(con, "tokens"), "t", "category", "VARCHAR")
    return query(con, f"SELECT DISTINCT coalesce({category}, 'uncategorized') AS category FROM tokens t")


def pair_counts(con) -> pd.DataFrame:
    from mismatch_lab.analysis.relations import query

    return query(con, "SELECT run_id, scorer, count(*) AS n FROM scores GROUP BY ALL")


def worst(con) -> pd.DataFrame:
    """`browse.worst_sequences` of the units on `con`, WORST_N a scope (every scorer: scope NULL; each scorer),
    with each sequence's step."""
    from mismatch_lab.analysis import browse
    from mismatch_lab.analysis.relations import query

    scorers = query(con, "SELECT DISTINCT scorer FROM scores ORDER BY 1")["scorer"].tolist()
    found = [browse.worst_sequences(con, scorer=s, n=WORST_N).assign(scope=s) for s in [None, *scorers]]
    steps = query(con, "SELECT run_id, seq_id, step FROM sequences")
    return pd.concat(found, ignore_index=True).merge(steps, on=["run_id", "seq_id"], how="left")


QUERIES = {"worst": UnitQuery(worst, ("run_id", "step", "seq_id"))}
"""The per-unit queries of this module (`units._queries` holds them with the others)."""


def _merged() -> dict:
    from mismatch_lab.analysis.rows import TOKEN_ID_KEYS
    from mismatch_lab.store.units_merged import Merged

    return {
        "clip_grid": Merged(clip_grid, GRID_KEYS),
        "clip_token_ids": Merged(clip_token_ids, TOKEN_ID_KEYS),
        "clipped_token_ids": Merged(clipped_token_ids, TOKEN_ID_KEYS),
        "token_names": Merged(token_names, ("run_id", "token_id"), {"token_text": "least"}),
        "categories": Merged(categories, ("category",), {}),
    }


class ClippingUnits(ShardUnits):
    """The units of a shard store as the Clipping page reads them: its queries combined over sets of units
    (`units_merged`)."""

    queries = ()

    @property
    def merged(self) -> dict:
        return _merged()


class PairUnits(ShardUnits):
    """The units of a shard store as the pages' pair lists read them (`list_pairs`: the Clipping and Volatility
    pages): the score counts alone, not every clipping sum of a refresh's new steps."""

    queries = ()

    @property
    def merged(self) -> dict:
        from mismatch_lab.store.units_merged import Merged

        return {"pair_counts": Merged(pair_counts, ("run_id", "scorer"), {"n": "sum"})}


class WorstUnits(ShardUnits):
    """The units of a shard store as the inspector's Worst sequences mode reads them."""

    queries = ("worst",)


# --- the look-ups ----------------------------------------------------------------------------------------------


def _run_labels(source: ShardUnits, results: cache.ResultsCache) -> pd.DataFrame:
    """(run_id, rollout): each run's rollout label, from the run rows alone (cached under what labels the runs: a
    writer's status moving rewrites its row, not its label)."""
    from mismatch_lab.analysis.definitions import rollout_label_sql
    from mismatch_lab.analysis.relations import query

    key = cache._digest((cache.code_fingerprint(), source.runs_described()))
    return results.get_or_compute(("clipping.run_labels",), key, lambda: _on(
        source, [], lambda con: query(con, f"SELECT run_id, {rollout_label_sql('r')} AS rollout FROM runs r")))


def list_pairs(source: ShardUnits, results: cache.ResultsCache) -> pd.DataFrame:
    """`browse.list_pairs` of a shard store: the units' score counts per run and scorer, by the runs' rollout."""
    counts = merged(source.like(PairUnits), results, "pair_counts")
    found = counts.merge(_run_labels(source, results), on="run_id")  # (as the whole store's join with the runs)
    out = found.groupby(PAIR_KEYS, sort=True)["n"].sum().astype("int64").reset_index()
    return out.rename(columns={"n": "n_tokens"})


def list_categories(source: ShardUnits, results: cache.ResultsCache) -> list[str]:
    """`browse.list_categories` of a shard store: the categories of every unit."""
    return sorted(merged(source.like(ClippingUnits), results, "categories")["category"].tolist())


def clipping_by_category(source: ShardUnits, results: cache.ResultsCache, rollout: str, scorer: str) -> pd.DataFrame:
    """`clipping.clipping_by_category(rollout=, scorer=)` at the published thresholds, from the units' sums."""
    from mismatch_lab.analysis.clipping import category_table

    grid = merged(source.like(ClippingUnits), results, "clip_grid")
    return category_table(grid[(grid["rollout"] == rollout) & (grid["scorer"] == scorer)])


def top_clipped_tokens(source: ShardUnits, results: cache.ResultsCache, n: int, rollout: str, scorer: str
                       ) -> pd.DataFrame:
    """`clipping.top_clipped_tokens(n, rollout=, scorer=)` at the published thresholds from the kept parts' sums
    per token id, named by the least text of each id over the units; as the whole-store query, in two steps: the
    clip counts of every token from the units' clipped rows (`clipped_token_ids`), then every sum of the
    contenders' ids."""
    from mismatch_lab.analysis.clipping import (
        TOKEN_COLUMNS,
        contenders_of,
        ranked_tokens,
    )
    from mismatch_lab.analysis.relations import empty
    from mismatch_lab.analysis.rows import (
        TOKEN_KEYS,
        named_token_sums,
        token_ids_of,
    )

    def of_pair(rows: pd.DataFrame) -> pd.DataFrame:  # (after a cut by numbers: few rows' labels compared)
        return rows[(rows["rollout"] == rollout) & (rows["scorer"] == scorer)]

    clipping = source.like(ClippingUnits)
    names = merged(clipping, results, "token_names")
    contenders = contenders_of(named_token_sums(of_pair(merged(clipping, results, "clipped_token_ids")), names), n)
    if contenders.empty:
        return empty(TOKEN_COLUMNS)
    ids = token_ids_of(contenders, names)
    found = named_token_sums(of_pair(pd.concat(_rows_of_ids(merged_parts(clipping, results, "clip_token_ids"), ids))),
                             names)
    return ranked_tokens(contenders[TOKEN_KEYS].merge(found, on=TOKEN_KEYS, how="left"), int(n))  # null keys match


def _rows_of_ids(parts: list[pd.DataFrame], ids: list[int]) -> list[pd.DataFrame]:
    """The rows of `parts` whose token_id is among `ids` (a few ids among every part's; none: NULL ids), parts
    without such rows left out (at least one: an empty frame)."""
    wanted = np.asarray(ids, dtype=np.int64)
    out = [p.take(np.flatnonzero(np.isin(p["token_id"].to_numpy(np.int64, na_value=NO_ID), wanted)))
           for p in parts]
    return [p for p in out if len(p)] or out[:1]


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
