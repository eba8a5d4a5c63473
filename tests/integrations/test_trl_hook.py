"""attach()'s own bookkeeping, driven by a stand-in for GRPOTrainer that follows TRL 1.16's schedule of
generations per micro-step (orchestration only: the values recorded from a real GRPOTrainer are checked in
test_trl.py)."""

from __future__ import annotations

import json
import types
from collections import defaultdict

import pytest
import torch

from mismatch_lab.errors import UserError
from mismatch_lab.integrations.trl import attach
from mismatch_lab.store.reader import open_store


class _Model(torch.nn.Module):
    name_or_path = "stand-in"

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))


class StandIn:
    """The attributes attach() reads, and TRL's loop: generate when `_step % (steps_per_generation *
    num_iterations) == 0`, one micro-step per gradient-accumulation step."""

    def __init__(self, *, ga=1, spg=None, num_iterations=1, B=4, T=5, rank=0, world=1, **args):
        self.args = types.SimpleNamespace(
            use_vllm=True, vllm_importance_sampling_correction=True, bf16=False, fp16=False, run_name="standin",
            output_dir="out", gradient_accumulation_steps=ga, steps_per_generation=spg or ga,
            num_iterations=num_iterations, num_generations=2, **args)
        self.model = _Model().train()
        self.accelerator = types.SimpleNamespace(process_index=rank, num_processes=world)
        self.state = types.SimpleNamespace(global_step=0)
        self.num_generations, self.reward_weights = 2, torch.tensor([1.0])
        self._metrics = {"train": defaultdict(list)}
        self.processing_class, self.B, self.T, self._step, self.callbacks = None, B, T, 0, []

    def add_callback(self, cb):
        self.callbacks.append(cb)

    def _calculate_rewards(self, *args):
        return torch.arange(self.B, dtype=torch.float32).unsqueeze(1)

    def _generate_and_score_completions(self, inputs):
        self._calculate_rewards()
        self._metrics["train"]["sampling/sampling_logp_difference/mean"].append(0.5)
        self._metrics["train"]["num_tokens"] = [float(self._step)]  # TRL replaces this list, not appends
        B, T = self.B, self.T
        return {"completion_ids": torch.ones(B, T, dtype=torch.long), "completion_mask": torch.ones(B, T),
                "sampling_per_token_logps": torch.full((B, T), -1.0), "old_per_token_logps": torch.full((B, T), -1.5),
                "advantages": torch.linspace(-1, 1, B)}

    def train(self, max_steps, resume_from=None):
        """As transformers' Trainer.train: the step count starts at 0 again, or at the checkpoint's step
        (`resume_from_checkpoint`); TRL's micro-step counter `_step` carries on."""
        a = self.args
        self.state.global_step = resume_from or 0
        while self.state.global_step < max_steps:
            for _ in range(a.gradient_accumulation_steps):
                if self._step % (a.steps_per_generation * a.num_iterations) == 0:
                    self._generate_and_score_completions(None)
                self._step += 1
            self.state.global_step += 1
        for cb in self.callbacks:
            cb.on_train_end(a, self.state, None)


def _steps(store) -> list[int]:
    return [r[0] for r in open_store(store).execute("SELECT DISTINCT step FROM sequences ORDER BY 1").fetchall()]


@pytest.mark.parametrize(("kw", "every", "want"), [
    ({"num_iterations": 2}, 2, [1, 5, 9, 13]),  # batches at 1, 3, 5, ...: a step filter 'step % 2' kept none
    ({"ga": 2, "spg": 4}, 2, [1, 5, 9, 13]),
    ({"num_iterations": 3}, 3, [1, 10]),
    ({}, 1, list(range(1, 16))),
])
def test_every_keeps_one_in_n_generated_batches(tmp_path, kw, every, want):
    trainer = StandIn(**kw)
    rec = attach(trainer, tmp_path / "s", every=every)
    trainer.train(15)
    assert rec.closed and _steps(tmp_path / "s") == want
    cfg = open_store(tmp_path / "s").execute("SELECT config FROM runs").fetchone()[0]
    assert f'"every_generated_batches": {every}' in cfg


def test_a_metric_whose_list_trl_replaces_is_recorded_for_every_batch(tmp_path):
    trainer = StandIn()
    attach(trainer, tmp_path / "s")
    trainer.train(3)
    rows = open_store(tmp_path / "s").execute(
        "SELECT step, value FROM train_metrics WHERE name = 'trl/num_tokens' ORDER BY step").fetchall()
    assert rows == [(1, 0.0), (2, 1.0), (3, 2.0)]


def test_a_second_attach_is_refused_before_it_writes_anything(tmp_path):
    trainer = StandIn()
    attach(trainer, tmp_path / "s")
    with pytest.raises(UserError, match="already called on this trainer"):
        attach(trainer, tmp_path / "other")
    assert not (tmp_path / "other").exists()


def test_a_run_resumed_from_a_checkpoint_replaces_the_steps_recorded_after_it(tmp_path):
    """The crashed run went on to step 6; resumed from the checkpoint of step 3, its steps 4..6 (weights
    thrown away) make room for the resumed run's: no step holds both."""
    first = StandIn()
    attach(first, tmp_path / "s")
    first.train(6)
    resumed = StandIn()  # a new process: TRL restores global_step, not its micro-step counter
    attach(resumed, tmp_path / "s")
    with pytest.warns(UserWarning, match=r"removed 3 step\(s\) recorded after it before \(4..6\)"):
        resumed.train(5, resume_from=3)
    con = open_store(tmp_path / "s")
    assert _steps(tmp_path / "s") == [1, 2, 3, 4, 5]
    assert con.execute("SELECT step, count(*) FROM sequences GROUP BY step ORDER BY step").fetchall() \
        == [(s, 4) for s in range(1, 6)]
    # steps 4, 5 come from the resumed run (its micro-step counter restarted at 0)
    assert con.execute("SELECT step, value FROM train_metrics WHERE name = 'trl/num_tokens' ORDER BY step").fetchall() \
        == [(1, 0.0), (2, 1.0), (3, 2.0), (4, 0.0), (5, 1.0)]


def test_another_experiment_under_the_same_run_name_is_refused(tmp_path):
    attach(StandIn(), tmp_path / "s").close()
    with pytest.raises(UserError, match=r"other TRL \(or attach\) options: num_iterations 1 \(now 2\).*run_name="):
        attach(StandIn(num_iterations=2), tmp_path / "s")
    with pytest.raises(UserError, match=r"options: every 1 \(now 3\)"):  # attach's own sampling, too
        attach(StandIn(), tmp_path / "s", every=3)


def test_a_second_train_call_of_the_same_trainer_records_through_a_new_attach(tmp_path):
    """A notebook trains the same trainer object again after its first train() ended: attach again. Resumed
    from the checkpoint of step 3 the call continues the run; a plain train() counts from step 0 again and
    replaces what the first call recorded, like any run started afresh under the same name. Each batch is
    recorded once (the wrappers are not stacked)."""
    per_step = "SELECT step, count(*) FROM sequences GROUP BY step ORDER BY step"
    trainer = StandIn()
    first = attach(trainer, tmp_path / "s")
    trainer.train(3)
    assert first.closed
    second = attach(trainer, tmp_path / "s")
    trainer.train(5, resume_from=3)
    assert second.closed and open_store(tmp_path / "s").execute(per_step).fetchall() == [(s, 4) for s in range(1, 6)]
    attach(trainer, tmp_path / "s")
    with pytest.warns(UserWarning, match=r"training starts after step 0: removed 5 step\(s\)"):
        trainer.train(2)
    con = open_store(tmp_path / "s")
    assert con.execute(per_step).fetchall() == [(1, 4), (2, 4)]
    assert con.execute("SELECT status FROM runs").fetchone()[0] == "complete"


def _ranks_by_step(store) -> list[tuple[int, int]]:
    return open_store(store).execute(
        "SELECT step, count(DISTINCT seq_id >> 20) FROM sequences GROUP BY step ORDER BY step").fetchall()


def test_a_job_resumed_on_fewer_processes_drops_the_later_steps_of_the_ranks_it_no_longer_has(tmp_path):
    store = tmp_path / "s"
    for rank in (0, 1):  # a 2-process job recorded steps 1..4 on each rank, then died
        attach(trainer := StandIn(rank=rank, world=2), store)
        trainer.train(4)
    assert [n for _, n in _ranks_by_step(store)] == [2, 2, 2, 2]
    resumed = StandIn(rank=0, world=1)
    attach(resumed, store)
    with pytest.warns(UserWarning, match=r"removed 2 step\(s\) recorded after it before \(3..4\)"):
        resumed.train(4, resume_from=2)
    assert _ranks_by_step(store) == [(1, 2), (2, 2), (3, 1), (4, 1)]  # rank 1 keeps only what the checkpoint covers
    con = open_store(store)
    assert con.execute("SELECT status, n_ranks FROM runs").fetchone() == ("complete", 2)
    restarted = StandIn(rank=0, world=1)  # from step 0: rank 1 holds nothing any more, its runs row goes too
    attach(restarted, store)
    with pytest.warns(UserWarning, match=r"training starts after step 0"):
        restarted.train(2)
    assert _ranks_by_step(store) == [(1, 1), (2, 1)]
    assert open_store(store).execute("SELECT n_ranks FROM runs").fetchone()[0] == 1


def test_another_model_under_the_same_run_name_is_refused(tmp_path):
    from pathlib import Path

    attach(StandIn(), tmp_path / "s", model=Path("models/qwen")).close()
    attach(StandIn(), tmp_path / "s", model="models/qwen").close()  # the same model, however it is spelled
    attach(StandIn(), tmp_path / "other").close()
    other = StandIn()
    other.model.name_or_path = "another-model"
    with pytest.raises(UserError, match=r"another model or other TRL.*model 'stand-in' \(now 'another-model'\)"):
        attach(other, tmp_path / "other")


@pytest.mark.parametrize(("args", "want"), [
    ({"top_p": 0.9}, {"top_p": 0.9}),
    ({"top_k": 20, "min_p": 0.05}, {"top_k": 20, "min_p": 0.05}),
    ({"generation_kwargs": {"repetition_penalty": 1.1}}, {"repetition_penalty": 1.1}),
    ({"vllm_structured_outputs_regex": "[0-9]+", "generation_kwargs": {"min_tokens": 4, "logit_bias": {"7": 2.0}}},
     {"vllm_structured_outputs_regex": "[0-9]+", "min_tokens": 4, "logit_bias": {"7": 2.0}}),
    ({"temperature": 0.7, "generation_kwargs": {"temperature": 1.0}}, {"temperature": 1.0}),  # π at 0.7, μ at 1.0
])
def test_sampling_that_truncates_or_penalises_mu_is_warned_about_and_stored(tmp_path, args, want):
    with pytest.warns(UserWarning, match="truncated or penalised sampling distribution"):
        attach(StandIn(**args), tmp_path / "s").close()
    cfg = json.loads(open_store(tmp_path / "s").execute("SELECT config FROM runs").fetchone()[0])
    assert cfg["mu_processing"] == want


def test_neutral_sampling_options_leave_mu_unprocessed(tmp_path, recwarn):
    attach(StandIn(top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0, temperature=0.7,
                   vllm_structured_outputs_regex=None, generation_kwargs={"temperature": 0.7, "min_tokens": 0}),
           tmp_path / "s").close()
    cfg = json.loads(open_store(tmp_path / "s").execute("SELECT config FROM runs").fetchone()[0])
    assert cfg["mu_processing"] == {}
    assert cfg["mu"] == "sampling_per_token_logps (vLLM, logprobs_mode=processed_logprobs)"
    assert not [w for w in recwarn if "truncated" in str(w.message)]


@pytest.mark.parametrize(("client", "mode"), [
    (types.SimpleNamespace(get_server_info=lambda: {"model_config": {"logprobs_mode": "raw_logprobs"}}), "raw_logprobs"),
    (types.SimpleNamespace(get_server_info=dict), "unknown"),  # an older server without the field
    (None, "unknown"),  # a process without the client
])
def test_a_vllm_servers_logprobs_mode_is_read_into_the_runs_config(tmp_path, client, mode):
    trainer = StandIn(vllm_mode="server")
    trainer.vllm_generation = types.SimpleNamespace(vllm_client=client)
    attach(trainer, tmp_path / "s").close()
    cfg = json.loads(open_store(tmp_path / "s").execute("SELECT config FROM runs").fetchone()[0])
    assert cfg["mu"] == f"sampling_per_token_logps (vLLM, logprobs_mode={mode})"
