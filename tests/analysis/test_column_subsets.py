"""Optional columns stay optional: every analysis on stores holding only the required columns plus any
subset of the optional groups (top-K, entropy, exact TV/KL, token text + category), as a Parquet directory
(absent columns read as NULL) and as a DuckDB file whose tables physically lack them.

The source store mixes a collect run ('vllm:bf16' scored by hf:fp32 / hf:bf16) with a run recorded in an
RL framework: engine_dtype NULL (rollout label 'vllm'), scorers 'trl:fp32' / 'trl:bf16', sequences over
three training steps. Required-column metrics are compared with a pandas reference computed from the
frames the generator wrote (analysis_reference.naive_pair_rows)."""

from __future__ import annotations

import itertools
import json

import duckdb
import numpy as np
import pandas as pd
import pytest
from analysis_reference import naive_pair_rows

from mismatch_lab.analysis import (
    ANALYSES,
    approximation,
    clipping,
    precision,
    run_all,
    steps,
    violations,
    volatility,
)
from mismatch_lab.analysis import definitions as d
from mismatch_lab.analysis.relations import col, typed_null
from mismatch_lab.categories import CATEGORIES
from mismatch_lab.cli import main
from mismatch_lab.store.reader import open_store
from mismatch_lab.store.synthetic import (
    SyntheticSpec,
    stepped_frames,
    subset_store,
    synthetic_store,
    write_store,
)

SPEC = SyntheticSpec(
    rollouts=("vllm:bf16", "vllm:fp16"),
    scorers=("hf:fp32", "hf:bf16"),
    n_sequences=12,
    max_len=12,
    n_one_token=1,
    n_planted=4,
    n_nonfinite=2,
    n_rollout_nonfinite=1,
    rewards="advantage",
    topk=4,
    exact_tv=True,
    train_steps=3,
    seed=11,
)
RECORDED = "synthetic-1-vllm-fp16"
RENAMED = {"hf:fp32": "trl:fp32", "hf:bf16": "trl:bf16"}
PAIRS = {("vllm:bf16", "hf:fp32"), ("vllm:bf16", "hf:bf16"), ("vllm", "trl:fp32"), ("vllm", "trl:bf16")}
GROUPS = ("topk", "entropy", "exact", "text")
SUBSETS = [g for k in range(len(GROUPS) + 1) for g in itertools.combinations(GROUPS, k)]
CASES = [(form, g) for form in ("duckdb", "parquet") for g in SUBSETS]


def _id(case) -> str:
    form, groups = case
    return f"{form}:{'+'.join(groups) or 'required-only'}"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """(path, frames) of the mixed source store, every optional column filled."""
    tmp = tmp_path_factory.mktemp("subset-source")
    base = synthetic_store(tmp / "base.duckdb", SPEC)
    frames = stepped_frames(base.frames, 3, run_ids=[RECORDED], kind="record", engine_dtype=None, scorers=RENAMED)
    return write_store(tmp / "source.duckdb", frames), frames


@pytest.fixture(scope="module")
def naive(source):
    return naive_pair_rows(source[1])


def make_subset(source, tmp_path_factory, form: str, groups: tuple[str, ...], rewards: bool = True):
    tmp = tmp_path_factory.mktemp("subset")
    out = tmp / ("store.duckdb" if form == "duckdb" else "results")
    return subset_store(source[0], out, groups + (("rewards",) if rewards else ()), form=form)


@pytest.fixture(scope="module", params=CASES, ids=_id)
def case(request, source, tmp_path_factory):
    """(groups, the store's connection, run_all's tables) for one (form, subset of optional groups)."""
    form, groups = request.param
    con = open_store(make_subset(source, tmp_path_factory, form, groups))
    yield set(groups), con, run_all(con)
    con.close()


# -- the store really lacks what it should ----------------------------------------------------------
def test_a_duckdb_subset_store_physically_lacks_the_optional_columns(source, tmp_path_factory):
    con = duckdb.connect(str(make_subset(source, tmp_path_factory, "duckdb", ())), read_only=True)
    cols = {t: {r[0] for r in con.execute(f"DESCRIBE {t}").fetchall()} for t in ("sequences", "tokens", "scores")}
    assert cols["tokens"] == {"run_id", "seq_id", "pos", "token_id", "logp_rollout"}
    assert cols["scores"] == {"run_id", "seq_id", "pos", "scorer", "logp", "nonfinite"}
    assert cols["sequences"] == {"run_id", "seq_id", "step", "response_len", "reward", "advantage"}
    con.close()


def test_a_subscripted_missing_list_column_is_a_null_not_a_parser_error():
    # the bug: `NULL::DOUBLE[]` followed by `[i]` parsed as the array type DOUBLE[][i]
    missing = col(set(), "s", "logps_at_rollout_topk", "DOUBLE[]")
    con = duckdb.connect()
    assert con.execute(f"SELECT list_transform([1.0, 2.0], lambda x, i: {missing}[i])").fetchone()[0] == [None, None]
    assert con.execute(f"SELECT {typed_null('INTEGER[]')}[1] IS NULL").fetchone()[0] is True
    pair = d.topk_pair_sql(missing)
    sql = ", ".join(f"{e} AS {n}" for n, e in pair.items())
    row = con.execute(f"SELECT {sql} FROM (SELECT 3 AS k_len, [0.1, 0.2, 0.3] AS k_ea, 0.0 AS k_ea_la)").fetchone()
    assert row == (False, None, None, None, None)  # k_ok, k_mass_b, k_abs, k_kl, k_n


def test_the_rollout_label_is_the_engine_alone_when_the_dtype_is_unknown():
    con = duckdb.connect()
    con.execute("CREATE TABLE runs AS SELECT * FROM (VALUES ('vllm', 'bf16'), ('vllm', NULL), ('sglang', '')) t(engine, engine_dtype)")
    got = [r[0] for r in con.execute(f"SELECT {d.ROLLOUT_LABEL_SQL} FROM runs").fetchall()]
    assert got == ["vllm:bf16", "vllm", "sglang"]
    unqualified = [r[0] for r in con.execute(f"SELECT {d.rollout_label_sql(None)} FROM runs").fetchall()]
    assert unqualified == got


# -- every analysis on every subset, against the pandas reference -------------------------------------
def test_run_all_returns_every_analysis_with_the_pairs_of_the_store(case):
    _, _, tables = case
    assert list(tables) == list(ANALYSES)
    pairs = tables["precision"][tables["precision"]["comparison"] == "rollout_vs_scorer"]
    assert set(zip(pairs["rollout"], pairs["scorer"])) == PAIRS


def test_precision_of_required_columns_equals_the_pandas_reference(case, naive):
    _, _, tables = case
    pairs = tables["precision"][tables["precision"]["comparison"] == "rollout_vs_scorer"].set_index(["rollout", "scorer"])
    for (ro, sc), g in naive.groupby(["rollout", "scorer"]):
        row, ok = pairs.loc[(ro, sc)], g[g["finite"]]
        assert row["n_tokens"] == len(g) and row["n_nonfinite"] == (~g["finite"]).sum() > 0
        assert row["abs_dp_mean"] == pytest.approx(ok["abs_dp"].mean(), rel=1e-9)
        assert row["abs_dlogp_mean"] == pytest.approx(ok["abs_dlogp"].mean(), rel=1e-9)
        assert row["kl_k3"] == pytest.approx(ok["k3"].mean(), rel=1e-9)
        clipped = ((ok["r"] < d.CLIP_LOW) | (ok["r"] > d.CLIP_HIGH)).mean()
        assert row["frac_ratio_outside_clip"] == pytest.approx(clipped, rel=1e-12) and clipped > 0


def test_volatility_counts_every_finite_token_and_optional_statistics_only_where_stored(case, naive):
    groups, _, tables = case
    vol = tables["volatility"]
    for scale, per_pair in ((s, len(d.bucket_edges(s))) for s in ("linear", "log")):
        part = vol[(vol["scale"] == scale) & (vol["bucket"] >= 0)]
        assert part.groupby(["rollout", "scorer"]).size().to_dict() == {p: per_pair for p in PAIRS}
        n = part.groupby(["rollout", "scorer"])["n_tokens"].sum()
        assert n.to_dict() == naive[naive["finite"]].groupby(["rollout", "scorer"]).size().to_dict()
    assert (vol["n_topk"].sum() > 0) == ("topk" in groups)
    assert (vol["n_exact"].sum() > 0) == ("exact" in groups)
    assert vol["topk_tv_mean"].notna().any() == ("topk" in groups)
    assert vol["tv_exact_vs_ref_mean"].notna().any() == ("exact" in groups)


def test_clipping_by_category_falls_back_to_uncategorized_without_token_text(case, naive):
    groups, _, tables = case
    clip = tables["clipping"]
    cat = clip[(clip["view"] == "category") & (clip["adv_sign"] == "all")]
    filled = cat[cat["n_tokens"] > 0].set_index(["rollout", "scorer", "category"])
    ok = naive[naive["finite"]]
    if "text" in groups:
        assert "uncategorized" not in set(cat["category"])
    else:
        ok = ok.assign(category="uncategorized")
        assert set(CATEGORIES) < set(cat["category"])  # every category still listed, the known ones empty
    expect = ok.groupby(["rollout", "scorer", "category"]).size()
    assert filled["n_tokens"].to_dict() == expect.to_dict()
    if "entropy" in groups:
        want = ok.groupby(["rollout", "scorer", "category"])["entropy"].mean()
        np.testing.assert_allclose(filled["entropy_mean"].loc[want.index], want, rtol=1e-9)
    else:
        assert cat["entropy_mean"].isna().all()


def test_top_clipped_tokens_are_ranked_by_id_when_the_store_has_no_token_text(case, naive):
    groups, _, tables = case
    clip = tables["clipping"]
    top = clip[clip["view"] == "top_token"]
    ok = naive[naive["finite"]]
    clipped = ok[(ok["r"] < d.CLIP_LOW) | (ok["r"] > d.CLIP_HIGH)]
    assert len(top) > 0 and (top["n_ratio_clip"] > 0).all()
    if "text" in groups:
        assert top["token_text"].notna().all() and top["token_id"].isna().all()
    else:
        assert top["token_text"].isna().all() and top["token_id"].notna().all()
        assert (top["category"] == "uncategorized").all()
        for (ro, sc), g in top.groupby(["rollout", "scorer"]):
            want = clipped[(clipped["rollout"] == ro) & (clipped["scorer"] == sc)].groupby("token_id").size()
            got = g.set_index(g["token_id"].astype(int))["n_ratio_clip"]
            assert got.to_dict() == want.loc[got.index].to_dict()
            assert got.iloc[0] == want.max() and list(g["rank"]) == list(range(1, len(g) + 1))


def test_violations_count_the_tokens_of_each_advantage_sign(case, naive):
    _, _, tables = case
    v = tables["violations"]
    tok = v[v["source"] == "tokens"].set_index(["rollout", "scorer", "adv_sign"])
    want = naive[naive["finite"] & naive["adv_sign"].notna()].groupby(["rollout", "scorer", "adv_sign"]).size()
    assert tok["n_tokens"].to_dict() == want.to_dict()
    series = v[v["source"] == "train_metrics"]
    assert len(series) == SPEC.train_steps * 3  # the training run's three series, kept whatever else is missing


def test_approximation_needs_exact_tv_and_top_k_only_for_its_top_k_columns(case, naive):
    groups, _, tables = case
    a = tables["approximation"]
    # only the collect run was scored by the reference scorer hf:fp32 (the recorded run's are trl:*)
    assert list(zip(a["rollout"], a["scorer"], a["reference"])) == [("vllm:bf16", "hf:bf16", "hf:fp32")]
    row = a.iloc[0]
    assert (row["n_exact"] > 0) == ("exact" in groups)
    assert (row["n_topk_exact"] > 0) == ({"exact", "topk"} <= groups)
    if "exact" not in groups:
        assert pd.isna(row["binary_tv_corr"]) and pd.isna(row["exact_tv_mean"])


def test_steps_hold_the_recorded_run_only_and_equal_the_pandas_reference(case, naive):
    _, _, tables = case
    s = tables["steps"]
    assert set(s["run_id"]) == {RECORDED} and set(s["rollout"]) == {"vllm"}
    want = naive[naive["step"].notna()].groupby(["run_id", "rollout", "scorer", "step"])
    got = s.set_index(["run_id", "rollout", "scorer", "step"])
    assert sorted(got.index) == sorted(want.groups)
    assert got["n_tokens"].to_dict() == want.size().to_dict()
    assert got["n_nonfinite"].to_dict() == want["finite"].apply(lambda f: int((~f).sum())).to_dict()
    for col_name, ref in (("abs_dp_mean", "abs_dp"), ("abs_dlogp_mean", "abs_dlogp"), ("kl_k3", "k3")):
        np.testing.assert_allclose(got[col_name].loc[list(want.groups)], want[ref].mean().loc[list(want.groups)], rtol=1e-9)


EDGE_CASES = [(form, g) for form in ("duckdb", "parquet") for g in ((), GROUPS)]


@pytest.mark.parametrize("case", EDGE_CASES, indirect=True, ids=_id)  # the bare and the full subset suffice here
def test_each_analysis_function_alone_equals_its_run_all_table(case):
    _, con, tables = case

    def same(stacked: pd.DataFrame, single: pd.DataFrame) -> None:
        assert len(single) > 0
        got = stacked[single.columns].reset_index(drop=True)
        pd.testing.assert_frame_equal(got, single.reset_index(drop=True), check_dtype=False, rtol=1e-9)

    vol, clip, prec = tables["volatility"], tables["clipping"], tables["precision"]
    same(vol[vol["scale"] == "log"].drop(columns="scale"), volatility.volatility_table(con, buckets="log").drop(columns="scale"))
    same(clip[clip["view"] == "mu_bucket"].drop(columns="scale"), clipping.clipping_by_bucket(con).drop(columns="scale"))
    same(clip[clip["view"] == "top_token"], clipping.top_clipped_tokens(con))
    same(prec[prec["comparison"] == "scorer_vs_reference"], precision.noise_floor(con))
    same(tables["violations"][tables["violations"]["source"] == "tokens"], violations.violations_table(con))
    same(tables["approximation"], approximation.approximation_table(con))
    same(tables["steps"], steps.step_series(con))
    drift = precision.sequence_drift(con)
    assert len(drift) == con.execute("SELECT count(DISTINCT (run_id, seq_id, scorer)) FROM scores").fetchone()[0]


# -- stores without reward columns, the command ----------------------------------------------------------
def test_a_store_without_reward_columns_has_no_signed_rows_and_the_same_pair_metrics(source, tmp_path_factory, naive):
    path = make_subset(source, tmp_path_factory, "duckdb", (), rewards=False)
    con = open_store(path)
    assert "reward" not in {r[0] for r in con.execute("DESCRIBE sequences").fetchall()}
    out = run_all(con)
    assert not (out["violations"]["source"] == "tokens").any()
    assert set(out["clipping"]["adv_sign"]) == {"all"}
    pairs = out["precision"][out["precision"]["comparison"] == "rollout_vs_scorer"].set_index(["rollout", "scorer"])
    want = naive[naive["finite"]].groupby(["rollout", "scorer"])["abs_dp"].mean()
    np.testing.assert_allclose(pairs["abs_dp_mean"].loc[want.index], want, rtol=1e-9)
    con.close()


@pytest.mark.parametrize("form", ["duckdb", "parquet"])
def test_analyze_runs_on_a_required_columns_store_and_filters_by_an_engine_only_label(
    form, source, tmp_path_factory, tmp_path, naive, capsys
):
    path = make_subset(source, tmp_path_factory, form, ())
    target = tmp_path / "out.json"
    assert main(["analyze", "--db", str(path), "--json", str(target), "--rollout", "vllm", "--all"]) == 0
    doc = json.loads(target.read_text())
    assert list(doc) == list(ANALYSES)
    pairs = [r for r in doc["precision"] if r["comparison"] == "rollout_vs_scorer"]
    assert {(r["rollout"], r["scorer"]) for r in pairs} == {("vllm", "trl:fp32"), ("vllm", "trl:bf16")}
    recorded = naive[naive["run_id"] == RECORDED]
    assert len(doc["steps"]) == recorded.groupby(["scorer", "step"]).ngroups == 6
    assert sum(r["n_tokens"] for r in doc["steps"]) == len(recorded)
    assert "== steps (6 rows) ==" in capsys.readouterr().out
    assert main(["analyze", "--db", str(path), "--rollout", "vllm:None"]) == 2
    assert "it holds: vllm, vllm:bf16" in capsys.readouterr().err
