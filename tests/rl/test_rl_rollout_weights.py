"""fp8 rollout weights: the per-channel e4m3 rounding against a naive quantiser, row by row."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from mismatch_lab.engines.weights import fp8_per_channel, round_state


def _naive(w):
    out = torch.empty_like(w)
    for i in range(w.shape[0]):
        row = w[i].float()
        s = float(row.abs().max()) / 448.0 or 1.0
        out[i] = (row / s).to(torch.float8_e4m3fn).float() * s
    return out


def test_fp8_rounding_matches_a_naive_per_channel_quantiser():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(16, 64, generator=gen) * torch.logspace(-4, 1, 16)[:, None]
    w[3] = 0.0
    got = fp8_per_channel(w)
    assert torch.equal(got, _naive(w))
    assert not torch.equal(got, w) and torch.equal(got[3], w[3])
    rel = ((got - w).abs() / w.abs().amax(1, keepdim=True).clamp(min=1e-30))[w.abs().amax(1) > 0]
    assert float(rel.max()) <= 2 ** -4 + 1e-7  # e4m3: 3 mantissa bits, at most half an ulp of the row's max
    # on the grid: quantising again changes nothing
    assert torch.equal(fp8_per_channel(got), got)


def test_round_state_leaves_vectors_alone_and_rejects_unknown_kinds():
    state = {"w": torch.randn(4, 8), "norm": torch.randn(8)}
    out = round_state(state, "fp8")
    assert torch.equal(out["norm"], state["norm"]) and not torch.equal(out["w"], state["w"])
    assert round_state(state, "none") is state
    with pytest.raises(ValueError):
        round_state(state, "int4")
