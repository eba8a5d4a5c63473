"""Figure 10 (figures/support.py): mean log r against mean log S per rollout rule and the residual by μ bucket,
drawn from a small store written by the real writer with planted values: a processed fp32 rollout whose log r
is exactly its log S, a raw fp32 rollout with no bias, and a processed bf16 rollout with noise on top."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from mismatch_lab.analysis.support import support_table
from mismatch_lab.figures import FIGURES, Skip
from mismatch_lab.figures.support import MIN_BUCKET_TOKENS, fig10_support
from mismatch_lab.store.reader import open_store
from mismatch_lab.store.writer import (
    SCORE_TYPES,
    SEQUENCE_TYPES,
    TOKEN_TYPES,
    StoreWriter,
)

N_SEQ, LEN = 10, 24
SUM_ORDER = N_SEQ * LEN * np.finfo(np.float64).eps  # DuckDB's parallel avg sums in any order: relative rounding bound
RUNS = {  # run_id -> (engine_dtype, config, noise on log π in nats, log S stored)
    "proc32": ("fp32-p0.9-processed", {"top_p": 0.9, "logprobs_mode": "processed"}, 0.0, True),
    "raw32": ("fp32-p0.9", {"top_p": 0.9, "logprobs_mode": "raw"}, 0.0, True),
    "proc16": ("bf16-p0.9-processed", {"top_p": 0.9, "logprobs_mode": "processed"}, 0.02, True),
}


def _table(cols: dict, types: dict):
    import pyarrow as pa

    n = len(next(iter(cols.values())))
    return pa.table({c: pa.array(cols[c], t) if c in cols else pa.nulls(n, t) for c, t in types.items()})


def _write_run(writer, run_id: str, spec: tuple, rng) -> None:
    dtype, config, noise, with_support = spec
    writer.start_run(run_id, study="s", kind="collect", model="m", weights_sha256="x", engine="vllm",
                     engine_dtype=dtype, device="cpu", versions={}, config=config)
    n = N_SEQ * LEN
    seq, pos = np.repeat(np.arange(N_SEQ), LEN), np.tile(np.arange(LEN), N_SEQ)
    log_s = rng.uniform(-0.4, -0.01, n)
    lpi = rng.uniform(np.log(1e-6), 0.0, n) + log_s  # log-uniform μ: several μ buckets
    processed = config.get("logprobs_mode") == "processed"
    lmu = lpi - log_s if processed else lpi.copy()  # processed μ: renormalised over the kept mass S
    if noise:
        lmu = lmu + rng.normal(0.0, noise, n)
    sequences = _table({"run_id": [run_id] * N_SEQ, "seq_id": list(range(N_SEQ)), "response_len": [LEN] * N_SEQ},
                       SEQUENCE_TYPES)
    tokens = _table({"run_id": [run_id] * n, "seq_id": seq.tolist(), "pos": pos.tolist(), "token_id": [1] * n,
                     "logp_rollout": lmu.tolist()}, TOKEN_TYPES)
    support = {"log_support": log_s.tolist(), "logp_support": (lpi - log_s).tolist()} if with_support else {}
    scores = _table({"run_id": [run_id] * n, "seq_id": seq.tolist(), "pos": pos.tolist(), "scorer": ["hf:fp32"] * n,
                     "logp": lpi.tolist(), "nonfinite": [False] * n, **support}, SCORE_TYPES)
    writer.write_chunk(run_id, 0, sequences=sequences, tokens=tokens, scores=scores, seconds=0.0)
    writer.set_status(run_id, "complete")


@pytest.fixture(scope="module")
def support_store(tmp_path_factory):
    db = tmp_path_factory.mktemp("support_fig") / "s.duckdb"
    rng = np.random.default_rng(0)
    w = StoreWriter(db)
    for run_id, spec in RUNS.items():
        _write_run(w, run_id, spec, rng)
    w.close()
    return db


@pytest.fixture(scope="module")
def drawn(support_store):
    con = open_store(support_store)
    table = support_table(con)
    (stem, fig), = fig10_support(con)
    return stem, fig, table


def _points(ax) -> dict[str, tuple[float, float]]:
    """The identity panel's points, by the annotation next to each (the rollout's dtype and rule)."""
    pts = [line for line in ax.lines if line.get_linestyle() == "None"]
    names = [t.get_text() for t in ax.texts]
    return {name: (float(p.get_xdata()[0]), float(p.get_ydata()[0])) for name, p in zip(names, pts)}


def test_the_support_figure_is_registered_as_figure_10():
    assert FIGURES["10"] is fig10_support


def test_each_pair_is_drawn_at_its_mean_log_s_and_mean_log_r_from_the_analysis(drawn):
    stem, fig, table = drawn
    assert stem == "fig10_sampling_support"
    pts = _points(fig.axes[0])
    pair = table[table["view"] == "pair"].set_index("rollout")
    assert set(pts) == {r.split(":")[-1] for r in pair.index}
    for rollout, row in pair.iterrows():
        assert pts[rollout.split(":")[-1]] == pytest.approx((row["log_s_mean"], row["dlogp_mean"]), rel=SUM_ORDER)


def test_processed_fp32_lies_on_the_identity_line_and_raw_at_zero_log_r(drawn):
    _, fig, _ = drawn
    pts = _points(fig.axes[0])
    x, y = pts["fp32-p0.9-processed"]
    # per token log π − (log π − log S) rounds by at most ~11 ulp of 1 (|log π| <= 10): relative to a mean
    # log S of ~0.2 that is ~60 eps; 1000 eps leaves room for the sum's own rounding
    assert x < -0.1 and y == pytest.approx(x, rel=1000 * np.finfo(np.float64).eps)
    x, y = pts["fp32-p0.9"]
    assert x < -0.1 and y == 0.0


def test_the_bucket_panel_draws_the_residual_of_processed_and_log_r_of_raw_rollouts(drawn):
    _, fig, table = drawn
    lines = {line.get_label(): line for line in fig.axes[1].lines if not line.get_label().startswith("_")}
    buckets = table[(table["view"] == "mu_bucket") & (table["n_tokens"] >= MIN_BUCKET_TOKENS)]
    for label, col in (("vllm:fp32-p0.9-processed / hf:fp32", "residual_mean"), ("vllm:fp32-p0.9 / hf:fp32", "dlogp_mean"),
                       ("vllm:bf16-p0.9-processed / hf:fp32", "residual_mean")):
        rollout = label.split(" / ")[0]
        want = buckets[buckets["rollout"] == rollout].sort_values("mu_bucket")[col].to_numpy()
        assert len(want) >= 3
        np.testing.assert_allclose(np.asarray(lines[label].get_ydata(), float), want, rtol=SUM_ORDER, atol=0)
    fp32 = np.asarray(lines["vllm:fp32-p0.9-processed / hf:fp32"].get_ydata())
    assert np.abs(fp32).max() <= 1e-12  # the bias is exactly the support: nothing remains
    assert np.abs(np.asarray(lines["vllm:bf16-p0.9-processed / hf:fp32"].get_ydata())).max() > 1e-4


def test_small_buckets_are_left_out_of_the_bucket_panel(drawn):
    _, fig, table = drawn
    small = table[(table["view"] == "mu_bucket") & (table["n_tokens"] < MIN_BUCKET_TOKENS)
                  & (table["rollout"] == "vllm:fp32-p0.9")]
    line = next(li for li in fig.axes[1].lines if li.get_label() == "vllm:fp32-p0.9 / hf:fp32")
    assert len(small) > 0
    drawn_n = len(line.get_ydata())
    assert drawn_n == len(table[(table["view"] == "mu_bucket") & (table["rollout"] == "vllm:fp32-p0.9")]) - len(small)


def test_the_figure_has_a_title_a_caption_with_n_and_labelled_axes(drawn):
    _, fig, table = drawn
    n = int(table[table["view"] == "pair"]["n_tokens"].sum())
    assert fig._suptitle.get_text().strip()
    assert any(f"n = {n:,} tokens" in t.get_text().replace("\n", " ") for t in fig.texts)
    for ax in fig.axes:
        assert ax.get_title() and "(" in ax.get_xlabel() and "(" in ax.get_ylabel()


def test_a_store_without_log_s_is_skipped_not_drawn_empty(tmp_path):
    db = tmp_path / "plain.duckdb"
    w = StoreWriter(db)
    _write_run(w, "plain", ("bf16", {}, 0.0, False), np.random.default_rng(1))
    w.close()
    with pytest.raises(Skip, match="no log S"):
        fig10_support(open_store(db))


def test_one_scorer_per_rollout_is_drawn(support_store):
    from mismatch_lab.figures.support import support_pairs

    df = support_pairs(open_store(support_store))
    assert isinstance(df, pd.DataFrame)
    assert df.groupby("rollout")["scorer"].nunique().max() == 1
