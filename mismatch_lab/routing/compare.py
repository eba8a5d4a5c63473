"""The routing record and the comparison of two routings of the same tokens (pure numpy).

A routing holds, per token n and MoE layer l, the k experts chosen in rank order (`ids[n, l]`, highest router
score first), their weights as the experts received them (`weights[n, l]`) and the router's margin: its k-th
largest logit minus its (k+1)-th (`margin[n, l]`), the distance to the nearest change of the chosen set.

Two routings agree at (n, l) when their expert SETS are equal: the order within the top-k changes nothing
in the layer's output but the weights, which the weights comparison sees.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MARGIN_EDGES = (0.0, 1e-3, 1e-2, 1e-1, 1.0, np.inf)
"""Bucket edges of the reference side's router margin (logit units) for `flips by margin`."""


@dataclass
class Routing:
    ids: np.ndarray  # int64 [N, L, k], rank order
    weights: np.ndarray  # float64 [N, L, k], in the order of `ids`
    margin: np.ndarray  # float64 [N, L]: k-th minus (k+1)-th router logit

    def __post_init__(self):
        self.ids = np.asarray(self.ids, dtype=np.int64)
        self.weights = np.asarray(self.weights, dtype=np.float64)
        self.margin = np.asarray(self.margin, dtype=np.float64)
        if self.ids.ndim != 3 or self.weights.shape != self.ids.shape or self.margin.shape != self.ids.shape[:2]:
            raise ValueError(f"routing shapes ids {self.ids.shape}, weights {self.weights.shape}, margin "
                             f"{self.margin.shape}: want [N, L, k], [N, L, k], [N, L]")

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.ids.shape


def margins(logits: np.ndarray, k: int) -> np.ndarray:
    """k-th largest minus (k+1)-th largest of `logits` [..., E] along the last axis (float64)."""
    top = -np.sort(-np.asarray(logits, dtype=np.float64), axis=-1)
    return top[..., k - 1] - top[..., k]


def set_differs(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """bool [N, L]: the expert sets of ids `a` and `b` [N, L, k] differ (order ignored)."""
    if a.shape != b.shape:
        raise ValueError(f"routings of different shapes {a.shape} and {b.shape}: compare the same tokens")
    return np.any(np.sort(a, axis=-1) != np.sort(b, axis=-1), axis=-1)


def compare(ref: Routing, other: Routing, edges=MARGIN_EDGES) -> dict:
    """How `other` routes the tokens `ref` routed: per-layer flip rate (share of tokens whose expert set
    differs), `any_layer_differs` (share of tokens differing in at least one layer), order-only differences,
    flips by bucket of `ref`'s margin (each bucket: [lo, hi), count of (token, layer) cells, flips), and
    `downstream_flips`: flips of a token that already flipped in an earlier layer (its hidden state then
    differs for a reason other than arithmetic), with `downstream_flips_margin_ge_1` those at margin >= 1."""
    flip = set_differs(ref.ids, other.ids)
    downstream = flip & (np.cumsum(flip, axis=1) > 1)
    order_only = ~flip & np.any(ref.ids != other.ids, axis=-1)
    bucket = np.digitize(ref.margin, edges[1:-1], right=False)
    by_margin = [{"lo": float(edges[i]), "hi": float(edges[i + 1]), "cells": int((bucket == i).sum()),
                  "flips": int(flip[bucket == i].sum())} for i in range(len(edges) - 1)]
    return {
        "tokens": int(flip.shape[0]), "layers": int(flip.shape[1]), "k": int(ref.ids.shape[2]),
        "flip_rate_per_layer": [float(x) for x in flip.mean(axis=0)] if flip.size else [],
        "flip_rate": float(flip.mean()) if flip.size else 0.0,
        "any_layer_differs": float(flip.any(axis=1).mean()) if flip.size else 0.0,
        "order_only_rate": float(order_only.mean()) if flip.size else 0.0,
        "flips_by_margin": by_margin,
        "max_margin_of_a_flip": float(ref.margin[flip].max()) if flip.any() else None,
        "flips": int(flip.sum()), "downstream_flips": int(downstream.sum()),
        "downstream_flips_margin_ge_1": int((downstream & (ref.margin >= 1.0)).sum()),
    }


def concat(routings: list[Routing]) -> Routing:
    """The routings of several sequences as one, tokens after tokens."""
    return Routing(ids=np.concatenate([r.ids for r in routings]),
                   weights=np.concatenate([r.weights for r in routings]),
                   margin=np.concatenate([r.margin for r in routings]))
