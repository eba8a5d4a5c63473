"""`mismatch-lab layers` end to end through `mismatch_lab.cli.main` on the tiny model, and its user errors."""

from __future__ import annotations

import json

import pytest

from mismatch_lab.cli import main

ROW_KEYS = {"layer", "kind", "index", "module", "rel_err", "growth"}


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "a", "prompt": "What is 7 + 7?"}\n{"id": "b", "prompt": "Name a colour."}\n')
    return path


def test_layers_prints_the_table_and_writes_rows_in_input_to_output_order_and_a_figure(
        tiny_model, prompts_file, tmp_path, capsys):
    out, fig = tmp_path / "layers.json", tmp_path / "layers.png"
    code = main(["layers", "--model", tiny_model, "--prompts", str(prompts_file), "--dtype", "bf16",
                 "--continuation", "2", "--json", str(out), "--figure", str(fig)])
    printed = capsys.readouterr().out
    assert code == 0
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert [r["layer"] for r in rows] == ["embed", "attn.0", "mlp.0", "attn.1", "mlp.1", "norm", "logits"]
    assert [r["kind"] for r in rows] == ["embed", "attn", "mlp", "attn", "mlp", "norm", "logits"]
    assert [r["index"] for r in rows] == [None, 0, 0, 1, 1, None, None]
    assert all(set(r) == ROW_KEYS for r in rows[:-1]) and set(rows[-1]) == ROW_KEYS | {"tv_mean", "kl_mean"}
    assert (doc["engine"], doc["dtype"], doc["reference"], doc["sequences"]) == ("hf", "bf16", "hf:fp32", 2)
    ratios = {r["layer"]: r["growth"] for r in rows if r["growth"] is not None}
    assert doc["fastest_growth"] == {"layer": max(ratios, key=ratios.get), "ratio": max(ratios.values())}
    assert f"fastest growth: {doc['fastest_growth']['layer']}" in printed and "hf:bf16 vs hf:fp32" in printed
    assert fig.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv, message", [
    (["--dtype", "int8"], "--dtype int8: use one of bf16, fp16, fp32"),
    (["--engine", "sglang"], "--engine sglang: use one of hf, vllm"),
    (["--continuation", "-1"], "--continuation -1: pass 0 or more tokens"),
    (["--figure", "x.pdf"], "--figure x.pdf: pass a .png path"),
    (["--prompts", "missing.jsonl"], "--prompts missing.jsonl: no such file"),
])
def test_a_bad_flag_is_a_one_line_user_error_with_exit_status_2(argv, message, capsys):
    assert main(["layers", "--model", "/nonexistent-model-dir", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_a_prompts_file_that_is_not_json_lines_is_a_user_error_naming_the_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "prompt": "ok"}\nnot json\n')
    assert main(["layers", "--prompts", str(bad)]) == 2
    assert f"{bad}:2: not valid JSON" in capsys.readouterr().err
