"""The Overview of a shard store still being written, merged from per-unit parts (mismatch_lab/store/units_overview.py).

Real Recorders write the store; each look-up (run list, precision table, doctor's view) is compared with its
whole-store query on the same store as the runs go on: several runs, non-finite rows, a resumed step logged again,
a damaged shard. The doctor's advice reads its dropped shares on a sample of prompt groups (the sample's target
lowered so that these small stores are sampled). A refresh of the page computes the new steps only (counted by
wrapping the functions that compute, not timed).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pandas as pd
import pytest
from app_paths import open_page

from mismatch_lab.analysis import browse, precision
from mismatch_lab.analysis import sample as sample_mod
from mismatch_lab.doctor.report import doctor_view
from mismatch_lab.record import Recorder
from mismatch_lab.store import cache, units, units_overview
from mismatch_lab.store.reader import open_store

B, T = 8, 40
RTOL = 1e-12  # float64 sums of the same rows, added in another order
SAMPLE = 1_000  # the doctor's sample target here: 8 steps of 320 tokens are compared 1 in 4 prompt groups


def _log(rec: Recorder, step: int, seed: int, nonfinite: bool = False) -> None:
    rng = np.random.default_rng(seed)
    lmu = -rng.exponential(1.0, (B, T))
    lpi = np.minimum(lmu + rng.normal(0, 0.3, (B, T)), 0.0)
    if nonfinite:
        lpi[0, 3] = np.nan
    rec.log_step(step, rng.integers(0, 100, (B, T)), np.ones((B, T), bool), lmu, lpi, rewards=rng.normal(size=B))


def _live(path) -> Recorder:
    return Recorder(path, "live", framework="verl", rollout_engine="vllm", rollout_dtype="bf16")


@pytest.fixture(autouse=True)
def small_sample(monkeypatch):
    monkeypatch.setattr(sample_mod, "SAMPLE_TOKENS", SAMPLE)


def _assert_equal(path, results: cache.ResultsCache) -> units_overview.OverviewUnits:
    """Every Overview look-up per unit equals its whole-store query on the store at `path`."""
    con = open_store(path)
    try:
        whole = {"list_runs": browse.list_runs(con), "precision_table": precision.precision_table(con),
                 "doctor_view": doctor_view(con)}
    finally:
        con.close()
    source = units_overview.OverviewUnits(path)
    mine = {name: fn(source, results) for name, (_, fn) in units_overview.OVERVIEW.items()}
    for name in ("list_runs", "precision_table"):
        pd.testing.assert_frame_equal(mine[name], whole[name], rtol=RTOL)
    assert mine["doctor_view"].verdicts == whole["doctor_view"].verdicts
    assert _same(mine["doctor_view"].recommendations, whole["doctor_view"].recommendations)
    pd.testing.assert_frame_equal(mine["doctor_view"].table, whole["doctor_view"].table, rtol=RTOL)
    return mine


def _same(a, b) -> bool:
    """Equal, numbers to RTOL and NaN equal to NaN (an advice's number the store does not give)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=RTOL)
    return a == b


def test_every_overview_look_up_per_unit_equals_the_whole_store_query_as_the_runs_go_on(tmp_path):
    path = tmp_path / "live"
    results = cache.ResultsCache(path)
    with Recorder(path, "other", framework="verl", rollout_engine="sglang", rollout_dtype="fp16") as other:
        for step in range(3):
            _log(other, step, 10 + step)
    rec = _live(path)
    for step in range(4):
        _log(rec, step, step, nonfinite=step == 2)
    first = _assert_equal(path, results)
    _log(rec, 4, 4)  # a new step
    _assert_equal(path, results)
    rec.close()  # the run's status moves, no unit changes
    _assert_equal(path, results)
    with _live(path) as again:  # a resumed job logs step 1 again: its files are replaced
        _log(again, 1, 99)
    last = _assert_equal(path, results)
    advice = {a["rule"]: a["because"] for a in last["doctor_view"].recommendations}
    assert "sequences sampled (1 in 4 prompt groups)" in advice["sequence_ratio"]  # the dropped shares were read
    assert "nonfinite" in advice
    runs = last["list_runs"].set_index("run_id")
    assert runs.loc["live", "steps"] == 5 and runs.loc["live", "n_nonfinite"] == 1
    assert runs.loc["live", "status"] == "complete" and first["list_runs"].set_index("run_id").loc["live", "status"] == "running"


def _steps_logged(path, steps: int):
    """A live store of `steps` logged steps; returns a scores shard of step 1."""
    with _live(path) as rec:
        for step in range(steps):
            _log(rec, step, step)
    return min(path.glob("scores/live/step-00000001/*.parquet"))


def test_the_overview_per_unit_leaves_a_damaged_shard_out_and_says_so_as_the_whole_store_does(tmp_path):
    path = tmp_path / "live"
    shard = _steps_logged(path, 4)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # a node died mid-write
    mine = _assert_equal(path, cache.ResultsCache(path))
    assert mine["list_runs"]["steps"].tolist() == [3]
    assert all("incomplete: read without 1 damaged shard(s)" in v["detail"] for v in mine["doctor_view"].verdicts)


@pytest.mark.parametrize("column", ["tv_exact_vs_ref", "logps_at_rollout_topk"])
def test_a_store_whose_units_hold_an_exact_tv_or_the_trainers_top_k_is_judged_by_the_whole_store_doctor(
        tmp_path, column):
    """Columns no writer of ours puts in a shard store (another writer's): the merge does not reproduce what
    they change (the exact-TV checks; the top-K rules' dropped shares, skipped where any finite token of the
    pair lacks the lists, which per-unit parts cannot tell)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    path = tmp_path / "live"
    shard = _steps_logged(path, 3)
    table = pq.read_table(shard)
    values = {"tv_exact_vs_ref": lambda: pc.abs(table["logp"]),
              "logps_at_rollout_topk": lambda: pa.array([[x] for x in table["logp"].to_pylist()],
                                                        pa.list_(pa.float64()))}[column]()
    pq.write_table(table.append_column(column, values), shard)  # another writer's column
    source = units_overview.OverviewUnits(path)
    assert units_overview.doctor_view(source, cache.ResultsCache(path)) is None  # not merged: the whole store's


@pytest.fixture
def computed(monkeypatch):
    """The units of each per-unit computation (`units._compute`) and of each dropped-share part
    (`units_overview._counts`), one set per call."""
    calls: dict[str, list[set]] = {"units": [], "corrections": []}
    compute, counts = units._compute, units_overview._counts

    @functools.wraps(compute)
    def counted_compute(source, results, fps, todo, name):
        calls["units"].append(set(todo))
        return compute(source, results, fps, todo, name)

    @functools.wraps(counts)
    def counted_counts(source, todo, every):
        calls["corrections"].append(set(todo))
        return counts(source, todo, every)

    monkeypatch.setattr(units, "_compute", counted_compute)
    monkeypatch.setattr(units_overview, "_counts", counted_counts)
    return calls


def test_a_refresh_of_the_overview_computes_only_the_new_steps_and_shows_them(tmp_path, monkeypatch, lab_ui,
                                                                              computed):
    import lab_cache

    from mismatch_lab.store import reader

    path = (tmp_path / "live").resolve()
    with _live(path) as rec:
        for step in range(8):
            _log(rec, step, step)
        at = open_page(path, monkeypatch, "overview")
        assert {u for c in computed["units"] for u in c} == {("live", s) for s in range(8)}
        for step in (8, 9):  # the writer goes on while the page is open (the sample's stride stays 4)
            _log(rec, step, step)
        whole_opens = []
        opened = reader._open_parquet_dir
        monkeypatch.setattr(reader, "_open_parquet_dir", lambda d, files=None, *a, **k: whole_opens.append(files)
                            or opened(d, files, *a, **k))
        monkeypatch.setattr(lab_cache, "FINGERPRINT_S", 0.0)  # the page takes the store's fingerprint on this run
        del computed["units"][:]
        at.run()
        assert not at.exception, at.exception
    new = {("live", 8), ("live", 9)}
    assert computed["units"] and all(c == new for c in computed["units"])  # the finished steps came from the cache
    assert None not in whole_opens  # no connection on the whole store
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Sequences"] == f"{10 * B:,}" and metrics["Tokens"] == f"{10 * B * T:,}"
    con = open_store(path)
    try:
        whole = precision.precision_table(con)
        key = sample_mod.group_key_sql(con)
        every = 4  # 3,200 tokens of 8 steps and 4,000 of 10 for a sample of at most 1,000: 1 in 4 prompt groups
        sampled = {(r, int(s)) for r, s in con.execute(f"SELECT run_id, step FROM sequences q WHERE {key} % {every} = 0")
                   .fetchall()}
    finally:
        con.close()
    # the dropped shares compared the sampled prompt groups of the first 8 steps, then those of the new steps alone
    first = {u for u in sampled if u not in new}
    assert first and computed["corrections"] == [first, sampled & new]
    shown = next(d.value for d in at.dataframe if "kl_k3" in d.value.columns and "seq_n" in d.value.columns)
    pd.testing.assert_frame_equal(shown.reset_index(drop=True), whole, rtol=RTOL)


def test_an_imported_run_of_prompt_groups_per_unit_equals_the_whole_store(tmp_path):
    import json

    from mismatch_lab.cli import main

    rng, lines = np.random.default_rng(5), []
    for step in range(6):
        for prompt in range(4):  # GRPO groups of 3 samples: the doctor's sample keeps or drops whole groups
            for _ in range(3):
                mu = -rng.exponential(1.0, 30)
                pi = np.minimum(mu + rng.normal(0, 0.3, 30), 0.0)
                lines.append({"step": step, "token_ids": rng.integers(0, 100, 30).tolist(), "logp_rollout": mu.tolist(),
                              "logp_trainer": pi.tolist(), "reward": float(rng.normal()), "prompt_id": f"p{prompt}"})
    dump = tmp_path / "grpo.jsonl"
    dump.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    path = tmp_path / "store"
    assert main(["import", "jsonl", str(dump), "--out", str(path), "--rollout-engine", "vllm", "--rollout-dtype",
                 "bf16"]) == 0
    with _live(path) as rec:  # a recorded run beside it
        _log(rec, 0, 0)
    mine = _assert_equal(path, cache.ResultsCache(path))
    assert "prompt groups)" in {a["rule"]: a["because"] for a in mine["doctor_view"].recommendations}["sequence_ratio"]
