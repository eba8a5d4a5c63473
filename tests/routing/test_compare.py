"""The routing comparison against a naive loop over tokens and layers."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from mismatch_lab.routing.compare import MARGIN_EDGES, Routing, compare, concat, margins


def _random_routing(rng, n=200, layers=3, experts=8, k=2) -> tuple[Routing, np.ndarray]:
    logits = rng.normal(size=(n, layers, experts))
    ids = np.argsort(-logits, axis=-1)[..., :k]
    w = np.take_along_axis(logits, ids, -1)
    return Routing(ids=ids, weights=w, margin=margins(logits, k)), logits


def _naive(ref: Routing, other: Routing) -> dict:
    n, layers, _ = ref.ids.shape
    flips = [[set(ref.ids[t, l]) != set(other.ids[t, l]) for l in range(layers)] for t in range(n)]
    per_layer = [sum(flips[t][l] for t in range(n)) / n for l in range(layers)]
    any_layer = sum(any(row) for row in flips) / n
    buckets = []
    for lo, hi in itertools.pairwise(MARGIN_EDGES):
        cells = [(t, l) for t in range(n) for l in range(layers) if lo <= ref.margin[t, l] < hi]
        buckets.append((len(cells), sum(flips[t][l] for t, l in cells)))
    downstream = sum(flips[t][l] and any(flips[t][:l]) for t in range(n) for l in range(layers))
    return {"per_layer": per_layer, "any": any_layer, "buckets": buckets, "downstream": downstream}


def test_flip_rates_any_layer_differs_and_margin_buckets_match_a_naive_loop():
    rng = np.random.default_rng(0)
    ref, logits = _random_routing(rng)
    perturbed = logits + rng.normal(scale=0.3, size=logits.shape)
    other = Routing(ids=np.argsort(-perturbed, axis=-1)[..., :2], weights=ref.weights, margin=ref.margin)
    got, want = compare(ref, other), _naive(ref, other)
    assert got["flip_rate_per_layer"] == pytest.approx(want["per_layer"], rel=1e-12)
    assert got["any_layer_differs"] == pytest.approx(want["any"], rel=1e-12)
    assert [(b["cells"], b["flips"]) for b in got["flips_by_margin"]] == want["buckets"]
    assert got["downstream_flips"] == want["downstream"] > 0
    assert 0 < got["flip_rate"] < 1  # the perturbation flips some cells and not all


def test_a_swap_of_rank_within_the_top_k_is_no_flip_but_counts_as_an_order_only_difference():
    rng = np.random.default_rng(1)
    ref, _ = _random_routing(rng, n=10)
    swapped = Routing(ids=ref.ids[..., ::-1], weights=ref.weights, margin=ref.margin)
    got = compare(ref, swapped)
    assert got["any_layer_differs"] == 0.0 and got["order_only_rate"] == 1.0


def test_margins_are_the_kth_minus_the_next_logit():
    logits = np.array([[3.0, -1.0, 2.5, 0.25]])
    assert margins(logits, 2)[0] == 2.5 - 0.25
    assert margins(logits, 1)[0] == 3.0 - 2.5


def test_concatenated_routings_keep_every_token_in_order():
    rng = np.random.default_rng(2)
    a, _ = _random_routing(rng, n=3)
    b, _ = _random_routing(rng, n=4)
    both = concat([a, b])
    assert both.ids.shape == (7, 3, 2) and (both.ids[3:] == b.ids).all() and (both.margin[:3] == a.margin).all()


def test_routings_of_different_shapes_are_refused():
    rng = np.random.default_rng(3)
    a, _ = _random_routing(rng, n=3)
    b, _ = _random_routing(rng, n=4)
    with pytest.raises(ValueError, match="same tokens"):
        compare(a, b)
    with pytest.raises(ValueError, match="want"):
        Routing(ids=a.ids, weights=a.weights[:, :, :1], margin=a.margin)
