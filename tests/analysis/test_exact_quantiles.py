"""analysis.quantiles: bracketed quantiles equal DuckDB's quantile_cont and numpy's default, whatever the
sample, with NULLs, NaN, ties, empty and tiny groups and two key sets sharing one pass."""

from __future__ import annotations

import math

import duckdb
import numpy as np
import pandas as pd
import pytest

from mismatch_lab.analysis import quantiles as Q

LEVELS = (0.01, 0.05, 0.5, 0.95, 0.99)


def _table() -> pd.DataFrame:
    """Groups (a, b) of very different sizes: a in 0..3 x b in 0..2; the value v has NULLs, exact ties
    (a block of 1.0), NaN in one group; w only on some rows (its `keep` filter)."""
    rng = np.random.default_rng(7)
    parts = []
    sizes = {(0, 0): 120_000, (0, 1): 40_000, (1, 0): 60_000, (1, 2): 3, (2, 1): 1, (3, 2): 900}
    for (a, b), n in sizes.items():
        v = np.exp(rng.normal(0.0, 0.05 * (a + 1), n))
        v[rng.random(n) < 0.3] = 1.0  # ties at the median
        frame = pd.DataFrame({"a": a, "b": b, "v": v, "w": rng.random(n), "keep": rng.random(n) < 0.5})
        frame.loc[frame.sample(frac=0.05, random_state=a * 3 + b).index, "v"] = None  # NULL values
        parts.append(frame)
    parts.append(pd.DataFrame({"a": 2, "b": 2, "v": [None] * 5, "w": 0.5, "keep": True}))  # only NULLs
    nan = pd.DataFrame({"a": 3, "b": 0, "v": np.r_[np.linspace(0, 1, 2000), [np.nan] * 30], "w": 0.1, "keep": True})
    return pd.concat([*parts, nan], ignore_index=True)


@pytest.fixture(scope="module")
def con():
    c = duckdb.connect()
    c.register("frame", _table())
    c.execute("CREATE TABLE t AS SELECT a::INTEGER AS a, b::INTEGER AS b, v, w, keep FROM frame")
    return c


WANTED = [Q.Wanted("v", "v", LEVELS), Q.Wanted("w", "w", (0.99,), where="keep")]
SETS = {"by_a": ["a"], "by_b": ["b"]}


def _reference(con, keys: list[str]) -> pd.DataFrame:
    sql = f"""SELECT {', '.join(keys)}, quantile_cont(v, {list(LEVELS)}) AS qv,
                     quantile_cont(w, 0.99) FILTER (WHERE keep) AS qw FROM t GROUP BY ALL"""
    return con.execute(sql).df()


def _assert_same(got: pd.DataFrame, ref: pd.DataFrame, keys: list[str]) -> None:
    merged = got.merge(ref, on=keys, how="outer", validate="one_to_one")
    assert len(merged) == len(ref) == len(got)
    for _, row in merged.iterrows():
        want = [np.nan] * len(LEVELS) if row["qv"] is None else list(row["qv"])
        for i, expected in enumerate([*want, row["qw"]]):
            value = row[f"v_{i}"] if i < len(LEVELS) else row["w_0"]
            expected = np.nan if expected is None else float(expected)
            if np.isnan(expected):
                assert np.isnan(value), (row[keys].tolist(), i)
            else:  # the same order statistics; the interpolation within 2 ulp (one rounding, as DuckDB's)
                assert abs(value - expected) <= 2 * np.spacing(abs(expected)), (row[keys].tolist(), i, value, expected)


def _spy_recompute(monkeypatch) -> list:
    redone, real = [], Q._recompute
    monkeypatch.setattr(Q, "_recompute", lambda *a, **k: (redone.append((tuple(a[4]), a[5].name)), real(*a, **k))[1])
    return redone


@pytest.mark.parametrize("sample_rows", [500, 20_000, 10**9])
def test_equal_to_quantile_cont_for_every_key_set(con, sample_rows, monkeypatch):
    monkeypatch.setattr(Q, "MIN_SAMPLE", 50)  # bracket the big groups even from small samples
    redone = _spy_recompute(monkeypatch)
    got = Q.exact_quantiles(con, "SELECT * FROM t", {}, SETS, WANTED, sample_rows=sample_rows)
    for name, keys in SETS.items():
        _assert_same(got[name], _reference(con, keys), keys)
    # the brackets held their ranks: only a = 3, whose top 1 % is NaN (never kept), went to quantile_cont
    assert set(redone) <= {((3,), "v")}


def test_equal_to_numpy_default_quantile(con):
    got = Q.exact_quantiles(con, "SELECT * FROM t", {}, {"g": ["a", "b"]}, WANTED, sample_rows=5_000)["g"]
    frame = con.execute("SELECT * FROM t").df()
    row = got[(got["a"] == 0) & (got["b"] == 0)].iloc[0]
    values = frame.loc[(frame["a"] == 0) & (frame["b"] == 0), "v"].dropna().to_numpy()
    np.testing.assert_allclose([row[f"v_{i}"] for i in range(len(LEVELS))], np.quantile(values, LEVELS), rtol=1e-15)


def test_a_misplaced_bracket_is_detected_and_recomputed(con, monkeypatch):
    """A sample that brackets the wrong values (here: the sample's top values for every quantile) must not
    change a result: the counts show the miss and the group is computed with quantile_cont."""
    monkeypatch.setattr(Q, "MIN_SAMPLE", 50)
    monkeypatch.setattr(Q, "_bracket", lambda s, q: (float(s[-3]), float(s[-1])) if len(s) >= 50 else (np.nan, np.nan))
    redone = _spy_recompute(monkeypatch)
    got = Q.exact_quantiles(con, "SELECT * FROM t", {}, SETS, WANTED, sample_rows=20_000)
    assert redone, "no group was recomputed although every bracket sat at the top"
    for name, keys in SETS.items():
        _assert_same(got[name], _reference(con, keys), keys)


def test_the_pass_keeps_a_small_share_of_a_large_group(con, monkeypatch):
    """The point of bracketing: on a group of 10^5 rows only the values near the wanted ranks are kept."""
    kept = {}
    real = Q._pass

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        kept["n"] = sum(len(x) for x in out["_qkept_v"] if x is not None)
        return out

    monkeypatch.setattr(Q, "_pass", spy)
    rel = "SELECT a, v, w, keep FROM t WHERE a = 0 AND b = 0 AND v <> 1.0"  # without the block of ties
    got = Q.exact_quantiles(con, rel, {}, {"a": ["a"]}, WANTED, sample_rows=20_000)["a"]
    rows = con.execute(f"SELECT count(v) FROM ({rel})").fetchone()[0]
    assert 0 < kept["n"] < 0.1 * rows
    ref = con.execute(f"""SELECT a, quantile_cont(v, {list(LEVELS)}) AS qv,
                                 quantile_cont(w, 0.99) FILTER (WHERE keep) AS qw FROM ({rel}) GROUP BY a""").df()
    _assert_same(got, ref, ["a"])


def test_interpolation_and_selection_edges():
    assert np.isnan(Q.select(np.array([]), 0, 0, 0.5))  # an empty group
    assert Q.select(np.array([3.0]), 0, 1, 0.99) == 3.0  # one value
    assert Q.select(np.array([1.0, 2.0]), 5, 10, 0.5) is None  # the ranks 4 and 5 lie below the bracket
    assert Q.select(np.array([1.0, 2.0]), 4, 10, 0.5) == pytest.approx(1.5)
    assert Q.interpolate(1.0, 3.0, 0.25) == 1.5


def _compare(con, rel: str, sets: dict, wanted: list, monkeypatch, **kw) -> list:
    """exact_quantiles against quantile_cont over the same rows, per key set; the groups recomputed."""
    redone = _spy_recompute(monkeypatch)
    got = Q.exact_quantiles(con, rel, {}, sets, wanted, **kw)
    for name, keys in sets.items():
        for w in wanted:
            ref = con.execute(f"""SELECT {', '.join(keys)}, quantile_cont({w.sql()}, {list(w.levels)}) AS q
                                  FROM ({rel}) GROUP BY ALL""").fetchall()
            assert len(ref) == len(got[name])
            for *key, qs in ref:
                mine = got[name]
                for k, v in zip(keys, key, strict=True):
                    mine = mine[mine[k].isna()] if v is None else mine[mine[k] == v]
                assert len(mine) == 1, key
                want = [np.nan] * len(w.levels) if qs is None else [np.nan if x is None else x for x in qs]
                np.testing.assert_allclose(mine.iloc[0][w.columns()].astype(float), want, rtol=4e-16, atol=0)
    return redone


def test_null_and_wide_integer_keys_are_groups_of_their_own(monkeypatch):
    """NULL keys (a label, an integer) and integers beyond 2**53 keep their groups apart, bracketed."""
    monkeypatch.setattr(Q, "MIN_SAMPLE", 50)
    rng = np.random.default_rng(3)
    n = 3000
    frame = pd.DataFrame({"label": [None] * n + ["x"] * n, "i": [None] * (n // 2) + [7] * (3 * n // 2),
                          "big": np.where(np.arange(2 * n) % 2 == 0, 2**60, 2**60 + 1), "v": rng.random(2 * n)})
    c = duckdb.connect()
    c.register("frame", frame)
    # bign: integers 2**53 + 1 apart from 2**53 only by one, beside NULLs (pandas would round them via float64)
    c.execute("""CREATE TABLE t AS SELECT label::VARCHAR AS label, i::INTEGER AS i, big::BIGINT AS big,
                 CASE WHEN i IS NULL THEN NULL WHEN big % 2 = 0 THEN 9007199254740992 ELSE 9007199254740993 END::BIGINT
                 AS bign, v FROM frame""")
    sets = {"label": ["label"], "i": ["i"], "big": ["big"], "bign": ["bign"], "_redo": ["label"]}
    for levels in [(0.05,), (0.05, 0.5, 0.99)]:  # a single low level once hid a miscounted NULL cell
        redone = _compare(c, "SELECT *, label AS _redo FROM t", sets, [Q.Wanted("v", "v", levels)], monkeypatch,
                          sample_rows=2_000)  # fmt: skip
        assert redone == [], "a NULL key's brackets missed: its rows were counted in the wrong cell"
    got = Q.exact_quantiles(c, "SELECT * FROM t", {}, {"bign": ["bign"]}, [Q.Wanted("v", "v", (0.5,))])["bign"]
    assert sorted(got["bign"].dropna().tolist()) == [9007199254740992, 9007199254740993]  # exact, apart
    labels = Q.exact_quantiles(c, "SELECT * FROM t", {}, {"label": ["label"]}, [Q.Wanted("v", "v", (0.5,))])["label"]
    assert labels["label"].dtype == object and labels["v_0"].dtype == np.float64


def test_infinite_values_at_the_wanted_ranks(monkeypatch):
    """inf where d = 0 is x_lo itself (inf * 0 would be NaN); a bracket reaching the infinities holds."""
    monkeypatch.setattr(Q, "MIN_SAMPLE", 20)
    c = duckdb.connect()
    c.execute("CREATE TABLE t AS SELECT 1 AS g, CASE WHEN i % 10 = 0 THEN 'inf'::DOUBLE WHEN i % 10 = 1 "
              "THEN '-inf'::DOUBLE ELSE i::DOUBLE END AS v FROM range(1001) r(i)")
    _compare(c, "SELECT * FROM t", {"g": ["g"]}, [Q.Wanted("v", "v", (0.0, 0.05, 0.5, 0.95, 1.0))], monkeypatch)
    assert Q.interpolate(math.inf, math.inf, 0.0) == math.inf


def test_rows_with_every_rollout_label_null(tmp_path, monkeypatch):
    """A store whose runs name no engine (rollout label NULL): Rows' quantiles, materialised and live,
    equal quantile_cont's per bucket, through the bracketed path."""
    from mismatch_lab.analysis import definitions as d
    from mismatch_lab.analysis.rows import Rows
    from mismatch_lab.store.reader import open_store
    from mismatch_lab.store.synthetic import SyntheticSpec, synthetic_store

    monkeypatch.setattr(Q, "MIN_SAMPLE", 5)
    monkeypatch.setattr(Q, "SAMPLE_ROWS", 300)
    path = tmp_path / "s.duckdb"
    synthetic_store(path, SyntheticSpec(rollouts=("vllm:bf16",), scorers=("hf:fp32",), n_sequences=20, seed=5))
    with duckdb.connect(str(path)) as w:
        w.execute("UPDATE runs SET engine = NULL")
    con = open_store(path)
    for materialize in (True, False):
        rows = Rows(con, materialize=materialize)
        got = rows.quantiles("linear", d.N_LINEAR_BUCKETS)
        rel, params = rows.sql["rollout"]
        ref = con.execute(f"""SELECT {rows._bucket('linear', d.N_LINEAR_BUCKETS)} AS bucket,
                                     quantile_cont(r, {list(d.RATIO_QUANTILES)}) AS q FROM ({rel}) GROUP BY ALL""",
                          params).fetchall()  # fmt: skip
        assert got["rollout"].isna().all() and len(got) == len(ref)
        for bucket, qs in ref:
            mine = got[got["bucket"] == bucket].iloc[0]
            np.testing.assert_allclose([mine[f"r_p{round(q * 100):02d}"] for q in d.RATIO_QUANTILES],
                                       [np.nan if x is None else x for x in (qs or [None] * 5)], rtol=4e-16)
        rows.close()
    con.close()


@pytest.mark.parametrize(("sets", "params", "message"), [
    ({"all": []}, {}, "at least one key column"),
    ({"f": ["w"]}, {}, "labels, integers or dates"),
    ({"a": ["a"]}, {"_qk0": 1}, "reserved"),
])  # fmt: skip
def test_what_cannot_be_keyed_is_refused(con, sets, params, message):
    rel = "SELECT * FROM t" + (" WHERE a < $_qk0" if params else "")
    with pytest.raises(ValueError, match=message):
        Q.exact_quantiles(con, rel, params, sets, WANTED)


def test_parameters_reach_every_query_and_levels_are_checked(con):
    """A $parameter read by a Wanted's filter reaches the sample too; a Wanted needs levels in [0, 1]."""
    wanted = [Q.Wanted("v", "v", [0.5], where="w > $cut")]  # a list of levels is taken as a tuple
    got = Q.exact_quantiles(con, "SELECT * FROM t", {"cut": 0.5}, {"a": ["a"]}, wanted)["a"]
    ref = dict(con.execute("SELECT a, quantile_cont(v, 0.5) FILTER (WHERE w > 0.5) FROM t GROUP BY a").fetchall())
    for a, v in zip(got["a"], got["v_0"], strict=True):
        assert (np.isnan(v) and ref[a] is None) or abs(v - ref[a]) <= 2 * np.spacing(abs(ref[a]))
    for levels in [(), (1.5,)]:
        with pytest.raises(ValueError, match="levels"):
            Q.Wanted("v", "v", levels)
