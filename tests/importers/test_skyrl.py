"""`mismatch-lab import skyrl`: real pickles written as SkyRL's TrainingInputBatch.save writes them
(framework_writers/skyrl.py), read back through the store and the analyses."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
from framework_writers.skyrl import naive, save, step_fields
from import_fixtures import counts, same, stored

from mismatch_lab.store.schema import MAX_LOG_RATIO


def _dump(root, steps=(1, 2, 3), legacy: bool = False, **kw) -> dict:
    """export_path/dumped_data/global_step_<N>_training_input.pkl; returns step -> fields."""
    out = {}
    for s in steps:
        fields, meta = step_fields(s, **kw)
        save(fields, meta, root / "dumped_data" / f"global_step_{s}_training_input.pkl", legacy=legacy)
        out[s] = fields
    return out


def _expected(dumps: dict) -> dict:
    return {(s, 0, i): w for s, f in dumps.items() for i, w in enumerate(naive(f, s))}


@pytest.mark.parametrize("legacy", [False, True], ids=["reduce", "legacy-dict-items"])
def test_every_stored_token_matches_a_plain_pass_over_the_pickled_tensors(cli, tmp_path, legacy):
    dumps = _dump(tmp_path / "export", legacy=legacy)
    assert "skyrl" not in sys.modules  # the importer does not need SkyRL's classes
    store = tmp_path / "store"
    code, out, err = cli("import", "skyrl", tmp_path / "export", "--out", store, "--trust-pickle",
                         "--trainer-dtype", "fp32")
    assert code == 0, err
    want, got = _expected(dumps), stored(store, "export")
    assert got.keys() == want.keys()
    for key, w in want.items():
        seq, toks = got[key]["seq"], got[key]["tokens"]
        assert seq["prompt_len"] == w["prompt_len"] and seq["response_len"] == len(w["pos"])
        assert [t["pos"] for t in toks] == w["pos"] and [t["token_id"] for t in toks] == w["token_id"]
        for t, mu, pi, adv in zip(toks, w["mu"], w["pi"], w["adv"]):
            assert same(t["logp_rollout"], mu if math.isfinite(mu) else None)
            assert same(t["logp"], pi if math.isfinite(pi) else None) and same(t["advantage"], adv)
    # pad_training_input_batch's rows (loss_mask 0) are not stored; the tool-output hole keeps its place
    assert counts(store)["sequences"] == sum(len(f["loss_mask"]) - 2 for f in dumps.values())
    assert got[(1, 0, 1)]["tokens"][1]["pos"] == 2
    assert "scorer skyrl:fp32" in out


def test_the_analyses_equal_a_numpy_pass_over_the_raw_tensors(cli, tmp_path):
    from mismatch_lab.analysis.precision import precision_table
    from mismatch_lab.store.reader import open_store

    want = _expected(_dump(tmp_path / "export", steps=(4, 5)))
    store = tmp_path / "store"
    assert cli("import", "skyrl", tmp_path / "export" / "dumped_data", "--out", store, "--trust-pickle")[0] == 0
    mu = np.array([x for s in want.values() for x in s["mu"]])
    pi = np.array([x for s in want.values() for x in s["pi"]])
    with np.errstate(invalid="ignore"):
        ok = np.isfinite(mu) & np.isfinite(pi) & (pi - mu < MAX_LOG_RATIO)
    mu, pi = mu[ok], pi[ok]
    d = pi - mu
    con = open_store(store)
    row = precision_table(con).iloc[0]
    con.close()
    assert (row["n_tokens"], row["n_finite"]) == (sum(len(s["mu"]) for s in want.values()), len(d))
    for col, value in (("abs_dp_mean", np.mean(np.abs(np.exp(pi) - np.exp(mu)))), ("abs_dlogp_mean", np.mean(np.abs(d))),
                       ("kl_k3", np.mean(np.exp(d) - 1 - d))):
        assert math.isclose(row[col], value, rel_tol=1e-12), col


def test_bfloat16_trainer_logprobs_are_read_through_skyrls_torch_fallback(cli, tmp_path):
    dumps = _dump(tmp_path / "export", steps=(1,), bf16_pi=True)
    store = tmp_path / "store"
    assert cli("import", "skyrl", tmp_path / "export", "--out", store, "--trust-pickle")[0] == 0
    got = stored(store, "export")
    for key, w in _expected(dumps).items():  # naive reads the bf16 values as float64: exactly representable
        assert all(same(t["logp"], p if math.isfinite(p) else None) for t, p in zip(got[key]["tokens"], w["pi"]))


def test_needs_trust_pickle_and_names_a_missing_rollout_logprob_field(cli, tmp_path):
    fields, meta = step_fields(1)
    fields["rollout_logprobs"] = None
    save(fields, meta, tmp_path / "export" / "dumped_data" / "global_step_1_training_input.pkl")
    code, _, err = cli("import", "skyrl", tmp_path / "export", "--out", tmp_path / "store")
    assert code == 2 and "--trust-pickle" in err
    code, _, err = cli("import", "skyrl", tmp_path / "export", "--out", tmp_path / "store", "--trust-pickle")
    assert code == 2 and "'rollout_logprobs' is missing" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "store").exists()


def test_a_pickle_that_is_no_training_batch_is_a_one_line_error(cli, tmp_path):
    import pickle

    path = tmp_path / "export" / "dumped_data" / "global_step_1_training_input.pkl"
    path.parent.mkdir(parents=True)
    path.write_bytes(pickle.dumps({"sequences": [1, 2]}))
    code, _, err = cli("import", "skyrl", tmp_path / "export", "--out", tmp_path / "store", "--trust-pickle")
    assert code == 2 and "not a SkyRL TrainingInputBatch" in err


def test_without_torch_the_import_names_what_to_install_in_one_line(tmp_path):
    import subprocess
    from pathlib import Path

    light = Path(__file__).resolve().parents[2] / ".venv-light" / "bin" / "mismatch-lab"
    assert light.exists(), "run `bash scripts/setup.sh`, which builds the light install (no torch) in .venv-light"
    fields, meta = step_fields(1)
    save(fields, meta, tmp_path / "export" / "dumped_data" / "global_step_1_training_input.pkl")
    done = subprocess.run([str(light), "import", "skyrl", str(tmp_path / "export"), "--out", str(tmp_path / "store"),
                           "--trust-pickle"], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 2 and "needs torch" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "store").exists()
