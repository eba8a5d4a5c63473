"""relations.with_metrics (guarded inputs, shared exponentials, no per-metric guard) against the standalone
expressions of relations.metrics_sql (each metric under its own CASE WHEN finite): the same value bit for
bit on every row, NULL on exactly the same rows, edge inputs included."""

from __future__ import annotations

import math

import duckdb

from mismatch_lab.analysis import definitions as d
from mismatch_lab.analysis.relations import GUARDED, SHARED, metrics_sql, with_metrics

INF, NAN = math.inf, math.nan
PAIRS = [
    (math.log(0.3), math.log(0.5)), (0.0, math.log(0.5)), (math.log(0.5), 0.0), (0.0, 0.0),
    (math.log(0.999), math.log(0.9)), (math.log(1e-9), math.log(1e-3)), (-700.0, 10.0), (-800.0, 0.0),
    (-INF, math.log(0.2)), (math.log(0.2), -INF), (INF, 0.0), (NAN, -1.0), (-1.0, NAN), (None, -1.0),
    (-1.0, None), (-2.0, -1.0),
]  # fmt: skip
"""(log mu, log pi): ordinary, mu or pi = 1, a ratio past exp's range, infinities, NaN and NULL."""


def _rows(con: duckdb.DuckDBPyConnection) -> str:
    """A base row set of PAIRS, each with and without the nonfinite flag, `finite` as the analyses set it."""
    con.execute("CREATE TABLE raw (i INTEGER, lmu DOUBLE, lpi DOUBLE, nonfinite BOOLEAN)")
    con.executemany("INSERT INTO raw VALUES (?, ?, ?, ?)",
                    [[2 * i + f, a, b, bool(f)] for i, (a, b) in enumerate(PAIRS) for f in (0, 1)])  # fmt: skip
    return (f"SELECT i, lmu, lpi, {d.finite_sql()} AS finite, "
            "CAST(NULL AS STRUCT(tv DOUBLE, kl DOUBLE)) AS topk FROM raw")  # fmt: skip


def test_layered_metrics_equal_the_standalone_ones_on_every_row():
    con = duckdb.connect()
    base = _rows(con)
    names = [n for n in metrics_sql() if n != "topk"]
    layered = con.execute(f"SELECT i, {', '.join(names)} FROM ({with_metrics(base, ('topk',))}) ORDER BY i").fetchall()
    alone = ", ".join(f"{metrics_sql()[n]} AS {n}" for n in names)
    standalone = con.execute(f"SELECT i, {alone} FROM ({base}) ORDER BY i").fetchall()
    assert len(layered) == 2 * len(PAIRS)
    finite = dict(con.execute(f"SELECT i, finite FROM ({base})").fetchall())
    assert 0 < sum(finite.values()) < len(finite)  # both kinds of rows are compared
    for got, want in zip(layered, standalone, strict=True):
        for name, g, w in zip(["i", *names], got, want, strict=True):
            same = g == w or (g is not None and w is not None and math.isnan(g) and math.isnan(w))
            assert same and (g is None) == (w is None), (got[0], name, g, w)
            if not finite[got[0]] and name != "i":
                assert g is None, (got[0], name, g)


def test_the_layers_own_columns_do_not_come_out():
    con = duckdb.connect()
    columns = [r[0] for r in con.execute(f"DESCRIBE {with_metrics(_rows(con), ('topk',))}").fetchall()]
    assert not set(columns) & {*GUARDED.values(), *SHARED.values()}
    assert {"mu", "pi", "r", "k3", "bkl", "topk_tv", "topk_kl"} <= set(columns)
