"""`mismatch-lab import slime`: real torch.save files in slime's format_version 2 layout."""

from __future__ import annotations

import math

import pytest
import torch
from import_fixtures import (
    counts,
    naive_slime,
    same,
    slime_payload,
    store_files,
    stored,
)


@pytest.fixture
def dump(tmp_path):
    d = tmp_path / "dump" / "train_data"  # --dump-details DIR writes DIR/train_data/{rollout_id}.pt
    d.mkdir(parents=True)
    payloads = [slime_payload(0, seed=1), slime_payload(1, seed=2, topk=3)]
    for p in payloads:
        torch.save(p, d / f"{p['rollout_id']}.pt")
    return tmp_path / "dump", payloads


def _topk(store, run_id):
    from mismatch_lab.store.reader import open_store

    con = open_store(store)
    rows = con.execute("SELECT seq_id, pos, topk_ids_rollout, topk_logps_rollout FROM tokens WHERE run_id = ? "
                       "ORDER BY seq_id, pos", [run_id]).fetchall()
    return {(r[0], r[1]): (r[2], r[3]) for r in rows}


def test_every_token_lands_on_its_seq_and_pos(cli, dump, tmp_path):
    path, payloads = dump
    store = tmp_path / "store"
    code, out, err = cli("import", "slime", path, "--out", store, "--trust-pickle", "--rollout-engine", "sglang",
                         "--trainer-dtype", "bf16")
    assert code == 0, err
    got = stored(store, "dump")
    want = {k: v for p in payloads for k, v in naive_slime(p).items()}
    assert got.keys() == want.keys()
    topk = _topk(store, "dump")
    for key, w in want.items():
        seq, toks = got[key]["seq"], got[key]["tokens"]
        assert seq["step"] == key[0] and seq["response_len"] == len(toks) == len(w["pos"])
        assert seq["prompt_len"] == w["prompt_len"] and same(seq["reward"], w["reward"])
        for i, t in enumerate(toks):
            assert (t["pos"], t["token_id"]) == (w["pos"][i], w["token_id"][i])
            assert same(t["logp_rollout"], w["mu"][i]) and same(t["logp"], w["pi"][i])
            assert same(t.get("advantage"), w["adv"][i]) and same(t["entropy"], w["entropy"][i])
            ids, lps = topk[(seq["seq_id"], t["pos"])]
            if w["topk"] is None:
                assert ids is None and lps is None
            else:
                assert ids == w["topk"][i][0] and all(math.isclose(a, b) for a, b in zip(lps, w["topk"][i][1]))
    # the placeholder sample: masked slots (rollout log-prob 0.0) are not stored, their places kept
    ph = got[(0, 0, 1)]["tokens"]
    assert [t["pos"] for t in ph][:2] == [0, 3] and all(t["logp_rollout"] != 0.0 for t in ph)
    n_mask = sum(int(s["loss_masks"].sum()) for p in payloads for s in p["samples"])
    assert counts(store)["tokens"] == n_mask
    assert "scorer slime:bf16" in out and "sglang" in out


def test_needs_trust_pickle(cli, dump, tmp_path):
    path, _ = dump
    code, _, err = cli("import", "slime", path, "--out", tmp_path / "store")
    assert code == 2 and "--trust-pickle" in err and "pickle" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "store").exists()


def test_reimport_adds_nothing(cli, dump, tmp_path):
    path, _ = dump
    store = tmp_path / "store"
    assert cli("import", "slime", path / "train_data", "--out", store, "--trust-pickle")[0] == 0
    n = counts(store)
    code, out, _ = cli("import", "slime", path / "train_data", "--out", store, "--trust-pickle")
    assert code == 0 and "0 read, 2 skipped" in out and counts(store) == n


def test_misaligned_and_foreign_files(cli, tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    p = slime_payload(3, seed=4)
    p["samples"][2]["log_probs"] = p["samples"][2]["log_probs"][:-1]
    torch.save(p, d / "3.pt")
    code, _, err = cli("import", "slime", d / "3.pt", "--out", tmp_path / "store", "--trust-pickle")
    assert code == 2 and "sample 2" in err and "'log_probs'" in err and "misaligned" in err
    assert store_files(tmp_path / "store") == []

    torch.save({"rollout_id": 0, "samples": [{"tokens": [1, 2]}]}, d / "3.pt")  # a rollout dump
    code, _, err = cli("import", "slime", d / "3.pt", "--out", tmp_path / "store", "--trust-pickle")
    assert code == 2 and "rollout dump" in err
    p = slime_payload(3, seed=4)
    del p["samples"][0]["log_probs"]
    torch.save(p, d / "3.pt")
    code, _, err = cli("import", "slime", d, "--out", tmp_path / "store", "--trust-pickle")
    assert code == 2 and "'log_probs' is missing" in err
    p = slime_payload(3, seed=4)
    p["raw_reward"][int(p["samples"][1]["rollout_position"])] = "x"  # rewards are read from raw_reward
    torch.save(p, d / "3.pt")
    code, _, err = cli("import", "slime", d, "--out", tmp_path / "store", "--trust-pickle")
    assert code == 2 and "sample 1: field 'rewards' must be a number" in err
    (d / "3.pt").write_bytes(b"not a pickle")
    code, _, err = cli("import", "slime", d, "--out", tmp_path / "store", "--trust-pickle")
    assert code == 2 and "torch.load" in err
    assert store_files(tmp_path / "store") == []


def test_nonfinite_and_bf16(cli, tmp_path):
    p = slime_payload(7, rank=3, seed=5, placeholder=False)
    s = p["samples"][0]
    s["log_probs"][1] = float("nan")
    s["rollout_log_probs"][2] = float("-inf")
    for s in p["samples"]:
        s["log_probs"] = s["log_probs"].to(torch.bfloat16)
    torch.save(p, tmp_path / "7.pt")
    store = tmp_path / "store"
    code, out, _ = cli("import", "slime", tmp_path / "7.pt", "--out", store, "--trust-pickle")
    assert code == 0 and "non-finite  2 tokens" in out
    toks = stored(store, tmp_path.name)[(7, 3, 0)]["tokens"]
    assert toks[1]["logp"] is None and toks[2]["logp_rollout"] is None
    assert [t["nonfinite"] for t in toks][:4] == [False, True, True, False]
    want = naive_slime(p)[(7, 3, 0)]
    assert same(toks[0]["logp"], want["pi"][0])  # bf16 values read exactly


@pytest.mark.parametrize(("edit", "needle"), [
    (lambda p: p.__setitem__("rollout_id", "3"), "field 'rollout_id' must be a whole number, got str '3'"),
    (lambda p: p.__setitem__("rollout_id", None), "field 'rollout_id' must be a whole number, got NoneType"),
    (lambda p: p.__setitem__("rollout_id", 1.7), "field 'rollout_id' must be a whole number, got float 1.7"),
    (lambda p: p["samples"][1].__setitem__("response_lengths", "5"), "sample 1: field 'response_lengths' must be a whole number"),
    (lambda p: p["samples"][2].__setitem__("tokens", "1 2 3"), "sample 2: field 'tokens' must hold token ids"),
    (lambda p: p["samples"][0]["tokens"].__setitem__(-1, 2**31 + 5), "sample 0: field 'tokens' must hold token ids (integers in [0, 2^31)); got 2147483653"),
    (lambda p: p["samples"][3].__setitem__("log_probs", ["x"] * 9), "sample 3: field 'log_probs' must be a list or tensor of numbers"),
])
def test_mistyped_fields_are_one_line_errors(cli, tmp_path, edit, needle):
    """Scalars and ids of a dump are checked, not converted blindly: no traceback, no wrapped or truncated id."""
    p = slime_payload(3, seed=4)
    edit(p)
    torch.save(p, tmp_path / "3.pt")
    code, _, err = cli("import", "slime", tmp_path / "3.pt", "--out", tmp_path / "store", "--trust-pickle")
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    assert store_files(tmp_path / "store") == []


def test_a_folder_skips_files_that_are_no_train_dump_and_names_them(cli, tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    torch.save(slime_payload(3, seed=4), d / "train_3.pt")
    torch.save({"rollout_id": 3, "samples": [{"tokens": [1, 2]}]}, d / "rollout_3.pt")  # beside it, same folder
    torch.save({"model": {"w": torch.zeros(2)}}, d / "ckpt.pt")
    code, out, err = cli("import", "slime", d, "--out", tmp_path / "store", "--trust-pickle")
    assert code == 0, err
    assert "1 read" in out and "rollout_3.pt skipped: a rollout dump" in out and "ckpt.pt skipped: not a slime" in out
    assert counts(tmp_path / "store")["sequences"] == len(slime_payload(3, seed=4)["samples"])
    p = slime_payload(4, seed=4)
    p["format_version"] = 3  # a train dump of another version is never skipped silently
    torch.save(p, d / "train_4.pt")
    code, _, err = cli("import", "slime", d, "--out", tmp_path / "other", "--trust-pickle")
    assert code == 2 and "train_4.pt: not a slime train-data dump of format_version 2 (format_version 3)" in err


def test_a_folder_without_any_train_dump_is_an_error_and_leaves_no_store(cli, tmp_path):
    d = tmp_path / "rollout_data"
    d.mkdir()
    torch.save({"rollout_id": 3, "samples": [{"tokens": [1, 2]}]}, d / "3.pt")
    code, _, err = cli("import", "slime", d, "--out", tmp_path / "store", "--trust-pickle")
    assert code == 2 and "no slime file to import" in err and "3.pt skipped: a rollout dump" in err
    assert not (tmp_path / "store").exists()
