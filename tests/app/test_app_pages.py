"""Every page of the app under Streamlit's AppTest, on real DuckDB and Parquet stores.

Each test asserts the page's expected elements and that no exception was rendered. The `bare` store
(no top-K, no rewards, no training runs, no figures) must show plain messages instead.
"""

from __future__ import annotations

import functools
import shutil
import threading

import pytest
from app_paths import APP
from streamlit.testing.v1 import AppTest

PAGES = ["overview", "volatility", "clipping", "corrections", "inspector", "training", "figures"]
TIMEOUT_S = 60  # the first run imports pandas/altair/duckdb; later runs take well under a second


def start(monkeypatch, store) -> AppTest:
    monkeypatch.setenv("MISMATCH_LAB_STUDY", str(store))
    at = AppTest.from_file(str(APP), default_timeout=TIMEOUT_S)
    at.run()
    assert not at.exception, at.exception
    return at


def visit(at: AppTest, page: str) -> AppTest:
    at.switch_page(f"app_pages/{page}.py").run()
    assert not at.exception, at.exception
    return at


def texts(elements) -> str:
    return " ".join(str(e.value) for e in elements)


def labels(at: AppTest) -> list[str]:
    return [w.label for w in at.selectbox]


@pytest.fixture(params=["duckdb", "parquet"])
def full_store(request, duckdb_store, parquet_store):
    return duckdb_store if request.param == "duckdb" else parquet_store


def test_the_sidebar_opens_the_study_given_at_start(monkeypatch, full_store):
    at = start(monkeypatch, full_store)
    assert at.session_state["store_path"] == str(full_store.resolve())
    assert [w.value for w in at.sidebar.selectbox] == [str(full_store.resolve())]
    assert [b.label for b in at.sidebar.button] == ["Reload data"]


def test_overview_lists_studies_runs_and_the_precision_table(monkeypatch, full_store):
    at = start(monkeypatch, full_store)  # the default page
    assert [t.value for t in at.title] == ["Overview"]
    assert [s.value for s in at.subheader] == ["Studies", "Runs", "Precision table"]
    studies, runs, precision, doctor = (d.value for d in at.dataframe)  # the doctor's verdicts: a dataframe too
    assert studies["open"].sum() == 1 and not studies["shard store"].any()
    assert {"check", "pair", "value", "band", "verdict"} <= set(doctor.columns)
    assert sorted(runs["run_id"]) == ["collect-hf-fp16", "collect-vllm-bf16", "train-dppo", "train-grpo"]
    assert {"model", "rollout", "scorers", "weights_sha256", "n_tokens", "status"} <= set(runs.columns)
    assert sorted(zip(precision["rollout"], precision["scorer"])) == [
        ("hf:fp16", "hf:fp32"),
        ("vllm:bf16", "hf:bf16"),
        ("vllm:bf16", "hf:fp32"),
    ]
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Runs"] == "4" and metrics["Non-finite scores"] == "1"
    assert int(metrics["Tokens"].replace(",", "")) == int(runs["n_tokens"].sum())


def apply(at: AppTest) -> AppTest:
    """Submit the Volatility page's bucket form."""
    next(b for b in at.button if b.label == "Apply").click().run()
    assert not at.exception, at.exception
    return at


def test_volatility_shows_ratio_and_tv_by_mu_bucket_with_bucket_controls(monkeypatch, full_store):
    at = visit(start(monkeypatch, full_store), "volatility")
    assert labels(at)[0] == "Pair (rollout μ → scorer π)"
    assert len(at.get("vega_lite_chart")) == 3
    assert len(at.dataframe[0].value) == 10  # ten linear buckets by default
    at.radio(key="vol_scale").set_value("log")
    table = apply(at).dataframe[0].value
    assert len(table) == 13 and table["bucket_label"].iloc[0].startswith("[0, 1e-06)")
    at.select_slider(key="vol_n").set_value(6)
    at.number_input(key="vol_eps_high").set_value(0.5)
    assert len(apply(at).dataframe[0].value) == 7
    assert "1 + 0.5]" in texts(at.caption)
    at.selectbox(key="vol_pair").set_value(2).run()
    assert not at.exception and len(at.get("vega_lite_chart")) == 3


def test_clipping_compares_ppo_and_dppo_by_category_and_filters(monkeypatch, full_store):
    at = visit(start(monkeypatch, full_store), "clipping")
    assert [s.value for s in at.subheader] == ["By category: PPO clip vs DPPO mask", "Top clipped tokens"]
    by_cat, top = (d.value for d in at.dataframe)
    assert {"frac_ratio_clip", "frac_tv_mask"} <= set(by_cat.columns)
    assert len(top) > 0 and top["n_ratio_clip"].gt(0).all()
    # the vllm:bf16 -> hf:fp32 pair includes the training runs: advantage signs are offered
    at.selectbox(key="clip_pair").set_value(2).run()
    assert not at.exception
    assert at.radio(key="clip_sign").options == ["all tokens (two-sided)", "positive advantage", "negative advantage"]
    at.radio(key="clip_sign").set_value("negative").run()
    assert not at.exception
    at.multiselect(key="clip_categories").set_value(["number"]).run()
    assert not at.exception
    assert set(at.dataframe[0].value["category"]) <= {"number"}


def test_inspector_shows_a_coloured_sequence_with_token_detail_and_track(monkeypatch, full_store):
    at = visit(start(monkeypatch, full_store), "inspector")
    assert labels(at)[:4] == ["Run", "Sequence", "Scorer (π)", "Token (defaults to the largest |Δp|)"]
    assert len(at.html) == 1 and "<span title=" in at.html[0].value
    assert [s.value for s in at.subheader][1:] == ["Token detail", "Cumulative log-ratio"]
    assert len(at.get("vega_lite_chart")) == 1
    detail = at.dataframe[0].value
    assert {"pi", "ratio", "entropy", "ppo_clipped", "dppo_masked"} <= set(detail.columns)
    for colour in ("ratio", "mask decision", "|Δp|"):
        at.radio(key="insp_colour").set_value(colour).run()
        assert not at.exception and "<span" in at.html[0].value


def test_inspector_shows_every_scorer_and_the_top_k_of_a_token(monkeypatch, full_store):
    at = visit(start(monkeypatch, full_store), "inspector")
    at.selectbox(key="insp_run").set_value("collect-vllm-bf16").run()
    assert not at.exception
    assert sorted(at.dataframe[0].value["scorer"]) == ["hf:bf16", "hf:fp32"]
    assert [t.label for t in at.tabs] == ["top-K of rollout", "top-K of hf:bf16", "top-K of hf:fp32"]
    rollout_list = at.dataframe[1].value
    assert {"μ (rollout)", "π hf:bf16", "π hf:fp32", "text"} <= set(rollout_list.columns)
    assert "Reward" in [m.label for m in at.metric]
    assert "no reward" in texts(at.caption)


def test_inspector_jumps_to_the_worst_sequences(monkeypatch, full_store):
    at = visit(start(monkeypatch, full_store), "inspector")
    at.radio(key="insp_mode").set_value("Worst sequences by max |Δp|").run()
    assert not at.exception
    options = at.selectbox(key="insp_worst_pick").options
    assert len(options) == 38  # every sequence of the store is scored; fewer than the 50 shown at most
    assert all("max |Δp|" in o for o in options)
    shown = [float(o.split("max |Δp| ")[1].split()[0]) for o in options]
    assert shown == sorted(shown, reverse=True)
    at.selectbox(key="insp_worst_scorer").set_value("hf:bf16").run()
    assert not at.exception
    options = at.selectbox(key="insp_worst_pick").options
    assert len(options) == 8 and all(o.endswith("(hf:bf16)") for o in options)
    assert at.subheader[0].value.startswith("collect-vllm-bf16 · sequence ")


def test_training_draws_curves_per_objective_and_opens_a_step_in_the_inspector(monkeypatch, full_store):
    at = visit(start(monkeypatch, full_store), "training")
    assert [s.value for s in at.subheader] == ["Curves per objective", "Mismatch per step", "Sequences of a step"]
    assert len(at.get("vega_lite_chart")) == 3 + 2  # three logged metrics, two per-step mismatch metrics
    assert at.multiselect(key="train_runs").value == ["train-dppo", "train-grpo"]
    per_step = at.dataframe[0].value  # the per-step table, in its expander
    assert sorted(set(zip(per_step["run_id"], per_step["step"]))) == [(r, s) for r in ("train-dppo", "train-grpo")
                                                                       for s in range(3)]  # fmt: skip
    at.select_slider(key="train_step:train-dppo").set_value(1).run()
    assert not at.exception
    assert at.dataframe[-1].value["step"].eq(1).all()
    next(b for b in at.button if b.label == "Open step 1 in the token inspector").click().run()
    assert not at.exception
    assert [t.value for t in at.title] == ["Token inspector"]
    assert at.selectbox(key="insp_run").value == "train-dppo"
    assert at.selectbox(key="insp_step").value == 1
    assert len(at.selectbox(key="insp_seq").options) == 4  # the four sequences of step 1


def test_figures_shows_the_study_pngs(monkeypatch, study_dir):
    at = visit(start(monkeypatch, study_dir), "figures")
    assert len(at.get("image")) == 2
    assert [s.value for s in at.subheader] == ["fig1 ratio vs mu", "fig2 clipping by category"]


BARE_MESSAGES = {  # page -> a plain message shown where the missing content would be
    "volatility": "No top-K stored for this pair",
    "clipping": "No rewards or advantages stored",
    "corrections": "Not computed for this pair (needs top-K log-probs",
    "inspector": "No top-K stored for this token",
    "training": "This study has no training runs",
    "figures": "This study has no figures yet",
}


@pytest.mark.parametrize("page", PAGES)
def test_a_bare_study_shows_plain_messages_not_exceptions(monkeypatch, bare_store, page):
    at = visit(start(monkeypatch, bare_store), page)
    if page == "overview":
        assert [s.value for s in at.subheader] == ["Studies", "Runs", "Precision table"]
        assert at.dataframe[1].value["n_rewarded"].eq(0).all()
    else:
        assert BARE_MESSAGES[page] in texts(at.info) + " " + texts(at.caption)


def test_without_any_study_every_page_says_how_to_start_one(monkeypatch, tmp_path):
    monkeypatch.delenv("MISMATCH_LAB_STUDY", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(APP.parent))
    import lab_ui

    monkeypatch.setattr(lab_ui, "REPO", tmp_path)  # hide the checkout's own studies/
    at = AppTest.from_file(str(APP), default_timeout=TIMEOUT_S)
    at.run()
    for page in PAGES:
        visit(at, page)
        assert "No study to show" in texts(at.info), page


def test_an_unreadable_store_is_reported_not_raised(monkeypatch, tmp_path):
    bad = tmp_path / "broken.duckdb"
    bad.write_bytes(b"this is not a database")
    at = start(monkeypatch, bad)
    assert "Cannot open" in texts(at.error)


@pytest.fixture
def own_store(tmp_path, duckdb_store):
    """A private copy of the full store: no other test's cache entries or threads refer to its path."""
    copy = tmp_path / "own.duckdb"
    shutil.copyfile(duckdb_store, copy)
    return copy.resolve()


def test_the_warm_up_computes_exactly_what_the_pages_ask_for(monkeypatch, own_store):
    from mismatch_lab.analysis import browse, clipping, precision, volatility
    from mismatch_lab.corrections import compare

    monkeypatch.syspath_prepend(str(APP.parent))
    import lab_ui

    calls: dict[str, int] = {}

    def counting(module, name):
        original = getattr(module, name)

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    for module, name in [
        (precision, "precision_table"),
        (volatility, "volatility_of_pair"),
        (volatility, "pair_tokens"),
        (clipping, "clipping_by_category"),
        (clipping, "top_clipped_tokens"),
        (browse, "worst_sequences"),
        (compare, "accumulate"),  # (one pass of the comparison: `compare`, or the page's `compare_with_drops`)
    ]:
        counting(module, name)
    lab_ui._warm(str(own_store))  # what the background thread runs
    warmed = dict(calls)
    # 3 pairs: volatility linear + log (from the pair's tokens, read once), clipping and top tokens each; worst
    # sequences overall + per scorer;
    # the precision table twice: the Overview's table and the Doctor section's checks; the comparison twice:
    # the Corrections page's of every method, the Doctor section's of the methods it may advise (their
    # dropped-sequence shares, doctor/measure.py)
    assert warmed == {
        "precision_table": 2,
        "volatility_of_pair": 6,
        "pair_tokens": 3,
        "clipping_by_category": 3,
        "top_clipped_tokens": 3,
        "worst_sequences": 3,
        "accumulate": 2,
    }

    at = start(monkeypatch, own_store)
    for page in ("volatility", "clipping"):
        visit(at, page)
    at.selectbox(key="clip_pair").set_value(2).run()
    at.slider(key="clip_top_n").set_value(80).run()
    visit(at, "volatility").radio(key="vol_scale").set_value("log")
    apply(at)
    visit(at, "inspector").radio(key="insp_mode").set_value("Worst sequences by max |Δp|").run()
    at.selectbox(key="insp_worst_scorer").set_value("hf:bf16").run()
    visit(at, "corrections")
    assert not at.exception
    assert calls == warmed  # every view above was served from the warm cache


def test_opening_a_store_starts_the_warm_up_thread_once(monkeypatch, own_store):
    monkeypatch.syspath_prepend(str(APP.parent))
    import lab_ui

    monkeypatch.setenv("MISMATCH_LAB_APP_WARMUP", "1")
    at = start(monkeypatch, own_store)
    thread = lab_ui._warm_up(str(own_store))  # the cached resource: the thread the app started
    thread.join(timeout=TIMEOUT_S)
    assert isinstance(thread, threading.Thread) and not thread.is_alive()
    visit(at, "clipping")
    assert lab_ui._warm_up(str(own_store)) is thread
