"""presets_report's aggregation over a store's batches: counts (tokens or sequences a framework logs) add up
over the batches, fractions stay token-weighted means. Checked on a stored study laid out in several batches
against the store's own token and sequence counts."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from frameworks_reference.inputs import fresh, rows, tokens

from mismatch_lab.corrections import frameworks
from mismatch_lab.corrections.presets_report import (
    COUNTS,
    format_presets,
    presets_json,
    run_presets,
)
from mismatch_lab.store.reader import open_store

STUDY = Path(__file__).resolve().parents[2] / "studies" / "batch-invariance"
PRESETS = ("roll/default", "areal/default", "nemo-rl/default")


@pytest.fixture(scope="module")
def table():
    chosen = [frameworks.get(n) for n in PRESETS]
    return run_presets(open_store(STUDY), chosen, chunk_tokens=512)


def test_counts_are_summed_over_the_batches_and_fractions_stay_fractions(table):
    assert (table.n_batches > 1).all()
    for row in table.itertuples():
        m = row.metrics
        assert set(row.summed_metrics) == set(m) & COUNTS[row.framework]
        if row.framework == "roll":
            assert m["actor/total_samples@sum"] == row.n_seqs and m["actor/valid_samples@sum"] == row.n_seqs
            assert 0 <= m["actor/valid_sample_ratio@sum"] <= 1 and 0 <= m["actor/clipfrac@sum"] <= 1
        elif row.framework == "areal":
            assert m["n_valid_tokens"] == row.n_tokens and m["clipped_tokens"] <= row.n_tokens
        else:
            assert m["num_valid_samples"] == row.n_seqs and m["num_masked_seqs_by_logprob_error"] == 0


def test_the_listing_and_the_json_name_which_metrics_are_sums(table):
    text = format_presets(table)
    assert f"actor/total_samples@sum = {table.n_seqs.iloc[0]:.6g} (sum over {table.n_batches.iloc[0]} batches)" \
        in text
    assert "actor/clipfrac@sum" in text and "actor/clipfrac@sum = 0 (sum" not in text
    first = presets_json(table)[0]
    assert first["summed_metrics"] == ["actor/valid_samples@sum", "actor/total_samples@sum"]
    assert first["n_batches"] == int(table.n_batches.iloc[0])


def test_every_name_counts_lists_is_a_metric_its_framework_logs():
    t = tokens(rows())
    logged = {fw: set() for fw in COUNTS}
    for fw in COUNTS:
        for preset in frameworks.of_framework(fw):
            with torch.no_grad():
                logged[fw] |= set(preset(fresh(t)).metrics)
    for fw, names in COUNTS.items():
        assert names <= logged[fw], (fw, names - logged[fw])
