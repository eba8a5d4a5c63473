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


def test_layers_help_and_a_bad_dtype_import_neither_torch_transformers_vllm_nor_matplotlib():
    import subprocess
    import sys

    probe = ("import sys\nfrom mismatch_lab.cli import main\n"
             "try: main(['layers', '--help'])\nexcept SystemExit: pass\n"
             "assert main(['layers', '--dtype', 'int8']) == 2\n"
             "print([m for m in ('torch', 'transformers', 'vllm', 'matplotlib') if m in sys.modules])")
    proc = subprocess.run([sys.executable, "-c", probe], check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"
    assert "--dtype int8: use one of" in proc.stderr


@pytest.mark.slow
def test_on_the_embedded_model_bf16_departs_more_at_the_logits_than_at_the_first_block(embedded_model, tmp_path,
                                                                                      capsys):
    out = tmp_path / "layers.json"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "What is the capital of France?"}\n')
    assert main(["layers", "--prompts", str(prompts), "--continuation", "0", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    by = {r["layer"]: r for r in doc["rows"]}
    assert len(doc["rows"]) == 1 + 2 * 30 + 2  # SmolLM2-135M: 30 blocks
    assert 0 < by["embed"]["rel_err"] <= 2.0 ** -8  # one bf16 rounding per element (test_layers_hf)
    assert by["logits"]["rel_err"] > by["attn.0"]["rel_err"]  # compounded through 30 blocks and the bf16 lm_head
    assert doc["fastest_growth"] is not None and 0 < by["logits"]["tv_mean"] < 1
