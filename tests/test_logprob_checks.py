"""Log-probabilities above 0 (probabilities passed by mistake) are refused at every entry: the JSON-lines,
prime-rl and slime importers, `Recorder.log_step`, and our own engines' and scorers' outputs. The one
allowance is `record.flat.LOGP_TOLERANCE` (rounding); NaN, +-inf and masked-out positions pass."""

from __future__ import annotations

import json

import numpy as np
import pytest
from importers.import_fixtures import (
    counts,
    prime_line,
    prime_sample,
    slime_payload,
    store_files,
)

from mismatch_lab.cli import main
from mismatch_lab.engines.base import Sample, check_samples
from mismatch_lab.errors import UserError
from mismatch_lab.record.flat import LOGP_TOLERANCE, PROBABILITIES_FIX, check_logprobs
from mismatch_lab.scoring.hf_scorer import Ragged, ScoredTokens, check_scored

ABOVE = float(np.nextafter(LOGP_TOLERANCE, 1.0))  # the first double past the allowance
GOOD = {"step": 0, "token_ids": [5, 6, 7], "logp_rollout": [-0.5, -1.0, -0.25], "logp_trainer": [-0.5, -1.1, -0.2]}


@pytest.fixture
def cli(capsys):
    """Run `mismatch-lab ARGS` in this process: (exit code, stdout, stderr)."""

    def run(*args) -> tuple[int, str, str]:
        code = main([str(a) for a in args])
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


def _line(**change) -> str:
    return json.dumps(GOOD | change)


def _import(cli, path, store, fmt="jsonl", *extra):
    return cli("import", fmt, path, "--out", store, *extra)


def _snapshot(store):
    return {p: (store / p).read_bytes() for p in store_files(store)}


# -- the rule itself ----------------------------------------------------------------------------------


def test_the_tolerance_is_exact_in_fp32_and_a_few_ulps_of_one():
    assert np.float32(LOGP_TOLERANCE) == LOGP_TOLERANCE  # a float32 tensor at the allowance compares exactly
    assert LOGP_TOLERANCE == 8 * np.finfo(np.float32).eps  # 8 ULPs of 1.0 in fp32 (eps = 2^-23)


def test_a_value_at_the_tolerance_passes_and_the_next_double_is_refused_with_count_largest_and_fix():
    check_logprobs(np.array([-1.0, LOGP_TOLERANCE, np.nan, -np.inf, np.inf]), "x")
    with pytest.raises(ValueError) as err:
        check_logprobs(np.array([-1.0, ABOVE, 0.75, np.nan]), "step 3: logp_rollout")
    msg = str(err.value)
    assert msg.startswith("step 3: logp_rollout has 2 values above 0 (the largest 0.75") and msg.endswith(PROBABILITIES_FIX)


def test_only_the_stored_positions_count():
    values = np.array([0.9, -0.1, 0.8])
    check_logprobs(values, "x", np.array([False, True, False]))
    with pytest.raises(ValueError, match="1 value above 0 .the largest 0.8"):
        check_logprobs(values, "x", np.array([False, True, True]))


# -- mismatch-lab import jsonl -------------------------------------------------------------------------


@pytest.mark.parametrize("path_kind", ["bulk", "line-by-line"])
@pytest.mark.parametrize("field", ["logp_rollout", "logp_trainer"])
def test_import_jsonl_refuses_probabilities_naming_file_line_field_count_and_largest(cli, tmp_path, field, path_kind):
    store = tmp_path / "store"
    first = tmp_path / "first.jsonl"
    first.write_text(_line() + "\n")
    assert _import(cli, first, store, "jsonl", "--run-name", "r")[0] == 0
    before = _snapshot(store)
    lines = [_line(), _line(), _line(**{field: [0.6, 0.3, 0.1]}), _line(**{field: [-0.2, 0.95, -0.1]})]
    if path_kind == "line-by-line":  # a number advantage on one line and a list on another: the Python pass
        lines[0] = _line(advantage=1.0)
        lines[1] = _line(advantage=[1.0, 1.0, 1.0])
    bad = tmp_path / "probs.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    code, _, err = _import(cli, bad, store, "jsonl", "--run-name", "r")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{bad}:3: field '{field}' has 4 values above 0 (the largest 0.95" in err, err
    assert PROBABILITIES_FIX in err
    assert _snapshot(store) == before  # the store is as it was


def test_import_jsonl_accepts_the_tolerance_masked_probabilities_and_nonfinite_values(cli, tmp_path):
    f = tmp_path / "ok.jsonl"
    f.write_text(_line(logp_rollout=[LOGP_TOLERANCE, -1.0, -0.5], mask=[True, True, True]) + "\n"
                 + _line(logp_trainer=[0.9, -1.0, -0.5], mask=[False, True, True]) + "\n"  # prompt position: free
                 + '{"step": 0, "token_ids": [1, 2], "logp_rollout": [NaN, -Infinity], "logp_trainer": [null, -1.0]}\n')
    code, _, err = _import(cli, f, tmp_path / "store")
    assert code == 0, err
    assert counts(tmp_path / "store")["tokens"] == 3 + 2 + 2


def test_import_jsonl_refuses_the_first_double_above_the_tolerance(cli, tmp_path):
    f = tmp_path / "edge.jsonl"
    f.write_text(_line(logp_rollout=[ABOVE, -1.0, -0.5]) + "\n")
    code, _, err = _import(cli, f, tmp_path / "store")
    assert code == 2 and f"{f}:1: field 'logp_rollout' has 1 value above 0" in err, err
    assert not (tmp_path / "store").exists()


def test_import_jsonl_refuses_top_k_probabilities_naming_file_step_and_field(cli, tmp_path):
    f = tmp_path / "topk.jsonl"
    rec = GOOD | {"step": 4, "rollout_topk_ids": [[5, 9], [6, 9], [7, 9]],
                  "rollout_topk_logps": [[-0.1, -2.0], [0.7, 0.2], [-0.3, -1.0]]}
    f.write_text(json.dumps(rec) + "\n")
    code, _, err = _import(cli, f, tmp_path / "store")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{f}: step 4, rank 0: rollout_topk_logps has 2 values above 0 (the largest 0.7" in err, err
    assert not (tmp_path / "store").exists()


# -- prime-rl and slime ------------------------------------------------------------------------------


def test_import_prime_rl_refuses_probabilities_in_inference_logprobs(cli, tmp_path):
    rng = np.random.default_rng(0)
    step_dir = tmp_path / "out" / "token_exports" / "step_2"
    step_dir.mkdir(parents=True)
    good = prime_sample(rng, 3, 4, reward=1.0, adv=0.5)
    bad = prime_sample(rng, 3, 4, reward=1.0, adv=0.5)
    bad["inference_logprobs"] = [0.0] * 3 + [0.5, 0.25, -0.1, 0.125]  # prompt positions keep prime-rl's 0.0
    f = step_dir / "rank_0.jsonl"
    f.write_text(prime_line([good], step=2, rank=0) + "\n" + prime_line([bad], step=2, rank=0, idx=1) + "\n")
    (step_dir / "STABLE").touch()
    code, _, err = _import(cli, tmp_path / "out", tmp_path / "store", "prime-rl")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{f}:2: field 'inference_logprobs' has 3 values above 0 (the largest 0.5" in err, err
    assert not (tmp_path / "store").exists()


def test_import_slime_refuses_probabilities_in_rollout_log_probs_naming_the_sample(cli, tmp_path):
    import torch

    payload = slime_payload(5, topk=0)
    s = payload["samples"][2]
    s["rollout_log_probs"] = s["rollout_log_probs"].exp()  # probabilities where log-probs belong
    f = tmp_path / "dump" / "train_data" / "5.pt"
    f.parent.mkdir(parents=True)
    torch.save(payload, f)
    code, _, err = _import(cli, tmp_path / "dump", tmp_path / "store", "slime", "--trust-pickle")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    n = int(s["loss_masks"].sum())
    assert f"{f} (rollout_id 5): field 'rollout_log_probs' has {n} value" in err and "first in sample 2" in err, err
    assert not (tmp_path / "store").exists()


# -- Recorder.log_step ---------------------------------------------------------------------------------


def _step(B=3, T=4, seed=0):
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 500, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    lmu = -torch.rand(B, T, generator=g) * 3
    return ids, mask, lmu, lmu + 0.01 * torch.randn(B, T, generator=g)


@pytest.mark.parametrize("which", ["logp_rollout", "logp_trainer"])
def test_recorder_refuses_probabilities_before_writing_anything(tmp_path, which):
    from mismatch_lab.record import Recorder

    ids, mask, lmu, lpi = _step()
    with Recorder(tmp_path / "s", "r", framework="verl") as rec:
        rec.log_step(0, ids, mask, lmu, lpi)
        before = _snapshot(tmp_path / "s")
        probs = {"logp_rollout": lmu.exp(), "logp_trainer": lpi}, {"logp_rollout": lmu, "logp_trainer": lpi.exp()}
        args = probs[0] if which == "logp_rollout" else probs[1]
        for step in (0, 1):  # a step logged before (its files would be replaced) and a new one
            with pytest.raises(UserError) as err:
                rec.log_step(step, ids, mask, args["logp_rollout"], args["logp_trainer"])
            n = int(mask.sum())
            assert str(err.value).startswith(f"log_step({step}): {which} has {n} values above 0 (the largest ")
            assert str(err.value).endswith(PROBABILITIES_FIX) and "\n" not in str(err.value)
            assert _snapshot(tmp_path / "s") == before


def test_recorder_takes_float32_at_the_tolerance_and_refuses_the_next_float32(tmp_path):
    import torch

    from mismatch_lab.record import Recorder

    ids, mask, lmu, lpi = _step()
    at = lmu.clone()
    at[1, 2] = LOGP_TOLERANCE
    above = lmu.clone()
    above[1, 2] = torch.nextafter(torch.tensor(LOGP_TOLERANCE, dtype=torch.float32), torch.tensor(1.0))
    masked = mask.clone()
    masked[2, 0] = False
    pad = lmu.clone()
    pad[2, 0] = 0.9  # a probability at a masked-out (padding) position is never stored: free
    with Recorder(tmp_path / "s", "r", framework="verl") as rec:
        assert rec.log_step(0, ids, mask, at, lpi) == int(mask.sum())
        assert rec.log_step(1, ids, masked, pad, lpi) == int(masked.sum())
        with pytest.raises(UserError, match=r"log_step\(2\): logp_rollout has 1 value above 0"):
            rec.log_step(2, ids, mask, above, lpi)


def test_recorder_refuses_top_k_probabilities_but_not_the_padding_entries(tmp_path):
    import torch

    from mismatch_lab.record import Recorder

    ids, mask, lmu, lpi = _step()
    tk_ids = torch.randint(0, 500, (3, 4, 2))
    tk_lps = -torch.rand(3, 4, 2)
    tk_ids[0, 0, 1], tk_lps[0, 0, 1] = -1, 5.0  # a ragged list's padding entry: not counted (23 of 24)
    with Recorder(tmp_path / "s", "r", framework="verl") as rec:
        rec.log_step(0, ids, mask, lmu, lpi, rollout_topk_ids=tk_ids, rollout_topk_logps=tk_lps)
        with pytest.raises(UserError, match=r"log_step\(1\): rollout_topk_logps has 23 values above 0"):
            rec.log_step(1, ids, mask, lmu, lpi, rollout_topk_ids=tk_ids, rollout_topk_logps=tk_lps.exp())


# -- our engines and scorers: a value above 0 is an internal error -------------------------------------


def test_an_engine_returning_a_log_prob_above_zero_is_an_internal_error():
    ok = [Sample(token_ids=[1, 2], logps=[-0.1, float("nan")], text="", finish_reason="stop",
                 topk_ids=[[1, 3], [2, 3]], topk_logps=[[-0.1, -3.0], [-0.2, -4.0]])]
    assert check_samples(ok, "vllm:bf16") is ok
    bad = [Sample(token_ids=[1, 2], logps=[-0.1, 0.01], text="", finish_reason="stop")]
    with pytest.raises(RuntimeError, match="vllm:bf16 rollout: the sampled tokens' log mu has 1 value above 0.*internal"):
        check_samples(bad, "vllm:bf16")


def test_a_scorer_returning_a_log_prob_above_zero_is_an_internal_error():
    offsets = np.array([0, 2])
    topk = Ragged(np.array([[-0.1, -2.0, 0.0], [-0.3, -1.0, 7.0]]), np.array([3, 2]))  # 7.0: padding
    check_scored("hf:bf16", ScoredTokens(offsets, np.array([-0.1, -0.3]), np.zeros(2, bool), topk_logps=topk))
    with pytest.raises(RuntimeError, match="scorer hf:bf16: log pi has 1 value above 0 .the largest 0.002"):
        check_scored("hf:bf16", ScoredTokens(offsets, np.array([0.002, -0.3]), np.zeros(2, bool)))
    topk.lens[1] = 3
    with pytest.raises(RuntimeError, match="scorer hf:bf16: top-K log-probs has 1 value above 0"):
        check_scored("hf:bf16", ScoredTokens(offsets, np.array([-0.1, -0.3]), np.zeros(2, bool), topk_logps=topk))
