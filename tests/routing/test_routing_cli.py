"""`mismatch-lab routing`: refusals before any model is loaded, and the printed report."""

from __future__ import annotations

from mismatch_lab.cli import main


def test_a_dense_checkpoint_is_refused_in_one_line_naming_the_tiny_moe_builder(tiny_model, capsys):
    assert main(["routing", "--model", tiny_model]) == 2
    err = capsys.readouterr().err
    assert "not an MoE checkpoint" in err and "model tiny-moe" in err and len(err.strip().splitlines()) == 1


def test_the_report_prints_flip_rates_and_each_replays_mean_abs_dp():
    from mismatch_lab.routing.command import REPLAYS, format_text

    routing = {"tokens": 10, "layers": 2, "k": 2, "flip_rate_per_layer": [0.1, 0.0], "any_layer_differs": 0.1,
               "order_only_rate": 0.0, "flips": 2, "downstream_flips": 1,
               "downstream_flips_margin_ge_1": 0, "flips_by_margin": [{"lo": 0.0, "hi": 0.1, "cells": 3, "flips": 1}]}
    result = {"model": "m", "vllm_dtype": "bf16", "trainer": "hf fp32", "sequences": 1}
    result.update({name: {"mean_abs_dp": 0.01 * (i + 1), "max_abs_dp": 0.5, "routing_vs_vllm": routing}
                   for i, name in enumerate(REPLAYS)})
    text = format_text(result)
    assert "flip rate per layer  0.1000 0.0000" in text and "[0,0.1): 1/3" in text
    assert all(f"{name}" in text for name in REPLAYS) and "mean |dp| 3.000e-02" in text


def test_model_tiny_moe_writes_the_builders_bytes_and_wants_an_out_folder(tmp_path, tiny_moe, capsys):
    from pathlib import Path

    assert main(["model", "tiny-moe"]) == 2
    assert "`model tiny-moe` needs --out DIR" in capsys.readouterr().err
    assert main(["model", "tiny-moe", "--out", str(tmp_path / "m"), "--seed", "0"]) == 0
    built = Path(capsys.readouterr().out.strip())
    assert built == tmp_path / "m"
    assert (built / "model.safetensors").read_bytes() == (Path(tiny_moe) / "model.safetensors").read_bytes()
