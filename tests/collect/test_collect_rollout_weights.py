"""`collect --rollout-weights`: the rollout engine runs rounded weights, the scorers the checkpoint's, and the
run is its own rollout in the precision table (real vLLM CPU engine, real HF scorer, the tiny model)."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import pytest

from mismatch_lab.cli import main


def _prompts(path: Path, n: int = 3) -> Path:
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"What is {i} + {i + 1}?"}) + "\n" for i in range(n)))
    return path


def _collect(model, prompts, db, *extra, scorers="fp32") -> None:
    assert main(["collect", "--model", str(model), "--prompts", str(prompts), "--db", str(db), "--samples", "2",
                 "--max-tokens", "6", "--rollout-dtypes", "fp32", "--scorer-dtypes", scorers, "--top-k", "3",
                 "--max-model-len", "128", "--no-progress", "--memory-plan", "off", *extra]) == 0


def _tokens(db) -> dict:
    con = duckdb.connect(str(db), read_only=True)
    rows = con.execute("SELECT seq_id, pos, token_id, logp_rollout FROM tokens ORDER BY seq_id, pos").fetchall()
    con.close()
    return {(s, p): (t, lp) for s, p, t, lp in rows}


def test_fp8_rollout_weights_run_the_rounded_weights_and_stay_apart_in_the_precision_table(tmp_path, tiny_model):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mismatch_lab.analysis.precision import precision_table
    from mismatch_lab.engines.weights import round_state

    prompts = _prompts(tmp_path / "p.jsonl")
    db = tmp_path / "w.duckdb"
    _collect(tiny_model, prompts, db)
    _collect(tiny_model, prompts, db, "--rollout-weights", "fp8", scorers="fp32,vllm:fp32")

    # a checkpoint holding the rounded weights, loaded by a fresh engine the ordinary way
    m = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    m.load_state_dict(round_state(m.state_dict(), "fp8"))
    rounded = tmp_path / "tiny-fp8"
    m.save_pretrained(rounded, safe_serialization=True)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(rounded)
    db_rounded = tmp_path / "r.duckdb"
    _collect(rounded, prompts, db_rounded)

    con = duckdb.connect(str(db), read_only=True)
    runs = {dt: (rid, json.loads(cfg)) for rid, dt, cfg in con.execute("SELECT run_id, engine_dtype, config FROM runs").fetchall()}
    assert set(runs) == {"fp32", "fp32-wfp8"}
    assert runs["fp32"][1]["rollout_weights"] == "none" and runs["fp32-wfp8"][1]["rollout_weights"] == "fp8"
    assert "-fp32-wfp8-" in runs["fp32-wfp8"][0] and runs["fp32"][0] != runs["fp32-wfp8"][0]
    table = precision_table(con, scorer="hf:fp32").set_index("rollout")["abs_dlogp_mean"]
    # the vLLM prefill scorer of the same dtype is an engine of its own, on the checkpoint's weights
    gap = con.execute("SELECT max(abs(v.logp - h.logp)) FROM scores v JOIN scores h USING (run_id, seq_id, pos) "
                      "WHERE v.scorer = 'vllm:fp32' AND h.scorer = 'hf:fp32'").fetchone()[0]
    con.close()
    assert gap < 1e-3, gap
    # two rows, not one merged 'vllm:fp32': the plain rollout agrees with the fp32 scorer on the checkpoint's
    # weights; the fp8-weights rollout is measured against those same unrounded weights
    assert sorted(table.index) == ["vllm:fp32", "vllm:fp32-wfp8"]
    assert table["vllm:fp32"] < 1e-4 and table["vllm:fp32-wfp8"] > 1e-3, table

    con = duckdb.connect(str(db), read_only=True)
    rows = con.execute("SELECT run_id, seq_id, pos, token_id, logp_rollout FROM tokens").fetchall()
    con.close()
    fp8_id = runs["fp32-wfp8"][0]
    pushed = {(s, p): (t, lp) for r, s, p, t, lp in rows if r == fp8_id}
    unrounded = {(s, p): (t, lp) for r, s, p, t, lp in rows if r != fp8_id}
    loaded = _tokens(db_rounded)
    # the engine really ran the rounded weights: bit for bit what an engine loaded from them samples and says
    assert pushed == loaded and len(pushed) > 10
    # and not the checkpoint's: μ of the first token (same seed) moves
    firsts = [abs(pushed[k][1] - unrounded[k][1]) for k in pushed if k[1] == 0]
    assert max(firsts) > 1e-3


def test_an_unknown_rollout_weights_kind_is_refused(tmp_path, tiny_model, capsys):
    prompts = _prompts(tmp_path / "p.jsonl")
    with pytest.raises(SystemExit):
        main(["collect", "--model", tiny_model, "--prompts", str(prompts), "--db", str(tmp_path / "x.duckdb"),
              "--rollout-weights", "int4"])
    assert not (tmp_path / "x.duckdb").exists()
