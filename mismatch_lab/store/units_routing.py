"""The app's Routing page on a shard store still being written, without a whole-store pass at each refresh.

The routing table compares the rollout's expert ids with a scorer's on the cells both sides recorded
(`analysis.routing`): a store whose routing rows are all the rollout's (what the Recorder and the importers
write: the rollout engine's routes) has no such cell, and its table is empty. The sides present are counted per
set of units (`units_merged`: a refresh counts its new units' rows); where a scorer's side is there too, the table
is computed on a connection over every unit (the whole store's rows: none of our writers puts them in a shard
store).
"""

from __future__ import annotations

import pandas as pd

from mismatch_lab.store import cache
from mismatch_lab.store.units import ShardUnits, _on
from mismatch_lab.store.units_merged import merged


def routing_sides(con) -> pd.DataFrame:
    """Per routing side (the rollout's, a scorer's): its rows (none without a routing table)."""
    from mismatch_lab.analysis.relations import query, table_columns

    if not table_columns(con, "routing"):
        return pd.DataFrame({"side": pd.Series(dtype=object), "n": pd.Series(dtype="int64")})
    return query(con, "SELECT side::VARCHAR AS side, count(*) AS n FROM routing GROUP BY ALL")


class RoutingUnits(ShardUnits):
    """The units of a shard store as the Routing page reads them."""

    queries = ()

    @property
    def merged(self) -> dict:
        from mismatch_lab.store.units_merged import Merged

        return {"routing_sides": Merged(routing_sides, ("side",), {"n": "sum"})}


def routing_table(source: ShardUnits, results: cache.ResultsCache) -> pd.DataFrame:
    """`analysis.routing.routing_table` of a shard store: empty where only the rollout's routes are stored, else
    computed over every unit."""
    from mismatch_lab.analysis import routing
    from mismatch_lab.store.schema import ROUTING_ROLLOUT_SIDE

    sides = set(merged(source.like(RoutingUnits), results, "routing_sides")["side"])
    if not sides - {ROUTING_ROLLOUT_SIDE}:
        return routing.empty(routing.COLUMNS)
    return _on(source, list(source.fingerprints()), routing.routing_table)
