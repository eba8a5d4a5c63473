"""The Recorder and the shard store: what goes in comes back at the right (sequence, position), ranks
never collide, a killed writer loses only the unit in flight, and re-logging adds nothing twice."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from mismatch_lab.errors import UserError
from mismatch_lab.record import Recorder
from mismatch_lab.record.recorder import to_numpy
from mismatch_lab.store import shards
from mismatch_lab.store.reader import open_store


def _batch(seed: int, B: int = 5, T: int = 7, K: int = 3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 500, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[0] = False  # a fully masked sequence
    mask[1, :3] = False  # response starts at position 3
    mask[1, 3:] = True
    mask[1, 5] = False  # a hole (tool output) keeps its place
    lmu = -torch.rand(B, T, generator=g) * 3
    lpi = (lmu + 0.05 * torch.randn(B, T, generator=g)).clamp(max=0.0)  # a log-prob is <= 0
    return ids, mask, lmu, lpi, torch.randint(0, 500, (B, T, K), generator=g), -torch.rand(B, T, K, generator=g)


def _naive_rows(ids, mask, lmu, lpi):
    """(seq index, pos, token, log mu, log pi, t) of every masked position, by loops."""
    rows = []
    for b in range(ids.shape[0]):
        first = next((t for t in range(ids.shape[1]) if mask[b, t]), None)
        for t in range(ids.shape[1]):
            if mask[b, t]:
                rows.append((b, t - first, int(ids[b, t]), float(lmu[b, t]), float(lpi[b, t]), t))
    return rows


def test_values_land_at_their_sequence_and_position(tmp_path):
    ids, mask, lmu, lpi, tk_ids, tk_lps = _batch(0)
    adv = torch.tensor([0.5, -1.0, 2.0, 0.0, 1.5])
    with Recorder(tmp_path / "s", "r1", framework="verl", rollout_engine="vllm", trainer_dtype="bf16",
                  rollout_dtype="bf16") as rec:
        n = rec.log_step(7, ids, mask, lmu, lpi, advantages=adv, rewards=torch.arange(5.0),
                         rollout_topk_ids=tk_ids, rollout_topk_logps=tk_lps, metrics={"loss/value": 0.25})
    assert n == int(mask.sum())
    con = open_store(tmp_path / "s")
    got = con.execute("""
        SELECT q.seq_id, t.pos, t.token_id, t.logp_rollout, s.logp, t.topk_ids_rollout, t.topk_logps_rollout,
               q.step, q.advantage, q.reward, s.scorer, s.nonfinite
        FROM tokens t JOIN scores s USING (run_id, seq_id, pos) JOIN sequences q USING (run_id, seq_id)
        ORDER BY q.seq_id, t.pos""").fetchall()
    want = _naive_rows(ids, mask, lmu, lpi)
    assert len(got) == len(want)
    seqs = sorted({r[0] for r in got})
    for g, (b, pos, tok, mu, pi, t) in zip(got, want):
        assert seqs.index(g[0]) == b - 1  # sequence 0 has no response token, so no token rows
        assert (g[1], g[2]) == (pos, tok)
        assert (g[3], g[4]) == (mu, pi)  # float32 -> float64 is exact
        assert g[5] == tk_ids[b, t].tolist() and g[6] == pytest.approx(tk_lps[b, t].tolist(), abs=1e-7)
        assert (g[7], g[8], g[9], g[10], g[11]) == (7, float(adv[b]), float(b), "verl:bf16", False)
    seq = con.execute("SELECT seq_id, response_len, step FROM sequences ORDER BY seq_id").fetchall()
    assert [r[1] for r in seq] == mask.sum(1).tolist() and {r[2] for r in seq} == {7}
    run = con.execute("SELECT kind, engine, engine_dtype, status, json_extract_string(config, '$.scorer') FROM runs").fetchall()
    assert run == [("record", "vllm", "bf16", "complete", "verl:bf16")]
    assert con.execute("SELECT step, name, value FROM train_metrics").fetchall() == [(7, "loss/value", 0.25)]


def test_per_token_advantages_and_nonfinite_values_are_null_and_flagged(tmp_path):
    ids, mask, lmu, lpi, *_ = _batch(1)
    lpi[2, mask[2].nonzero()[0, 0]] = float("nan")
    lmu[3, mask[3].nonzero()[0, 0]] = float("-inf")
    adv = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)  # means exact
    rec = Recorder(tmp_path / "s", "r", framework="prime-rl")
    rec.log_step(0, ids, mask, lmu, lpi, advantages=adv)
    rec.close()
    con = open_store(tmp_path / "s")
    assert con.execute("SELECT count(*), count(s.logp), count(t.logp_rollout), count_if(nonfinite) "
                       "FROM tokens t JOIN scores s USING (run_id, seq_id, pos)").fetchone() == (int(mask.sum()),
                                                                                                int(mask.sum()) - 1,
                                                                                                int(mask.sum()) - 1, 2)
    assert con.execute("SELECT DISTINCT scorer FROM scores").fetchall() == [("prime-rl:trainer",)]
    # the sequence's advantage is the mean over its response tokens; the per-token one is kept beside it
    seq = con.execute("SELECT q.advantage, avg(t.advantage) FROM sequences q JOIN tokens t USING (run_id, seq_id) "
                      "GROUP BY q.seq_id, q.advantage ORDER BY q.seq_id").fetchall()
    want = [float(adv[b][mask[b]].mean()) for b in range(ids.shape[0]) if mask[b].any()]
    assert [r[0] for r in seq] == pytest.approx(want, rel=1e-6)
    assert [r[1] for r in seq] == pytest.approx(want, rel=1e-6)


def test_ranks_write_their_own_files_and_the_run_is_complete_when_all_close(tmp_path):
    recs = [Recorder(tmp_path / "s", "multi", framework="slime", rank=r) for r in (0, 1)]
    for step in (0, 1):
        for r, rec in enumerate(recs):
            ids, mask, lmu, lpi, *_ = _batch(10 * step + r)
            rec.log_step(step, ids, mask, lmu, lpi)
    recs[0].close()
    con = open_store(tmp_path / "s")
    assert con.execute("SELECT status, n_ranks FROM runs").fetchall() == [("running", 2)]
    recs[1].close()
    con = open_store(tmp_path / "s")
    assert con.execute("SELECT status FROM runs").fetchall() == [("complete",)]
    n_tok = sum(int(_batch(10 * step + r)[1].sum()) for step in (0, 1) for r in (0, 1))
    assert con.execute("SELECT count(*), count(DISTINCT (seq_id, pos)) FROM tokens").fetchone() == (n_tok, n_tok)
    assert con.execute("SELECT count(*), count(DISTINCT seq_id) FROM sequences").fetchone() == (20, 20)
    # a failed rank fails the run
    with pytest.raises(RuntimeError), Recorder(tmp_path / "s", "multi", framework="slime", rank=2):
        raise RuntimeError("boom")
    assert open_store(tmp_path / "s").execute("SELECT status FROM runs").fetchall() == [("failed",)]


def test_relogging_a_step_after_a_restart_replaces_it_and_every_and_max_sequences_thin_the_run(tmp_path):
    ids, mask, lmu, lpi, *_ = _batch(3)
    for _ in range(2):  # the same rank restarts and logs the same steps again
        rec = Recorder(tmp_path / "s", "r", framework="trl", every=2, max_sequences_per_step=3)
        assert [rec.log_step(s, ids, mask, lmu, lpi) for s in range(4)] == [int(mask[:3].sum()), 0] * 2
        rec.close()
    con = open_store(tmp_path / "s")
    assert con.execute("SELECT step, count(*) FROM sequences GROUP BY step ORDER BY step").fetchall() == [(0, 3), (2, 3)]
    assert con.execute("SELECT count(*) FROM tokens").fetchone()[0] == 2 * int(mask[:3].sum())
    cfg = con.execute("SELECT json_extract(config, '$.every'), json_extract(config, '$.max_sequences_per_step') "
                      "FROM runs").fetchone()
    assert tuple(map(int, cfg)) == (2, 3)


def test_a_resumed_job_replaces_every_part_and_metric_it_logged_for_a_step(tmp_path):
    ids, mask, lmu, lpi, *_ = _batch(3)
    first = Recorder(tmp_path / "s", "r", framework="trl")
    first.log_step(5, ids, mask, lmu, lpi, metrics={"loss/value": 1.0})  # part 0
    first.log_step(5, ids, mask, lmu - 1.0, lpi)  # part 1 of the same step
    first.log_step(6, ids, mask, lmu, lpi)
    del first  # the job dies without close(); its lock on (run, rank) goes with it
    resumed = Recorder(tmp_path / "s", "r", framework="trl")  # restarts at step 5, logs it once, no metrics
    resumed.log_step(5, ids, mask, lmu - 2.0, lpi)
    resumed.close()
    con = open_store(tmp_path / "s")
    n = int(mask.sum())
    assert con.execute("SELECT step, count(*) FROM tokens JOIN sequences USING (run_id, seq_id) GROUP BY step "
                       "ORDER BY step").fetchall() == [(5, n), (6, n)]
    got = con.execute("SELECT min(logp_rollout) FROM tokens JOIN sequences USING (run_id, seq_id) WHERE step = 5").fetchone()[0]
    assert got == pytest.approx(float((lmu - 2.0)[mask].min()))
    assert con.execute("SELECT count(*) FROM train_metrics").fetchone() == (0,)


_KILLED = textwrap.dedent("""
    import os, signal, sys, torch
    from mismatch_lab.record import Recorder
    from mismatch_lab.store import shards
    replace, calls = os.replace, []
    def dying_replace(src, dst):
        calls.append(dst)
        if "step-00000001" in str(dst) and len([c for c in calls if "step-00000001" in str(c)]) == 2:
            os.kill(os.getpid(), signal.SIGKILL)  # between the renames of step 1's shards
        replace(src, dst)
    shards.os.replace = dying_replace
    rec = Recorder(sys.argv[1], "k", framework="trl")
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        ids = torch.randint(0, 100, (4, 6), generator=g)
        rec.log_step(step, ids, torch.ones(4, 6, dtype=torch.bool), -torch.rand(4, 6, generator=g),
                     -torch.rand(4, 6, generator=g), metrics={"m/value": float(step)})
""")


def test_a_killed_writer_loses_only_the_unit_in_flight(tmp_path):
    store = tmp_path / "s"
    proc = subprocess.run([sys.executable, "-c", _KILLED, str(store)], check=False, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    # step 1's tokens shard was renamed into place, its sequences shard was not: no reader sees step 1
    assert shards.shard_path(store, "tokens", "k", 1, "rank-00000-part-0000").is_file()
    assert not shards.shard_path(store, "sequences", "k", 1, "rank-00000-part-0000").is_file()
    con = open_store(store)
    assert con.execute("SELECT DISTINCT step FROM sequences").fetchall() == [(0,)]
    assert con.execute("SELECT count(*) FROM tokens").fetchone()[0] == 24
    assert con.execute("SELECT count(*) FROM scores").fetchone()[0] == 24
    assert con.execute("SELECT step FROM train_metrics").fetchall() == [(0,)]
    assert con.execute("SELECT status FROM runs").fetchall() == [("running",)]
    # what the killed writer left are temporary files of step 1's unit, which no reader globs
    leftovers = list(store.rglob(".*.tmp-*"))
    assert leftovers and {p.parent.name for p in leftovers} == {"step-00000001"}
    # a restarted writer of the rank removes them and logs step 1 again under the same names: the store is
    # whole, nothing twice
    rec = Recorder(store, "k", framework="trl")
    assert not list(store.rglob(".*.tmp-*"))
    rec.log_step(1, torch.zeros(4, 6, dtype=torch.long), torch.ones(4, 6, dtype=torch.bool), torch.zeros(4, 6),
                 torch.zeros(4, 6))
    rec.close()
    con = open_store(store)
    assert con.execute("SELECT step, count(*) FROM tokens JOIN sequences USING (run_id, seq_id) GROUP BY step "
                       "ORDER BY step").fetchall() == [(0, 24), (1, 24)]


def test_torch_tensors_come_to_the_host_exactly_in_one_copy():
    ids = torch.tensor([[2**60 + 1, 5]])  # above 2^53: exact only if ids never pass through float64
    mask = torch.tensor([[True, False]])
    lp = torch.tensor([[-0.1234567, float("nan")]], dtype=torch.float32)
    a, m, b, none = to_numpy(ids, mask, lp, None)
    assert a.dtype == np.int64 and a.tolist() == [[2**60 + 1, 5]]
    assert m.dtype == bool and m.tolist() == [[True, False]]
    assert b[0, 0] == np.float64(np.float32(-0.1234567)) and np.isnan(b[0, 1]) and none is None
    copies = []
    real_cpu = torch.Tensor.cpu

    def counting_cpu(self, *args, **kwargs):
        copies.append(self.shape)
        return real_cpu(self, *args, **kwargs)

    torch.Tensor.cpu = counting_cpu
    try:
        to_numpy(ids, mask, lp, lp)
    finally:
        torch.Tensor.cpu = real_cpu
    assert len(copies) == 1


def test_bad_input_is_an_error_naming_the_field(tmp_path):
    rec = Recorder(tmp_path / "s", "r", framework="trl")
    ids = torch.zeros(2, 3, dtype=torch.long)
    ok = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(UserError, match="logp_trainer has shape"):
        rec.log_step(0, ids, ok, torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(UserError, match="advantages has shape"):
        rec.log_step(0, ids, ok, torch.zeros(2, 3), torch.zeros(2, 3), advantages=torch.zeros(3))
    ids_rule = r"token_ids at response positions must be whole numbers in \[0, 2\^31\); got "
    with pytest.raises(UserError, match=ids_rule + "8589934592"):
        rec.log_step(0, torch.full((2, 3), 2**33), ok, torch.zeros(2, 3), torch.zeros(2, 3))
    for bad, shown in ((float("nan"), "nan"), (2.7, "2.7"), (-1.0, "-1.0")):  # float ids: no NaN -> INT_MIN, no truncation
        floats = torch.ones(2, 3, dtype=torch.float64)
        floats[1, 2] = bad
        with pytest.raises(UserError, match=ids_rule + shown):
            rec.log_step(0, floats, ok, torch.zeros(2, 3), torch.zeros(2, 3))
    with pytest.raises(UserError, match=r"mask must be bool \(or 0/1\).*0\.3"):
        rec.log_step(0, ids, torch.full((2, 3), 0.3), torch.zeros(2, 3), torch.zeros(2, 3))
    with pytest.raises(UserError, match=r"rollout_topk_ids at response positions must be whole numbers in \[0, 2\^31\), or -1 for padding; got 3000000000"):
        rec.log_step(0, ids, ok, torch.zeros(2, 3), torch.zeros(2, 3),
                     rollout_topk_ids=torch.full((2, 3, 2), 3_000_000_000), rollout_topk_logps=torch.zeros(2, 3, 2))
    with pytest.raises(UserError, match=r"close\(status='done'\): the status is one of complete, failed"):
        rec.close("done")
    with pytest.raises(UserError, match="run name"):
        Recorder(tmp_path / "s", "a/b", framework="trl")
    with pytest.raises(UserError, match="run name"):  # refused before the store is made
        Recorder(tmp_path / "new", "a b", framework="trl")
    assert not (tmp_path / "new").exists()
    with pytest.raises(UserError, match="rollout_engine"):
        Recorder(tmp_path / "s", "r", framework="trl", rollout_engine="tgi")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x.txt").write_text("x")
    with pytest.raises(UserError, match="not a mismatch-lab shard store"):
        Recorder(tmp_path / "other", "r", framework="trl")
    assert open_store(tmp_path / "s").execute("SELECT count(*) FROM tokens").fetchone() == (0,)


def test_a_tokenizer_fills_texts_and_categories_with_the_collect_classifier(tmp_path, tiny_model):
    from transformers import AutoTokenizer

    from mismatch_lab.categories import TokenTexts

    tok = AutoTokenizer.from_pretrained(tiny_model)
    ids = torch.tensor([tok.encode(" 12 + 35 = Wait, the answer")])
    rec = Recorder(tmp_path / "s", "r", framework="trl", tokenizer=tok)
    rec.log_step(0, ids, torch.ones_like(ids, dtype=torch.bool), torch.zeros(ids.shape), torch.zeros(ids.shape))
    rec.close()
    got = open_store(tmp_path / "s").execute("SELECT token_text, category FROM tokens ORDER BY pos").fetchall()
    texts = TokenTexts(tok)
    assert got == [texts(int(t)) for t in ids[0]]
    assert {"number", "math", "connective", "word"} <= {c for _, c in got}


def test_runs_lists_and_drops_a_run_of_a_shard_store(tmp_path, capsys):
    from mismatch_lab.cli import main

    for name in ("keep", "gone"):
        with Recorder(tmp_path / "s", name, framework="trl", rollout_engine="sglang") as rec:
            ids, mask, lmu, lpi, *_ = _batch(5)
            rec.log_step(0, ids, mask, lmu, lpi)
    assert main(["runs", "--db", str(tmp_path / "s")]) == 0
    listing = capsys.readouterr().out
    assert "keep" in listing and "gone" in listing and "sglang" in listing
    assert main(["runs", "--db", str(tmp_path / "s"), "--drop", "gone"]) == 0
    con = open_store(tmp_path / "s")
    assert con.execute("SELECT DISTINCT run_id FROM tokens").fetchall() == [("keep",)]
    assert con.execute("SELECT run_id FROM runs").fetchall() == [("keep",)]
    assert main(["runs", "--db", str(tmp_path / "s"), "--drop", "gone"]) == 2  # no such run any more


def test_an_interrupted_commit_leaves_neither_shards_nor_temporary_files(tmp_path, monkeypatch):
    from mismatch_lab.store import shards as sh

    ids, mask, lmu, lpi, *_ = _batch(3)
    rec = Recorder(tmp_path / "s", "r", framework="trl")
    real, calls = sh.os.replace, []

    def interrupted(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real(src, dst)

    monkeypatch.setattr(sh.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        rec.log_step(0, ids, mask, lmu, lpi)
    monkeypatch.setattr(sh.os, "replace", real)
    assert not [p for p in (tmp_path / "s").rglob("*") if p.is_file() and "step-" in str(p)]


def test_without_token_ids_the_ids_are_null_and_a_batch_may_have_no_positions(tmp_path):
    """log_step(token_ids=None) (a loss function sees no ids): every value lands as with ids, token_id is
    NULL; a [B, 0] batch records B sequences without tokens."""
    ids, mask, lmu, lpi, _, _ = _batch(3)
    with Recorder(tmp_path / "s", "r", framework="verl") as rec:
        assert rec.log_step(0, None, mask, lmu, lpi) == int(mask.sum())
        assert rec.log_step(1, torch.zeros(4, 0, dtype=torch.long), torch.zeros(4, 0, dtype=torch.bool),
                            torch.zeros(4, 0), torch.zeros(4, 0)) == 0
    con = open_store(tmp_path / "s")
    got = con.execute("""SELECT q.seq_id & 1048575, t.pos, t.token_id, t.logp_rollout, s.logp FROM tokens t
                         JOIN scores s USING (run_id, seq_id, pos) JOIN sequences q USING (run_id, seq_id)
                         ORDER BY 1, 2""").fetchall()
    want = [(b, pos, None, mu, pi) for b, pos, _tok, mu, pi, _t in _naive_rows(ids, mask, lmu, lpi)]
    assert [g[:3] for g in got] == [w[:3] for w in want]
    assert np.allclose([g[3:] for g in got], [w[3:] for w in want], rtol=0, atol=1e-7)
    assert con.execute("SELECT step, count(*), sum(response_len) FROM sequences GROUP BY step ORDER BY step").fetchall() \
        == [(0, 5, int(mask.sum())), (1, 4, 0)]


def test_the_runs_view_takes_every_descriptive_column_from_the_lowest_rank(tmp_path):
    """Even where the lowest rank left a column NULL: no value of another rank is mixed in."""
    ids, mask, lmu, lpi, _, _ = _batch(5)
    for rank, model in ((0, None), (1, "m1")):
        with Recorder(tmp_path / "s", "r", framework="trl", rank=rank, model=model) as rec:
            rec.log_step(0, ids, mask, lmu, lpi)
    assert open_store(tmp_path / "s").execute("SELECT model, n_ranks, status FROM runs").fetchall() \
        == [(None, 2, "complete")]


def test_metrics_several_ranks_log_are_one_value_per_step_their_mean(tmp_path):
    from mismatch_lab.analysis.violations import train_series

    ids, mask, lmu, lpi, _, _ = _batch(6)
    for rank in (0, 1, 2):
        with Recorder(tmp_path / "s", "r", framework="trl", rank=rank) as rec:
            for step in (0, 1):
                metrics = {"loss/policy/mean": 10.0 * rank + step} | ({"only/rank0": 7.0} if rank == 0 else {})
                rec.log_step(step, ids, mask, lmu, lpi, metrics=metrics)
    got = train_series(open_store(tmp_path / "s"))
    assert got[["step", "name", "value"]].values.tolist() == [
        [0, "loss/policy/mean", 10.0], [1, "loss/policy/mean", 11.0], [0, "only/rank0", 7.0], [1, "only/rank0", 7.0]]


def test_a_recorder_refuses_a_run_the_store_holds_with_another_kind_or_scorer(tmp_path):
    """An imported run numbers its sequences on its own: a Recorder writing into it would reuse those ids."""
    ids, mask, lmu, lpi, _, _ = _batch(7)
    f = tmp_path / "a.jsonl"
    f.write_text('{"step": 0, "token_ids": [1, 2], "logp_rollout": [-1.0, -2.0], "logp_trainer": [-1.1, -2.1]}\n')
    from mismatch_lab.cli import main

    assert main(["import", "jsonl", str(f), "--out", str(tmp_path / "s"), "--run-name", "imp"]) == 0
    with pytest.raises(UserError, match=r"run 'imp' is already in .* with kind 'import' \(now 'record'\), "
                                        r"scorer 'jsonl:trainer' \(now 'trl:trainer'\)"):
        Recorder(tmp_path / "s", "imp", framework="trl")
    with Recorder(tmp_path / "s", "rec", framework="trl", rollout_engine="vllm") as rec:
        rec.log_step(0, ids, mask, lmu, lpi)
    with pytest.raises(UserError, match=r"engine 'vllm' \(now 'unknown'\)"):
        Recorder(tmp_path / "s", "rec", framework="trl")
    with Recorder(tmp_path / "s", "rec", framework="trl", rollout_engine="vllm", rank=1) as rec:  # the same run
        rec.log_step(0, ids, mask, lmu, lpi)
    assert open_store(tmp_path / "s").execute("SELECT run_id, kind, n_ranks FROM runs ORDER BY 1").fetchall() \
        == [("imp", "import", 1), ("rec", "record", 2)]
