"""benchmarks/bench_collect_gpu.py, run on the CPU at its check shape: it builds the random-weight checkpoint,
collects with the HF engine at three dtypes and accounts every token to its phase (the GPU figures
themselves need a lent GPU machine)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import duckdb

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_collect_gpu.py"


def test_the_gpu_collect_benchmark_runs_end_to_end_on_a_cpu(tmp_path, embedded_model, monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_collect_gpu", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    from mismatch_lab.engines.hf_engine import HFEngine
    from mismatch_lab.scoring import HFScorer

    monkeypatch.setattr(HFEngine, "generate", HFEngine.generate)  # the script wraps both; undone after the test
    monkeypatch.setattr(HFScorer, "score", HFScorer.score)
    out = bench.main(["--shape", "tiny-wide", "--device", "cpu", "--prompts", "3", "--samples", "2",
                      "--max-tokens", "6", "--work", str(tmp_path), "--json", str(tmp_path / "r.json")])
    phases = out["phases"]
    assert sorted(phases) == ["generate hf:bf16", "generate hf:fp16", "generate hf:fp32", "score bf16+fp16+fp32"]
    generated = sum(p["tokens"] for n, p in phases.items() if n.startswith("generate"))
    con = duckdb.connect(str(tmp_path / "tiny-wide.duckdb"), read_only=True)
    stored = con.execute("SELECT count(*) FROM tokens").fetchone()[0]
    # a vocabulary past the tokenizer's: ids it cannot name are stored without text, not refused
    assert con.execute("SELECT count(*) FROM tokens WHERE token_id >= 49152 AND token_text IS NULL").fetchone()[0] > 0
    assert generated == stored == out["tokens"] == phases["score bf16+fp16+fp32"]["tokens"] > 0
    assert all(p["peak"] is None and p["seconds"] > 0 for p in phases.values())  # no device peak on a CPU
    assert any("total on the device" in line for line in out["plan"])
    assert json.loads((tmp_path / "r.json").read_text())["tokens"] == stored


def test_a_shape_whose_plan_cannot_fit_is_refused_before_any_weight_is_built(tmp_path):
    import pytest

    from mismatch_lab.errors import UserError

    spec = importlib.util.spec_from_file_location("bench_collect_gpu", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    with pytest.raises(UserError, match=r"memory plan: .* a smaller --gen-batch \(the HF engine keeps the logits of all 64"):
        bench.main(["--shape", "llama-3.1-8b", "--device", "cpu", "--prompts", "4", "--max-tokens", "256",
                    "--gen-batch", "64", "--work", str(tmp_path)])
    model = tmp_path / "model-llama-3.1-8b"
    assert (model / "config.json").is_file() and not list(model.glob("*.safetensors"))  # 16 GB not written
