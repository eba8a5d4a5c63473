"""`mismatch-lab model prepare --grid bf16`: the default model's weights rounded onto the bf16 grid, written next
to it, found by `resolve_model('default-bf16grid')`, with its own weights hash (the tiny model stands in for
the embedded one)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mismatch_lab import models


def _bf16_rne(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> nearest bf16 (ties to even) by hand on the bit pattern, kept in fp32 (finite inputs)."""
    bits = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    lsb = (bits >> 16) & 1
    rounded = ((bits + 0x7FFF + lsb) & 0xFFFF0000).to(torch.int64)
    rounded = torch.where(rounded >= 2**31, rounded - 2**32, rounded).to(torch.int32)
    return rounded.view(torch.float32)


def _weights(d) -> dict:
    out = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.fixture
def cache(tmp_path, monkeypatch, tiny_model):
    """A model cache whose 'default' is the tiny model."""
    monkeypatch.setenv("MISMATCH_LAB_CACHE", str(tmp_path / "cache"))
    shutil.copytree(tiny_model, models.default_model_dir())
    return tmp_path / "cache"


def test_the_bf16_grid_model_rounds_every_weight_to_the_nearest_even_bf16(cache):
    d = Path(models.resolve_model("default-bf16grid"))  # prepared on first use, next to the default
    assert d == models.grid_model_dir("bf16") and d.parent == models.default_model_dir().parent
    assert (d / ".complete").exists() and (d / "config.json").exists() and (d / "tokenizer.json").exists()
    src, got = _weights(models.default_model_dir()), _weights(d)
    assert set(got) == set(src) and len(got) > 5
    moved = 0
    for name, w in src.items():
        g = got[name]
        assert g.dtype == w.dtype == torch.float32, name
        assert torch.equal(g.to(torch.bfloat16).float(), g), name  # bf16-exact
        assert torch.equal(g, _bf16_rne(w)), name  # the fp32 weight rounded to nearest, ties to even
        moved += int((g != w).sum())
    assert moved > 0
    assert models.weights_sha256(str(d)) != models.weights_sha256(str(models.default_model_dir()))
    # the loaded model is the same architecture: HF reads it with nothing missing
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    assert torch.equal(m.model.embed_tokens.weight, got["model.embed_tokens.weight"])


def test_ties_round_to_even():
    # 1 + 2^-8 is halfway between 1 and 1 + 2^-7 (bf16 has 7 fraction bits): to even, 1; 1 + 3·2^-8 up to 1 + 2^-6
    x = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8)], dtype=torch.float32)
    from mismatch_lab.engines.weights import bf16_grid

    assert bf16_grid(x).tolist() == [1.0, 1 + 2**-6, -1.0]
    assert torch.equal(bf16_grid(x), _bf16_rne(x))


def test_an_unprepared_grid_model_names_the_command(tmp_path, monkeypatch):
    from mismatch_lab.errors import UserError

    monkeypatch.setenv("MISMATCH_LAB_CACHE", str(tmp_path))
    with pytest.raises(UserError, match="model prepare --grid bf16"):
        models.resolve_model("default-bf16grid", prepare=False)


def test_model_path_and_prepare_name_the_grid_directory(cache, capsys):
    from mismatch_lab.cli import main

    assert main(["model", "path", "--grid", "bf16"]) == 0
    assert capsys.readouterr().out.strip() == str(models.grid_model_dir("bf16"))
    assert main(["model", "prepare", "--grid", "bf16"]) == 0
    out = capsys.readouterr().out.split()
    assert str(models.grid_model_dir("bf16")) in out
    assert models.weights_sha256(str(models.grid_model_dir("bf16"))) in out
