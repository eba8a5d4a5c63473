"""Every page of the app (Streamlit AppTest) on stores holding only the required columns plus a subset of
the optional groups (top-K, entropy, exact TV/KL, token text + category), as a DuckDB file whose tables
physically lack the other columns and as a Parquet directory (absent columns read as NULL).

The source store holds a collect run (vllm:bf16 scored by hf:fp32 and hf:bf16), a run recorded in an RL
framework (kind 'record', dtype unknown: rollout 'vllm'; scorers 'trl:fp32', 'trl:bf16'; sequences over
three training steps) and a training run's metric series. The pages must show that run with its label,
its per-step mismatch, tokens without text as ids and 'uncategorized' -- and the numbers of the analyses,
checked here against pandas."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from app_paths import APP
from streamlit.testing.v1 import AppTest

from mismatch_lab.analysis.steps import step_series
from mismatch_lab.corrections.layout import pair_info
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
    n_sequences=8,
    max_len=10,
    n_planted=2,
    n_nonfinite=1,
    rewards="advantage",
    topk=3,
    exact_tv=True,
    train_steps=3,
    seed=31,
)
RECORDED = "synthetic-1-vllm-fp16"
GROUPS = ("topk", "entropy", "exact", "text")
SUBSETS = [g for k in range(len(GROUPS) + 1) for g in itertools.combinations(GROUPS, k)]
# every subset as DuckDB (columns physically absent); as Parquet none, each group alone, and all
CASES = [("duckdb", g) for g in SUBSETS] + [("parquet", g) for g in SUBSETS if len(g) in (0, 1, len(GROUPS))]
TIMEOUT_S = 60


def _id(case) -> str:
    return f"{case[0]}:{'+'.join(case[1]) or 'required-only'}"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("app-subsets")
    base = synthetic_store(tmp / "base.duckdb", SPEC)
    frames = stepped_frames(base.frames, 2, run_ids=[RECORDED], kind="record", engine_dtype=None,
                            scorers={"hf:fp32": "trl:fp32", "hf:bf16": "trl:bf16"})  # fmt: skip
    return write_store(tmp / "source.duckdb", frames), frames


@pytest.fixture(scope="module")
def abs_dp(source):
    """Mean |pi - mu| per (rollout, scorer) over finite rows, with pandas from the frames."""
    f = source[1]
    labels = {r: (e if d is None else f"{e}:{d}") for r, e, d in zip(f["runs"]["run_id"], f["runs"]["engine"], f["runs"]["engine_dtype"])}
    df = f["tokens"].merge(f["scores"], on=["run_id", "seq_id", "pos"])
    lmu, lpi = (df[c].to_numpy(dtype=float, na_value=np.nan) for c in ("logp_rollout", "logp"))
    ok = np.isfinite(lmu) & np.isfinite(lpi) & ~df["nonfinite"].astype(bool)
    df = df[ok].assign(rollout=lambda x: x["run_id"].map(labels), v=np.abs(np.exp(lpi[ok]) - np.exp(lmu[ok])))
    return df.groupby(["rollout", "scorer"])["v"].mean()


def visit(at: AppTest, page: str) -> AppTest:
    at.switch_page(f"app_pages/{page}.py").run()
    assert not at.exception, (page, at.exception)
    return at


def texts(elements) -> str:
    return " ".join(str(e.value) for e in elements)


def frame_with(at: AppTest, *columns):
    return next(df.value for df in at.dataframe if set(columns) <= set(df.value.columns))


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_every_page_renders_what_the_store_holds(case, source, abs_dp, tmp_path, monkeypatch):
    form, groups = case
    store = subset_store(source[0], tmp_path / ("s.duckdb" if form == "duckdb" else "results"),
                         groups + ("rewards",), form=form)  # fmt: skip
    monkeypatch.setenv("MISMATCH_LAB_STUDY", str(store))
    at = AppTest.from_file(str(APP), default_timeout=TIMEOUT_S)
    at.run()
    assert not at.exception, at.exception

    # Overview: the recorded run under its engine-only label, the precision table equal to pandas
    runs = frame_with(at, "run_id", "rollout", "n_tokens")
    assert runs.set_index("run_id").loc[RECORDED, "rollout"] == "vllm"
    precision = frame_with(at, "abs_dp_mean", "n_finite").set_index(["rollout", "scorer"])
    assert sorted(precision.index) == sorted(abs_dp.index) and ("vllm", "trl:fp32") in precision.index
    np.testing.assert_allclose(precision["abs_dp_mean"].loc[abs_dp.index], abs_dp, rtol=1e-9)

    # Volatility: ten linear buckets; top-K TV only where stored
    visit(at, "volatility")
    assert len(at.dataframe[0].value) == 10
    assert ("No top-K stored for this pair" in texts(at.caption)) == ("topk" not in groups)

    # Clipping: without token text every token is 'uncategorized', and the top tokens are ids
    visit(at, "clipping")
    offered = at.multiselect(key="clip_categories").options
    if "text" in groups:
        assert "uncategorized" not in offered and len(offered) > 1
    else:
        assert offered == ["uncategorized"]
        by_cat = frame_with(at, "category", "frac_ratio_clip")
        assert set(by_cat["category"]) == {"uncategorized"}
        top = frame_with(at, "token_text", "token_id", "n_ratio_clip")
        # no text stored: each token is shown by its id
        assert top["token_id"].notna().all() and (top["token_text"] == "id " + top["token_id"].astype(str)).all()

    # Corrections: every method's row on the first pair; top-K rules only where the pair carries top-K lists
    visit(at, "corrections")
    con = open_store(store)
    info = pair_info(con)
    con.close()
    first = info.iloc[0]
    assert at.selectbox(key="corr_pair").options[0] == f"{first.rollout} → {first.scorer}"
    methods = frame_with(at, "method", "frac_tokens_masked", "framework").set_index("method")
    assert methods.loc["seq_mis", "n_tokens"] == first.n_tokens
    assert bool(first.has_topk) == ("topk" in groups)
    assert np.isnan(methods.loc["dppo_topk_tv", "frac_tokens_masked"]) == ("topk" not in groups)
    assert ("Not computed for this pair" in texts(at.caption)) == ("topk" not in groups)

    # Token inspector on the recorded run: ids stand in for missing text, top-K tabs only where stored
    visit(at, "inspector")
    at.selectbox(key="insp_run").set_value(RECORDED).run()
    assert not at.exception, at.exception
    assert at.selectbox(key="insp_step").options == ["all steps", "0", "1"]
    html = at.html[0].value
    markdown = texts(at.markdown)
    if "text" in groups:
        assert "⟨" not in html and "**category** uncategorized" not in markdown
    else:
        assert "⟨" in html and "**category** uncategorized" in markdown and "**Text** not stored" in markdown
    assert ("No top-K stored for this token" in texts(at.info)) == ("topk" not in groups)
    detail = frame_with(at, "scorer", "pi", "entropy")
    assert set(detail["scorer"]) == {"trl:fp32", "trl:bf16"}
    assert detail["entropy"].notna().all() == ("entropy" in groups)

    # Training: the recorded run is a run over steps; its per-step mismatch is steps.step_series
    visit(at, "training")
    assert RECORDED in at.multiselect(key="train_runs").options
    assert [s.value for s in at.subheader] == ["Curves per objective", "Mismatch per step", "Sequences of a step"]
    per_step = frame_with(at, "run_id", "step", "kl_k3")
    con = open_store(store)
    want = step_series(con)
    con.close()
    assert set(per_step["run_id"]) == {RECORDED} and len(per_step) == len(want) == 4  # 2 steps x 2 scorers
    np.testing.assert_allclose(per_step["abs_dp_mean"], want["abs_dp_mean"], rtol=1e-12)
    assert len(at.get("vega_lite_chart")) == 2 + 2  # two logged metrics by default, two per-step metrics

    visit(at, "figures")
    assert "This study has no figures yet" in texts(at.info)
