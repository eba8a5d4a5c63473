"""The float64 tokens every framework-preset test feeds both to the preset and to the framework's own code.

Real tokens: the first SEQUENCES sequences of the precision-sweep study's bf16-rollout run, with
μ = the vLLM bf16 rollout's log-probs, π_old = the HF fp32 scorer's and π = the HF fp16 scorer's (so π ≠ π_old
and the PPO ratio is not identically 1). The store holds no advantages: A = (seq_id mod 5 − 2)/2 ∈
{−1, −0.5, 0, 0.5, 1}, a fixed pattern that includes A = 0.

Extreme rows appended after them (one row each, several one-token): log r beyond ±20, μ or π below 1e-10,
A = 0, and ratios placed on the bands the presets compare against (TRL's cap 3, slime's [0, 2] and
[0.5, 5], prime-rl's Δp = ±0.2, OPSM's δ).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from mismatch_lab.corrections.frameworks.base import Tokens

STUDY = Path(__file__).resolve().parents[3] / "studies" / "precision-sweep" / "results"
RUN_LIKE = "%collect-vllm-bf16-%"
SEQUENCES = 300
DT = torch.float64

EXTREMES: list[tuple[list[float], list[float], list[float], float]] = [
    # (log π, log π_old, log μ, A) per row; log π_old = log π unless stated
    ([-1.0, -0.5, -2.0], [-1.0, -0.5, -2.0], [-25.0, -0.5, -2.0], 1.0),        # log r = +24
    ([-30.0, -0.1], [-30.0, -0.1], [-0.01, -0.1], -1.0),                      # log r ≈ −30, μ ≈ 1
    ([-25.0], [-25.0], [-0.3], 0.5),                                          # π < 1e-10, one token
    ([-0.2], [-0.2], [-24.0], -0.5),                                          # μ < 1e-10, one token
    ([-0.7, -1.1], [-0.6, -1.0], [-2.0, -3.0], 0.0),                          # A = 0, large r
    ([-2.0], [-2.0], [-0.5], 0.0),                                            # A = 0, Δp ≈ −0.47
    ([math.log(3.0)], [math.log(3.0)], [0.0], 1.0),                           # ρ = 3 exactly (ln 3)
    ([math.log(2.0) - 1.0], [math.log(2.0) - 1.0], [-1.0], -1.0),              # r = 2 (slime TIS cap)
    ([math.log(0.5) - 0.5], [math.log(0.5) - 0.5], [-0.5], 1.0),              # r = 0.5 (IcePop low)
    ([math.log(0.7)], [math.log(0.7)], [math.log(0.5)], 1.0),                 # Δp = π − μ = 0.2
    ([math.log(0.3)], [math.log(0.3)], [math.log(0.5)], -1.0),                # Δp = −0.2
    ([-1.0, -1.0], [-1.0, -1.0], [-1.0 + 1e-4, -1.0 + 1e-4], -1.0),           # mean(log μ − log π) = 1e-4
    ([-0.05, -3.0, -0.4], [-0.06, -2.9, -0.5], [-0.05, -2.0, -0.45], -1.0),    # π ≠ π_old, A < 0
    ([-0.01], [-2.0], [-2.0], 1.0),                                           # π/π_old = e^1.99, A > 0
    ([-3.0], [-0.5], [-0.5], -1.0),                                           # π/π_old = e^−2.5, A < 0
    ([-1e-12], [-1e-12], [-1e-12], 1.0),                                      # on-policy, π ≈ 1
]


def _store_rows() -> list[tuple[list[float], list[float], list[float], float]]:
    from mismatch_lab.store.reader import open_store

    con = open_store(STUDY)
    rows = con.execute(
        """
        WITH s AS (SELECT seq_id FROM sequences WHERE run_id LIKE ? ORDER BY seq_id LIMIT ?)
        SELECT t.seq_id, list(p.logp ORDER BY t.pos), list(o.logp ORDER BY t.pos), list(t.logp_rollout ORDER BY t.pos)
        FROM tokens t JOIN s USING (seq_id)
        JOIN scores p ON p.run_id = t.run_id AND p.seq_id = t.seq_id AND p.pos = t.pos AND p.scorer = 'hf:fp16'
        JOIN scores o ON o.run_id = t.run_id AND o.seq_id = t.seq_id AND o.pos = t.pos AND o.scorer = 'hf:fp32'
        WHERE t.run_id LIKE ?
        GROUP BY t.seq_id ORDER BY t.seq_id
        """, [RUN_LIKE, SEQUENCES, RUN_LIKE]).fetchall()
    return [(lp, lo, lm, ((seq_id % 5) - 2) / 2) for seq_id, lp, lo, lm in rows]


def rows() -> list[tuple[list[float], list[float], list[float], float]]:
    """The store's rows, then the extreme ones (an even count: TRL groups completions in pairs)."""
    out = _store_rows() + EXTREMES
    assert len(out) % 2 == 0, len(out)
    return out


def tokens(batch: list[tuple[list[float], list[float], list[float], float]] | None = None,
           pad: float = 0.0) -> Tokens:
    """[B, T] float64 Tokens, right-padded with `pad`; logp requires grad."""
    batch = rows() if batch is None else batch
    width = max(len(r[0]) for r in batch)

    def grid(i: int) -> torch.Tensor:
        return torch.tensor([r[i] + [pad] * (width - len(r[i])) for r in batch], dtype=DT)

    mask = torch.tensor([[j < len(r[0]) for j in range(width)] for r in batch])
    adv = torch.tensor([[r[3]] * width for r in batch], dtype=DT)
    return Tokens(grid(0).requires_grad_(True), grid(1), grid(2), adv, mask)


def fresh(t: Tokens) -> Tokens:
    """The same tokens with a new leaf logp (one backward per preset)."""
    return Tokens(t.logp.detach().clone().requires_grad_(True), t.logp_old, t.logp_rollout, t.advantages, t.mask)


def rel_close(a: float, b: float, rtol: float = 1e-9) -> bool:
    """|a − b| ≤ rtol·max(|a|, |b|), NaN equal to NaN."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= rtol * max(abs(a), abs(b))


def assert_same_result(ours_t: Tokens, ours, loss: float, grad, keep, weight, metrics: dict,
                       metric_rtol=lambda name: 1e-9) -> None:
    """A preset's Result (after `ours.loss.backward()` on `ours_t`) equals the reference's loss, gradient wrt
    log π, keep mask, weight and every metric (same names; each at `metric_rtol(name)` relative)."""
    assert rel_close(ours.loss.item(), loss), (ours.loss.item(), loss)
    torch.testing.assert_close(ours_t.logp.grad, grad, rtol=1e-9, atol=0.0)
    assert torch.equal(ours.keep, keep)
    torch.testing.assert_close(ours.weight, weight, rtol=1e-9, atol=0.0)
    assert sorted(ours.metrics) == sorted(metrics)
    for name, value in metrics.items():
        assert rel_close(float(ours.metrics[name]), float(value), metric_rtol(name)), (name, ours.metrics[name], value)
