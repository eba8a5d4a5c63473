"""`mismatch-lab import nemo-rl`: real train_data_step<N>.jsonl files written as NeMo-RL's logger writes
them (framework_writers/nemo_rl.py), read back through the store and the analyses."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
from framework_writers.nemo_rl import (
    log_batched_dict_as_jsonl,
    naive,
    step_batch,
    write_log_dir,
)
from import_fixtures import counts, same, stored

from mismatch_lab.store.schema import MAX_LOG_RATIO

STEPS = {"exp_001": [1, 2], "exp_002": [3]}


def _expected(files: dict, old: bool = False) -> dict:
    """(step, rank, index) -> the plain pass's sample, indices counting per step in file order."""
    out, index = {}, {}
    for path, data in files.items():
        step = int(re.search(r"step(\d+)", path.name).group(1))
        for s in naive(data, step, old):
            i = index.get(step, 0)
            out[(step, 0, i)] = s
            index[step] = i + 1
    return out


def _finite_pairs(want: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    mu = np.array([x for s in want.values() for x in s["mu"]], dtype=np.float64)
    pi = np.array([x for s in want.values() for x in s["pi"]], dtype=np.float64)
    step = np.array([s["step"] for s in want.values() for _ in s["mu"]])
    with np.errstate(invalid="ignore"):
        ok = np.isfinite(mu) & np.isfinite(pi) & (pi - mu < MAX_LOG_RATIO)
    return mu[ok], pi[ok], step[ok]


def test_every_stored_token_matches_a_plain_pass_over_the_logger_lines(cli, tmp_path):
    files = write_log_dir(tmp_path / "logs", STEPS)
    store = tmp_path / "store"
    code, out, err = cli("import", "nemo-rl", tmp_path / "logs", "--out", store, "--rollout-engine", "vllm",
                         "--trainer-dtype", "bf16")
    assert code == 0, err
    want, got = _expected(files), stored(store, "logs")
    assert got.keys() == want.keys()
    for key, w in want.items():
        seq, toks = got[key]["seq"], got[key]["tokens"]
        assert seq["response_len"] == len(w["pos"]) and seq["prompt_len"] == w["prompt_len"]
        assert same(seq["reward"], w["reward"]) and same(seq["advantage"], float(np.mean(w["adv"])) if all(
            math.isfinite(a) for a in w["adv"]) else None)
        assert [t["pos"] for t in toks] == w["pos"] and [t["token_id"] for t in toks] == w["token_id"]
        for t, mu, pi, adv in zip(toks, w["mu"], w["pi"], w["adv"]):
            assert same(t["logp_rollout"], mu if math.isfinite(mu) else None)
            assert same(t["logp"], pi if math.isfinite(pi) else None) and t["nonfinite"] == (not math.isfinite(mu - pi))
            assert same(t["advantage"], adv)
    # the sample with sample_loss_mask 0 is not stored; NaN / -Infinity are NULL with nonfinite set
    n_written = sum(len(d["input_lengths"]) for d in files.values())
    assert counts(store)["sequences"] == len(want) == n_written - len(files)
    assert "scorer nemo-rl:bf16" in out and "token_mult_prob_error" in out


def test_the_analyses_and_nemo_rls_metrics_equal_a_numpy_pass_over_the_raw_arrays(cli, tmp_path):
    from mismatch_lab.analysis.precision import precision_table
    from mismatch_lab.store.reader import open_store

    files = write_log_dir(tmp_path / "logs", STEPS, seed=7)
    store = tmp_path / "store"
    code, out, err = cli("import", "nemo-rl", tmp_path / "logs", "--out", store, "--rollout-dtype", "bf16")
    assert code == 0, err
    want = _expected(files)
    mu, pi, step = _finite_pairs(want)
    d = pi - mu
    con = open_store(store)
    row = precision_table(con).iloc[0]
    n_all = sum(len(s["mu"]) for s in want.values())
    assert (row["n_tokens"], row["n_finite"]) == (n_all, len(d))
    for col, value in (("abs_dp_mean", np.mean(np.abs(np.exp(pi) - np.exp(mu)))), ("abs_dlogp_mean", np.mean(np.abs(d))),
                       ("kl_k3", np.mean(np.exp(d) - 1 - d))):
        assert math.isclose(row[col], value, rel_tol=1e-12), col
    # NeMo-RL's token_mult_prob_error per step: in the summary, and computable from the stored rows
    sql = """SELECT t.step, avg(exp(abs(s.logp - k.logp_rollout))) FROM scores s JOIN tokens k USING (run_id, seq_id, pos)
             JOIN sequences t USING (run_id, seq_id) WHERE NOT s.nonfinite AND s.logp IS NOT NULL
             AND k.logp_rollout IS NOT NULL GROUP BY 1 ORDER BY 1"""
    from_store = dict(con.execute(sql).fetchall())
    con.close()
    line = next(x for x in out.splitlines() if "per step (token_mult_prob_error" in x)
    for s in (1, 2, 3):
        mult = float(np.mean(np.exp(np.abs(d[step == s]))))
        k3 = float(np.mean(np.exp(d[step == s]) - 1 - d[step == s]))
        assert math.isclose(from_store[s], mult, rel_tol=1e-12)
        m = re.search(rf"\b{s}: ([0-9.e+-]+), ([0-9.e+-]+)", line)
        assert math.isclose(float(m.group(1)), mult, rel_tol=1e-5) and math.isclose(float(m.group(2)), k3, rel_tol=1e-5)


def test_the_old_form_stores_from_the_first_rollout_logprob_to_input_lengths(cli, tmp_path):
    files = write_log_dir(tmp_path / "logs", {"exp_001": [1, 2]}, seed=3, old=True)
    store = tmp_path / "store"
    code, _out, err = cli("import", "nemo-rl", tmp_path / "logs" / "exp_001", "--out", store)
    assert code == 0, err
    want, got = _expected(files, old=True), stored(store, "logs")
    assert got.keys() == want.keys()
    for key, w in want.items():
        toks = got[key]["tokens"]
        assert got[key]["seq"]["prompt_len"] == w["prompt_len"] and [t["pos"] for t in toks] == w["pos"]
        assert all(t["token_id"] is None for t in toks)
        assert all(same(t["logp_rollout"], m if math.isfinite(m) else None) for t, m in zip(toks, w["mu"]))
        assert all(same(t["logp"], p if math.isfinite(p) else None) for t, p in zip(toks, w["pi"]))


def test_unwrapped_lines_read_the_same_as_the_loggers_batch_of_one(cli, tmp_path):
    data = step_batch(5)
    log_batched_dict_as_jsonl(data, tmp_path / "a" / "train_data_step4.jsonl")
    (tmp_path / "b").mkdir()
    with open(tmp_path / "b" / "train_data_step4.jsonl", "w") as f:  # the same lines without the extra list level
        f.writelines(json.dumps({k: v[i] for k, v in data.items()}) + "\n" for i in range(len(data["rewards"])))
    for name in ("a", "b"):
        assert cli("import", "nemo-rl", tmp_path / name, "--out", tmp_path / "store")[0] == 0
    a, b = stored(tmp_path / "store", "a"), stored(tmp_path / "store", "b")
    assert a.keys() == b.keys() and len(a) == len(naive(data, 4))
    for k in a:
        assert [(t["pos"], t["token_id"], t["logp_rollout"], t["logp"]) for t in a[k]["tokens"]] == [
            (t["pos"], t["token_id"], t["logp_rollout"], t["logp"]) for t in b[k]["tokens"]]


def test_a_run_that_skipped_the_trainer_pass_is_refused(cli, tmp_path):
    data = step_batch(1, edge=False)
    data["prev_logprobs"] = [[0.0] * len(r) for r in data["prev_logprobs"]]  # force_on_policy_ratio = true
    log_batched_dict_as_jsonl(data, tmp_path / "logs" / "train_data_step1.jsonl")
    code, _, err = cli("import", "nemo-rl", tmp_path / "logs", "--out", tmp_path / "store")
    assert code == 2 and "force_on_policy_ratio" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "store").exists()


@pytest.mark.parametrize("edit, needle", [
    (lambda d: d["prev_logprobs"][2].pop(), ":3: field 'prev_logprobs' has a different length"),
    (lambda d: d["generation_logprobs"][1].__setitem__(-1, "x"), ":2: field 'generation_logprobs' must be a list of numbers"),
    (lambda d: d["input_lengths"].__setitem__(4, 10_000), ":5: field 'input_lengths' must be a whole number"),
    (lambda d: d["token_ids"][0].__setitem__(0, -5), ":1: field 'token_ids' must be a list of token ids"),
])
def test_a_bad_line_is_a_one_line_error_naming_file_and_line(cli, tmp_path, edit, needle):
    data = step_batch(2)
    edit(data)
    path = log_batched_dict_as_jsonl(data, tmp_path / "logs" / "train_data_step1.jsonl")
    code, _, err = cli("import", "nemo-rl", tmp_path / "logs", "--out", tmp_path / "store")
    assert code == 2 and f"{path}{needle}" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "store").exists()


def test_probabilities_in_generation_logprobs_are_refused(cli, tmp_path):
    data = step_batch(4, edge=False)
    data["generation_logprobs"] = [[math.exp(x) if x else 0.0 for x in r] for r in data["generation_logprobs"]]
    log_batched_dict_as_jsonl(data, tmp_path / "logs" / "train_data_step1.jsonl")
    code, _, err = cli("import", "nemo-rl", tmp_path / "logs", "--out", tmp_path / "store")
    assert code == 2 and "generation_logprobs" in err and "probabilities" in err


def test_reimporting_the_log_dir_adds_nothing(cli, tmp_path):
    write_log_dir(tmp_path / "logs", STEPS)
    store = tmp_path / "store"
    assert cli("import", "nemo-rl", tmp_path / "logs", "--out", store)[0] == 0
    n = counts(store)
    code, out, _ = cli("import", "nemo-rl", tmp_path / "logs", "--out", store)
    assert code == 0 and counts(store) == n and "3 skipped" in out


def test_import_jsonl_on_a_nemo_rl_log_dir_names_the_nemo_rl_importer(cli, tmp_path):
    write_log_dir(tmp_path / "logs", {"exp_001": [1]})
    code, _, err = cli("import", "jsonl", tmp_path / "logs" / "exp_001", "--out", tmp_path / "store")
    assert code == 2 and f"mismatch-lab import nemo-rl {tmp_path / 'logs' / 'exp_001'}" in err, err
