"""`mismatch_lab.integrations.trl` on a real `trl.GRPOTrainer` with colocated vLLM (CPU backend).

One training run (module fixture) on the session's tiny random Llama: 8 completions (2 prompts x 4) of at
most 8 tokens per generated batch, gradient accumulation 2 (so steps_per_generation = 2) and
num_iterations = 2, three optimizer steps at lr 1e-3. TRL generates at global steps 0 and 2, so the
recorder must hold steps 1 and 3 once each, and steps 1 and 3 are the log entries that carry TRL's
sampling metrics. The fixture keeps what the tests compare (TRL's log history, the completion masks, the
engine's log-probs of fixed sequences right after each weight sync, the synced weights saved to disk)
and frees the trainer's engine before any test starts another: one vLLM engine at a time.
"""

from __future__ import annotations

import gc
import math
import socket
from pathlib import Path

import pytest

pytest.importorskip("trl")
pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from mismatch_lab.errors import UserError
from mismatch_lab.integrations.trl import attach, use_cpu_weight_sync
from mismatch_lab.store.reader import open_store

pytestmark = pytest.mark.slow

PROMPTS = ["The sky is", "One plus one is", "My favourite colour is", "Water boils at"]
PROBE_TEXTS = ["The capital of France is Paris, and the capital of Italy is Rome. ",
               " ".join(str(i) for i in range(400))]
METRIC = "sampling/sampling_logp_difference/mean"


def reward_len(completions, **kwargs):
    """Longer completions score higher (any deterministic reward with some spread will do)."""
    return [len(c) / 10.0 for c in completions]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def distributed_env():
    """The variables TRL's colocated engine and accelerate read (one process)."""
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port()), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        yield


def _config(out: Path, **overrides):
    from trl import GRPOConfig

    kwargs = {"output_dir": str(out), "use_vllm": True, "vllm_mode": "colocate", "use_cpu": True, "bf16": False,
              "vllm_gpu_memory_utilization": 0.35, "vllm_max_model_length": 1024, "per_device_train_batch_size": 4,
              "gradient_accumulation_steps": 2, "num_generations": 4, "num_iterations": 2,
              "max_completion_length": 8, "max_steps": 3, "learning_rate": 1e-3, "logging_steps": 1,
              "save_strategy": "no", "report_to": [], "seed": 0}
    kwargs.update(overrides)
    return GRPOConfig(**kwargs)


def _trainer(model: str, args):
    from datasets import Dataset
    from trl import GRPOTrainer

    dataset = Dataset.from_list([{"prompt": p} for p in PROMPTS])
    return GRPOTrainer(model=model, reward_funcs=reward_len, args=args, train_dataset=dataset)


def _probe_sequences(tokenizer, block_size: int) -> list[list[int]]:
    """Fixed token sequences two KV-cache blocks and a bit long, so a prefix-cache hit is possible."""
    n = 2 * block_size + 5
    return [(tokenizer(t)["input_ids"] * n)[:n] for t in PROBE_TEXTS]


def _engine_logps(llm, sequences) -> tuple[list, list]:
    """The engine's log-probs on fixed sequences, two ways: (1) 8 tokens sampled after each sequence with a
    per-request seed (tokens and their log-probs; this path reads the prefix cache, so stale KV of old
    weights would show), (2) every token of each sequence teacher-forced (prompt_logprobs)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=s) for s in sequences]
    params = [SamplingParams(max_tokens=8, temperature=1.0, logprobs=0, seed=100 + i) for i in range(len(sequences))]
    sampled = []
    for out in llm.generate(prompts, params, use_tqdm=False):
        c = out.outputs[0]
        sampled.append((list(c.token_ids), [float(d[t].logprob) for t, d in zip(c.token_ids, c.logprobs)]))
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    forced = [[float(entry[tok].logprob) for tok, entry in zip(seq[1:], out.prompt_logprobs[1:])]
              for seq, out in zip(sequences, outs)]
    return sampled, forced


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model, distributed_env):
    """Run the training once; return what the tests compare (module docstring)."""
    import time

    tmp = tmp_path_factory.mktemp("trl")
    trainer = _trainer(tiny_model, _config(tmp / "grpo-out"))
    use_cpu_weight_sync(trainer)
    recorder = attach(trainer, tmp / "store")

    generation = trainer.vllm_generation
    probes = _probe_sequences(trainer.processing_class, generation.llm.llm_engine.vllm_config.cache_config.block_size)
    engine_sync = generation.sync_weights
    synced: dict[int, tuple[Path, tuple]] = {}  # global step at sync -> (saved weights, _engine_logps)

    def sync_and_probe():
        engine_sync()
        step = trainer.state.global_step
        saved = tmp / f"synced-{step}"
        trainer.model.save_pretrained(saved)  # tied embeddings: the config ties lm_head on load
        trainer.processing_class.save_pretrained(saved)
        synced[step] = (saved, _engine_logps(generation.llm, probes))

    generation.sync_weights = sync_and_probe

    batches: list[tuple[int, int, int]] = []  # (recorded step, completion-mask tokens, completions)
    recorded_generate = trainer._generate_and_score_completions

    def generate_and_count(inputs):
        out = recorded_generate(inputs)
        if trainer.model.training:
            batches.append((trainer.state.global_step + 1, int(out["completion_mask"].sum()), out["completion_ids"].shape[0]))
        return out

    trainer._generate_and_score_completions = generate_and_count
    started = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - started

    cfg = generation.llm.llm_engine.vllm_config
    model_config, scheduler_config = cfg.model_config, cfg.scheduler_config
    engine_args = {"dtype": model_config.dtype, "max_model_len": model_config.max_model_len,
                   "max_num_seqs": scheduler_config.max_num_seqs,
                   "max_num_batched_tokens": scheduler_config.max_num_batched_tokens,
                   "enforce_eager": model_config.enforce_eager, "logprobs_mode": model_config.logprobs_mode}
    result = {"store": tmp / "store", "recorder": recorder, "log_history": list(trainer.state.log_history),
              "batches": batches, "synced": synced, "probes": probes, "engine_args": engine_args,
              "train_seconds": seconds, "num_generations": trainer.num_generations}
    del generation.llm  # free the engine before another one starts
    trainer = generation = None
    gc.collect()
    return result


def _step_means(con) -> dict[int, tuple[float, int]]:
    rows = con.execute("""
        SELECT q.step, avg(abs(s.logp - t.logp_rollout)), count(*)
        FROM tokens t JOIN scores s USING (run_id, seq_id, pos) JOIN sequences q USING (run_id, seq_id)
        WHERE NOT s.nonfinite AND s.logp IS NOT NULL AND t.logp_rollout IS NOT NULL
        GROUP BY q.step ORDER BY q.step""").fetchall()
    return {int(step): (float(mean), int(n)) for step, mean, n in rows}


def test_recorded_mismatch_equals_trls_logged_metric(trained):
    con = open_store(trained["store"])
    logged = {h["step"]: h for h in trained["log_history"] if h.get(METRIC) is not None}
    means = _step_means(con)
    # one record per generated batch, under the step whose log entry carries the batch's metrics
    assert sorted(logged) == [1, 3]
    assert sorted(means) == [1, 3]
    assert [b[0] for b in trained["batches"]] == [1, 3]
    for step, (mean, _) in means.items():
        assert mean == pytest.approx(logged[step][METRIC], rel=1e-4), step

    tokens = dict(con.execute("SELECT q.step, count(*) FROM tokens t JOIN sequences q USING (run_id, seq_id) "
                              "GROUP BY q.step").fetchall())
    for step, n_mask, n_seq in trained["batches"]:
        assert tokens[step] == n_mask
        assert means[step][1] == n_mask  # every token of this fp32/bf16 run is finite
        assert n_seq == 8

    # sequences: rewards as TRL logs them, GRPO advantages centred per group, groups of num_generations
    seqs = con.execute("SELECT step, prompt_id, reward, advantage, response_len FROM sequences").fetchall()
    assert len(seqs) == 16 and all(r[2] is not None and r[3] is not None for r in seqs)
    for step in (1, 3):
        rewards = [r[2] for r in seqs if r[0] == step]
        assert sum(rewards) / len(rewards) == pytest.approx(logged[step]["reward"], rel=1e-5)
        groups: dict[str, list[float]] = {}
        for r in seqs:
            if r[0] == step:
                groups.setdefault(r[1], []).append(r[3])
        assert sorted(len(g) for g in groups.values()) == [trained["num_generations"]] * 2
        assert all(abs(sum(g)) < 1e-4 for g in groups.values())

    # TRL's own metrics of each batch ride along in train_metrics
    stored = {(s, n): v for s, n, v in con.execute("SELECT step, name, value FROM train_metrics").fetchall()}
    for step in (1, 3):
        assert stored[(step, "trl/" + METRIC)] == pytest.approx(logged[step][METRIC], rel=1e-12)
        assert stored[(step, "trl/reward")] == pytest.approx(logged[step]["reward"], rel=1e-12)

    run = con.execute("SELECT run_id, status, engine, engine_dtype, model, config FROM runs").fetchall()
    assert len(run) == 1
    run_id, status, engine, engine_dtype, model, config = run[0]
    assert (run_id, status, engine, engine_dtype) == ("grpo-out", "complete", "vllm", "bf16")
    assert model is not None and Path(model).name == "tiny"
    assert '"scorer": "trl:fp32"' in config and '"num_iterations": 2' in config
    assert con.execute("SELECT DISTINCT scorer FROM scores").fetchall() == [("trl:fp32",)]
    assert trained["recorder"].closed
    assert trained["train_seconds"] < 120


def test_cpu_weight_sync_matches_a_fresh_engine_bit_for_bit(trained):
    from mismatch_lab.engines.vllm_engine import _import_vllm

    vllm = _import_vllm()
    synced = trained["synced"]
    assert sorted(synced) == [0, 2]  # before the first batch and after two optimizer steps
    (saved, in_training), (_, initial) = synced[2], synced[0]
    assert in_training != initial  # lr 1e-3: the weights really moved, and the engine followed
    llm = vllm.LLM(model=str(saved), seed=0, kv_cache_memory_bytes=256 << 20, **trained["engine_args"])
    try:
        fresh = _engine_logps(llm, trained["probes"])
    finally:
        del llm
        gc.collect()
    sampled, forced = fresh
    assert all(math.isfinite(x) for row in forced for x in row) and all(len(t) == 8 for t, _ in sampled)
    assert sampled == in_training[0]  # same sampled tokens, log-probs equal as floats (bit for bit)
    assert forced == in_training[1]


@pytest.mark.parametrize("use_vllm", [False, True])
def test_attach_needs_the_importance_sampling_correction(tmp_path, tiny_model, distributed_env, trained, use_vllm):
    """`trained` first: its engine is gone before this one (use_vllm=True) starts."""
    trainer = _trainer(tiny_model, _config(tmp_path / "out", use_vllm=use_vllm, vllm_importance_sampling_correction=False))
    try:
        with pytest.raises(UserError, match="vllm_importance_sampling_correction=True") as info:
            attach(trainer, tmp_path / "store")
        assert ("use_vllm=True" in str(info.value)) == (not use_vllm)
        assert not (tmp_path / "store").exists()
    finally:
        if use_vllm:
            del trainer.vllm_generation.llm
        del trainer
        gc.collect()


def test_attach_names_use_vllm_when_it_is_off(tmp_path, tiny_model, distributed_env):
    trainer = _trainer(tiny_model, _config(tmp_path / "out", use_vllm=False))
    with pytest.raises(UserError, match=r"GRPOConfig\(use_vllm=True\)"):
        attach(trainer, tmp_path / "store")
