"""MoE routing: how often a scorer sends a token to other experts than the rollout did, and what that costs.

Read from the optional `routing` table (one row per run, sequence, response position, side, MoE layer;
docs/moe.md). Per (rollout, scorer) pair, over the (token, layer) cells both sides recorded (a cell one side
lacks is left out), with the definition of `routing.compare.compare` (tested against it):

* a cell **flips** when the two expert SETS differ (`list_sort` of each side's ids, as `set_differs` sorts);
* `flip_rate` = flipped cells / cells, `flip_rate_per_layer` the same per MoE layer (list, layer 0 first);
* `any_layer_differs` = share of tokens with a flip in at least one layer;
* flips by bucket of the ROLLOUT's margin (`compare.MARGIN_EDGES`: [lo, hi), the last hi = +inf written as
  null); cells whose rollout margin was not recorded are counted apart (`cells_no_margin`);
* the mismatch of the tokens WITH a flip in some layer and WITHOUT, each over its finite (token, scorer) rows
  (definitions.finite_sql): mean |Δp| = |π − μ|, mean |Δ log p|, mean k3 = r − 1 − log r (definitions.
  token_metrics_sql), with their token counts;
* R3: where scorer `<s>-r3` (trainer forward replaying the rollout's expert ids) sits beside `<s>` for the same
  rollout, the `<s>` row carries `r3_scorer`, both pairs' mean |Δp| over every scored token of the runs with
  routing (`abs_dp_mean`, `abs_dp_mean_r3`) and `r3_share` = 1 − abs_dp_mean_r3 / abs_dp_mean: the part of
  the pair's mismatch that replaying the routing removes.

Column `view`: 'pair' (one row per pair, everything above), 'layer' (per pair and layer: cells, flips,
flip_rate), 'margin' (per pair and margin bucket: margin_lo, margin_hi, cells, flips, flip_rate). A store
without routing rows (or without the table) gives an empty table.
"""

from __future__ import annotations

import math
import uuid
from contextlib import contextmanager

import duckdb
import pandas as pd

from mismatch_lab.analysis import definitions as d
from mismatch_lab.analysis.relations import Filters, _used, empty, query, table_columns
from mismatch_lab.routing.compare import MARGIN_EDGES
from mismatch_lab.store.schema import ROUTING_ROLLOUT_SIDE

R3_SUFFIX = "-r3"
"""A scorer label `<s>-r3` is `<s>` replaying the rollout's expert ids (store.schema, routing.side)."""
MISMATCH = ("abs_dp", "abs_dlogp", "k3")
PAIR_COLUMNS = [
    "tokens", "layers", "k", "cells", "flips", "flip_rate", "any_layer_differs", "flip_rate_per_layer",
    "flips_by_margin", "cells_no_margin",
    *(f"{m}_mean_{w}" for w in ("flip", "no_flip") for m in MISMATCH), "n_finite_flip", "n_finite_no_flip",
    "tokens_flip", "tokens_no_flip", "abs_dp_mean", "r3_scorer", "abs_dp_mean_r3", "r3_share",
]  # fmt: skip
INT_COLUMNS = ["tokens", "layers", "k", "cells", "flips", "cells_no_margin", "n_finite_flip", "n_finite_no_flip",
               "tokens_flip", "tokens_no_flip", "layer"]
COLUMNS = ["view", "rollout", "scorer", *PAIR_COLUMNS, "layer", "margin_lo", "margin_hi"]


def has_routing(con: duckdb.DuckDBPyConnection) -> bool:
    """Whether the store holds any routing row (absent table = none)."""
    if not table_columns(con, "routing"):
        return False
    return con.execute("SELECT EXISTS (SELECT 1 FROM routing)").fetchone()[0]


def bucket_sql(margin: str, edges=MARGIN_EDGES) -> str:
    """SQL: the index of `margin`'s bucket as np.digitize(margin, edges[1:-1]) gives it (NULL margin: NULL)."""
    whens = " ".join(f"WHEN CAST({margin} AS DOUBLE) < CAST({e!r} AS DOUBLE) THEN {i}" for i, e in enumerate(edges[1:-1]))
    return f"CASE WHEN {margin} IS NULL THEN NULL {whens} ELSE {len(edges) - 2} END"


def cells_sql(filters: Filters) -> tuple[str, dict]:
    """One row per (run, rollout, scorer, seq_id, pos, layer) both sides recorded: k, flip, the rollout's margin
    and its bucket."""
    rollout_sql = d.rollout_label_sql("runs")
    where, params = filters.where(rollout_sql, "sc.side", "ro.run_id")
    return f"""
        SELECT ro.run_id, {rollout_sql} AS rollout, sc.side AS scorer, ro.seq_id, ro.pos, ro.layer,
               len(ro.expert_ids) AS k, list_sort(ro.expert_ids) <> list_sort(sc.expert_ids) AS flip,
               ro.margin AS margin, {bucket_sql('ro.margin')} AS bucket
        FROM (SELECT * FROM routing WHERE side = '{ROUTING_ROLLOUT_SIDE}') ro
        JOIN routing sc ON sc.run_id = ro.run_id AND sc.seq_id = ro.seq_id AND sc.pos = ro.pos
             AND sc.layer = ro.layer AND sc.side <> '{ROUTING_ROLLOUT_SIDE}'
        JOIN runs ON runs.run_id::VARCHAR = ro.run_id::VARCHAR
        WHERE {where}""", params


def _cell_counts(con, cells: str, params: dict) -> pd.DataFrame:
    """Cells and flips per pair, per (pair, layer) and per (pair, margin bucket)."""
    return query(con, f"""
        SELECT rollout, scorer, layer, bucket, grouping(layer) AS g_layer,
               grouping(bucket) AS g_bucket, count(*) AS cells, count(*) FILTER (WHERE flip) AS flips,
               max(k) AS k, count(DISTINCT layer) AS layers, count(*) FILTER (WHERE margin IS NULL) AS no_margin
        FROM ({cells})
        GROUP BY GROUPING SETS ((rollout, scorer), (rollout, scorer, layer), (rollout, scorer, bucket))""", params)


def _token_mismatch(con, cells: str, params: dict) -> pd.DataFrame:
    """Per (pair, any-layer flip): tokens, finite rows and the means of |Δp|, |Δlogp|, k3 over them."""
    m = d.token_metrics_sql()
    finite = d.finite_sql(nonfinite="s.nonfinite")
    return query(con, f"""
        WITH tok AS (SELECT run_id, rollout, scorer, seq_id, pos, bool_or(flip) AS flip FROM ({cells}) GROUP BY ALL),
        j AS (SELECT tok.*, t.logp_rollout AS lmu, s.logp AS lpi, {finite} AS finite
              FROM tok LEFT JOIN tokens t ON t.run_id::VARCHAR = tok.run_id::VARCHAR AND t.seq_id = tok.seq_id
                   AND t.pos = tok.pos
              LEFT JOIN scores s ON s.run_id::VARCHAR = tok.run_id::VARCHAR AND s.seq_id = tok.seq_id
                   AND s.pos = tok.pos AND s.scorer::VARCHAR = tok.scorer)
        SELECT rollout, scorer, flip, count(*) AS tokens, count(*) FILTER (WHERE finite) AS n_finite,
               avg({m['btv']}) FILTER (WHERE finite) AS abs_dp, avg(abs({m['dlogp']})) FILTER (WHERE finite) AS abs_dlogp,
               avg({m['k3']}) FILTER (WHERE finite) AS k3
        FROM j GROUP BY ALL""", params)


def _pair_dp(con, filters: Filters) -> pd.DataFrame:
    """Mean |Δp| per (rollout, scorer) over every finite scored token of the runs holding routing rows."""
    rollout_sql = d.rollout_label_sql("runs")
    where, params = filters.where(rollout_sql, "s.scorer::VARCHAR", "t.run_id::VARCHAR")
    m = d.token_metrics_sql("t.logp_rollout", "s.logp")
    finite = d.finite_sql("t.logp_rollout", "s.logp", "s.nonfinite")
    return query(con, f"""
        SELECT {rollout_sql} AS rollout, s.scorer::VARCHAR AS scorer, avg({m['btv']}) FILTER (WHERE {finite}) AS dp
        FROM tokens t JOIN scores s USING (run_id, seq_id, pos) JOIN runs USING (run_id)
        WHERE {where} AND t.run_id::VARCHAR IN (SELECT DISTINCT run_id::VARCHAR FROM routing)
        GROUP BY ALL""", params)


def routing_table(con: duckdb.DuckDBPyConnection, *, rollout=None, scorer=None, run_ids=None) -> pd.DataFrame:
    """The routing table (module docstring): 'pair', 'layer' and 'margin' rows, pairs in label order."""
    if not has_routing(con):
        return empty(COLUMNS)
    filters = Filters.make(rollout, scorer, run_ids)
    with _materialized(con, *cells_sql(filters)) as cells:  # the self-join once, read by both passes
        counts = _cell_counts(con, cells, {})
        if counts.empty:
            return empty(COLUMNS)
        pairs = _pairs(counts, _token_mismatch(con, cells, {}), _pair_dp(con, filters))
    layers = _detail(counts, "g_bucket", "layer").assign(view="layer")
    margins = _detail(counts, "g_layer", "bucket").assign(view="margin")
    margins["margin_lo"] = [MARGIN_EDGES[int(b)] for b in margins["bucket"]]
    margins["margin_hi"] = [_finite(MARGIN_EDGES[int(b) + 1]) for b in margins["bucket"]]
    out = pd.concat([pairs.assign(view="pair"), layers, margins], ignore_index=True)
    order = {"pair": 0, "layer": 1, "margin": 2}
    out = out.sort_values(["rollout", "scorer", "view", "layer", "margin_lo"], key=lambda s: s.map(order)
                          if s.name == "view" else s).reset_index(drop=True)
    return out.astype({c: "Int64" for c in INT_COLUMNS}).reindex(columns=COLUMNS)


@contextmanager
def _materialized(con: duckdb.DuckDBPyConnection, sql: str, params: dict):
    """`sql` as a temporary table of this connection (its name yielded as a relation), dropped on exit."""
    table = f"_ml_routing_cells_{uuid.uuid4().hex[:10]}"
    con.execute(f"CREATE TEMP TABLE {table} AS {sql}", _used(sql, params))
    try:
        yield f"SELECT * FROM {table}"
    finally:
        con.execute(f"DROP TABLE IF EXISTS {table}")


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _detail(counts: pd.DataFrame, other: str, key: str) -> pd.DataFrame:
    """The (pair, `key`) rows of the grouping sets: those grouped by `key` and not by the other detail."""
    rows = counts[(counts["g_layer"] + counts["g_bucket"] == 1) & (counts[other] == 1)].copy()
    rows = rows[rows[key].notna()]  # cells without a rollout margin have no bucket
    rows["flip_rate"] = rows["flips"] / rows["cells"]
    return rows[["rollout", "scorer", key, "cells", "flips", "flip_rate"]]


def _pairs(counts: pd.DataFrame, tokens: pd.DataFrame, dp: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for (ro, sc), pair in counts[(counts["g_layer"] == 1) & (counts["g_bucket"] == 1)].groupby(["rollout", "scorer"]):
        row = pair.iloc[0]
        layers = _detail(counts[(counts["rollout"] == ro) & (counts["scorer"] == sc)], "g_bucket", "layer")
        margins = _detail(counts[(counts["rollout"] == ro) & (counts["scorer"] == sc)], "g_layer", "bucket")
        tok = tokens[(tokens["rollout"] == ro) & (tokens["scorer"] == sc)].set_index("flip")
        rows.append({"rollout": ro, "scorer": sc, "cells": int(row["cells"]), "flips": int(row["flips"]),
                     "k": int(row["k"]), "layers": int(row["layers"]), "flip_rate": row["flips"] / row["cells"],
                     "cells_no_margin": int(row["no_margin"]),
                     "flip_rate_per_layer": [float(x) for x in layers.sort_values("layer")["flip_rate"]],
                     "flips_by_margin": _by_margin(margins), **_split_tokens(tok)})
    out = pd.DataFrame(rows)
    return _with_r3(out, dp)


def _by_margin(margins: pd.DataFrame) -> list[dict]:
    """Every MARGIN_EDGES bucket as compare.compare lists it ({lo, hi, cells, flips}; hi +inf as None)."""
    have = margins.set_index(margins["bucket"].astype(int))
    return [{"lo": MARGIN_EDGES[i], "hi": _finite(MARGIN_EDGES[i + 1]),
             "cells": int(have["cells"].get(i, 0)), "flips": int(have["flips"].get(i, 0))}
            for i in range(len(MARGIN_EDGES) - 1)]


def _split_tokens(tok: pd.DataFrame) -> dict:
    """Token counts, any_layer_differs and the mismatch means of the tokens with / without a flip."""
    n = {w: int(tok["tokens"].get(flag, 0)) for w, flag in (("flip", True), ("no_flip", False))}
    out = {"tokens": n["flip"] + n["no_flip"], "tokens_flip": n["flip"], "tokens_no_flip": n["no_flip"],
           "any_layer_differs": n["flip"] / max(n["flip"] + n["no_flip"], 1)}
    for w, flag in (("flip", True), ("no_flip", False)):
        out[f"n_finite_{w}"] = int(tok["n_finite"].get(flag, 0))
        for m in MISMATCH:
            v = tok[m].get(flag) if flag in tok.index else None
            out[f"{m}_mean_{w}"] = None if v is None or pd.isna(v) else float(v)
    return out


def _with_r3(pairs: pd.DataFrame, dp: pd.DataFrame) -> pd.DataFrame:
    """abs_dp_mean per pair; on each `<s>` pair with an `<s>-r3` beside it, the R3 columns."""
    mean_dp = {(r.rollout, r.scorer): r.dp for r in dp.itertuples()}
    pairs["abs_dp_mean"] = [mean_dp.get(k) for k in zip(pairs["rollout"], pairs["scorer"])]
    r3 = [(ro, sc + R3_SUFFIX) if (ro, sc + R3_SUFFIX) in mean_dp and not sc.endswith(R3_SUFFIX) else None
          for ro, sc in zip(pairs["rollout"], pairs["scorer"])]
    pairs["r3_scorer"] = [k[1] if k else None for k in r3]
    pairs["abs_dp_mean_r3"] = [mean_dp[k] if k else None for k in r3]
    pairs["r3_share"] = [1.0 - b / a if k and a and pd.notna(a) and pd.notna(b) else None
                         for k, a, b in zip(r3, pairs["abs_dp_mean"], pairs["abs_dp_mean_r3"])]
    return pairs
