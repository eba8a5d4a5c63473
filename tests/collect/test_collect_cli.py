"""`mismatch-lab collect` end to end: bad input, resume after a kill, a second writer, long prompts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pytest

from mismatch_lab.cli import main

PY = sys.executable


def _prompts(path: Path, n: int, long_every: int = 0) -> Path:
    rows = []
    for i in range(n):
        text = f"Question {i}: what is {i} + {i + 1}? Give the final answer as a number at the end."
        if long_every and i % long_every == long_every - 1:
            text = "word " * 400  # far beyond the 128-token context used below
        rows.append({"id": f"p{i}", "prompt": text, "answer": str(2 * i + 1)})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _args(model, prompts, db, *extra):
    return ["collect", "--model", str(model), "--prompts", str(prompts), "--db", str(db), "--samples", "2",
            "--max-tokens", "6", "--rollout-dtypes", "fp32", "--scorer-dtypes", "fp32,bf16", "--top-k", "3",
            "--max-model-len", "128", "--chunk-prompts", "2", "--no-progress", *extra]


# ---------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "case, fix_hint",
    [
        ("missing_model", "no such directory"),
        ("unknown_dtype", "unknown rollout dtype"),
        ("unknown_scorer", "unknown scorer"),
        ("min_over_max", "--min-tokens 7 must be between 0 and --max-tokens 6"),
        ("malformed_study", "malformed TOML"),
        ("unknown_study_key", "unknown keys"),
        ("empty_prompts", "holds no prompts"),
        ("malformed_prompts", "not valid JSON"),
        ("prompt_without_id", "needs an \"id\""),
        ("missing_prompts", "no such file"),
        ("model_without_weights", "no *.safetensors"),
    ],
)
def test_each_bad_input_gets_a_one_line_error_exit_2_and_writes_nothing(case, fix_hint, tmp_path, tiny_model, capsys):
    db = tmp_path / "out.duckdb"
    prompts = _prompts(tmp_path / "p.jsonl", 2)
    model, extra, study = tiny_model, [], None
    if case == "missing_model":
        model = tmp_path / "nope"
    elif case == "unknown_dtype":
        extra = ["--rollout-dtypes", "fp8"]
    elif case == "unknown_scorer":
        extra = ["--scorer-dtypes", "tpu:fp32"]
    elif case == "min_over_max":
        extra = ["--min-tokens", "7"]
    elif case == "malformed_study":
        study = tmp_path / "s" / "study.toml"
        study.parent.mkdir()
        study.write_text("samples = [unclosed\n")
    elif case == "unknown_study_key":
        study = tmp_path / "s" / "study.toml"
        study.parent.mkdir()
        study.write_text("sampels = 4\n")
    elif case == "empty_prompts":
        prompts.write_text("\n")
    elif case == "malformed_prompts":
        prompts.write_text('{"id": 1, "prompt": "ok"}\n{"id": 2, "prompt": \n')
    elif case == "prompt_without_id":
        prompts.write_text('{"prompt": "hello"}\n')
    elif case == "missing_prompts":
        prompts = tmp_path / "absent.jsonl"
    elif case == "model_without_weights":
        model = tmp_path / "empty_model"
        model.mkdir()
        (model / "config.json").write_text("{}")
    args = _args(model, prompts, db, *extra)
    if study:
        args = ["collect", "--study", str(study), "--db", str(db), "--model", str(tiny_model), "--no-progress"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fix_hint in err[0], err
    assert not db.exists()


# ------------------------------------------------------------------------------------- resume after a kill
def _collect_proc(args, **kw):
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONUNBUFFERED="1")
    return subprocess.Popen([PY, "-m", "mismatch_lab.cli", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=env, text=True, **kw)


def _content(db: Path):
    con = duckdb.connect(str(db), read_only=True)
    out = {
        "runs": con.execute("SELECT run_id, status FROM runs ORDER BY 1").fetchall(),
        "chunks": con.execute("SELECT count(*) FROM chunks_done").fetchone()[0],
        "seq": con.execute("SELECT run_id, seq_id, prompt_id, sample_idx, response_len, reward FROM sequences ORDER BY 1, 2").fetchall(),
        "tok": con.execute("SELECT run_id, seq_id, pos, token_id, logp_rollout FROM tokens ORDER BY 1, 2, 3").fetchall(),
        "sc": con.execute("SELECT run_id, seq_id, pos, scorer, logp, tv_exact_vs_ref FROM scores ORDER BY 1, 2, 3, 4").fetchall(),
        "dup": con.execute("SELECT count(*) FROM (SELECT run_id, seq_id, pos, scorer FROM scores GROUP BY ALL HAVING count(*) > 1)").fetchone()[0],
        "skipped": con.execute("SELECT prompt_id, reason FROM skipped_prompts ORDER BY 1").fetchall(),
    }
    con.close()
    return out


def _collect_here(capfd, args) -> tuple[int, str]:
    """`collect` in this process (no interpreter and import start-up); stdout and stderr joined as a child's."""
    capfd.readouterr()
    code = main(args)
    out, err = capfd.readouterr()
    return code, out + err


def test_killed_runs_resume_with_nothing_lost_and_nothing_duplicated(tmp_path, tiny_model, signalled_cli, capfd):
    # the interruptions need their own process (real SIGINT, SIGKILL); the reference, the resume and the rerun
    # of a complete run read and write only the store, so they run in this process
    prompts = _prompts(tmp_path / "p.jsonl", 12, long_every=6)  # 2 of 12 prompts too long for the context
    ref_db, db = tmp_path / "ref.duckdb", tmp_path / "killed.duckdb"
    code, out = _collect_here(capfd, _args(tiny_model, prompts, ref_db))
    assert code == 0, out
    assert "skipped prompts (longer than the context): 2" in out
    expected = _content(ref_db)
    assert expected["runs"][0][1] == "complete" and expected["dup"] == 0
    assert [p for p, _ in expected["skipped"]] == ["p11", "p5"]
    assert len(expected["seq"]) == 10 * 2
    assert all(row[-1] in (0.0, 1.0) for row in expected["seq"])  # every prompt has an answer: reward set

    # Ctrl-C after the first chunk, then kill -9 inside the fourth chunk's transaction, then finish
    p = signalled_cli(_args(tiny_model, prompts, db), signal.SIGINT, 1)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 130, out
    assert "re-run the same command to resume" in out
    assert _content(db)["chunks"] == 1
    p = signalled_cli(_args(tiny_model, prompts, db), signal.SIGKILL, 2)  # 1 + 2 chunks committed, dies in the 4th of 6
    out, _ = p.communicate(timeout=300)
    assert p.returncode == -signal.SIGKILL, out
    got_partial = _content(db)
    assert got_partial["chunks"] == 3 and got_partial["runs"][0][1] == "running"
    assert 0 < len(got_partial["seq"]) < len(expected["seq"]) and got_partial["dup"] == 0
    # what was committed before the kill is already final (rewards are filled when the run completes)
    assert {r[:-1] for r in got_partial["seq"]} <= {r[:-1] for r in expected["seq"]}
    assert set(got_partial["tok"]) <= set(expected["tok"]) and set(got_partial["sc"]) <= set(expected["sc"])
    code, out = _collect_here(capfd, _args(tiny_model, prompts, db))
    assert code == 0, out
    got = _content(db)
    assert got == expected  # same rows, same values (per-sample seeds), run complete, no duplicates

    # a complete run is not redone
    code, out = _collect_here(capfd, _args(tiny_model, prompts, db))
    assert code == 0 and "already complete" in out
    assert _content(db) == expected


def test_a_second_writer_gets_a_clear_error_not_a_hang(tmp_path, capsys):
    db = tmp_path / "busy.duckdb"
    holder = subprocess.Popen(
        [PY, "-c", "import sys, time, duckdb; c = duckdb.connect(sys.argv[1]); print('ready', flush=True); time.sleep(60)", str(db)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        from mismatch_lab.errors import StoreBusyError
        from mismatch_lab.store.writer import StoreWriter

        t0 = time.time()
        with pytest.raises(StoreBusyError, match="another process"):
            StoreWriter(db)
        assert time.time() - t0 < 10
    finally:
        holder.kill()
        holder.wait()


def test_a_study_file_names_the_study_and_flags_override_it(tmp_path):
    import argparse

    from mismatch_lab.collect import add_arguments, load_config

    study = tmp_path / "studies" / "my-sweep"
    study.mkdir(parents=True)
    _prompts(study / "p.jsonl", 2)
    (study / "study.toml").write_text(
        '[collect]\nprompts = "p.jsonl"\nsamples = 3\nscore_batch_tokens = 512\nrollout_dtypes = ["bf16"]\n')
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = load_config(parser.parse_args(["--study", str(study / "study.toml"), "--samples", "5"]))
    # the run ids and runs.study carry the folder's name, not the path given to --study
    assert cfg.study == "my-sweep"
    assert Path(cfg.db) == study / "my-sweep.duckdb" and Path(cfg.prompts) == (study / "p.jsonl").resolve()
    assert (cfg.samples, cfg.score_batch_tokens, cfg.rollout_dtypes) == (5, 512, ["bf16"])


def test_min_tokens_and_rollout_weights_enter_the_run_id_only_when_set(tmp_path, tiny_model):
    import argparse

    from mismatch_lab.collect import add_arguments, load_config
    from mismatch_lab.collect.job import prepare

    prompts = _prompts(tmp_path / "p.jsonl", 2)
    parser = argparse.ArgumentParser()
    add_arguments(parser)

    def base_cfg(*extra):
        return prepare(load_config(parser.parse_args(["--model", tiny_model, "--prompts", str(prompts), *extra]))).base_cfg

    assert "min_tokens" not in base_cfg()  # run ids of runs stored before the option existed stay the same
    assert base_cfg("--min-tokens", "3")["min_tokens"] == 3
    assert "rollout_weights" not in base_cfg() and base_cfg("--rollout-weights", "fp8")["rollout_weights"] == "fp8"


# ------------------------------------------------------------------------------------ the embedded model
@pytest.mark.slow
def test_on_the_embedded_model_the_mismatch_orders_bf16_over_fp16_over_fp32(tmp_path, embedded_model):
    from mismatch_lab.analysis.precision import precision_table

    prompts = Path(__file__).resolve().parents[2] / "data" / "default_prompts.jsonl"
    rows = [json.loads(x) for x in prompts.read_text().splitlines()[:8]]
    small = tmp_path / "p.jsonl"
    small.write_text("".join(json.dumps(r) + "\n" for r in rows))
    db = tmp_path / "e.duckdb"
    assert main(["collect", "--model", embedded_model, "--prompts", str(small), "--db", str(db), "--samples", "1",
                 "--max-tokens", "32", "--rollout-dtypes", "bf16,fp16,fp32", "--scorer-dtypes", "fp32",
                 "--top-k", "0", "--no-progress"]) == 0
    con = duckdb.connect(str(db), read_only=True)
    df = precision_table(con, scorer="hf:fp32").set_index("rollout")
    m = df["abs_dlogp_mean"]
    assert m["vllm:bf16"] > m["vllm:fp16"] > m["vllm:fp32"], df
    assert m["vllm:fp32"] < 1e-4  # docs/environment.md: 4.9e-6 measured
    assert df.loc["vllm:bf16", "n_tokens"] > 100


def test_rewards_score_the_last_number_of_each_reply_against_the_answer(tmp_path):
    from mismatch_lab.collect import fill_rewards
    from mismatch_lab.store.writer import StoreWriter, to_arrow

    w = StoreWriter(tmp_path / "r.duckdb")
    seqs = to_arrow("sequences", {"run_id": ["r"] * 3, "seq_id": [0, 1, 2], "prompt_id": ["a", "a", "chat"],
                                  "response_text": ["7 + 5 = 12.", "It is 13", "hello"]})
    empty = lambda t: to_arrow(t, {"run_id": []})
    w.write_chunk("r", 0, sequences=seqs, tokens=empty("tokens"), scores=empty("scores"), seconds=0.0)
    prompts = [{"id": "a", "prompt": "What is 7 + 5?", "answer": "12"}, {"id": "chat", "prompt": "hi", "answer": None}]
    assert fill_rewards(w.con, ["r"], prompts) == 2
    assert w.con.execute("SELECT reward FROM sequences ORDER BY seq_id").fetchall() == [(1.0,), (0.0,), (None,)]
    assert fill_rewards(w.con, ["r"], prompts) == 0  # idempotent
    w.close()


def test_the_user_sees_the_plan_the_progress_and_the_summary_not_engine_logs(tmp_path, tiny_model):
    prompts = _prompts(tmp_path / "p.jsonl", 2)
    args = [a for a in _args(tiny_model, prompts, tmp_path / "q.duckdb") if a != "--no-progress"]
    p = _collect_proc(args)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out
    assert "memory plan for cpu" in out and "fits" in out
    assert "collect vllm:fp32" in out  # our progress bar
    assert "study adhoc: 1 run(s), 4 sequences" in out  # the summary
    for noise in ("set_num_threads", "Loading weights", "Loading safetensors", "Warning", "INFO"):
        assert noise not in out, noise
