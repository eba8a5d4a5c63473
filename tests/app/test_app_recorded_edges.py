"""The app on a run recorded the way a loss function records it (token_ids=None, advantages but no
rewards) with a sequence whose loss mask is empty and one whose every row is non-finite: what each page
then says must be true of the store."""

from __future__ import annotations

import numpy as np
import pytest
from app_paths import open_page

from mismatch_lab.analysis import browse
from mismatch_lab.record import Recorder
from mismatch_lab.store.reader import open_store

B, T = 6, 12


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("edges") / "store"
    rng = np.random.default_rng(4)
    with Recorder(path, "loss", framework="verl", rollout_engine="vllm", rollout_dtype="bf16") as rec:
        for step in range(2):
            mask = np.ones((B, T), bool)
            mask[0] = False  # sequence 0 of each step: nothing to train on
            lmu = -rng.exponential(1.0, (B, T))
            lpi = np.minimum(lmu + rng.normal(0, 0.5, (B, T)), 0.0)  # wide: many tokens leave the clip range
            lpi[1] = np.nan  # sequence 1: every row non-finite
            rec.log_step(step, None, mask, lmu, lpi, advantages=rng.normal(size=(B, T)))
    return path


def _page(store, monkeypatch, page: str):
    return open_page(store, monkeypatch, page)


def test_clipping_says_tokens_without_ids_cannot_be_ranked(store, monkeypatch):
    at = _page(store, monkeypatch, "clipping")
    clipped = next(d.value for d in at.dataframe if {"category", "n_ratio_clip"} <= set(d.value.columns))
    n = int(clipped["n_ratio_clip"].sum())
    assert n > 0
    info = " ".join(i.value for i in at.info)
    assert f"{n:,} tokens of the chosen categories leave PPO's clip range" in info
    assert "stored without token ids or texts" in info and "No token of the chosen categories" not in info


def test_inspector_lists_only_sequences_with_tokens_and_names_the_advantage(store, monkeypatch):
    at = _page(store, monkeypatch, "inspector")
    captions = " ".join(c.value for c in at.caption)
    assert "2 sequence(s) without a stored (loss-mask) token are not listed." in captions
    assert "carries no reward or advantage" not in captions  # it carries an advantage
    picker = next(s for s in at.selectbox if s.label == "Sequence")
    assert len(picker.options) == 2 * (B - 1) and not any("0 tokens" in o for o in picker.options)
    assert {m.label: m.value for m in at.metric}["Tokens"] == str(T)


def test_worst_sequences_leave_out_sequences_without_a_finite_row(store):
    worst = browse.worst_sequences(open_store(store))
    assert len(worst) == 2 * (B - 2) and worst["max_abs_dp"].notna().all()
    assert not (worst["seq_id"] & ((1 << 20) - 1)).isin([0, 1]).any()
