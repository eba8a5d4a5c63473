"""The CUDA path: the HF engine and the scorer at bf16/fp16/fp32 on a GPU (skipped without one; CI has none).

Runs on a lent GPU machine with: MISMATCH_LAB_TINY_MODEL=<dir> python -m pytest -m gpu tests/collect/test_collect_gpu.py
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.testing import assert_close

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def model_dir(request):
    path = os.environ.get("MISMATCH_LAB_TINY_MODEL")
    return path if path else request.getfixturevalue("tiny_model")


def _items():
    from mismatch_lab.scoring import ScoreItem

    g = torch.Generator().manual_seed(0)
    return [ScoreItem(torch.randint(0, 5000, (12,), generator=g).tolist(), torch.randint(0, 5000, (20,), generator=g).tolist())
            for _ in range(8)]


def test_cuda_scorer_fp32_equals_the_cpu_scorer_and_lower_precisions_move_away(model_dir):
    from mismatch_lab.scoring import HFScorer

    items = _items()
    cpu = HFScorer(model_dir, ["fp32"], device="cpu", top_k=5).score(items)["hf:fp32"]
    gpu = HFScorer(model_dir, ["fp32", "bf16", "fp16"], device="cuda", top_k=5, chunk_rows=64).score(items)
    # TF32 is off by default for matmuls in torch, so fp32 on the GPU matches the CPU closely
    assert_close(torch.from_numpy(gpu["hf:fp32"].logp), torch.from_numpy(cpu.logp), atol=2e-4, rtol=1e-4)
    tv = {d: torch.from_numpy(gpu[f"hf:{d}"].tv_exact_vs_ref) for d in ("fp32", "bf16", "fp16")}
    assert float(tv["fp32"].abs().max()) == 0.0
    assert float(tv["bf16"].mean()) > float(tv["fp16"].mean()) > 0.0  # 7-bit vs 10-bit mantissa
    assert not any(gpu[f"hf:{d}"].nonfinite.any() for d in ("bf16", "fp16"))


def test_cuda_scorer_in_turn_gives_the_resident_numbers(model_dir):
    from mismatch_lab.scoring import HFScorer

    items = _items()
    kw = {"device": "cuda", "top_k": 5, "chunk_rows": 64}
    resident = HFScorer(model_dir, ["fp32", "bf16"], **kw).score(items)
    in_turn = HFScorer(model_dir, ["fp32", "bf16"], placement="in_turn", **kw).score(items)
    for name in resident:
        assert torch.equal(torch.from_numpy(resident[name].logp), torch.from_numpy(in_turn[name].logp))


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_cuda_hf_engine_mu_agrees_with_the_teacher_forced_scorer_at_the_same_dtype(model_dir, dtype):
    from mismatch_lab.engines.base import GenRequest, make_engine
    from mismatch_lab.scoring import HFScorer, ScoreItem

    eng = make_engine("hf", model_dir, dtype, device="cuda", seed=0)
    reqs = [GenRequest(prompt_ids=it.prompt_ids, seed=i) for i, it in enumerate(_items()[:4])]
    samples = eng.generate(reqs, max_tokens=16, top_k=5)
    assert all(s.token_ids for s in samples)
    res = HFScorer(model_dir, [dtype], device="cuda", top_k=5).score(
        [ScoreItem(r.prompt_ids, s.token_ids) for r, s in zip(reqs, samples)])[f"hf:{dtype}"]
    mu = torch.tensor([x for s in samples for x in s.logps], dtype=torch.float64)
    pi = torch.from_numpy(res.logp)
    # same weights, same dtype; decode (KV cache) vs one prefill differ only by kernel order
    bound = {"fp32": 1e-4, "bf16": 0.1, "fp16": 0.02}[dtype]
    assert float((pi - mu).abs().mean()) < bound
    eng.close()
