"""The training loop on real engines: weight sync vLLM <- HF, two loop steps into the store, kill -9 and resume.

All on the session's tiny random Llama (real tokenizer) with real vLLM (CPU backend) and real HF.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
duckdb = pytest.importorskip("duckdb")

from mismatch_lab.rl.loop import TrainConfig, response_logps, train

REQUIRED_METRICS = (
    "reward/mean", "reward/accuracy/mean", "response/length/mean", "entropy/mean", "mismatch/abs_dp/mean",
    "mismatch/abs_dp/max", "mismatch/kl_k3/mean", "mask/nonzero_adv/frac", "mask/all/frac",
    "mask/negative_adv/frac", "bad_update/negative_adv/frac", "grad/norm/value", "time/rollout/seconds",
    "time/score/seconds", "time/update/seconds", "time/sync/seconds",
)


def _hf_logps(model, prompts, responses):
    with torch.no_grad():
        lp, _, _, _ = response_logps(model, prompts, responses, trainer_dtype="fp32")
    return [lp[i, : len(r)] for i, r in enumerate(responses)]


def _mean_abs_diff(a: list, b: list) -> float:
    diffs = torch.cat([(x - torch.tensor(y, dtype=torch.float32)).abs() for x, y in zip(a, b)])
    return float(diffs.mean())


def test_weight_push_makes_vllm_match_the_trainer(tiny_model, vllm_tiny_fp32):
    from transformers import AutoModelForCausalLM

    from mismatch_lab.engines.base import GenRequest

    engine = vllm_tiny_fp32
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    original = {k: v.clone() for k, v in base.state_dict().items()}
    trained = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a stand-in for an optimizer step: every weight moves
        for p in trained.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    reqs = [GenRequest(prompt_ids=p, seed=11 + i) for i, p in enumerate(prompts)]
    try:
        samples = engine.generate(reqs, max_tokens=12, top_k=0)
        responses = [s.token_ids for s in samples]
        seqs = list(zip(prompts, responses))
        before = [r[0] for r in engine.prefill_logprobs(seqs)]
        # the engine still holds the base weights: it matches the base model and not the trained one
        assert _mean_abs_diff(_hf_logps(base, prompts, responses), before) < 1e-4
        assert _mean_abs_diff(_hf_logps(trained, prompts, responses), before) > 1e-2

        engine.load_state_dict(trained.state_dict())
        after = [r[0] for r in engine.prefill_logprobs(seqs)]
        assert _mean_abs_diff(_hf_logps(trained, prompts, responses), after) < 1e-4
        # the sampling path (μ recorded at generation) follows the new weights too
        new = engine.generate(reqs, max_tokens=12, top_k=0)
        new_resp = [s.token_ids for s in new]
        assert _mean_abs_diff(_hf_logps(trained, prompts, new_resp), [s.logps for s in new]) < 1e-4
    finally:
        engine.load_state_dict(original)  # the engine is shared by the session: give it its weights back
    restored = [r[0] for r in engine.prefill_logprobs(seqs)]
    assert _mean_abs_diff(_hf_logps(base, prompts, responses), restored) < 1e-4


def _rows(db: Path, sql: str, params=()):
    con = duckdb.connect(str(db), read_only=True)
    try:
        return con.execute(sql, list(params)).fetchall()
    finally:
        con.close()


class _ParityTask:
    """A verifiable task the random tiny model scores on about half the time (the arithmetic task would give it
    reward 0 everywhere, hence zero advantages and no gradient): reward 1 when the reply has an even length."""

    SPLITS = ("sanity",)

    @staticmethod
    def generate(split, n, *, seed):
        from mismatch_lab.rl.tasks.arithmetic import generate

        return generate("sanity", n, seed=seed)

    @staticmethod
    def reward(text, answer):
        return float(len(text) % 2 == 0)


def test_two_loop_steps_write_metrics_and_step_sequences(tiny_model, tmp_path, monkeypatch):
    from mismatch_lab.rl.tasks import TASKS

    monkeypatch.setitem(TASKS, "parity", _ParityTask)
    cfg = TrainConfig(model=tiny_model, loss="dppo_topk_tv", task="parity", samples_per_prompt=4, steps=2, prompts_per_step=2,
                      max_tokens=8, lr=1e-3, minibatches=2, rollout_dtype="fp32", trainer_dtype="fp32",
                      checkpoint_every=1, db=str(tmp_path / "t.duckdb"), out=str(tmp_path / "runs"),
                      kv_cache_mb=256, study="test")
    logged = []
    run_id = train(cfg, progress=False, log=lambda step, m: logged.append(step))
    db = tmp_path / "t.duckdb"
    assert logged == [1, 2]
    assert _rows(db, "SELECT kind, status FROM runs WHERE run_id = ?", [run_id]) == [("train", "complete")]
    per_step = _rows(db, "SELECT step, count(*), count(reward), count(advantage), sum(response_len) FROM sequences "
                         "WHERE run_id = ? GROUP BY step ORDER BY step", [run_id])
    assert [r[:4] for r in per_step] == [(1, 8, 8, 8), (2, 8, 8, 8)]
    n_tok = sum(r[4] for r in per_step)
    assert _rows(db, "SELECT count(*) FROM tokens WHERE run_id = ?", [run_id]) == [(n_tok,)]
    assert _rows(db, "SELECT scorer, count(*), count(logp), count(entropy) FROM scores WHERE run_id = ? GROUP BY scorer",
                 [run_id]) == [("hf:fp32", n_tok, n_tok, n_tok)]
    names = {r[0] for r in _rows(db, "SELECT DISTINCT name FROM train_metrics WHERE run_id = ?", [run_id])}
    assert set(REQUIRED_METRICS) <= names
    assert _rows(db, "SELECT count(*) FROM (SELECT step, name FROM train_metrics WHERE run_id = ? "
                     "GROUP BY step, name HAVING count(*) > 1)", [run_id]) == [(0,)]
    m = {(s, n): v for s, n, v in _rows(db, "SELECT step, name, value FROM train_metrics WHERE run_id = ?", [run_id])}
    assert m[(1, "advantage/abs/mean")] > 0 and m[(1, "grad/norm/value")] > 0  # step 1 really moved the weights
    # lr 1e-3 moves the weights a lot after step 1; fp32 vLLM still agrees with the fp32 trainer at step 2 only
    # because the loop pushed the new weights before the step-2 rollout
    assert m[(2, "mismatch/abs_dp/mean")] < 1e-4
    assert m[(2, "mismatch/abs_dp/max")] < 1e-3
    ckpt = torch.load(tmp_path / "runs" / run_id / "checkpoint.pt", map_location="cpu", weights_only=False)
    assert ckpt["step"] == 2 and "optimizer" in ckpt and ckpt["optimizer"]["state"]


def test_a_smaller_steps_after_an_interrupted_longer_run_keeps_the_checkpointed_steps(tiny_model, tmp_path, monkeypatch):
    # studies/stability/run.sh asks for 20, 40, ... steps in turn: re-run after a kill, a run whose checkpoint
    # is past the current target must keep every stored step its checkpoint holds
    from mismatch_lab.rl.tasks import TASKS

    monkeypatch.setitem(TASKS, "parity", _ParityTask)
    cfg = TrainConfig(model=tiny_model, loss="grpo", task="parity", samples_per_prompt=2, steps=2, prompts_per_step=2,
                      max_tokens=6, lr=1e-3, rollout_dtype="fp32", checkpoint_every=1, db=str(tmp_path / "s.duckdb"),
                      out=str(tmp_path / "runs"), kv_cache_mb=256, study="test")
    run_id = train(cfg, progress=False)
    db = tmp_path / "s.duckdb"
    with duckdb.connect(str(db)) as con:  # what a kill during a later, longer invocation leaves behind
        con.execute("UPDATE runs SET status = 'running' WHERE run_id = ?", [run_id])
    cfg.steps = 1
    assert train(cfg, progress=False) == run_id
    assert _rows(db, "SELECT DISTINCT step FROM sequences ORDER BY step") == [(1,), (2,)]
    assert _rows(db, "SELECT chunk FROM chunks_done ORDER BY chunk") == [(1,), (2,)]
    assert _rows(db, "SELECT status FROM runs") == [("complete",)]


def test_killed_run_resumes_without_duplicate_rows(tiny_model, tmp_path, signalled_cli, capfd):
    db, out = tmp_path / "k.duckdb", tmp_path / "runs"
    args = ["train", "--model", tiny_model, "--loss", "grpo",
            "--steps", "3", "--prompts-per-step", "2", "--samples-per-prompt", "2", "--max-tokens", "6",
            "--lr", "1e-3", "--rollout-dtype", "fp32", "--checkpoint-every", "2", "--kv-cache-mb", "256",
            "--db", str(db), "--out", str(out), "--no-progress"]
    # the hard way: kill -9 while step 2 is being written (no cleanup; the DB and checkpoint stay as they are)
    proc = signalled_cli(args, signal.SIGKILL, 1)
    log, _ = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL, log[-2000:]
    assert "step 1/3 committed" in log and "step 2/3 committed" not in log
    assert _rows(db, "SELECT chunk FROM chunks_done") == [(1,)]
    assert _rows(db, "SELECT DISTINCT step FROM sequences") == [(1,)]
    # the resume reads only what the kill left on disk, so it runs in this process (no interpreter start-up)
    from mismatch_lab.cli import main

    capfd.readouterr()
    code = main(args)
    stderr = capfd.readouterr().err
    assert code == 0, stderr[-2000:]
    assert "resuming after step" in stderr
    (run_id,) = [r[0] for r in _rows(db, "SELECT run_id FROM runs")]
    assert _rows(db, "SELECT status FROM runs") == [("complete",)]
    assert _rows(db, "SELECT chunk, count(*) FROM chunks_done GROUP BY chunk ORDER BY chunk") == [(1, 1), (2, 1), (3, 1)]
    assert _rows(db, "SELECT step, count(*), count(DISTINCT seq_id) FROM sequences GROUP BY step ORDER BY step") == \
        [(1, 4, 4), (2, 4, 4), (3, 4, 4)]
    assert _rows(db, "SELECT count(*) FROM (SELECT seq_id, pos FROM tokens GROUP BY seq_id, pos HAVING count(*) > 1)") == [(0,)]
    assert _rows(db, "SELECT count(*) FROM (SELECT seq_id, pos, scorer FROM scores GROUP BY ALL HAVING count(*) > 1)") == [(0,)]
    assert _rows(db, "SELECT count(*) FROM (SELECT step, name FROM train_metrics GROUP BY step, name "
                     "HAVING count(*) > 1)") == [(0,)]
    assert {r[0] for r in _rows(db, "SELECT DISTINCT step FROM train_metrics")} == {1, 2, 3}
    assert torch.load(out / run_id / "checkpoint.pt", map_location="cpu", weights_only=False)["step"] == 3
