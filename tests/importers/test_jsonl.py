"""`mismatch-lab import jsonl`: mismatch-lab's own one-sequence-a-line format."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys

import pytest
from import_fixtures import (
    counts,
    jsonl_lines,
    naive_jsonl,
    same,
    store_files,
    stored,
    write_jsonl,
)


def _topk(store, run_id):
    from mismatch_lab.store.reader import open_store

    rows = open_store(store).execute("SELECT seq_id, pos, topk_ids_rollout, topk_logps_rollout FROM tokens "
                                     "WHERE run_id = ?", [run_id]).fetchall()
    return {(r[0], r[1]): (r[2], r[3]) for r in rows}


def _check(store, run_id, want):
    got = stored(store, run_id)
    assert got.keys() == want.keys()
    topk = _topk(store, run_id)
    for key, w in want.items():
        seq, toks = got[key]["seq"], got[key]["tokens"]
        assert seq["step"] == key[0] and seq["response_len"] == len(toks) == len(w["pos"])
        assert seq["prompt_id"] == w["prompt_id"] and same(seq["reward"], w["reward"])
        assert (seq["advantage"] is None) == (w["adv_seq"] is None)
        if w["adv_seq"] is not None:
            assert math.isclose(seq["advantage"], w["adv_seq"], abs_tol=1e-12)
        assert seq["prompt_len"] is None
        for i, t in enumerate(toks):
            assert (t["pos"], t["token_id"]) == (w["pos"][i], w["token_id"][i])
            assert same(t["logp_rollout"], w["mu"][i]) and same(t["logp"], w["pi"][i])
            assert t["nonfinite"] == (w["mu"][i] is None or w["pi"][i] is None)
            if w["adv_tok"] is not None:
                assert same(t["advantage"], w["adv_tok"][i])
            else:
                assert t.get("advantage") is None
            if w["entropy"] is not None:
                assert same(t["entropy"], w["entropy"][i])
            ids, lps = topk[(seq["seq_id"], t["pos"])]
            if w["topk"] is None:
                assert ids is None
            else:
                assert ids == w["topk"][i][0] and lps == pytest.approx(w["topk"][i][1])


@pytest.mark.parametrize("adv_form", ["list", "number"])
def test_every_token_lands_on_its_seq_and_pos(cli, tmp_path, adv_form):
    recs = jsonl_lines(1, n=9, adv_form=adv_form)
    f = write_jsonl(tmp_path / "my run.jsonl", recs)
    store = tmp_path / "store"
    code, out, err = cli("import", "jsonl", f, "--out", store, "--trainer-dtype", "fp16")
    assert code == 0, err
    _check(store, "my-run", naive_jsonl(recs))  # run name from the file name, sanitised
    assert "scorer jsonl:fp16" in out
    n_tokens = sum(sum(r.get("mask") or [True] * len(r["token_ids"])) for r in recs)
    assert counts(store)["tokens"] == n_tokens and f"{n_tokens} response" in out


def test_mixed_forms_take_the_line_by_line_path(cli, tmp_path):
    recs = jsonl_lines(2, n=6)
    recs[1]["advantage"] = 0.5  # a number among lists
    recs[2]["prompt_id"] = 17  # an integer prompt id
    recs[3]["mask"] = [0, 1] + [1] * (len(recs[3]["token_ids"]) - 2)  # 0/1 mask
    f = write_jsonl(tmp_path / "mixed.jsonl", recs)
    store = tmp_path / "store"
    assert cli("import", "jsonl", f, "--out", store)[0] == 0
    _check(store, "mixed", naive_jsonl(recs))


def test_minimal_lines_and_defaults(cli, tmp_path):
    recs = [{"step": 5, "token_ids": [1, 2, 3], "logp_rollout": [-0.1, -0.2, -0.3], "logp_trainer": [-0.1, -0.25, -0.3]},
            {"step": 5, "token_ids": [4], "logp_rollout": [-1.0], "logp_trainer": [-1.5], "extra": {"ignored": 1}}]
    store = tmp_path / "store"
    assert cli("import", "jsonl", write_jsonl(tmp_path / "m.jsonl", recs), "--out", store)[0] == 0
    _check(store, "m", naive_jsonl(recs))


def test_nonfinite_values(cli, tmp_path):
    f = tmp_path / "nf.jsonl"
    f.write_text('{"step": 0, "token_ids": [1, 2, 3, 4], "logp_rollout": [NaN, -0.5, null, -1.0], '
                 '"logp_trainer": [-0.1, Infinity, -0.2, -1.25]}\n')
    store = tmp_path / "store"
    code, out, _ = cli("import", "jsonl", f, "--out", store)
    assert code == 0 and "non-finite  3 tokens" in out and "0.25 over 1 finite tokens" in out
    toks = stored(store, "nf")[(0, 0, 0)]["tokens"]
    assert [t["logp_rollout"] for t in toks] == [None, -0.5, None, -1.0]
    assert [t["logp"] for t in toks] == [-0.1, None, -0.2, -1.25]
    assert [t["nonfinite"] for t in toks] == [True, True, True, False]


def test_summary_counts_an_overflowing_ratio_as_analyze_does(cli, tmp_path):
    # log pi - log mu = 799.5: both stored values are finite, r = exp(799.5) overflows a double
    f = tmp_path / "of.jsonl"
    f.write_text('{"step": 0, "token_ids": [1, 2, 3], "logp_rollout": [-800.0, -0.5, -1.0], '
                 '"logp_trainer": [-0.5, -0.5, -1.25]}\n')
    store = tmp_path / "store"
    code, out, _ = cli("import", "jsonl", f, "--out", store)
    assert code == 0 and "non-finite  1 tokens" in out and "0.125 over 2 finite tokens" in out
    assert "or r = pi/mu overflowing a double (values kept)" in out  # the label covers such a row too
    assert [t["nonfinite"] for t in stored(store, "of")[(0, 0, 0)]["tokens"]] == [False, False, False]  # values kept
    from mismatch_lab.analysis.steps import step_series
    from mismatch_lab.store.reader import open_store

    row = step_series(open_store(store)).iloc[0]
    assert (row["n_finite"], row["n_nonfinite"]) == (2, 1)


def test_two_files_into_one_run_do_not_collide(cli, tmp_path):
    a = jsonl_lines(3, n=4)
    b = jsonl_lines(4, n=4)
    store = tmp_path / "store"
    assert cli("import", "jsonl", write_jsonl(tmp_path / "a.jsonl", a), "--out", store, "--run-name", "r")[0] == 0
    assert cli("import", "jsonl", write_jsonl(tmp_path / "b.jsonl", b), "--out", store, "--run-name", "r")[0] == 0
    from mismatch_lab.store.reader import open_store

    con = open_store(store)
    n, distinct = con.execute("SELECT count(*), count(DISTINCT seq_id) FROM sequences").fetchone()
    assert n == distinct == 8
    first = naive_jsonl(a)
    nxt = {}
    for s, r, i in first:
        nxt[(s, r)] = max(nxt.get((s, r), 0), i + 1)
    _check(store, "r", first | naive_jsonl(b, start=nxt))
    before = counts(store)  # a folder of both files: nothing new
    (tmp_path / "both").mkdir()
    for x in ("a", "b"):
        (tmp_path / "both" / f"{x}.jsonl").write_bytes((tmp_path / f"{x}.jsonl").read_bytes())
    code, out, _ = cli("import", "jsonl", tmp_path / "both", "--out", store, "--run-name", "r")
    assert code == 0 and "0 read, 2 skipped" in out and counts(store) == before


@pytest.mark.parametrize(("line", "needle"), [
    ('{"step": 0, "token_ids": [1, 2], "logp_rollout": [-1, -2], "logp_trainer": [-1]}', "'logp_trainer' has a different length"),
    ('{"step": 0, "token_ids": [1, 2], "logp_rollout": [-1, -2]}', "'logp_trainer' is missing"),
    ('{"step": 0, "token_ids": [1, 2], "logp_rollout": [-1, -2], "logp_trainer": [-1, -2], "mask": [true]}', "'mask' has a different length"),
    ('{"step": 0, "token_ids": [1, 2, 3], "logp_rollout": [-1, -2, -3], "logp_trainer": [-1, -2, -3], "advantage": [1.0]}',
     "'advantage' has a different length"),
    ('{"step": -1, "token_ids": [1], "logp_rollout": [-1], "logp_trainer": [-1]}', "'step'"),
    ('{"token_ids": [1], "logp_rollout": [-1], "logp_trainer": [-1]}', "'step' is missing"),
    ('{"step": 0, "token_ids": [1], "logp_rollout": [-1], "logp_trainer": [-1], "rollout_topk_ids": [[1]]}', "go together"),
    ('{"step": 0, "token_ids": [1], "logp_rollout": [-1], "logp_trainer": [-1], "rollout_topk_ids": [[1, 2]], "rollout_topk_logps": [[-1]]}',
     "different shapes"),
    (('{"step": 0, "token_ids": [1, 2], "logp_rollout": [-1, -2], "logp_trainer": [-1, -2], "rollout_topk_ids": [[1], null], '
      '"rollout_topk_logps": [[-1], null]}'), "must be a list (one per token) of lists"),
    ('{"step": 0, "token_ids": [1], "logp_rollout": [-1], "logp_trainer": [-1], "rank": 5000}', "'rank'"),
    ('{"step": 0, "token_ids": [1, 2], "logp_rollout": [-1, -2], "logp_trainer": [-1, -2]', "not valid JSON"),
    ('[1, 2, 3]', "not a JSON object"),
    # token ids are stored as INTEGER: out of [0, 2^31) is an error, never a wrapped id (bulk and line paths)
    ('{"step": 0, "token_ids": [1, 2147483653], "logp_rollout": [-1, -2], "logp_trainer": [-1, -2]}',
     "field 'token_ids' must be a list of token ids (integers in [0, 2^31))"),
    ('{"step": 0, "token_ids": [-5], "logp_rollout": [-1], "logp_trainer": [-1]}', "field 'token_ids' must be a list of token ids"),
    ('{"step": 0, "token_ids": [1, 9223372036854775808], "logp_rollout": [-1, -2], "logp_trainer": [-1, -2]}',
     "field 'token_ids' must be a list of token ids"),
    (('{"step": 0, "token_ids": [1], "logp_rollout": [-1], "logp_trainer": [-1], "rollout_topk_ids": [[3000000000]], '
     '"rollout_topk_logps": [[-1]]}'), "field 'rollout_topk_ids' must hold token ids"),
])
def test_bad_line_names_file_line_and_commits_nothing(cli, tmp_path, line, needle):
    good = json.dumps({"step": 0, "token_ids": [1], "logp_rollout": [-1.0], "logp_trainer": [-1.0]})
    f = tmp_path / "bad.jsonl"
    f.write_text(good + "\n\n" + good + "\n" + line + "\n" + good + "\n")  # the bad one is line 4
    store = tmp_path / "store"
    code, _, err = cli("import", "jsonl", f, "--out", store)
    assert code == 2 and f"{f}:4:" in err and needle in err, err
    assert store_files(store) == []


def test_lines_longer_than_a_read_block(cli, tmp_path, monkeypatch):
    from mismatch_lab.importers import jsonlines

    monkeypatch.setattr(jsonlines, "BLOCK_SIZE", 1024)
    recs = jsonl_lines(6, n=5)
    recs[2]["token_ids"] = recs[2]["token_ids"] * 200  # a line of tens of kB
    for k in ("logp_rollout", "logp_trainer", "entropy", "advantage", "rollout_topk_ids", "rollout_topk_logps"):
        if isinstance(recs[2].get(k), list):
            recs[2][k] = recs[2][k] * 200
    store = tmp_path / "store"
    assert cli("import", "jsonl", write_jsonl(tmp_path / "long.jsonl", recs), "--out", store)[0] == 0
    _check(store, "long", naive_jsonl(recs))


def test_ctrl_c_between_the_commit_renames_leaves_the_store_as_it_was(cli, tmp_path, monkeypatch):
    """The commit renames shard after shard; an interrupt between two of them takes the renamed ones back
    (and the new run's row), so importing again is the remedy and adds everything once."""
    from mismatch_lab.store import shards

    store = tmp_path / "store"
    assert cli("import", "jsonl", write_jsonl(tmp_path / "a.jsonl", jsonl_lines(3, n=4)), "--out", store,
               "--run-name", "kept")[0] == 0
    before = store_files(store)
    lines = [{"step": s, "token_ids": [1, 2], "logp_rollout": [-1.0, -2.0], "logp_trainer": [-1.1, -2.1]}
             for s in (1, 2, 3)]
    b = tmp_path / "b.jsonl"
    b.write_text("".join(json.dumps(x) + "\n" for x in lines))
    real, seen = shards.os.replace, []

    def interrupted(src, dst):
        seen.append(dst)
        if "sequences" in str(dst) and sum("sequences" in str(x) for x in seen) == 2:
            raise KeyboardInterrupt
        real(src, dst)

    monkeypatch.setattr(shards.os, "replace", interrupted)
    assert cli("import", "jsonl", b, "--out", store, "--run-name", "r")[0] == 130  # the CLI's exit on Ctrl-C
    assert sum("sequences" in str(x) for x in seen) == 2  # the interrupt came between two commit renames
    monkeypatch.setattr(shards.os, "replace", real)
    assert store_files(store) == before
    code, out, _ = cli("import", "jsonl", b, "--out", store, "--run-name", "r")
    assert code == 0 and "1 read" in out
    from mismatch_lab.store.reader import open_store

    con = open_store(store)
    assert con.execute("SELECT step, count(*) FROM sequences WHERE run_id = 'r' GROUP BY step ORDER BY step").fetchall() \
        == [(1, 1), (2, 1), (3, 1)]
    con.close()


def test_a_second_import_into_a_run_being_imported_stops_and_commits_nothing(cli, tmp_path):
    """Imports number sequences after the run's highest index: two at once into one run would pick the same
    ids, so the second stops (naming the holder) while the first holds the run's lock; other runs go on."""
    from mismatch_lab.store import shards

    store = tmp_path / "store"
    a = write_jsonl(tmp_path / "a.jsonl", jsonl_lines(3, n=4))
    assert cli("import", "jsonl", a, "--out", store, "--run-name", "r")[0] == 0
    before = store_files(store)
    b = write_jsonl(tmp_path / "b.jsonl", jsonl_lines(4, n=4))
    with shards.run_lock(store, "r"):  # what a running import of run r holds
        code, _, err = cli("import", "jsonl", b, "--out", store, "--run-name", "r")
        # held in this process here, so named as such (another process's: the killed-holder test below)
        assert code == 2 and "another import of this process still holds run 'r'" in err, err
        assert store_files(store) == sorted([*before, ".import-r.lock"])
        assert cli("import", "jsonl", b, "--out", store, "--run-name", "other")[0] == 0
    assert ".import-r.lock" not in store_files(store)
    assert cli("import", "jsonl", b, "--out", store, "--run-name", "r")[0] == 0  # released: it goes on
    assert not [f for f in store_files(store) if f.endswith(".lock")]


def test_an_import_killed_while_holding_the_lock_leaves_none(cli, tmp_path):
    """The lock is the kernel's (flock): a holder killed outright leaves its file but not its lock."""
    from mismatch_lab.store import shards

    store = shards.init_store(tmp_path / "store")
    code = ("import time; from pathlib import Path; from mismatch_lab.store import shards\n"
            f"with shards.run_lock(Path({str(store)!r}), 'r'):\n    print('held', flush=True); time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        b = write_jsonl(tmp_path / "b.jsonl", jsonl_lines(4, n=4))
        code, _, err = cli("import", "jsonl", b, "--out", store, "--run-name", "r")
        assert code == 2 and f"pid {holder.pid}" in err, err
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (store / ".import-r.lock").exists()  # left behind by the killed holder ...
    staged = shards.step_dir(store, "tokens", "r", 9)  # ... as are a killed import's staged files
    staged.mkdir(parents=True)
    (staged / ".import-0123456789abcdef.parquet.tmp-99-deadbeef").write_bytes(b"half")
    (staged / ".rank-00000-part-0000.parquet.tmp-98-deadbeef").write_bytes(b"a live Recorder's")
    assert cli("import", "jsonl", b, "--out", store, "--run-name", "r")[0] == 0  # ... and no obstacle
    assert store_files(store) and not (store / ".import-r.lock").exists()
    assert [f.name for f in staged.iterdir()] == [".rank-00000-part-0000.parquet.tmp-98-deadbeef"]


def test_without_flock_the_import_warns_and_goes_on(cli, tmp_path, monkeypatch):
    import errno

    from mismatch_lab.store import shards

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(shards.fcntl, "flock", no_locks)
    store = tmp_path / "store"
    code, _, err = cli("import", "jsonl", write_jsonl(tmp_path / "a.jsonl", jsonl_lines(3, n=4)), "--out", store)
    assert code == 0 and "going on without the lock" in err and "No locks available" in err, err
    assert store_files(store) and not [f for f in store_files(store) if f.endswith(".lock")]


_SIGNAL_AT_RENAME = """
import os, signal, sys
from mismatch_lab.store import shards
sig, tables, real, renamed = int(sys.argv[1]), sys.argv[2].split(","), os.replace, []
def replace(src, dst):
    if any(f"/{t}/" in str(dst) for t in tables):
        renamed.append(dst)
        if len(renamed) == 2:  # between the commit's renames
            os.kill(os.getpid(), sig)
    real(src, dst)
os.replace = replace
from mismatch_lab.cli import main
sys.exit(main(sys.argv[3:]))
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_terminated_or_killed_import_leaves_no_run_claiming_to_be_complete(tmp_path, sig):
    store = tmp_path / "store"
    f = write_jsonl(tmp_path / "a.jsonl", jsonl_lines(3, n=4))
    out = subprocess.run([sys.executable, "-c", _SIGNAL_AT_RENAME, str(int(sig)), "tokens,sequences", "import", "jsonl",
                          str(f), "--out", str(store)], check=False, capture_output=True, text=True, timeout=120)
    from mismatch_lab.store.reader import open_store

    if sig == signal.SIGTERM:  # deferred until the commit and its run row are done: the run is whole
        assert out.returncode == 143 and "terminated (SIGTERM)" in out.stderr, out.stderr
        assert open_store(store).execute("SELECT run_id, status FROM runs").fetchall() == [("a", "complete")]
    else:  # no handler runs: the run row written before the renames says it did not finish
        assert out.returncode == -signal.SIGKILL
        assert open_store(store).execute("SELECT run_id, status FROM runs").fetchall() == [("a", "running")]


def test_an_import_killed_after_its_renames_is_marked_complete_by_the_next(cli, tmp_path):
    from mismatch_lab.store.reader import open_store

    store = tmp_path / "store"
    f = write_jsonl(tmp_path / "a.jsonl", jsonl_lines(3, n=4))
    dies = ("import os, signal, sys\nfrom mismatch_lab.store import shards\nreal, rows = shards.write_run_row, []\n"
            "def write(root, row, rank):\n    rows.append(row['status'])\n"
            "    if len(rows) == 2: os.kill(os.getpid(), signal.SIGKILL)  # after the renames\n"
            "    real(root, row, rank)\nshards.write_run_row = write\n"
            "from mismatch_lab.cli import main\nsys.exit(main(sys.argv[1:]))")
    out = subprocess.run([sys.executable, "-c", dies, "import", "jsonl", str(f), "--out", str(store)], check=False,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == -signal.SIGKILL, out.stderr
    assert open_store(store).execute("SELECT status FROM runs").fetchall() == [("running",)]
    code, out, _ = cli("import", "jsonl", f, "--out", store)  # everything is in: nothing to add
    assert code == 0 and "0 read, 1 skipped" in out
    assert open_store(store).execute("SELECT status FROM runs").fetchall() == [("complete",)]


def test_a_terminated_import_into_a_complete_run_leaves_it_complete(cli, tmp_path):
    from mismatch_lab.store.reader import open_store

    store = tmp_path / "store"
    assert cli("import", "jsonl", write_jsonl(tmp_path / "a.jsonl", jsonl_lines(3, n=4)), "--out", store,
               "--run-name", "r")[0] == 0
    before = store_files(store)
    b = write_jsonl(tmp_path / "b.jsonl", jsonl_lines(4, n=4))
    out = subprocess.run([sys.executable, "-c", _SIGNAL_AT_RENAME, str(int(signal.SIGTERM)), "tokens,sequences",
                          "import", "jsonl", str(b), "--out", str(store), "--run-name", "r"], check=False,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 143, out.stderr
    assert set(before) < set(store_files(store))  # the signal came during the renames: they finished first
    assert open_store(store).execute("SELECT status FROM runs").fetchall() == [("complete",)]


def test_a_run_partly_committed_by_a_kill_is_finished_by_a_reimport(cli, tmp_path):
    from mismatch_lab.store.reader import open_store

    store = tmp_path / "store"
    f = write_jsonl(tmp_path / "a.jsonl", jsonl_lines(6, n=6))  # several steps: several sequences shards
    out = subprocess.run([sys.executable, "-c", _SIGNAL_AT_RENAME, str(int(signal.SIGKILL)), "sequences", "import",
                          "jsonl", str(f), "--out", str(store)], check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == -signal.SIGKILL, out.stderr
    assert open_store(store).execute("SELECT status FROM runs").fetchall() == [("running",)]  # the sign it is partial
    code, text, _ = cli("import", "jsonl", f, "--out", store)
    assert code == 0 and "0 read, 1 skipped" in text and "finished the commit" in text  # from its journal
    assert open_store(store).execute("SELECT status FROM runs").fetchall() == [("complete",)]
    assert counts(store)["sequences"] == 6
