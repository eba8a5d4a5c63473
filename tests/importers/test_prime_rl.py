"""`mismatch-lab import prime-rl`: fixture exports written as prime-rl's TokenExporter writes them
(conftest), read back through the real store reader (DuckDB over the shards)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from import_fixtures import (
    counts,
    naive_prime,
    prime_line,
    prime_sample,
    same,
    stored,
    write_prime_export,
)


@pytest.fixture
def export(tmp_path) -> Path:
    write_prime_export(tmp_path / "outputs")
    return tmp_path / "outputs"


def _files(export: Path, steps=(0,)) -> list[Path]:
    return sorted(p for s in steps for p in (export / "token_exports" / f"step_{s}").glob("rank_*.jsonl"))


def test_every_token_lands_on_its_seq_and_pos(cli, export, tmp_path):
    store = tmp_path / "store"
    code, out, err = cli("import", "prime-rl", export, "--out", store, "--rollout-engine", "vllm",
                         "--rollout-dtype", "bf16", "--trainer-dtype", "bf16")
    assert code == 0, err
    want = naive_prime(_files(export))
    got = stored(store, "outputs")
    assert set(got) == set(want)  # (step, rank, index): two ranks, packed samples split, file order
    for key, w in want.items():
        seq, toks = got[key]["seq"], got[key]["tokens"]
        assert seq["step"] == key[0] and seq["response_len"] == len(w["pos"]) == len(toks)
        assert seq["env_name"] == w["env_name"]
        assert seq["prompt_len"] == w["prompt_len"]
        assert same(seq["reward"], w["reward"])
        advs = [a for a in w["adv"]]
        assert math.isclose(seq["advantage"], sum(advs) / len(advs))
        for t, pos, tid, mu, pi, adv, ent in zip(toks, w["pos"], w["token_id"], w["mu"], w["pi"], w["adv"], w["entropy"]):
            assert (t["pos"], t["token_id"]) == (pos, tid)
            assert same(t["logp_rollout"], mu) and same(t["logp"], pi)
            assert same(t.get("advantage"), adv) and same(t["entropy"], ent)
            assert t["nonfinite"] == (mu is None or pi is None)
            assert t["token_text"] is None and t["category"] is None
    # token count = the loss-mask sum over the stable step (less the one ce-only position)
    lines = [json.loads(x) for f in _files(export) for x in f.read_text().splitlines()]
    assert sum(len(w["pos"]) for w in want.values()) == sum(sum(r["loss_mask"]) for r in lines) - 1
    assert "35 response (loss-mask) tokens" in out and "6" in out
    assert "non-finite  2 tokens" in out
    assert f"mismatch-lab analyze --db {store}" in out and f"mismatch-lab app --study {store}" in out


def test_run_row_and_scorer_label(cli, export, tmp_path):
    from mismatch_lab.store.reader import open_store

    store = tmp_path / "store"
    assert cli("import", "prime-rl", export, "--out", store, "--rollout-engine", "sglang", "--trainer-dtype", "fp32")[0] == 0
    con = open_store(store)
    kind, engine, dtype, config = con.execute("SELECT kind, engine, engine_dtype, config FROM runs").fetchone()
    assert (kind, engine, dtype) == ("import", "sglang", None)
    assert json.loads(config)["scorer"] == "prime-rl:fp32"
    assert con.execute("SELECT DISTINCT scorer FROM scores").fetchall() == [("prime-rl:fp32",)]
    store2 = tmp_path / "store2"
    assert cli("import", "prime-rl", export, "--out", store2)[0] == 0
    assert open_store(store2).execute("SELECT DISTINCT scorer, engine FROM scores, runs").fetchall() == [
        ("prime-rl:trainer", "unknown")]


def test_unstable_steps_and_reimport(cli, export, tmp_path):
    store = tmp_path / "store"
    code, out, _ = cli("import", "prime-rl", export, "--out", store)
    assert code == 0 and "without a STABLE marker skipped (step_1)" in out
    first = counts(store)
    assert stored(store, "outputs").keys() == naive_prime(_files(export)).keys()

    code, out, _ = cli("import", "prime-rl", export, "--out", store)  # the same files again: nothing new
    assert code == 0 and "0 read, 2 skipped" in out and "nothing new" in out
    assert counts(store) == first

    code, out, _ = cli("import", "prime-rl", export, "--out", store, "--include-unstable")
    assert code == 0 and "2 read, 2 skipped" in out  # step 0 known, step 1 new
    want = naive_prime(_files(export, (0, 1)))
    assert stored(store, "outputs").keys() == want.keys()
    assert counts(store)["tokens"] == sum(len(w["pos"]) for w in want.values())
    again = counts(store)
    assert cli("import", "prime-rl", export, "--out", store, "--include-unstable")[0] == 0
    assert counts(store) == again


def test_path_forms_and_run_names(cli, tmp_path):
    exports = write_prime_export(tmp_path / "multi", run_id="run_alpha")  # multi-run layout
    store = tmp_path / "store"
    assert cli("import", "prime-rl", tmp_path / "multi", "--out", store)[0] == 0
    from mismatch_lab.store.reader import open_store

    assert open_store(store).execute("SELECT run_id FROM runs").fetchall() == [("run_alpha",)]
    # the step folder and a single rank file are accepted too (into other runs)
    assert cli("import", "prime-rl", exports / "step_0", "--out", store, "--run-name", "by-step")[0] == 0
    assert cli("import", "prime-rl", exports / "step_0" / "rank_1.jsonl", "--out", store, "--run-name", "one")[0] == 0
    n = {r: c for r, c in open_store(store).execute("SELECT run_id, count(*) FROM tokens GROUP BY run_id").fetchall()}
    assert n["by-step"] == n["run_alpha"] and 0 < n["one"] < n["by-step"]
    # two runs under one output dir: the error names them
    write_prime_export(tmp_path / "multi", run_id="run_beta")
    code, _, err = cli("import", "prime-rl", tmp_path / "multi", "--out", store)
    assert code == 2 and "run_alpha, run_beta" in err
    code, _, err = cli("import", "prime-rl", tmp_path, "--out", tmp_path / "s3")
    assert code == 2 and "no prime-rl token exports" in err


def _assert_untouched(store: Path, before: list[str]) -> None:
    """No shard, temporary file or folder of the failed import is left."""
    assert sorted(str(p.relative_to(store)) for p in store.rglob("*")) == before


def test_malformed_line_names_file_and_line_and_commits_nothing(cli, export, tmp_path):
    store = tmp_path / "store"
    bad = export / "token_exports" / "step_0" / "rank_1.jsonl"
    lines = bad.read_text().splitlines()
    bad.write_text(lines[0] + "\n" + lines[1][:-40] + "\n")  # line 2 cut short
    code, _, err = cli("import", "prime-rl", export, "--out", store)
    assert code == 2 and f"{bad}:2:" in err and "not valid JSON" in err
    assert not store.exists()  # the store this import would have created is not left behind

    # the same into a store that already holds another run: that run is left as it was
    good = tmp_path / "good"
    write_prime_export(good, seed=3)
    assert cli("import", "prime-rl", good, "--out", store, "--run-name", "kept")[0] == 0
    before, n = sorted(str(p.relative_to(store)) for p in store.rglob("*")), counts(store)
    assert cli("import", "prime-rl", export, "--out", store)[0] == 2
    _assert_untouched(store, before)
    assert counts(store) == n


@pytest.mark.parametrize("field", ["trainer_logprobs", "loss_mask", "entropy"])
def test_misaligned_field_is_named(cli, export, tmp_path, field):
    f = export / "token_exports" / "step_0" / "rank_0.jsonl"
    lines = f.read_text().splitlines()
    rec = json.loads(lines[1])
    rec[field] = rec[field][:-1]
    lines[1] = json.dumps(rec, separators=(",", ":"))
    f.write_text("\n".join(lines) + "\n")
    code, _, err = cli("import", "prime-rl", export, "--out", tmp_path / "store")
    assert code == 2 and f"{f}:2:" in err and repr(field) in err and "misaligned" in err
    assert not (tmp_path / "store").exists()


def test_other_bad_inputs(cli, export, tmp_path):
    f = export / "token_exports" / "step_0" / "rank_0.jsonl"
    good = f.read_text()
    rec = json.loads(good.splitlines()[0])
    for change, needle in ((lambda r: r.update(schema_version=2), "schema_version"),
                           (lambda r: r.update(export_step=5), "step_0"),
                           (lambda r: r.pop("trainer_logprobs"), "'trainer_logprobs' is missing"),
                           (lambda r: r["token_ids"].__setitem__(0, 1.5), "token_ids"),
                           (lambda r: r["token_ids"].__setitem__(0, 2**31 + 5),
                            "field 'token_ids' must be a list of token ids (integers in [0, 2^31))"),
                           (lambda r: r["token_ids"].__setitem__(1, -3), "field 'token_ids' must be a list of token ids")):
        r = json.loads(json.dumps(rec))
        change(r)
        f.write_text(good.splitlines()[1] + "\n" + json.dumps(r) + "\n")
        code, _, err = cli("import", "prime-rl", export, "--out", tmp_path / "store")
        assert code == 2 and f"{f}:2:" in err and needle in err, err
    f.write_text(good.splitlines()[0] + good.splitlines()[1] + "\n")  # two objects on one line
    code, _, err = cli("import", "prime-rl", export, "--out", tmp_path / "store")
    assert code == 2 and f"{f}:1:" in err
    assert not (tmp_path / "store").exists()


def test_nonfinite_values_are_null_and_counted(cli, tmp_path):
    import numpy as np

    rng = np.random.default_rng(1)
    d = tmp_path / "o" / "token_exports" / "step_4"
    d.mkdir(parents=True)
    (d / "STABLE").touch()
    s = prime_sample(rng, 2, 5, reward=1.0, adv=1.0, nan_mu=(0, 3), nan_pi=(3, 4))
    s["entropy"][2 + 1] = float("nan")
    (d / "rank_0.jsonl").write_text(prime_line([s], step=4, rank=0) + "\n")
    store = tmp_path / "store"
    code, out, _ = cli("import", "prime-rl", tmp_path / "o", "--out", store)
    assert code == 0 and "non-finite  3 tokens" in out
    toks = stored(store, "o")[(4, 0, 0)]["tokens"]
    assert [t["logp_rollout"] is None for t in toks] == [True, False, False, True, False]
    assert [t["logp"] is None for t in toks] == [False, False, False, True, True]
    assert [t["nonfinite"] for t in toks] == [True, False, False, True, True]
    assert toks[1]["entropy"] is None and toks[0]["entropy"] is not None
    assert not any(t["logp_rollout"] == 0.0 for t in toks)  # never zeroed
    # the summary's mean |log pi - log mu| is over the 2 finite tokens only
    want = np.mean([abs(t["logp"] - t["logp_rollout"]) for t in toks if not t["nonfinite"]])
    assert f"{want:.6g} over 2 finite tokens" in out


def test_ce_only_positions_are_not_stored(cli, tmp_path):
    import numpy as np

    rng = np.random.default_rng(2)
    d = tmp_path / "o" / "token_exports" / "step_0"
    d.mkdir(parents=True)
    (d / "STABLE").touch()
    s = prime_sample(rng, 3, 6, reward=1.0, adv=1.0, ce_only=(0, 4))
    (d / "rank_0.jsonl").write_text(prime_line([s], step=0, rank=0) + "\n")
    assert cli("import", "prime-rl", tmp_path / "o", "--out", tmp_path / "store")[0] == 0
    toks = stored(tmp_path / "store", "o")[(0, 0, 0)]["tokens"]
    assert [t["pos"] for t in toks] == [0, 1, 2, 4]  # counted from the first rl token; the hole keeps its place
    assert [t["token_id"] for t in toks] == [s["token_ids"][3 + i] for i in (1, 2, 3, 5)]


def test_tokenizer_fills_text_and_category(cli, export, tmp_path, embedded_model):
    from transformers import AutoTokenizer

    from mismatch_lab.categories import CATEGORIES, TokenTexts

    store = tmp_path / "store"
    assert cli("import", "prime-rl", export, "--out", store, "--tokenizer", embedded_model)[0] == 0
    texts = TokenTexts(AutoTokenizer.from_pretrained(embedded_model))
    toks = [t for v in stored(store, "outputs").values() for t in v["tokens"]]
    assert toks and all(t["category"] in CATEGORIES for t in toks)
    for t in toks:
        assert (t["token_text"], t["category"]) == texts(t["token_id"])
    code, _, err = cli("import", "prime-rl", export, "--out", tmp_path / "s2", "--tokenizer", tmp_path / "nope")
    assert code == 2 and "--tokenizer" in err


def test_analyze_runs_on_an_imported_store(cli, export, tmp_path):
    store = tmp_path / "store"
    assert cli("import", "prime-rl", export, "--out", store, "--rollout-engine", "vllm", "--trainer-dtype", "bf16")[0] == 0
    code, out, err = cli("analyze", "--db", store)
    assert code == 0, err
    assert "prime-rl:bf16" in out


def test_large_file_in_parts(cli, tmp_path, monkeypatch):
    """A file of more tokens than a shard holds is written in parts (import-<digest>, then -p0001 ...);
    sequence ids continue across the parts and a re-import still adds nothing."""
    import numpy as np

    from mismatch_lab.importers import base, jsonlines

    monkeypatch.setattr(jsonlines, "DUCKDB_BATCH_ROWS", 2)
    monkeypatch.setattr(base, "SHARD_TOKENS", 30)
    rng = np.random.default_rng(5)
    d = tmp_path / "o" / "token_exports" / "step_2"
    d.mkdir(parents=True)
    (d / "STABLE").touch()
    lines = [prime_line([prime_sample(rng, 3, 20 if i != 2 else 4000, reward=1.0, adv=0.1)], step=2, rank=0, idx=i)
             for i in range(6)]
    f = d / "rank_0.jsonl"
    f.write_text("\n".join(lines) + "\n")
    store = tmp_path / "store"
    assert cli("import", "prime-rl", tmp_path / "o", "--out", store)[0] == 0
    names = sorted(p.stem for p in (store / "sequences" / "o" / "step-00000002").glob("*.parquet"))
    assert len(names) == 3 and names[0].startswith("import-") and names[1:] == [names[0] + "-p0001", names[0] + "-p0002"]
    want = naive_prime([f])
    got = stored(store, "o")
    assert got.keys() == want.keys()
    assert [len(got[k]["tokens"]) for k in sorted(got)] == [len(want[k]["pos"]) for k in sorted(want)]
    n = counts(store)
    assert cli("import", "prime-rl", tmp_path / "o", "--out", store)[0] == 0
    assert counts(store) == n
    assert pq.read_table(store / "runs" / "o" / "rank-00000.parquet").num_rows == 1


def test_recorded_and_imported_runs_share_a_store(cli, export, tmp_path):
    """A Recorder run and an imported run in one store: the reader unions their shards, analyze runs."""
    import numpy as np

    from mismatch_lab.record import Recorder
    from mismatch_lab.store.reader import open_store

    store = tmp_path / "store"
    rng = np.random.default_rng(0)
    with Recorder(store, "recorded", framework="trl", rollout_engine="vllm", trainer_dtype="bf16") as rec:
        mu = -rng.exponential(0.5, (3, 5))
        rec.log_step(0, rng.integers(0, 100, (3, 5)), np.ones((3, 5), bool), mu, np.minimum(mu + 0.01, 0.0), advantages=np.ones(3))
    assert cli("import", "prime-rl", export, "--out", store, "--rollout-engine", "vllm", "--trainer-dtype", "bf16")[0] == 0
    con = open_store(store)
    assert dict(con.execute("SELECT run_id, count(*) FROM tokens GROUP BY run_id").fetchall()) == {
        "recorded": 15, "outputs": 35}
    assert sorted(con.execute("SELECT run_id, kind FROM runs").fetchall()) == [("outputs", "import"), ("recorded", "record")]
    assert dict(con.execute("SELECT scorer, count(*) FROM scores GROUP BY scorer").fetchall()) == {
        "trl:bf16": 15, "prime-rl:bf16": 35}
    code, _, err = cli("analyze", "--db", store)
    assert code == 0, err
