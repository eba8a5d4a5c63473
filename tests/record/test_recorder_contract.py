"""The Recorder's promises to a training loop: its own config keys, one live writer per (run, rank), a step's
sequence cap over its calls, a re-logged step replaced only once the new rows are staged, one-line errors
for bad steps, ranks, metrics and tokenizers (nothing written before them)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from mismatch_lab.errors import UserError
from mismatch_lab.record import Recorder
from mismatch_lab.store import shards
from mismatch_lab.store.reader import open_store


def _batch(B: int = 4, T: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 500, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    lmu = -torch.rand(B, T, generator=g)
    return ids, mask, lmu, (lmu + 0.01).clamp(max=0.0)  # a log-prob is <= 0


def _count(store, sql="SELECT count(*) FROM tokens"):
    return open_store(store).execute(sql).fetchone()[0]


def test_config_may_not_override_what_the_recorder_writes(tmp_path):
    with pytest.raises(UserError, match=r"config= holds every, scorer, which the Recorder writes itself"):
        Recorder(tmp_path / "s", "r", framework="trl", config={"every": 1, "scorer": "hf:fp32", "lr": 1e-6})
    assert not (tmp_path / "s").exists()
    with Recorder(tmp_path / "s", "r", framework="trl", config={"lr": 1e-6}) as rec:
        rec.log_step(0, *_batch())
    cfg = open_store(tmp_path / "s").execute("SELECT config FROM runs").fetchone()[0]
    assert '"lr": 1e-06' in cfg and '"scorer": "trl:trainer"' in cfg


def test_a_second_live_writer_of_one_rank_is_refused_other_ranks_and_closed_ones_are_not(tmp_path):
    store = tmp_path / "s"
    first = Recorder(store, "r", framework="trl")
    first.log_step(0, *_batch())
    with pytest.raises(UserError, match=r"another Recorder of rank 0 of this process still holds run 'r'"):
        Recorder(store, "r", framework="trl")  # (another process's: the fork test below)
    with Recorder(store, "r", framework="trl", rank=1) as other:
        other.log_step(0, *_batch(seed=1))
    first.close()
    with Recorder(store, "r", framework="trl") as again:  # the lock went with close()
        again.log_step(1, *_batch(seed=2))
    assert _count(store) == 3 * 24
    assert not list(store.glob(".record-*.lock"))


def test_max_sequences_per_step_caps_the_step_over_its_calls(tmp_path):
    with Recorder(tmp_path / "s", "r", framework="trl", max_sequences_per_step=5) as rec:
        ids, mask, lmu, lpi = _batch(B=3)
        assert [rec.log_step(0, ids, mask, lmu, lpi) for _ in range(3)] == [18, 12, 0]  # 3 + 2 + 0 sequences
        assert rec.log_step(1, ids, mask, lmu, lpi) == 18
    con = open_store(tmp_path / "s")
    assert con.execute("SELECT step, count(*) FROM sequences GROUP BY step ORDER BY step").fetchall() == [(0, 5), (1, 3)]
    assert sorted(f.name for f in (tmp_path / "s" / "sequences" / "r" / "step-00000000").iterdir()) == \
        ["rank-00000-part-0000.parquet", "rank-00000-part-0001.parquet"]  # the capped call wrote no file
    with pytest.raises(UserError, match=r"max_sequences_per_step \(or None\) must be a whole number ≥ 1, got 2.5"):
        Recorder(tmp_path / "s", "q", framework="trl", max_sequences_per_step=2.5)


def test_a_run_continues_only_with_the_sampling_it_was_recorded_with(tmp_path):
    with Recorder(tmp_path / "s", "r", framework="trl", every=1) as rec:
        rec.log_step(0, *_batch())
    with pytest.raises(UserError, match=r"every 1 \(now 5\)"):
        Recorder(tmp_path / "s", "r", framework="trl", every=5)
    with pytest.raises(UserError, match=r"max_sequences_per_step None \(now 2\)"):
        Recorder(tmp_path / "s", "r", framework="trl", max_sequences_per_step=2)


def test_a_failed_relog_of_a_step_keeps_the_rows_it_would_have_replaced(tmp_path, monkeypatch):
    store = tmp_path / "s"
    first = Recorder(store, "r", framework="trl")
    first.log_step(7, *_batch(), metrics={"kl": 0.5})
    del first  # the job dies; a resumed one logs step 7 again
    resumed = Recorder(store, "r", framework="trl")
    with pytest.raises(UserError, match=r"metrics\['kl'\] must be a number \(or None\), got 'abc'"):
        resumed.log_step(7, *_batch(seed=1), metrics={"kl": "abc"})
    assert _count(store) == 24  # the metric is checked before anything of the step is touched

    real_add = shards.Transaction.add

    def failing_add(self, table, *args):  # the disk fills up while the new rows are staged
        if table == "scores":
            raise OSError(28, "No space left on device")
        return real_add(self, table, *args)

    monkeypatch.setattr(shards.Transaction, "add", failing_add)
    with pytest.raises(OSError):
        resumed.log_step(7, *_batch(seed=1))
    assert _count(store) == 24 and _count(store, "SELECT count(*) FROM train_metrics") == 1
    monkeypatch.undo()
    monkeypatch.setattr(shards, "_fsync", lambda path: (_ for _ in ()).throw(OSError(5, "Input/output error")))
    with pytest.raises(OSError):  # the new files cannot be synced (NFS, quota): the old ones stay
        resumed.log_step(7, *_batch(seed=1))
    assert _count(store) == 24 and _count(store, "SELECT count(*) FROM train_metrics") == 1
    monkeypatch.undo()
    assert resumed.log_step(7, *_batch(B=2, seed=1), metrics={"kl": None}) == 12
    resumed.close()
    assert _count(store) == 12
    assert open_store(store).execute("SELECT value FROM train_metrics").fetchall() == [(None,)]
    assert not [p for p in store.rglob(".*.tmp-*")]


def test_topk_ids_at_padding_positions_are_not_checked(tmp_path):
    ids, mask, lmu, lpi = _batch(B=2, T=4)
    mask[:, :2] = False  # prompt positions
    ids[:, :2] = -100  # a loop's padding value, where nothing is stored
    k_ids = torch.randint(0, 500, (2, 4, 3))
    k_ids[:, :2] = -100
    with Recorder(tmp_path / "s", "r", framework="trl") as rec:
        assert rec.log_step(0, ids, mask, lmu, lpi, rollout_topk_ids=k_ids, rollout_topk_logps=torch.zeros(2, 4, 3)) == 4
        k_ids[1, 3, 0] = -100  # at a response position: refused
        with pytest.raises(UserError, match=r"rollout_topk_ids at response positions .* got -100"):
            rec.log_step(1, ids, mask, lmu, lpi, rollout_topk_ids=k_ids, rollout_topk_logps=torch.zeros(2, 4, 3))


@pytest.mark.parametrize("step", [-1, 2**31, 3.7, True, "5", None])
def test_a_bad_step_is_a_one_line_error(tmp_path, step):
    with Recorder(tmp_path / "s", "r", framework="trl") as rec:
        with pytest.raises(UserError, match=r"step must be a whole number in \[0, 2\^31\), got "):
            rec.log_step(step, *_batch())
        assert rec.log_step(np.int64(3), *_batch()) == 24 and rec.log_step(torch.tensor(4), *_batch()) == 24


def test_bad_rank_and_tokenizer_are_refused_before_the_store_is_made(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "abc")
    with pytest.raises(UserError, match=r"\$RANK must be a whole number in \[0, 4096\), got 'abc'; or pass rank="):
        Recorder(tmp_path / "s", "r", framework="trl")
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(UserError, match=r"rank must be a whole number in \[0, 4096\), got 1.5"):
        Recorder(tmp_path / "s", "r", framework="trl", rank=1.5)
    monkeypatch.delenv("RANK")
    with pytest.raises(UserError, match=r"tokenizer must be a transformers tokenizer .* got object"):
        Recorder(tmp_path / "s", "r", framework="trl", tokenizer=object())
    assert not (tmp_path / "s").exists()


def test_an_id_past_the_tokenizers_vocabulary_has_no_text_and_no_category(tmp_path, tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    known = tok.encode("Wait")[0]
    ids = torch.tensor([[known, len(tok), len(tok) + 5]])  # then embedding rows past the vocabulary
    with Recorder(tmp_path / "s", "r", framework="trl", tokenizer=tok) as rec:
        rec.log_step(0, ids, torch.ones(1, 3, dtype=torch.bool), torch.zeros(1, 3), torch.zeros(1, 3))
    got = open_store(tmp_path / "s").execute("SELECT token_text, category FROM tokens ORDER BY pos").fetchall()
    assert got == [(tok.decode([known]), "connective"), (None, None), (None, None)]


def test_a_recorder_this_process_dropped_frees_its_rank_and_a_live_one_is_named(tmp_path):
    store = tmp_path / "s"
    rec = Recorder(store, "r", framework="trl")
    rec.cycle = rec  # as a trainer hook holds it: freed only by the garbage collector
    del rec
    again = Recorder(store, "r", framework="trl")  # a notebook cell run again
    with pytest.raises(UserError, match=r"another Recorder of rank 0 of this process still holds run 'r' .* close\(\) it"):
        Recorder(store, "r", framework="trl")
    again.close()


def test_a_recorder_that_fails_to_start_holds_no_lock(tmp_path, monkeypatch):
    def full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shards, "write_run_row", full)
    with pytest.raises(OSError):
        Recorder(tmp_path / "s", "r", framework="trl")
    monkeypatch.undo()
    Recorder(tmp_path / "s", "r", framework="trl").close()


_FORK = textwrap.dedent("""
    import gc, os, subprocess, sys, time
    from mismatch_lab.record import Recorder
    store, mode = sys.argv[1], sys.argv[2]
    rec = Recorder(store, "r", framework="trl")
    child = os.fork()
    if child == 0:  # a worker the trainer forked, e.g. a DataLoader's
        if mode == "exit":
            del rec
            gc.collect()
            os._exit(0)
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1), os.dup2(null, 2)  # let the test read the parent's output to its end
        time.sleep(30)
        os._exit(0)
    probe = [sys.executable, "-c", "import sys; from mismatch_lab.record import Recorder; "
             "Recorder(sys.argv[1], 'r', framework='trl').close()", store]
    if mode == "exit":
        os.waitpid(child, 0)
        out = subprocess.run(probe, check=False, capture_output=True, text=True)
        refused = f"another Recorder of rank 0 into run 'r' of {store} is running (pid {os.getpid()}"
        print("refused" if refused in out.stderr else "NOT refused: " + out.stderr[-300:])
    else:
        print(child, flush=True)
        os._exit(0)  # the trainer dies without close(); its worker lives on
""")


def test_a_forked_child_neither_frees_nor_keeps_its_parents_lock(tmp_path):
    store = str(tmp_path / "s")
    out = subprocess.run([sys.executable, "-c", _FORK, store, "exit"], check=False, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "refused", out.stdout + out.stderr  # the child's exit left the parent's lock
    out = subprocess.run([sys.executable, "-c", _FORK, store, "outlive"], check=True, capture_output=True, text=True, timeout=120)
    worker = int(out.stdout.strip())
    try:
        Recorder(store, "r", framework="trl").close()  # the dead trainer's worker does not hold its rank
    finally:
        os.kill(worker, signal.SIGKILL)


def test_a_run_whose_config_holds_its_cap_as_a_string_continues(tmp_path):
    """Recorders before the input checks wrote a numpy cap through json's default=str: "8"."""
    with Recorder(tmp_path / "s", "r", framework="trl", max_sequences_per_step=8) as rec:
        rec._row["config"]["max_sequences_per_step"] = "8"  # as such a Recorder wrote it
        rec.log_step(0, *_batch())
    with Recorder(tmp_path / "s", "r", framework="trl", max_sequences_per_step=np.int64(8)) as rec:
        assert rec.log_step(1, *_batch()) == 24


def test_an_interrupt_during_a_relogged_steps_renames_leaves_the_new_rows(tmp_path, monkeypatch):
    store = tmp_path / "s"
    first = Recorder(store, "r", framework="trl")
    first.log_step(7, *_batch())
    del first
    resumed = Recorder(store, "r", framework="trl")
    real, renamed = shards.os.replace, []

    def interrupted(src, dst):
        renamed.append(dst)
        if len(renamed) == 2:  # the old files are gone, one new file is in place
            raise KeyboardInterrupt
        real(src, dst)

    monkeypatch.setattr(shards.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        resumed.log_step(7, *_batch(B=2, seed=1))
    monkeypatch.undo()
    assert _count(store) == 12 and _count(store, "SELECT count(*) FROM sequences") == 2  # the new call, whole
    resumed.close()


def test_a_dropped_recorder_is_recognised_however_the_store_path_is_spelled(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rec = Recorder("s", "r", framework="trl")
    rec.cycle = rec
    del rec
    Recorder(tmp_path / "s", "r", framework="trl").close()


def test_drop_steps_after_removes_later_steps_and_with_world_size_those_of_ranks_the_job_lost(tmp_path):
    store = tmp_path / "s"
    for rank in (0, 1, 2):
        with Recorder(store, "r", framework="trl", rank=rank) as rec:
            for step in (1, 2, 3):
                rec.log_step(step, *_batch(seed=10 * rank + step))
    busy = Recorder(store, "r", framework="trl", rank=2)  # rank 2 is live elsewhere: left alone
    with Recorder(store, "r", framework="trl", rank=1) as rec1:
        assert rec1.drop_steps_after(2, world_size=1) == [3]  # only rank 0 handles other ranks
    with Recorder(store, "r", framework="trl") as rec0:
        with pytest.raises(UserError, match="world_size must be a whole number"):
            rec0.drop_steps_after(1, world_size=0)
        with pytest.warns(UserWarning, match=r"rank 2's steps after 1 are kept: another Recorder of rank 2"):
            assert rec0.drop_steps_after(1, world_size=1) == [2, 3]
    busy.close()
    per_rank = "SELECT seq_id >> 20 & 4095 AS rank, list(DISTINCT step ORDER BY step) FROM sequences GROUP BY 1 ORDER BY 1"
    assert open_store(store).execute(per_rank).fetchall() == [(0, [1]), (1, [1]), (2, [1, 2, 3])]
    assert shards.run_ranks(store, "r") == [0, 1, 2]
    with Recorder(store, "r", framework="trl") as rec0:  # afresh: ranks >= 1 hold nothing and lose their rows
        assert rec0.drop_steps_after(0, world_size=1) == [1, 2, 3]
    assert shards.run_ranks(store, "r") == [0] and _count(store) == 0
    with pytest.raises(UserError, match="this Recorder is closed"):
        rec0.drop_steps_after(0)
