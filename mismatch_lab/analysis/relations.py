"""The row sets every analysis starts from, as SQL over the store.

* rollout pairs: one row per (token, scorer): the rollout's log mu (`lmu`) next to a scorer's log pi
  (`lpi`), joined on (run_id, seq_id, pos), or paired by position within a shard store's row-aligned
  slices (store.aligned: the same rows, checked row by row); labelled (rollout '<engine>:<dtype>' of the
  run, scorer).
* scorer pairs: one row per (token, scorer != reference): the reference scorer's log-prob as `lmu`.
  Used for the scorer-vs-scorer noise floor and for the approximation quality.

`*_base` gives the joined columns plus `finite` (definitions.finite_sql) and the per-row parts of the
top-K divergences; `with_metrics` adds the per-token quantities of `definitions.token_metrics_sql` and
top-K TV/KL (NULL on non-finite rows, so aggregates skip them). Optional columns the store lacks (an
older file, a Parquet export without top-K, a recorded or imported run holding only the required
columns) read as typed NULLs (`col`): every analysis degrades to empty values, a token without a
category counts as 'uncategorized', and a run without engine_dtype is labelled by its engine alone.
`rows.Rows` runs the passes over these row sets.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import duckdb
import pandas as pd

from mismatch_lab.analysis import definitions as d
from mismatch_lab.store.aligned import MISALIGNED


def as_list(value: str | Iterable[str] | None) -> list[str] | None:
    """A filter argument (one label, several, or None for all) as a list or None."""
    if value is None:
        return None
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value]


def table_columns(con: duckdb.DuckDBPyConnection, table: str) -> set[str]:
    """Column names of a table or view in the main schema (empty set when it does not exist), without
    the contract columns a Parquet store lacks and its view fills with NULL (reader.FILLED_COLUMNS):
    queries then use a typed NULL constant instead of reading, or materialising, an empty column. Inside
    `fixed_store(con)`, from one look-up of every table's columns."""
    if not _held(con):
        return _columns(con, table).get(table, set())
    return set(once(con, "columns", lambda: _columns(con)).get(table, ()))


_COLUMNS_SQL = "SELECT table_name, column_name FROM information_schema.columns WHERE table_schema = 'main'"
_FIXED: contextvars.ContextVar[tuple[duckdb.DuckDBPyConnection, dict] | None] = contextvars.ContextVar(
    "fixed_store", default=None)


@contextlib.contextmanager
def fixed_store(con: duckdb.DuckDBPyConnection, memo: dict | None = None):
    """Within the block, look-ups of the store on `con` (`once`: its tables' columns, its runs) are taken at
    their first call and reused: for a series of queries on a connection whose store does not change
    meanwhile (`store.units` computing the new steps of a refresh, on a connection over their files). A
    look-up costs 1-4 ms (binding a Parquet view reads its files' footers), and the per-step queries of a
    refresh made 16 of the columns alone. Inside a block of the same `con` already: that block's look-ups. `memo`:
    the look-ups of an earlier block on `con` (a connection kept for more queries on the same files)."""
    if _held(con):
        yield con
        return
    token = _FIXED.set((con, {} if memo is None else memo))
    try:
        yield con
    finally:
        _FIXED.reset(token)


def _held(con: duckdb.DuckDBPyConnection) -> bool:
    fixed = _FIXED.get()
    return fixed is not None and fixed[0] is con


def once(con: duckdb.DuckDBPyConnection, key: str, compute: Callable[[], object]):
    """`compute()`, taken once per `key` inside `fixed_store(con)`, else at each call (the caller must not
    change what it returns)."""
    if not _held(con):
        return compute()
    memo = _FIXED.get()[1]
    if key not in memo:
        memo[key] = compute()
    return memo[key]


def prime(con: duckdb.DuckDBPyConnection, key: str, value) -> None:
    """Set the look-up `key` of `once` inside `fixed_store(con)` to `value` (known to the caller, e.g. from the
    same files read before); nothing outside it."""
    if _held(con):
        _FIXED.get()[1][key] = value


def run_ids(con: duckdb.DuckDBPyConnection) -> list:
    """The run ids of the `runs` table on `con` (once inside `fixed_store`)."""
    return once(con, "runs", lambda: [r[0] for r in con.execute("SELECT DISTINCT run_id FROM runs").fetchall()])


def _columns(con: duckdb.DuckDBPyConnection, table: str | None = None) -> dict[str, set[str]]:
    """table -> its columns less the filled ones (`table_columns`), of `table` only or of every table."""
    sql, params = (f"{_COLUMNS_SQL} AND table_name = ?", [table]) if table else (_COLUMNS_SQL, [])
    filled = _filled(con, table)
    return {name: cols - filled.get(name, set()) for name, cols in _by_table(con.execute(sql, params).fetchall()).items()}


def _filled(con: duckdb.DuckDBPyConnection, table: str | None) -> dict[str, set[str]]:
    """table -> the columns its view fills with NULL (reader.FILLED_COLUMNS), of `table` only or of all."""
    from mismatch_lab.store.reader import FILLED_COLUMNS

    sql, params = f"SELECT table_name, column_name FROM {FILLED_COLUMNS}", []
    if table:
        sql, params = f"{sql} WHERE table_name = ?", [table]
    try:
        rows = con.execute(sql, params).fetchall()
    except duckdb.CatalogException:
        return {}  # a DuckDB store: its columns are what its tables hold
    return _by_table(rows)


def _by_table(rows) -> dict[str, set[str]]:
    """(table_name, column_name) rows -> table -> its columns."""
    out: dict[str, set[str]] = {}
    for name, column in rows:
        out.setdefault(name, set()).add(column)
    return out


def has_tables(con: duckdb.DuckDBPyConnection, *tables: str) -> bool:
    return all(table_columns(con, t) for t in tables)


def typed_null(sql_type: str) -> str:
    """A NULL of `sql_type` as a self-contained expression. `CAST(NULL AS DOUBLE[])`, never
    `NULL::DOUBLE[]`: followed by a subscript (`...[i]`) the latter parses as the array type DOUBLE[][i]."""
    return f"CAST(NULL AS {sql_type})"


def col(cols: set[str], alias: str, name: str, sql_type: str) -> str:
    """`alias.name` if the column exists, else a typed NULL (older stores, partial exports, recorded or
    imported runs that hold only the required columns). Safe wherever an expression goes, subscripts too."""
    return f"{alias}.{name}" if name in cols else typed_null(sql_type)


@dataclass(frozen=True)
class Filters:
    """Which rows an analysis reads: rollout labels, scorer labels, run ids (None = all)."""

    rollout: list[str] | None = None
    scorer: list[str] | None = None
    run_ids: list[str] | None = None

    @classmethod
    def make(cls, rollout=None, scorer=None, run_ids=None) -> Filters:
        return cls(as_list(rollout), as_list(scorer), as_list(run_ids))

    def where(self, rollout_sql: str | None, scorer_sql: str, run_sql: str | None) -> tuple[str, dict]:
        """SQL condition + params of the filters on these expressions; one given as None is left out
        (decided by the caller)."""
        clauses, params = [], {}
        for name, values, expr in (
            ("f_rollout", self.rollout, rollout_sql),
            ("f_scorer", self.scorer, scorer_sql),
            ("f_run", self.run_ids, run_sql),
        ):
            if values is not None and expr is not None:
                clauses.append(f"list_contains(${name}::VARCHAR[], {expr})")
                params[name] = values
        return (" AND ".join(clauses) or "true"), params


def advantage_sql(con: duckdb.DuckDBPyConnection, sign_type: str = "VARCHAR") -> str:
    """Subquery (run_id, seq_id, step, adv_sign) with one row per sequence: its training step (NULL for
    collect runs) and the sign of its advantage (definitions.ADV_SIGNS; NULL where the advantage is 0 or
    neither advantage nor reward is stored)."""
    cols = table_columns(con, "sequences")
    adv, rew = col(cols, "q", "advantage", "DOUBLE"), col(cols, "q", "reward", "DOUBLE")
    step, prompt = col(cols, "q", "step", "INTEGER"), col(cols, "q", "prompt_id", "VARCHAR")
    return f"""
        SELECT run_id, seq_id, step,
               (CASE WHEN a > 0 THEN 'positive' WHEN a < 0 THEN 'negative' END)::{sign_type} AS adv_sign
        FROM (SELECT q.run_id, q.seq_id, {step} AS step,
                     {d.group_advantage_sql(adv, rew, f"q.run_id, {step}, {prompt}")} AS a
              FROM sequences q)"""


def _anchor(kl: bool = True) -> str:
    """SELECT-list of the anchor-side top-K columns (definitions.topk_anchor_sql) over columns k_ids,
    k_a (the anchor's top-K ids and log-probs) and token_id."""
    parts = d.topk_anchor_sql("k_ids", "k_a", "token_id", kl=kl)
    return ", ".join(f"{expr} AS {name}" for name, expr in parts.items())


PAIR_TOPK = list(d.topk_pair_sql("x"))  # k_ok, k_mass_b, k_abs, k_kl, k_n
TOPK_STORED = ["k_extra", "k_mass_a", *PAIR_TOPK]  # what part 3 (definitions.topk_sql) reads


def rollout_base(
    con: duckdb.DuckDBPyConnection,
    filters: Filters,
    *,
    topk: bool = True,
    advantage: bool = True,
    enums: dict[str, str] | None = None,
    aligned: list[tuple[str, str, str]] | None = None,
) -> tuple[str, dict]:
    """SQL + params: one row per (token, scorer) with rollout, scorer, run_id, seq_id, token_id, category,
    entropy, tv_exact (scores.tv_exact_vs_ref), lmu, lpi, finite; with topk the top-K parts (TOPK_STORED,
    mu's recorded top-K against the scorer's logps_at_rollout_topk; else NULL); with advantage the
    sequence's step and adv_sign
    ('positive' / 'negative' / NULL). `enums` (column -> ENUM type) casts those label columns where the
    fewest rows pass: the rollout label and the run id on `runs`, the category on `tokens`, before the join.
    `aligned`: (run_id, tokens, scores) of row-aligned slices (store.aligned.parts): tokens and scores are
    then paired by position within each slice the filters keep instead of joined on their keys, and a pair
    whose (seq_id, pos) differ raises store.aligned.MISALIGNED (the caller then joins on keys). Only for
    stores of one scorer: with several, a scorer filter could drop a misaligned pair before its check.
    With no slice kept, the key join (no rows, the same columns)."""
    p = _Pieces.make(con, topk, advantage, enums or {})
    slices = _aligned_slices(con, filters, aligned or [])
    return _by_position(p, filters, slices) if slices else _by_keys(con, p, filters)


@dataclass(frozen=True)
class _Pieces:
    """What both joins of rollout_base select: `tok(source, where)` the tokens side (alias t, with the
    anchor's top-K parts), `pair` the (name, expression) columns read from t and s, `runs` the labels of
    each run (run_id, run_label, rollout), `sign` the advantage rows (advantage_sql; '' without)."""

    tok: Callable[[str, str], str]
    pair: list[tuple[str, str]]
    runs: str
    sign: str

    @classmethod
    def make(cls, con: duckdb.DuckDBPyConnection, topk: bool, advantage: bool, enums: dict[str, str]) -> _Pieces:
        def cast(expr: str, name: str) -> str:
            return f"({expr})::{enums[name]}" if name in enums else expr

        tcols, scols = table_columns(con, "tokens"), table_columns(con, "scores")
        category = cast(f"coalesce({col(tcols, 'tokens', 'category', 'VARCHAR')}, 'uncategorized')", "category")

        def tok(source: str, where: str) -> str:
            return f"""SELECT run_id, seq_id, pos, logp_rollout, token_id, category {', ' + _anchor() if topk else ''}
                  FROM (SELECT run_id, seq_id, pos, logp_rollout,
                               {col(tcols, 'tokens', 'token_id', 'INTEGER')} AS token_id,
                               {category} AS category,
                               {col(tcols, 'tokens', 'topk_ids_rollout', 'INTEGER[]')} AS k_ids,
                               {col(tcols, 'tokens', 'topk_logps_rollout', 'DOUBLE[]')} AS k_a
                        FROM {source} AS tokens {where})"""

        nonfinite = col(scols, "s", "nonfinite", "BOOLEAN")
        pair = [("scorer", cast("s.scorer", "scorer")), ("seq_id", "t.seq_id"), ("token_id", "t.token_id"),
                ("category", "t.category"), ("lmu", "t.logp_rollout"), ("lpi", "s.logp"),
                ("finite", d.finite_sql("t.logp_rollout", "s.logp", nonfinite)),
                ("entropy", col(scols, "s", "entropy", "DOUBLE")), ("tv_exact", col(scols, "s", "tv_exact_vs_ref", "DOUBLE"))]  # fmt: skip
        if topk:
            pair += [(c, f"t.{c}") for c in ("k_extra", "k_mass_a")]
            pair += list(d.topk_pair_sql(col(scols, "s", "logps_at_rollout_topk", "DOUBLE[]")).items())
        else:
            pair += [(c, typed_null("BOOLEAN" if c in ("k_extra", "k_ok") else "DOUBLE")) for c in TOPK_STORED]
        # labels are cast where the fewest rows pass: on `runs` (one row a run), not on every token
        runs = f"SELECT run_id, {cast('run_id', 'run_id')} AS run_label, {cast(d.ROLLOUT_LABEL_SQL, 'rollout')} AS rollout FROM runs"
        sign = advantage_sql(con, enums.get("adv_sign", "VARCHAR")) if advantage else ""
        return cls(tok, pair, runs, sign)

    def select(self, alias: str | None = None) -> str:
        """The SELECT list of a row: labels from `runs`, the pair columns (expressions over t and s, or
        the columns of `alias` that holds them), the advantage columns from `adv`."""
        pair = [f"{alias}.{n}" if alias else f"{e} AS {n}" for n, e in self.pair]
        return ", ".join(["runs.rollout", pair[0], "runs.run_label AS run_id", *pair[1:],
                          *(["adv.adv_sign", "adv.step"] if self.sign else [])])  # fmt: skip


def _by_keys(con: duckdb.DuckDBPyConnection, p: _Pieces, filters: Filters) -> tuple[str, dict]:
    """rollout_base by the key join: tokens and scores hash-joined on (run_id, seq_id, pos), or on
    (seq_id, pos) where the rows are one run's (_one_run)."""
    where, params = filters.where("runs.rollout::VARCHAR", "s.scorer", "t.run_id")
    one = _one_run(con, filters, params)
    only = f"WHERE {one}" if one else ""
    adv = f"LEFT JOIN (SELECT * FROM ({p.sign}) {only}) adv ON {_join_on('adv', 't', one, ('seq_id',))}" if p.sign else ""
    return f"""
        SELECT {p.select()}
        FROM ({p.tok('tokens', only)}) t JOIN (SELECT * FROM scores {only}) s ON {_join_on('s', 't', one)}
        JOIN ({p.runs}) runs ON runs.run_id = t.run_id
        {adv}
        WHERE {where}""", params


def _by_position(p: _Pieces, filters: Filters, slices: list[tuple[str, str, str]]) -> tuple[str, dict]:
    """rollout_base by position: each slice's tokens and scores paired row by row (its run's index `_k` a
    constant of its rows), every pair's (seq_id, pos) checked; then the labels and the advantage rows
    joined once to all slices on that integer index (no run id string a row). The slices' run and rollout
    filters were decided by _aligned_slices; only the scorer filter is left to the rows (a filter on one
    side of a positional join would shift the pairing)."""
    where, params = filters.where(None, "s.scorer", None)
    check = f"CASE WHEN t.seq_id = s.seq_id AND t.pos = s.pos THEN true ELSE error('{MISALIGNED}') END"
    run_ids = list(dict.fromkeys(run for run, _, _ in slices))
    params["slice_runs"] = run_ids
    pair = ", ".join(f"{e} AS {n}" for n, e in p.pair)
    parts = " UNION ALL ".join(f"""
        SELECT {run_ids.index(run)} AS _k, {pair} FROM ({p.tok(ts, '')}) t POSITIONAL JOIN {ss} s
        WHERE {where} AND {check}""" for run, ts, ss in slices)  # fmt: skip
    small = [f"_ids AS MATERIALIZED (SELECT k::INTEGER AS _k, $slice_runs[k + 1] AS run_id FROM range({len(run_ids)}) r(k))",
             f"_runs AS MATERIALIZED (SELECT _ids._k, r.* FROM ({p.runs}) r JOIN _ids USING (run_id))"]  # fmt: skip
    adv = ""
    if p.sign:
        small.append(f"_adv AS MATERIALIZED (SELECT _ids._k, a.seq_id, a.step, a.adv_sign FROM ({p.sign}) a JOIN _ids USING (run_id))")
        adv = "LEFT JOIN _adv adv ON adv._k = x._k AND adv.seq_id = x.seq_id"
    return f"""
        WITH {', '.join(small)}
        SELECT {p.select('x')}
        FROM ({parts}) x JOIN _runs runs ON runs._k = x._k
        {adv}""", params


def _aligned_slices(
    con: duckdb.DuckDBPyConnection, filters: Filters, aligned: list[tuple[str, str, str]]
) -> list[tuple[str, str, str]]:
    """The (run_id, tokens, scores) slices of `aligned` whose run has a `runs` row and passes the run and
    rollout filters (decided here, once a slice)."""
    if not aligned:
        return []
    labels = dict(con.execute(f"SELECT run_id, {d.ROLLOUT_LABEL_SQL} FROM runs").fetchall())
    return [(run, ts, ss) for run, ts, ss in aligned if run in labels
            and (filters.run_ids is None or run in filters.run_ids)
            and (filters.rollout is None or labels[run] in filters.rollout)]  # fmt: skip


def _one_run(con: duckdb.DuckDBPyConnection, filters: Filters, params: dict) -> str:
    """'' or, where the rows are one run's (`runs` lists one run, or the filters name one), that run
    as parameter $one_run (set in `params`) and the returned condition on a row's run_id: both sides of
    a join then read that run alone and join on (seq_id, pos) (_join_on): the same rows as the three-
    column key, without hashing and comparing a run id string a token (~30 % of the join at 10^7)."""
    runs = filters.run_ids
    if runs is None:
        runs = run_ids(con)
    if len(set(runs)) != 1 or runs[0] is None:
        return ""
    params["one_run"] = runs[0]
    return "run_id = $one_run"


def _join_on(a: str, b: str, one_run: str, keys: tuple[str, ...] = ("seq_id", "pos")) -> str:
    """ON condition joining aliases a and b on `keys` (a token's by default) within a run: run_id is a key
    too unless both sides hold one run's rows (_one_run)."""
    return " AND ".join(f"{a}.{k} = {b}.{k}" for k in (keys if one_run else ("run_id", *keys)))


def _restrict(one_run: str, *aliases: str) -> str:
    """' AND alias.<one_run condition>' for each alias ('' when the rows are not one run's)."""
    return "".join(f" AND {a}.{one_run}" for a in aliases) if one_run else ""


def scorer_base(
    con: duckdb.DuckDBPyConnection,
    filters: Filters,
    reference: str = d.REFERENCE_SCORER,
    *,
    topk: bool = True,
) -> tuple[str, dict]:
    """SQL + params: one row per (token, scorer != reference) with rollout, scorer, reference, run_id,
    seq_id, lmu (the reference's log-prob), lpi (the scorer's), finite, tv_exact (the scorer's stored
    exact TV against the reference); with topk the top-K TV parts on the reference's own top-K (its topk_ids / topk_logps) against the scorer's
    logps_at_ref_topk (top-K KL stays NULL: no analysis reads it on scorer pairs)."""
    tcols, scols = table_columns(con, "tokens"), table_columns(con, "scores")
    where, params = filters.where(d.ROLLOUT_LABEL_SQL, "s.scorer", "s.run_id")
    params["reference"] = reference
    one = _one_run(con, filters, params)
    # the sampled token's id comes from `tokens`; that join is only paid for when top-K is wanted
    tok_join = f"JOIN tokens t ON {_join_on('t', 'r', one)}" if topk else ""
    ref = f"""SELECT run_id, seq_id, pos, scorer, logp, nonfinite {', ' + _anchor(kl=False) if topk else ''}
              FROM (SELECT r.run_id, r.seq_id, r.pos, r.scorer, r.logp,
                           {col(scols, 'r', 'nonfinite', 'BOOLEAN')} AS nonfinite,
                           {col(tcols, 't', 'token_id', 'INTEGER') if topk else typed_null('INTEGER')} AS token_id,
                           {col(scols, 'r', 'topk_ids', 'INTEGER[]')} AS k_ids,
                           {col(scols, 'r', 'topk_logps', 'DOUBLE[]')} AS k_a
                    FROM scores r {tok_join}
                    WHERE r.scorer = $reference
                      -- only runs another scorer scored too: the rest has no partner and costs a join
                      AND r.run_id IN (SELECT DISTINCT run_id FROM scores WHERE scorer <> $reference)
                      {_restrict(one, "r", "t") if topk else _restrict(one, "r")})"""
    cols = [
        f"{col(scols, 's', 'tv_exact_vs_ref', 'DOUBLE')} AS tv_exact",
    ]
    # only the top-K TV is read on scorer pairs (approximation quality): its KL is left NULL
    pair = d.topk_pair_sql(col(scols, "s", "logps_at_ref_topk", "DOUBLE[]"), kl=False)
    cols += [f"ref.{c}" for c in ("k_extra", "k_mass_a")] + [f"{e} AS {n}" for n, e in pair.items()] if topk else [
        f"{typed_null('BOOLEAN' if c in ('k_extra', 'k_ok') else 'DOUBLE')} AS {c}" for c in TOPK_STORED
    ]
    nf_s = col(scols, "s", "nonfinite", "BOOLEAN")
    nonfinite = f"(coalesce({nf_s}, false) OR coalesce(ref.nonfinite, false))"
    base = f"""
        SELECT {d.ROLLOUT_LABEL_SQL} AS rollout, s.scorer AS scorer, ref.scorer AS reference,
               s.run_id, s.seq_id, ref.logp AS lmu, s.logp AS lpi,
               {d.finite_sql('ref.logp', 's.logp', nonfinite)} AS finite,
               {', '.join(cols)}
        FROM scores s
        JOIN ({ref}) ref ON {_join_on('ref', 's', one)}
        JOIN runs ON runs.run_id = s.run_id
        WHERE s.scorer <> $reference AND {where} {_restrict(one, "s")}"""
    return base, params


STORED_METRICS = ("topk",)
"""The costly per-token metric (the top-K parts, list lambdas): a materialised row set stores it; the
scalar rest is recomputed by every pass from lmu and lpi (cheaper than the memory to store it)."""


GUARDED = {"lmu": "_m_lmu", "lpi": "_m_lpi"}
"""with_metrics' copies of lmu and lpi, NULL on non-finite rows: the scalar metrics read these, so they are
NULL there (arithmetic, exp, ln and CASE give NULL for NULL, never an error), as a CASE WHEN finite around
each of them would make them, with one guard a row instead of one a metric."""
SHARED = {name: f"_m_{name}" for name in d.shared_sql()}
"""The columns with_metrics computes its shared exponentials into (definitions.shared_sql), then drops."""


def metrics_sql(skip: Iterable[str] = (), *, layered: bool = False) -> dict[str, str]:
    """name -> SQL of every per-token metric and `topk` (STRUCT(tv, kl)), NULL on non-finite rows: each
    guarded by CASE WHEN finite, or (`layered`: with_metrics' expressions) the scalar ones read from the
    GUARDED inputs and the SHARED exponentials of the layers below."""
    topk = {"topk": f"CASE WHEN finite THEN {d.topk_sql('lmu', 'lpi')} END"}
    if layered:
        return {n: e for n, e in (d.token_metrics_sql(**GUARDED, shared=SHARED) | topk).items() if n not in skip}
    metrics = {name: f"CASE WHEN finite THEN {expr} END" for name, expr in d.token_metrics_sql().items()}
    return {name: expr for name, expr in (metrics | topk).items() if name not in skip}


def with_metrics(base: str, stored: Iterable[str] = ()) -> str:
    """A base row set plus every metric of `metrics_sql` not already `stored` as a column of base, and
    topk_tv / topk_kl unpacked from `topk`. Two layers below the metrics, not returned: lmu and lpi as NULL
    on non-finite rows (GUARDED), then the exponentials several metrics share, computed once a row
    (SHARED). Their names (prefix `_m_`) are reserved: a base column of the same name would be read in
    their place (DuckDB renames the new one)."""
    guard = ", ".join(f"CASE WHEN finite THEN {c} END AS {g}" for c, g in GUARDED.items())
    exps = ", ".join(f"{expr} AS {SHARED[name]}" for name, expr in d.shared_sql(**GUARDED).items())
    cols = ", ".join(f"{expr} AS {name}" for name, expr in metrics_sql(skip=stored, layered=True).items())
    own = ", ".join([*GUARDED.values(), *SHARED.values()])
    return f"""SELECT * EXCLUDE ({own}), topk.tv AS topk_tv, topk.kl AS topk_kl
               FROM (SELECT *, {cols} FROM (SELECT *, {exps} FROM (SELECT *, {guard} FROM ({base}))))"""


def _used(sql: str, params: dict | None) -> dict:
    return {k: v for k, v in (params or {}).items() if f"${k}" in sql}


def query(con: duckdb.DuckDBPyConnection, sql: str, params: dict | None = None) -> pd.DataFrame:
    """Run SQL with named parameters (those absent from the SQL dropped); ENUM labels come back as str."""
    return labels_as_str(con.execute(sql, _used(sql, params)).df())


def labels_as_str(df: pd.DataFrame) -> pd.DataFrame:
    """`df` with its categorical columns (DuckDB ENUM labels) as plain str objects, in place."""
    for c in df.select_dtypes("category").columns:
        df[c] = df[c].astype(object)
    return df


def empty(columns: Iterable[str]) -> pd.DataFrame:
    return pd.DataFrame({c: pd.Series(dtype="object") for c in columns})
