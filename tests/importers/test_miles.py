"""`mismatch-lab import miles`: real per-rank torch.save files written as miles' --dump-details writes
them (framework_writers/miles.py), joined over ranks, read back through the store and the analyses."""

from __future__ import annotations

import math

import numpy as np
import pytest
from framework_writers.miles import naive, rollout_samples, write_rollout
from import_fixtures import counts, same, stored

from mismatch_lab.store.schema import MAX_LOG_RATIO


def _dump(root, rollouts=(0, 1), **kw) -> dict:
    out = {}
    for rid in rollouts:
        out[rid] = rollout_samples(rid + 1)
        write_rollout(root, rid, out[rid], **kw)
    return out


def _expected(dumps: dict) -> dict:
    return {(rid, 0, i): w for rid, s in dumps.items() for i, w in enumerate(naive(s, rid))}


@pytest.mark.parametrize("layout", [{"dp": 2, "pp": 2}, {"dp": 2, "pp": 1, "tp": 2}, {"dp": 1, "pp": 2, "cp_size": 2},
                                    {"dp": 2, "pp": 1, "cp_size": 3, "tp": 2}, {"dp": 1, "pp": 1, "cp_size": 2, "qkv_format": "bshd"}],
                         ids=["dp2-pp2", "dp2-tp2", "pp2-cp2", "dp2-cp3-tp2", "cp2-bshd"])
def test_every_stored_token_matches_a_plain_pass_joined_over_the_rank_files(cli, tmp_path, layout):
    dumps = _dump(tmp_path / "dump", **layout)
    store = tmp_path / "store"
    code, out, err = cli("import", "miles", tmp_path / "dump", "--out", store, "--trust-pickle", "--trainer-dtype", "bf16")
    assert code == 0, err
    want, got = _expected(dumps), stored(store, "dump")
    assert got.keys() == want.keys()  # each sample once, though two ranks hold it
    for key, w in want.items():
        seq, toks = got[key]["seq"], got[key]["tokens"]
        assert seq["prompt_len"] == w["prompt_len"] and same(seq["reward"], w["reward"])
        assert [t["pos"] for t in toks] == w["pos"] and [t["token_id"] for t in toks] == w["token_id"]
        for t, mu, pi, adv in zip(toks, w["mu"], w["pi"], w["adv"]):
            assert same(t["logp_rollout"], mu if math.isfinite(mu) else None)
            assert same(t["logp"], pi if math.isfinite(pi) else None) and same(t["advantage"], adv)
    # the masked slot's 0.0 placeholder is not stored, its place kept
    hole = got[(0, 0, 1)]["tokens"]
    assert [t["pos"] for t in hole][:2] == [0, 2] and all(t["logp_rollout"] != 0.0 for t in hole)
    assert counts(store)["sequences"] == 12 and "scorer miles:bf16" in out and "2 read" in out


def test_the_analyses_equal_a_numpy_pass_over_the_raw_tensors(cli, tmp_path):
    from mismatch_lab.analysis.precision import precision_table
    from mismatch_lab.store.reader import open_store

    want = _expected(_dump(tmp_path / "dump", rollouts=(3, 4, 5)))
    store = tmp_path / "store"
    assert cli("import", "miles", tmp_path / "dump" / "train_data", "--out", store, "--trust-pickle")[0] == 0
    mu = np.array([x for s in want.values() for x in s["mu"]])
    pi = np.array([x for s in want.values() for x in s["pi"]])
    with np.errstate(invalid="ignore"):
        ok = np.isfinite(mu) & np.isfinite(pi) & (pi - mu < MAX_LOG_RATIO)
    d = pi[ok] - mu[ok]
    con = open_store(store)
    row = precision_table(con).iloc[0]
    con.close()
    assert (row["n_tokens"], row["n_finite"]) == (len(mu), len(d))
    for col, value in (("abs_dp_mean", np.mean(np.abs(np.exp(pi[ok]) - np.exp(mu[ok])))),
                       ("abs_dlogp_mean", np.mean(np.abs(d))), ("kl_k3", np.mean(np.exp(d) - 1 - d))):
        assert math.isclose(row[col], value, rel_tol=1e-12), col


def test_a_missing_context_parallel_slice_and_missing_trainer_logprobs_are_one_line_errors(cli, tmp_path):
    paths = write_rollout(tmp_path / "cp", 0, rollout_samples(1), dp=1, pp=1, cp_size=2)
    paths[1].unlink()  # cp rank 1's file
    code, _, err = cli("import", "miles", tmp_path / "cp", "--out", tmp_path / "store", "--trust-pickle")
    assert code == 2 and "context-parallel ranks [1]" in err and len(err.strip().splitlines()) == 1
    write_rollout(tmp_path / "nolp", 0, rollout_samples(1), pp=1)
    for p in (tmp_path / "nolp" / "train_data").glob("*.pt"):  # as with --skip-actor-forward-only
        import torch

        pack = torch.load(p, weights_only=False)
        del pack["rollout_data"]["log_probs"]
        torch.save(pack, p)
    code, _, err = cli("import", "miles", tmp_path / "nolp", "--out", tmp_path / "store", "--trust-pickle")
    assert code == 2 and "'log_probs' is missing" in err and len(err.strip().splitlines()) == 1
    code, _, err = cli("import", "miles", tmp_path / "nolp", "--out", tmp_path / "store")
    assert code == 2 and "--trust-pickle" in err
    assert not (tmp_path / "store").exists()


def test_import_slime_on_a_miles_dump_names_the_miles_importer(cli, tmp_path):
    write_rollout(tmp_path / "dump", 0, rollout_samples(1), pp=1)
    code, _, err = cli("import", "slime", tmp_path / "dump", "--out", tmp_path / "store", "--trust-pickle")
    assert code == 2 and f"mismatch-lab import miles {tmp_path / 'dump'} --out STORE" in err, err


def test_without_torch_the_import_names_what_to_install_in_one_line(tmp_path):
    import subprocess
    from pathlib import Path

    light = Path(__file__).resolve().parents[2] / ".venv-light" / "bin" / "mismatch-lab"
    assert light.exists(), "run `bash scripts/setup.sh`, which builds the light install (no torch) in .venv-light"
    write_rollout(tmp_path / "dump", 0, rollout_samples(1))
    done = subprocess.run([str(light), "import", "miles", str(tmp_path / "dump"), "--out", str(tmp_path / "store"),
                           "--trust-pickle"], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 2 and "needs torch" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "store").exists()
