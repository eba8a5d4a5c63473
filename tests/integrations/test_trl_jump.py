"""The mismatch jump after the first real update, recorded through `attach` on the embedded model.

TRL's default learning rate (1e-6) moves each fp32 weight of the trainer by at most ~1e-6, yet the colocated
vLLM engine, which runs the same weights rounded to bf16, then samples from a visibly different policy:
the embedded checkpoint (SmolLM2-135M-Instruct dequantised from a 4-bit GGUF) has ~8 % of its fp32 weights
exactly halfway between two bf16 values, where round-to-nearest-even picks a side; an update of 1e-6 moves
each such weight off the tie, and it rounds towards the update, a whole bf16 ulp (~|w| / 256) instead of
1e-6, in the direction the optimizer chose for it. The engine's π_bf16 takes a large coherent step that the
fp32 trainer's π does not, and the recorded |log π − log μ| jumps.

One GRPOTrainer run (fp32 trainer, bf16 colocated engine, CPU) on one prompt repeated every step, 3
optimizer steps with `lr_scheduler_type="constant_with_warmup", warmup_steps=1`: the first update runs at
lr 0 (the control: the weights stay bit for bit, the engine is re-synced all the same), the second at lr
1e-6. So step 1 and step 2 are sampled from the initial weights, step 3 after one real update.
Measured (docs/record.md): 0.0228, 0.0239, 0.0792 for steps 1-3 (3.3x); the test asks for more than 2x.
"""

from __future__ import annotations

import gc
import socket

import pytest

pytest.importorskip("trl")
pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from mismatch_lab.integrations.trl import attach, use_cpu_weight_sync
from mismatch_lab.store.reader import open_store

pytestmark = pytest.mark.slow

METRIC = "sampling/sampling_logp_difference/mean"
PROMPT = [{"role": "user", "content": "Write a short story about a dragon who learns to paint."}]
LR = 1e-6


def reward_chars(completions, **kwargs):
    """Longer answers score higher: any reward with some spread. The update's size hardly depends on it
    (AdamW normalises the gradient: about lr per weight), but advantages that are exactly 0 leave the weights
    where they are."""
    return [len(c[0]["content"]) / 10.0 for c in completions]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def jump_run(tmp_path_factory, embedded_model):
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tmp = tmp_path_factory.mktemp("trl-jump")
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port()), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        args = GRPOConfig(output_dir=str(tmp / "grpo-jump"), use_vllm=True, vllm_mode="colocate", use_cpu=True,
                          bf16=False, vllm_gpu_memory_utilization=0.35, vllm_max_model_length=512,
                          per_device_train_batch_size=8, num_generations=8, max_completion_length=16,
                          max_steps=3, learning_rate=LR, lr_scheduler_type="constant_with_warmup", warmup_steps=1,
                          logging_steps=1, save_strategy="no", report_to=[], seed=0)  # fmt: skip
        dataset = Dataset.from_list([{"prompt": PROMPT}] * 4)
        trainer = GRPOTrainer(model=embedded_model, reward_funcs=reward_chars, args=args, train_dataset=dataset)
        use_cpu_weight_sync(trainer)
        attach(trainer, tmp / "store")

        initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        after: dict[int, dict] = {}  # optimizer step -> how far the weights moved from the initial ones

        class Moved(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step > 2:  # the rollouts the test compares were all sampled by then
                    return
                moved = flipped = total = 0
                largest = 0.0
                for n, p in trainer.model.named_parameters():
                    w, w0 = p.detach(), initial[n]
                    moved += int((w != w0).sum())
                    flipped += int((w.to(torch.bfloat16) != w0.to(torch.bfloat16)).sum())
                    largest = max(largest, float((w - w0).abs().max()))
                    total += w.numel()
                after[state.global_step] = {"moved": moved / total, "flipped": flipped / total, "largest": largest}

        trainer.add_callback(Moved())
        trainer.train()
        result = {"store": tmp / "store", "log_history": list(trainer.state.log_history), "after": after}
        del trainer.vllm_generation.llm  # free the engine before another one starts
        trainer = initial = None
        gc.collect()
    return result


def _step_means(store) -> dict[int, float]:
    rows = open_store(store).execute("""
        SELECT q.step, avg(abs(s.logp - t.logp_rollout))
        FROM tokens t JOIN scores s USING (run_id, seq_id, pos) JOIN sequences q USING (run_id, seq_id)
        WHERE NOT s.nonfinite GROUP BY q.step ORDER BY q.step""").fetchall()
    return {int(step): float(mean) for step, mean in rows}


def test_recorded_mismatch_jumps_after_the_first_update_at_lr_1e_6(jump_run):
    after = jump_run["after"]
    # the lr-0 update left every weight as it was; the lr-1e-6 one moved most by at most ~lr, and moved the
    # bf16 rounding of a share of them by a whole ulp
    assert after[1] == {"moved": 0.0, "flipped": 0.0, "largest": 0.0}
    assert after[2]["moved"] > 0.5
    assert 0 < after[2]["largest"] <= 1.5 * LR
    assert after[2]["flipped"] > 0.01

    means = _step_means(jump_run["store"])
    logged = {h["step"]: h[METRIC] for h in jump_run["log_history"] if h.get(METRIC) is not None}
    print("recorded per-step mean |log pi - log mu|:", means, "TRL:", logged, "weights:", after)
    assert sorted(means) == sorted(logged) == [1, 2, 3]
    for step, mean in means.items():
        assert mean == pytest.approx(logged[step], rel=1e-4), step
    before = max(means[1], means[2])  # both sampled from the initial weights (step 2 after the lr-0 update)
    assert means[2] < 2 * means[1] and means[1] < 2 * means[2]  # no jump without a weight change
    assert means[3] > 2 * before  # the jump after the lr-1e-6 update
