"""NeMo-RL's token_mult_prob_error as an analyze table and a doctor check, for runs imported from NeMo-RL:
equal to NeMo-RL's own computation (its ClippedPGLossFn lines, transcribed below) on the tensors of the
train_data_step<N>.jsonl files written in its format (framework_writers/nemo_rl.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from framework_writers.nemo_rl import log_batched_dict_as_jsonl, step_batch

from mismatch_lab.analysis.nemo_rl_metric import BAND, nemo_rl_table
from mismatch_lab.store.reader import open_store

torch = pytest.importorskip("torch")


def nemo_rl_token_mult_prob_error(data: dict, microbatch: int = 2) -> float:
    """NVIDIA-NeMo/RL @7ea279ab on one step of one global batch: `ClippedPGLossFn.__call__`
    (nemo_rl/algorithms/loss/loss_functions.py) per microbatch with `masked_mean` (nemo_rl/algorithms/utils.py)
    and global_valid_toks (nemo_rl/models/automodel/data.py), the microbatch values summed (grpo.py, np.sum of
    all_mb_metrics). In float64 here: the definition, not float32's rounding, is under test."""
    t = {k: torch.tensor(data[k], dtype=torch.float64) for k in
         ("token_loss_mask", "sample_loss_mask", "generation_logprobs", "prev_logprobs")}

    def masked_mean(values, mask, dim=None, global_normalization_factor=None):
        normalization_factor = (torch.sum(mask, dim=dim) if global_normalization_factor is None
                                else global_normalization_factor)
        return torch.sum(values * mask, dim=dim) / (normalization_factor + 1e-8)

    global_valid_toks = torch.sum(t["token_loss_mask"][:, 1:] * t["sample_loss_mask"].unsqueeze(-1))
    total = 0.0
    for lo in range(0, len(data["input_lengths"]), microbatch):
        sl = slice(lo, lo + microbatch)
        token_mask = t["token_loss_mask"][sl][:, 1:]
        sample_mask = t["sample_loss_mask"][sl]
        prev_logprobs = t["prev_logprobs"][sl][:, 1:]
        generation_logprobs = t["generation_logprobs"][sl][:, 1:]
        mask = token_mask * sample_mask.unsqueeze(-1)
        lp_error = torch.abs(generation_logprobs - prev_logprobs)
        total += masked_mean(torch.exp(lp_error * mask), mask, global_normalization_factor=global_valid_toks).item()
    return total


def _write(log_dir, steps: dict[int, dict]) -> None:
    for n, data in steps.items():
        log_batched_dict_as_jsonl(data, log_dir / "exp_001" / f"train_data_step{n}.jsonl")


def _shifted(data: dict, shift: float) -> dict:
    """The step with log pi moved by `shift` at every response position (kept <= 0)."""
    out = dict(data)
    mask = np.array(data["token_loss_mask"], dtype=bool)
    prev = np.array(data["prev_logprobs"], dtype=np.float32)
    prev[mask] = np.minimum(prev[mask] - shift, 0.0)
    out["prev_logprobs"] = prev.tolist()
    return out


def test_the_table_equals_nemo_rls_own_computation_on_the_same_step_tensors(cli, tmp_path):
    steps = {1: step_batch(11, n=7, edge=False), 2: step_batch(12, n=5, edge=False)}
    steps[2]["sample_loss_mask"][3] = 0.0  # a sample NeMo-RL leaves out of the loss: out of both
    _write(tmp_path / "logs", steps)
    code, _, err = cli("import", "nemo-rl", tmp_path / "logs", "--out", tmp_path / "store", "--rollout-engine", "vllm",
                       "--trainer-dtype", "bf16")
    assert code == 0, err
    table = nemo_rl_table(open_store(tmp_path / "store"))
    assert list(table["step"]) == [1, 2] and set(table["scorer"]) == {"nemo-rl:bf16"}
    assert (table["n_nonfinite"] == 0).all()
    for row in table.itertuples():
        data = steps[row.step]
        n = int(np.sum(np.array(data["token_loss_mask"])[:, 1:] * np.array(data["sample_loss_mask"])[:, None]))
        theirs = nemo_rl_token_mult_prob_error(data)
        assert row.n_finite == n
        # NeMo-RL divides by n + 1e-8; beyond that, float64 sums of n terms in another order
        assert row.token_mult_prob_error == pytest.approx(theirs, rel=1e-8 / n + 4 * n * np.finfo(np.float64).eps)
        assert row.token_mult_prob_error > 1.0


def test_analyze_and_doctor_report_it_under_its_name_with_nemo_rls_band_for_nemo_rl_pairs_only(cli, tmp_path):
    calm = {1: step_batch(21, edge=False), 2: step_batch(22, edge=False), 3: step_batch(23, edge=False)}
    loud = {s: _shifted(d, 0.3) for s, d in calm.items()}  # every token off by ~0.3 nats: exp(0.3) = 1.35
    _write(tmp_path / "calm", calm)
    _write(tmp_path / "loud", loud)
    store = tmp_path / "store"
    for name, engine in (("calm", "vllm"), ("loud", "sglang")):
        assert cli("import", "nemo-rl", tmp_path / name, "--out", store, "--rollout-engine", engine,
                   "--trainer-dtype", "bf16")[0] == 0
    with open(tmp_path / "plain.jsonl", "w") as f:  # a run of another framework in the same store
        f.write(json.dumps({"step": 1, "token_ids": [1, 2], "logp_rollout": [-1.0, -2.0],
                            "logp_trainer": [-1.5, -2.0]}) + "\n")
    assert cli("import", "jsonl", tmp_path / "plain.jsonl", "--out", store)[0] == 0

    assert cli("analyze", "--db", store, "--json", tmp_path / "a.json")[0] == 0
    rows = json.loads((tmp_path / "a.json").read_text())["token_mult_prob_error"]
    assert sorted({r["run_id"] for r in rows}) == ["calm", "loud"] and len(rows) == 6
    by = {(r["run_id"], r["step"]): r["token_mult_prob_error"] for r in rows}
    for s in calm:
        assert by[("calm", s)] < BAND < by[("loud", s)]

    code, out, _ = cli("doctor", "--db", store, "--json", tmp_path / "d.json")
    assert code == 0
    checks = [c for c in json.loads((tmp_path / "d.json").read_text())["checks"]
              if c["check"] == "nemo_rl_mult_prob_error"]
    assert {c["pair"]: c["verdict"] for c in checks} == {"vllm/nemo-rl:bf16": "ok", "sglang/nemo-rl:bf16": "warn"}
    loud_row = next(c for c in checks if c["pair"] == "sglang/nemo-rl:bf16")
    assert loud_row["value"] == pytest.approx(float(np.median([by[("loud", s)] for s in loud])), rel=1e-12)
    assert loud_row["metric"] == "token_mult_prob_error" and "1.05" in loud_row["band"]
    assert "3 steps" in loud_row["detail"] and "3 above 1.05" in loud_row["detail"]
    assert "nemo_rl_mult_prob_error sglang/nemo-rl:bf16" in out
    # a store without NeMo-RL runs: no row, and not listed as not measured
    assert cli("import", "jsonl", tmp_path / "plain.jsonl", "--out", tmp_path / "plain-store")[0] == 0
    assert cli("doctor", "--db", tmp_path / "plain-store", "--json", tmp_path / "p.json")[0] == 0
    doc = json.loads((tmp_path / "p.json").read_text())
    assert not [c for c in doc["checks"] + doc["not_measured"] if c["check"] == "nemo_rl_mult_prob_error"]
    assert json.loads((tmp_path / "a.json").read_text())["precision"]  # the other tables still there
