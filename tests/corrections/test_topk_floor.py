"""The top-K divergences' 'other' bucket below the leftover floor (corrections/leftover.py): two leftovers
both below |S| · eps_fp32 count as equal (the bucket adds 0), one below and one above keeps its term.
Checked against a naive Python reference on hand-built tokens (torch rules and the analyses' SQL alike),
and on the stored precision-sweep study, whose vllm:fp32/hf:fp32 pair agrees to ~1e-6 per token."""

from __future__ import annotations

import math
from pathlib import Path

import duckdb
import numpy as np
import pytest
import torch

from mismatch_lab.analysis import definitions as d
from mismatch_lab.corrections.divergences import TopK, topk_kl, topk_tv

STUDY = Path(__file__).resolve().parents[2] / "studies" / "precision-sweep"
EPS32 = float(np.finfo(np.float32).eps)
EPS64 = float(np.finfo(np.float64).eps)


def naive(anchor_probs, probs, n_pad=0, *, floored=True):
    """(top-K TV, top-K KL(anchor ‖ π)) by a loop over the slots plus the 'other' bucket. floored=False is
    the formula before the floor: a leftover clamped to 0 against a positive one gives +inf."""
    po, qo = max(0.0, 1.0 - sum(anchor_probs)), max(0.0, 1.0 - sum(probs))
    floor = len(anchor_probs) * EPS32  # padding slots are not summed
    if floored and po < floor and qo < floor:
        po = qo = 0.0
    tv = 0.5 * (sum(abs(a - b) for a, b in zip(anchor_probs, probs)) + abs(po - qo))
    kl = sum(a * math.log(a / b) for a, b in zip(anchor_probs, probs) if a > 0)
    if po > 0:
        kl += math.inf if qo == 0 else po * math.log(po / qo)
    return tv, kl


# (anchor probabilities, trainer probabilities) of the K slots
CASES = {
    # vLLM fp32 leaves 1e-9 of mass outside the slots, HF fp32's slots sum a hair above 1 (clamped to 0)
    "both leftovers below the floor": ([0.6, 0.3, 0.1 - 1e-9], [0.6, 0.3, 0.1 + 1e-9]),
    # mass the rollout gives outside the slots and the trainer does not: a large, finite KL
    "rollout leftover large, trainer leftover tiny": ([0.5, 0.2], [0.6, 0.4 - 1e-9]),
    "rollout leftover large, trainer leftover zero": ([0.5, 0.2], [0.6, 0.4 + 1e-9]),
    "rollout leftover tiny, trainer leftover large": ([0.6, 0.4 - 1e-9], [0.5, 0.2]),
    "both leftovers just above the floor": ([0.5, 0.5 - 4 * EPS32], [0.5, 0.5 - 3.5 * EPS32]),
}


def _torch(anchor_probs, probs, n_pad=0):
    """topk_tv, topk_kl of one token with `n_pad` padding slots (valid False, junk values)."""
    la = torch.tensor([[[*map(math.log, anchor_probs), *[-0.1] * n_pad]]], dtype=torch.float64)
    lq = torch.tensor([[[*map(math.log, probs), *[-0.2] * n_pad]]], dtype=torch.float64)
    valid = torch.tensor([[[True] * len(probs) + [False] * n_pad]])
    t = TopK(la, lq, valid)
    return float(topk_tv(t)), float(topk_kl(t))


def _sql(anchor_probs, probs):
    """The analyses' top-K TV and KL (definitions.topk_*_sql) of one token whose sampled token is slot 0."""
    ids = list(range(len(probs)))
    la, lq = [math.log(x) for x in anchor_probs], [math.log(x) for x in probs]
    part1 = ", ".join(f"{e} AS {n}" for n, e in d.topk_anchor_sql("ids", "a_lps", "tok").items())
    part2 = ", ".join(f"{e} AS {n}" for n, e in d.topk_pair_sql("b_lps").items())
    row = duckdb.connect().execute(f"""
        SELECT ({d.topk_sql('a_lp', 'b_lp')}).tv, ({d.topk_sql('a_lp', 'b_lp')}).kl FROM (
            SELECT *, {part2} FROM (
                SELECT *, {part1} FROM (SELECT $ids::INTEGER[] AS ids, $la::DOUBLE[] AS a_lps, $lq::DOUBLE[] AS b_lps,
                                               0 AS tok, $la[1]::DOUBLE AS a_lp, $lq[1]::DOUBLE AS b_lp)))""",
                                       {"ids": ids, "la": la, "lq": lq}).fetchone()
    return tuple(math.inf if x == float("inf") else x for x in row)


def _close(x: float, y: float, n: int) -> bool:
    """Equal up to float64 rounding of a sum of n terms of size ≤ 1 (n · eps_fp64 per term, 8× margin)."""
    return x == y or abs(x - y) <= 8 * n * EPS64 * max(1.0, abs(y))


@pytest.mark.parametrize("case", sorted(CASES))
def test_top_k_divergences_equal_the_naive_floored_reference_in_torch_and_sql(case):
    anchor, trainer = CASES[case]
    want = naive(anchor, trainer)
    for got in (_torch(anchor, trainer), _sql(anchor, trainer)):
        assert all(_close(g, w, len(anchor) + 1) for g, w in zip(got, want)), (case, got, want)


def test_two_leftovers_below_the_floor_add_nothing_where_the_unfloored_kl_was_infinite():
    anchor, trainer = CASES["both leftovers below the floor"]
    assert naive(anchor, trainer, floored=False)[1] == math.inf  # the formula before the floor
    _, kl = _torch(anchor, trainer)
    slots_kl = sum(a * math.log(a / b) for a, b in zip(anchor, trainer))
    assert math.isfinite(kl) and _close(kl, slots_kl, 3) and abs(kl) < 1e-8


def test_one_tiny_leftover_against_a_large_one_keeps_its_large_finite_kl():
    anchor, trainer = CASES["rollout leftover large, trainer leftover tiny"]
    before, after = naive(anchor, trainer, floored=False), _torch(anchor, trainer)
    assert 5 < after[1] < 10 and _close(after[1], before[1], 3) and _close(after[0], before[0], 3)
    assert _torch(*CASES["rollout leftover large, trainer leftover zero"])[1] == math.inf


def test_the_floor_counts_the_valid_slots_only():
    # leftovers 2.5 eps and 0 with two real slots: above the floor 2 eps, so the KL stays +inf; counting the
    # padding slot as well would lift the floor to 3 eps and zero the bucket
    anchor, trainer = [0.5, 0.5 - 2.5 * EPS32], [0.5, 0.5 + EPS32]
    assert naive(anchor, trainer)[1] == _torch(anchor, trainer)[1] == _torch(anchor, trainer, n_pad=1)[1] == math.inf
    assert _torch(anchor, trainer, n_pad=1)[0] == _torch(anchor, trainer)[0] > 0


def _unfloored_kl(t: TopK) -> torch.Tensor:
    """Top-K KL as written before the floor: 1 − Σp clamped at 0 on each side, a · log(a / 0) = +inf."""
    valid = t.valid if t.valid is not None else torch.ones_like(t.logps, dtype=torch.bool)
    p = torch.where(valid, t.anchor_logps.exp(), 0.0)
    slots = torch.where(p > 0, p * (t.anchor_logps - t.logps), 0.0).sum(-1)
    po = (1 - p.sum(-1)).clamp(min=0)
    qo = (1 - torch.where(valid, t.logps.exp(), 0.0).sum(-1)).clamp(min=0)
    return slots + torch.where(po > 0, po * (po.log() - qo.log()), 0.0)


def test_the_top_k_kl_objective_masks_no_token_of_the_stored_fp32_pair_it_masked_before():
    """precision-sweep, rollout vllm:fp32 scored by hf:fp32 (top-K 20 of the rollout): the tokens read
    through open_store and laid out as `corrections` lays them out, the registry's dppo_topk_kl run on
    them. Before the floor the same rule masked tokens there (a +inf KL from a leftover of ~1e-8)."""
    from mismatch_lab.corrections import rules
    from mismatch_lab.corrections.compare import compare
    from mismatch_lab.corrections.layout import chunks, pair_info
    from mismatch_lab.corrections.registry import OBJECTIVES
    from mismatch_lab.store.reader import open_store

    method = OBJECTIVES["dppo_topk_kl"]
    params = method.resolve(None)
    unfloored = rules._dppo(lambda b: _unfloored_kl(b.topk))
    con = open_store(STUDY)
    try:
        info = pair_info(con)
        info = info[(info["rollout"] == "vllm:fp32") & (info["scorer"] == "hf:fp32")].reset_index(drop=True)
        assert len(info) == 1 and bool(info["has_topk"].iloc[0])
        masked = {"now": 0, "before": 0, "tokens": 0}
        for chunk in chunks(con, info, chunk_tokens=1 << 20):
            for part in chunk.parts(np.zeros(chunk.n, dtype=np.int64), 1, np.zeros(len(chunk.seq_start), dtype=np.int64)):
                b = part.batch
                masked["now"] += int((b.mask & ~method.rule(b, params).keep).sum())
                masked["before"] += int((b.mask & ~unfloored(b, params).keep).sum())
                masked["tokens"] += int(b.mask.sum())
        table = compare(con)["corrections"]
    finally:
        con.close()
    assert masked["tokens"] == int(info["n_tokens"].iloc[0]) > 10_000
    assert masked["now"] == 0 and masked["before"] > 0
    row = table[(table["method"] == "dppo_topk_kl") & (table["rollout"] == "vllm:fp32") & (table["scorer"] == "hf:fp32")]
    assert row["frac_tokens_masked"].tolist() == [0.0]  # what `mismatch-lab corrections` prints
