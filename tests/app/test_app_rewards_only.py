"""The app on a run recorded with rewards and prompt groups but no advantages (what `import jsonl` or a
slime dump often carries), and a tokenizer: the advantage the masks use is the derived one and every page
says so; whitespace tokens are visible; the doctor's bands read as written; the open store is named a
shard store."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from app_paths import open_page

from mismatch_lab.record import Recorder

B, T, STEPS = 8, 10, 2


@pytest.fixture(scope="module")
def store(tmp_path_factory, embedded_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(embedded_model)
    space = tok.convert_tokens_to_ids("Ġ")  # the byte-level BPE space: a token that draws as blank
    path = tmp_path_factory.mktemp("rewards") / "store"
    rng = np.random.default_rng(7)
    rewards = {}
    with Recorder(path, "rw", framework="slime", rollout_engine="sglang", rollout_dtype="bf16", tokenizer=tok) as rec:
        for step in range(STEPS):
            ids = np.where(rng.random((B, T)) < 0.5, space, rng.integers(100, 5000, (B, T)))
            lmu = -rng.exponential(0.5, (B, T))
            lpi = np.minimum(lmu + rng.normal(0, 0.4, (B, T)), 0.0)  # many tokens leave the clip range
            r = rng.integers(0, 2, B).astype(float)
            groups = [f"g{step}-{i // 4}" for i in range(B)]
            rec.log_step(step, ids, np.ones((B, T), bool), lmu, lpi, rewards=r, group_ids=groups)
            rewards[step] = (r, groups)
    return path, rewards


def _page(store, monkeypatch, page: str):
    return open_page(store[0], monkeypatch, page)


def test_the_inspector_shows_the_derived_advantage_the_masks_use(store, monkeypatch):
    at = _page(store, monkeypatch, "inspector")
    picker = next(s for s in at.selectbox if s.label == "Sequence")
    seq_id = int(str(picker.value).split()[0]) if not isinstance(picker.value, (int, np.integer)) else int(picker.value)
    step, index = seq_id >> 32, seq_id & ((1 << 20) - 1)
    r, groups = store[1][step]
    frame = pd.DataFrame({"r": r, "g": groups})
    want = r[index] - frame.groupby("g")["r"].transform("mean").to_numpy()[index]
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Advantage (derived)"] == f"{want:.3g}"


def test_corrections_name_the_advantage_derived(store, monkeypatch):
    at = _page(store, monkeypatch, "corrections")
    assert {m.label: m.value for m in at.metric}["Advantage"] == "derived"


def test_clipping_quotes_token_strings_so_a_space_is_visible(store, monkeypatch):
    at = _page(store, monkeypatch, "clipping")
    top = next(d.value for d in at.dataframe if "frac_ratio_clip" in d.value.columns and "token_text" in d.value.columns)
    assert "' '" in set(top["token_text"])
    assert all(t[0] in "'\"" for t in top["token_text"])


def test_overview_shows_the_doctor_bands_as_written_and_the_store_as_a_shard_store(store, monkeypatch):
    at = _page(store, monkeypatch, "overview")
    assert not at.table  # st.table renders Markdown: '>= 0.3 ok' turned into a quote
    frames = [d.value for d in at.dataframe]
    bands = next(f for f in frames if "band" in f.columns)
    assert any(str(b).startswith(">=") for b in bands["band"])
    studies = next(f for f in frames if "shard store" in f.columns)
    assert studies.loc[studies["open"], "shard store"].tolist() == [True]
