"""Fixtures for the figure tests: a tiny stored study built from a synthetic store and exported to Parquet.

`figure_study` is `<tmp>/studies/tiny/` with `results/<table>.parquet` written by `mismatch-lab export`
from a synthetic store holding: two collect rollouts (vllm:bf16 at gen_batch 0 = whole chunk, vllm:fp16),
a third collect run repeating vllm:bf16 at gen_batch 1 in which `CHANGED_SEQUENCES` sequences differ by one
token (the batch-invariance answer), a fourth repeating it with another scorer batch composition in which
only hf:bf16's log-probs move, by `SCORER_SHIFT` (the scorer-batching answer), three scorers with top-K and exact TV, rewards, a training run
with a loss name and a reward series, and a recorded run (`RECORDED`: a copy of the vllm:fp16 run as a
user's RL framework would record it: kind 'record', dtype unknown, scorers 'trl:*', sequences over
`RECORDED_STEPS` steps with the mismatch planted to grow by `RECORDED_DRIFT` nats of log pi per step).
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from recorded_run import RECORDED, RECORDED_DRIFT, RECORDED_STEPS

from mismatch_lab.store.parquet import export
from mismatch_lab.store.synthetic import (
    SyntheticSpec,
    stepped_frames,
    synthetic_store,
    write_store,
)

SPEC = SyntheticSpec(
    rollouts=("vllm:bf16", "vllm:fp16"),
    scorers=("hf:fp32", "hf:bf16", "hf:fp16"),
    n_sequences=12,
    max_len=16,
    n_planted=6,
    n_nonfinite=1,
    rewards="advantage",
    topk=4,
    exact_tv=True,
    train_steps=5,
    seed=7,
)
CHUNK = {"chunk_prompts": 3, "samples": 4}  # gen_batch 0 = the whole chunk = 12 requests
CHANGED_SEQUENCES = 3  # sequences of the batch-1 run that differ from the whole-chunk run
SCORER_SHIFT = 2e-3  # hf:bf16 log pi shift of the run scored one sequence per forward


def batch_variant(frames: dict[str, pd.DataFrame]) -> dict[str, pd.DataFrame]:
    """The synthetic frames plus a gen_batch=1 copy of the vllm:bf16 run in which the last token of the first
    CHANGED_SEQUENCES multi-token sequences is a different token id, and every rollout log-prob of the
    copy is shifted by 1e-3 (so |delta log mu| on the shared prefix is 1e-3)."""
    runs = frames["runs"].copy()
    runs["config"] = [json.dumps({**CHUNK, "gen_batch": 0}) if k == "collect" else json.dumps({"loss": "dppo_binary_tv"})
                      for k in runs["kind"]]  # fmt: skip
    src = runs[(runs["kind"] == "collect") & (runs["engine_dtype"] == "bf16")].iloc[0]
    new_id = src["run_id"] + "-batch1"
    copy = src.copy()
    copy["run_id"], copy["config"] = new_id, json.dumps({**CHUNK, "gen_batch": 1})
    runs = pd.concat([runs, copy.to_frame().T], ignore_index=True)

    seqs = frames["sequences"][frames["sequences"]["run_id"] == src["run_id"]].copy()
    toks = frames["tokens"][frames["tokens"]["run_id"] == src["run_id"]].copy()
    multi = seqs.loc[seqs["response_len"] > 1, "seq_id"].to_numpy()[:CHANGED_SEQUENCES]
    last = toks.groupby("seq_id")["pos"].transform("max") == toks["pos"]
    hit = toks["seq_id"].isin(multi) & last
    toks.loc[hit, "token_id"] = (toks.loc[hit, "token_id"].astype(int) + 1) % 40
    toks["logp_rollout"] = toks["logp_rollout"].astype("Float64") - 1e-3
    seqs["run_id"], toks["run_id"] = new_id, new_id
    # the whole-chunk run again, scored one sequence per forward: same tokens, hf:bf16 scores shifted
    sid = src["run_id"] + "-score1"
    rescored = src.copy()
    rescored["run_id"] = sid
    rescored["config"] = json.dumps({**CHUNK, "gen_batch": 0, "scorer": {"batch_tokens": 1, "chunk_rows": 1024}})
    runs = pd.concat([runs, rescored.to_frame().T], ignore_index=True)
    seqs2 = frames["sequences"][frames["sequences"]["run_id"] == src["run_id"]].assign(run_id=sid)
    toks2 = frames["tokens"][frames["tokens"]["run_id"] == src["run_id"]].assign(run_id=sid)
    sc2 = frames["scores"][frames["scores"]["run_id"] == src["run_id"]].assign(run_id=sid)
    sc2["logp"] = sc2["logp"].astype("Float64") + np.where(sc2["scorer"] == "hf:bf16", SCORER_SHIFT, 0.0)
    out = dict(frames)
    out["runs"] = runs
    out["sequences"] = pd.concat([frames["sequences"], seqs, seqs2], ignore_index=True)
    out["tokens"] = pd.concat([frames["tokens"], toks, toks2], ignore_index=True)
    out["scores"] = pd.concat([frames["scores"], sc2], ignore_index=True)
    steps = np.arange(SPEC.train_steps)
    reward = pd.DataFrame({"run_id": "synthetic-train", "step": steps, "name": "reward/mean", "value": 0.5 + 0.01 * steps})
    out["train_metrics"] = pd.concat([frames["train_metrics"], reward], ignore_index=True)
    return out


def with_recorded_run(frames: dict[str, pd.DataFrame]) -> dict[str, pd.DataFrame]:
    """The frames plus RECORDED: a copy of the vllm:fp16 collect run's sequences, tokens and scores as a
    recorded run over RECORDED_STEPS steps (stepped_frames: dtype unknown, scorers renamed 'trl:*', log pi
    lowered by RECORDED_DRIFT * step)."""
    runs = frames["runs"]
    src = runs[(runs["kind"] == "collect") & (runs["engine_dtype"] == "fp16")].iloc[0]["run_id"]
    out = dict(frames)
    copy = runs[runs["run_id"] == src].assign(run_id=RECORDED, config=json.dumps({"framework": "trl"}))
    out["runs"] = pd.concat([runs, copy], ignore_index=True)
    for table in ("sequences", "tokens", "scores"):
        part = frames[table][frames[table]["run_id"] == src].assign(run_id=RECORDED)
        out[table] = pd.concat([frames[table], part], ignore_index=True)
    renamed = {s: "trl:" + s.split(":")[1] for s in SPEC.scorers}
    return stepped_frames(out, RECORDED_STEPS, run_ids=[RECORDED], kind="record", engine_dtype=None,
                          scorers=renamed, drift=RECORDED_DRIFT)


@pytest.fixture(scope="session")
def changed_sequences() -> int:
    """How many sequences of the batch-1 run differ from the whole-chunk run (the planted answer)."""
    return CHANGED_SEQUENCES


@pytest.fixture(scope="session")
def scorer_shift() -> float:
    """How far hf:bf16's log pi moved in the run scored one sequence per forward (the planted answer)."""
    return SCORER_SHIFT


@pytest.fixture(scope="session")
def figure_store(tmp_path_factory):
    """(path of the DuckDB store, frames written)."""
    tmp = tmp_path_factory.mktemp("figstore")
    base = synthetic_store(tmp / "base.duckdb", SPEC)
    frames = with_recorded_run(batch_variant(base.frames))
    path = write_store(tmp / "tiny.duckdb", frames)
    return path, frames


@pytest.fixture(scope="session")
def figure_study(tmp_path_factory, figure_store):
    """studies/tiny/ with results/ exported by `export` (and the study's root `studies/`)."""
    root = tmp_path_factory.mktemp("studies")
    study = root / "tiny"
    export(figure_store[0], study / "results")
    return study


@pytest.fixture(scope="session")
def plain_study(tmp_path_factory):
    """A study with only the required columns: no top-K, no exact TV, no training run, one batch size."""
    tmp = tmp_path_factory.mktemp("plain")
    store = synthetic_store(tmp / "plain.duckdb", SyntheticSpec(n_sequences=6, max_len=10, n_planted=2, seed=3))
    export(store.path, tmp / "plain" / "results")
    return tmp / "plain"

