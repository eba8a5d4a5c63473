"""attach()'s live metrics on a real `trl.GRPOTrainer` (colocated vLLM, CPU): they reach TRL's own log
(`state.log_history`, and a TensorBoard event file through `report_to`), they equal the metrics of the
tokens the store holds for the step, and a crossed band warns once.

One run of test_trl.py's configuration (its helpers and fixture reused): tiny random Llama, 2 prompts x 4
completions, gradient accumulation 2 and num_iterations 2, so TRL generates for steps 1 and 3. Planted
data: π (`old_per_token_logps`) of every generated batch is lowered by log 2 before attach reads it, so
every token has r = 1/2 and every published band is crossed at both steps; each must warn once.
"""

from __future__ import annotations

import gc
import math
import struct
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("trl")
pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).parent))
from test_trl import _config, _trainer, distributed_env  # noqa: F401 - the fixture is used by name

from mismatch_lab.integrations.trl import attach, use_cpu_weight_sync
from mismatch_lab.record.live import LIVE_CHECKS, step_metrics, verdict_name
from mismatch_lab.store.reader import open_store

pytestmark = pytest.mark.slow

PLANTED = math.log(2.0)
OURS = ("mismatch/abs_dp/mean", "mismatch/abs_dlogp/mean", "mismatch/k3/mean", "nemo-rl/token_mult_prob_error")


def _tensorboard_writer() -> bool:
    """Whether transformers' TensorBoardCallback finds a writer (torch.utils.tensorboard or tensorboardX)."""
    from transformers.integrations import is_tensorboard_available

    return is_tensorboard_available()


@pytest.fixture(scope="module")
def live_run(tmp_path_factory, tiny_model, distributed_env):  # noqa: F811
    tmp = tmp_path_factory.mktemp("trl-live")
    report = ["tensorboard"] if _tensorboard_writer() else []
    trainer = _trainer(tiny_model, _config(tmp / "out", report_to=report))
    use_cpu_weight_sync(trainer)
    generate = trainer._generate_and_score_completions

    def planted(inputs, *args, **kwargs):
        out = generate(inputs, *args, **kwargs)
        out["old_per_token_logps"] = out["old_per_token_logps"] - PLANTED  # still log-probs (<= 0)
        return out

    trainer._generate_and_score_completions = planted  # wrapped by attach: it records the planted π
    attach(trainer, tmp / "store")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    result = {"store": tmp / "store", "out": tmp / "out", "history": list(trainer.state.log_history),
              "warnings": [str(w.message) for w in caught if str(w.message).startswith("mismatch_lab: step")],
              "tensorboard": bool(report)}
    del trainer.vllm_generation.llm  # free the engine before another test starts one
    trainer = None
    gc.collect()
    return result


def _stored_metrics(store: Path) -> dict[int, dict[str, float]]:
    """step -> step_metrics of the tokens the store holds for the step (one sequence per row of [B, T])."""
    con = open_store(store)
    rows = con.execute("""SELECT q.step, t.seq_id, t.pos, t.logp_rollout, s.logp FROM tokens t
                          JOIN scores s USING (run_id, seq_id, pos) JOIN sequences q USING (run_id, seq_id)
                          ORDER BY q.step, t.seq_id, t.pos""").fetchall()
    out = {}
    for step in sorted({r[0] for r in rows}):
        mine = [r for r in rows if r[0] == step]
        seqs = sorted({r[1] for r in mine})
        T = max(r[2] for r in mine) + 1
        mu, pi = np.zeros((len(seqs), T)), np.zeros((len(seqs), T))
        mask = np.zeros((len(seqs), T), bool)
        for _, seq, pos, lmu, lpi in mine:
            b = seqs.index(seq)
            mu[b, pos], pi[b, pos], mask[b, pos] = lmu, lpi, True
        out[step] = step_metrics(mu, pi, mask)
    return out


def test_the_live_metrics_are_in_trls_log_history_equal_to_the_stored_tokens_metrics(live_run):
    logged = {h["step"]: h for h in live_run["history"] if "mismatch/k3/mean" in h}
    stored = _stored_metrics(live_run["store"])
    assert sorted(logged) == sorted(stored) == [1, 3]
    for step, want in stored.items():
        for name in (*OURS, "verl/training/rollout_probs_diff_mean", "prime-rl/mismatch_kl/all/mean",
                     "slime/train_rollout_logprob_abs_diff", "mismatch/verdict/k3"):
            # TRL logs the float it was handed; the store round-trips float32 log-probs as float64
            assert logged[step][name] == pytest.approx(want[name], rel=1e-6), (step, name)
    # the planted r = 1/2 on top of the engine's own mismatch: k3 near 1/2 - log(1/2) - 1
    assert logged[1]["mismatch/k3/mean"] > 0.5 * (0.5 + math.log(2) - 1)


def test_a_crossed_band_warns_once_per_band_at_the_first_step_that_crosses_it(live_run):
    msgs = live_run["warnings"]
    logged = {h["step"]: h for h in live_run["history"] if "mismatch/k3/mean" in h}
    crossing = {c.name: min(s for s in logged if logged[s][verdict_name(c)] > 0)
                for c in LIVE_CHECKS if any(logged[s][verdict_name(c)] > 0 for s in logged)}
    # r = 1/2 on every token: k3 and slime's sequence mean fail at both steps (|π − μ| of a random tiny model's
    # near-uniform probabilities may stay under verl's level)
    assert {"k3", "seq_abs_dlogp"} <= set(crossing) and set(crossing.values()) == {1}
    assert len(msgs) == len(crossing), msgs  # once per band although step 3 crosses again
    for check in LIVE_CHECKS:
        mine = [m for m in msgs if f" {check.metric} = " in m]
        if check.name not in crossing:
            assert mine == []
            continue
        (msg,) = mine
        assert msg.startswith(f"mismatch_lab: step {crossing[check.name]}:") and check.band.source in msg


def _scalars(event_file: Path) -> dict[str, dict[int, float]]:
    """tag -> step -> value of a TensorBoard event file (TFRecord framing: length, crc, data, crc)."""
    from tensorboardX.proto import event_pb2

    out: dict[str, dict[int, float]] = {}
    data = event_file.read_bytes()
    at = 0
    while at < len(data):
        (n,) = struct.unpack("<Q", data[at: at + 8])
        event = event_pb2.Event.FromString(data[at + 12: at + 12 + n])
        at += 12 + n + 4
        for v in event.summary.value:
            out.setdefault(v.tag, {})[event.step] = v.simple_value
    return out


def test_the_live_metrics_reach_a_tensorboard_event_file_through_report_to(live_run):
    if not live_run["tensorboard"]:
        pytest.skip("no TensorBoard writer installed (tensorboard or tensorboardX): report_to='tensorboard' cannot run")
    pytest.importorskip("tensorboardX")  # the event protos the reader above parses with
    files = sorted(live_run["out"].rglob("events.out.tfevents.*"))
    assert files, f"no event file under {live_run['out']}"
    scalars = {}
    for f in files:
        scalars |= _scalars(f)
    logged = {h["step"]: h for h in live_run["history"] if "mismatch/k3/mean" in h}
    for name in OURS:
        tag = next(t for t in scalars if t.endswith(name))  # the callback may prefix 'train/'
        assert scalars[tag] == {s: pytest.approx(logged[s][name], rel=2**-23) for s in logged}, name  # float32
