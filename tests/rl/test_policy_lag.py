"""`train --policy-lag N`: the rollout engine samples with the weights of N updates ago and every sequence
records its lag; the staleness table then splits the run's μ-vs-π into the numerical floor (lag 0) and the lag.

The weight-version bookkeeping is checked on a stand-in engine that only records what it was given (an
orchestration fake); the numbers on one real run (tiny random Llama, real vLLM CPU engine, real HF trainer).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from mismatch_lab.errors import UserError
from mismatch_lab.rl.loop import LaggedSync, TrainConfig


class _Engine:
    """Records the weight version (the value every tensor of the pushed state holds) of each push."""

    def __init__(self):
        self.pushed: list[int] = []

    def load_state_dict(self, state):
        self.pushed.append(int(next(iter(state.values())).item()))


class _Model:
    """A 'trainer' whose one weight equals the number of updates made."""

    def __init__(self):
        self.w = torch.zeros(())

    def state_dict(self):
        return {"w": self.w}


def _run(lag: int, steps: int, version: int = 0) -> tuple[list[int], list[int]]:
    """(lag of each step's rollout, versions pushed) over `steps` updates."""
    engine, model = _Engine(), _Model()
    model.w += version
    sync = LaggedSync(engine, model, "none", lag, version=version)
    lags = []
    for step in range(version + 1, version + steps + 1):
        lags.append(sync.lag(step))
        model.w += 1  # the update of this step (in place: a kept copy must not follow it)
        sync.after_update(step)
    return lags, engine.pushed


@pytest.mark.parametrize(("n", "lags", "pushed"), [
    (0, [0, 0, 0, 0, 0], [1, 2, 3, 4, 5]),
    (1, [0, 1, 1, 1, 1], [1, 2, 3, 4]),
    (2, [0, 1, 2, 2, 2], [1, 2, 3]),
])
def test_each_rollout_samples_n_updates_behind_and_the_first_n_steps_record_their_smaller_lag(n, lags, pushed):
    assert _run(n, 5) == (lags, pushed)


def test_a_resumed_run_restarts_the_lag_from_the_checkpoint_weights_the_engine_holds():
    assert _run(2, 3, version=4) == ([0, 1, 2], [5])


def test_a_policy_lag_outside_0_to_steps_is_refused_in_one_line():
    for bad in (-1, 9):
        with pytest.raises(UserError, match=r"--policy-lag .* must be in 0\.\.--steps \(8\)"):
            TrainConfig(policy_lag=bad, steps=8).validate()


class _ParityTask:
    """Reward 1 when the reply has an even length: the random tiny model gets nonzero advantages."""

    SPLITS = ("sanity",)

    @staticmethod
    def generate(split, n, *, seed):
        from mismatch_lab.rl.tasks.arithmetic import generate

        return generate("sanity", n, seed=seed)

    @staticmethod
    def reward(text, answer):
        return float(len(text) % 2 == 0)


def test_a_run_with_lag_1_splits_into_a_numerical_floor_at_lag_0_and_a_larger_mismatch_at_lag_1(
        tiny_model, tmp_path, monkeypatch):
    from mismatch_lab.analysis.staleness import staleness_table
    from mismatch_lab.rl.loop import train
    from mismatch_lab.rl.tasks import TASKS
    from mismatch_lab.store.reader import open_store

    monkeypatch.setitem(TASKS, "parity", _ParityTask)
    db = tmp_path / "t.duckdb"
    cfg = TrainConfig(model=tiny_model, loss="dppo_binary_tv", task="parity", samples_per_prompt=4, steps=3,
                      prompts_per_step=2, max_tokens=8, lr=1e-3, rollout_dtype="fp32", trainer_dtype="fp32",
                      checkpoint_every=3, db=str(db), out=str(tmp_path / "runs"), kv_cache_mb=256, study="test",
                      policy_lag=1)
    run_id = train(cfg, progress=False)
    con = open_store(db)
    per_step = con.execute("SELECT step, min(policy_lag), max(policy_lag), count(*) FROM sequences WHERE run_id = ? "
                           "GROUP BY step ORDER BY step", [run_id]).fetchall()
    assert per_step == [(1, 0, 0, 8), (2, 1, 1, 8), (3, 1, 1, 8)]
    metric = dict(con.execute("SELECT step, value FROM train_metrics WHERE run_id = ? AND name = 'policy_lag/value'",
                              [run_id]).fetchall())
    assert metric == {1: 0.0, 2: 1.0, 3: 1.0}
    table = staleness_table(con, run_ids=[run_id]).set_index("policy_lag")
    assert list(table.index) == [0, 1] and (table["n_nonfinite"] == 0).all()
    floor, lagged = table.loc[0, "abs_dlogp_mean"], table.loc[1, "abs_dlogp_mean"]
    # lag 0: fp32 vLLM against the fp32 trainer on the same weights, the numerical floor; lag 1: μ from the
    # weights before an lr-1e-3 update of a random model, π after it
    assert floor < 1e-4 and lagged > 100 * floor, (floor, lagged)
