"""presets_report's extremes: a metric that a framework reduces by max or min over its micro-batches (NeMo-RL's
*_seq_mult_prob_error extremes, SkyRL's *_max/*_min, ROLL's @max/@min) is the max or min over the store's
batches, equal to a numpy pass over the store's tokens, not a token-weighted mean of the batches' extremes; and a
mean over sequences (every slime metric, NeMo-RL's mean_seq_mult_prob_error, ROLL's seq-mean-token-mean ones) is the mean over every sequence of
the store, the batches weighted by their sequences, not by their tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

from mismatch_lab.corrections import frameworks
from mismatch_lab.corrections.presets_report import EXTREMES, run_presets
from mismatch_lab.store.reader import open_store

STUDY = Path(__file__).resolve().parents[2] / "studies" / "batch-invariance"
PRESETS = ("nemo-rl/default", "skyrl/token_tis", "roll/default", "roll/token-mean", "slime/ppo")
RTOL = 64 * float(np.finfo(np.float64).eps)
"""The extremes are of float64 log-probs (the store's DOUBLE columns); sums of a sequence's terms in another
order differ by a few units of float64 rounding."""
RTOL32 = 4 * float(np.finfo(np.float32).eps)
"""SkyRL's importance ratio is exp of the log-ratio rounded to float32 (safe_exp_delta's out_dtype here); ROLL's
masked means divide by a float32 count (its float32 rounding, kept by the transcription)."""


@pytest.fixture(scope="module")
def table():
    return run_presets(open_store(STUDY), [frameworks.get(n) for n in PRESETS], chunk_tokens=512)


@pytest.fixture(scope="module")
def by_pair():
    """Per (rollout, scorer): the store's response tokens (run, sequence, μ's and the scorer's log-prob)."""
    import duckdb

    r = STUDY / "results"
    df = duckdb.connect().sql(
        f"select r.engine || ':' || r.engine_dtype as rollout, s.scorer, t.run_id, t.seq_id, "
        f"t.logp_rollout as lmu, s.logp as lp from '{r}/tokens.parquet' t "
        f"join '{r}/scores.parquet' s using (run_id, seq_id, pos) join '{r}/runs.parquet' r using (run_id)").df()
    return dict(iter(df.groupby(["rollout", "scorer"])))


def _row(table, preset, key):
    return table[(table.preset == preset) & (table.rollout == key[0]) & (table.scorer == key[1])].iloc[0]


def test_nemo_rl_sequence_error_extremes_are_those_of_every_sequence_of_the_store(table, by_pair):
    assert (table.n_batches > 1).all()
    for key, g in by_pair.items():
        per_seq = np.exp(np.abs(g.lmu - g.lp)).groupby([g.run_id, g.seq_id]).mean()
        m = _row(table, "nemo-rl/default", key).metrics
        for name in ("max_seq_mult_prob_error", "max_seq_mult_prob_error_after_mask"):
            assert m[name] == pytest.approx(per_seq.max(), rel=RTOL), (key, name)
        for name in ("min_seq_mult_prob_error", "min_seq_mult_prob_error_after_mask"):
            assert m[name] == pytest.approx(per_seq.min(), rel=RTOL), (key, name)
        for name in ("mean_seq_mult_prob_error", "mean_seq_mult_prob_error_after_mask"):
            assert m[name] == pytest.approx(per_seq.mean(), rel=RTOL), (key, name)


def test_slime_metrics_are_means_over_every_sequence_of_the_store(table, by_pair):
    for key, g in by_pair.items():
        per_seq = np.abs(g.lp - g.lmu).groupby([g.run_id, g.seq_id]).mean()
        m = _row(table, "slime/ppo", key).metrics
        assert m["train_rollout_logprob_abs_diff"] == pytest.approx(per_seq.mean(), rel=RTOL), key


def test_skyrl_is_ratio_max_is_the_largest_token_ratio_of_the_store(table, by_pair):
    for key, g in by_pair.items():
        m = _row(table, "skyrl/token_tis", key).metrics
        assert m["is_ratio_max"] == pytest.approx(np.exp(g.lp - g.lmu).max(), rel=RTOL32), key
        assert m["is_ratio_min"] <= np.exp(g.lp - g.lmu).min()


def test_roll_tagged_extremes_stay_extremes_and_untagged_metrics_stay_means(table):
    rule = EXTREMES["roll"]
    for row in table[table.framework == "roll"].itertuples():
        assert row.metrics["actor/ratio_max@max"] == 1.0 and row.metrics["actor/ratio_min@min"] == 1.0
        assert {k for k in row.metrics if rule(k)} == {"actor/ratio_max@max", "actor/ratio_min@min"}


def test_roll_seq_mean_token_mean_metrics_are_means_over_every_sequence_of_the_store(table, by_pair):
    for key, g in by_pair.items():
        log_r = (g.lp - g.lmu).groupby([g.run_id, g.seq_id])
        token = np.exp(g.lp - g.lmu).groupby([g.run_id, g.seq_id]).mean().mean()
        sequence = np.exp(log_r.sum()).mean()
        for preset in ("roll/default", "roll/token-mean"):  # whatever the loss's mode, these are seq-means
            m = _row(table, preset, key).metrics
            assert m["actor/train_infer_ratio_token_mean@sum"] == pytest.approx(token, rel=RTOL32), (preset, key)
            assert m["actor/train_infer_ratio_sequence_mean@sum"] == pytest.approx(sequence, rel=RTOL32), (preset, key)
