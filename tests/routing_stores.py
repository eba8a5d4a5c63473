"""Small stores with MoE routing rows, written with the real StoreWriter: synthetic routings with known flips.

`routing_store(path)` writes one run (rollout vllm:bf16) of `n_seq` sequences with scorers 'hf:fp32' (routing
drawn with planted flips), 'hf:fp32-r3' (the rollout's routing, a smaller |Δp|) and returns the Routing arrays
and per-token log-probs it wrote, so a test can recompute every number with numpy / routing.compare.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mismatch_lab.routing.compare import Routing
from mismatch_lab.store.writer import StoreWriter, to_arrow

N_EXPERTS, LAYERS, K = 8, 4, 2


@dataclass
class RoutingStore:
    path: object
    run_id: str
    rollout: Routing  # all tokens of all sequences, in (seq_id, pos) order
    sides: dict[str, Routing] = field(default_factory=dict)  # scorer label -> routing
    logp_rollout: np.ndarray = None
    logp: dict[str, np.ndarray] = field(default_factory=dict)  # scorer label -> log π
    keys: list[tuple[int, int]] = field(default_factory=list)  # (seq_id, pos) of each token


def _routing(rng: np.random.Generator, n: int, flip_prob: np.ndarray | None = None, base: Routing | None = None):
    """A routing of n tokens; with `base`, a copy whose cells flip (one expert swapped for an unused one) with
    probability `flip_prob` [n, L], and whose order is reversed elsewhere now and then (order-only)."""
    if base is None:
        ids = np.stack([[rng.permutation(N_EXPERTS)[:K] for _ in range(LAYERS)] for _ in range(n)])
        margin = np.exp(rng.uniform(np.log(1e-4), np.log(5.0), size=(n, LAYERS)))
        margin = margin.astype(np.float32).astype(np.float64)  # as routing.margin (FLOAT) stores it
        margin[0, 0] = 1.0  # on an edge (exact in float32): the bucket [1, inf), as np.digitize puts it
        w = rng.uniform(0.5, 0.9, size=(n, LAYERS, 1))
        return Routing(ids, np.concatenate([w, 1 - w], axis=-1), margin)
    ids = base.ids.copy()
    flips = rng.random(flip_prob.shape) < flip_prob
    for n_, l_ in zip(*np.nonzero(flips)):
        unused = [e for e in range(N_EXPERTS) if e not in ids[n_, l_]]
        ids[n_, l_, 1] = unused[0]
    swap = ~flips & (rng.random(flip_prob.shape) < 0.2)
    ids[swap] = ids[swap][:, ::-1]
    return Routing(ids, base.weights, base.margin)


def routing_store(path, seed: int = 0, n_seq: int = 6, length: int = 12, r3: bool = True) -> RoutingStore:
    rng = np.random.default_rng(seed)
    n = n_seq * length
    keys = [(s, p) for s in range(n_seq) for p in range(length)]
    ro = _routing(rng, n)
    flip_prob = np.select([ro.margin < 0.01, ro.margin < 0.1], [0.5, 0.1], 0.02)  # near-ties flip more often
    sides = {"hf:fp32": _routing(rng, n, flip_prob, ro)}
    if r3:
        sides["hf:fp32-r3"] = Routing(ro.ids.copy(), ro.weights, ro.margin)
    lmu = np.log(rng.uniform(0.05, 0.95, size=n))
    flipped = np.any(np.sort(sides["hf:fp32"].ids, -1) != np.sort(ro.ids, -1), axis=(1, 2))
    logp = {"hf:fp32": lmu + rng.normal(0, np.where(flipped, 0.3, 0.02))}
    if r3:
        logp["hf:fp32-r3"] = lmu + rng.normal(0, 0.02, size=n)
    logp["hf:fp32"][3] = np.nan  # a non-finite row: counted, left out of the means
    store = RoutingStore(path, "run-moe", ro, sides, lmu, logp, keys)
    _write(store)
    return store


def routing_rows(run_id: str, keys, side: str, r: Routing, margin: bool = True) -> dict[str, list]:
    rows = {c: [] for c in ("run_id", "seq_id", "pos", "side", "layer", "expert_ids", "expert_weights", "margin")}
    for i, (s, p) in enumerate(keys):
        for layer in range(r.ids.shape[1]):
            for c, v in (("run_id", run_id), ("seq_id", s), ("pos", p), ("side", side), ("layer", layer),
                         ("expert_ids", r.ids[i, layer].tolist()), ("expert_weights", r.weights[i, layer].tolist()),
                         ("margin", float(r.margin[i, layer]) if margin else None)):
                rows[c].append(v)
    return rows


def _write(store: RoutingStore) -> None:
    writer = StoreWriter(store.path)
    writer.start_run(store.run_id, study="moe", kind="collect", model="tiny-moe", weights_sha256="", engine="vllm",
                     engine_dtype="bf16", device="cpu", versions={}, config={})
    seqs = sorted({s for s, _ in store.keys})
    lengths = [sum(1 for s, _ in store.keys if s == q) for q in seqs]
    sequences = to_arrow("sequences", {"run_id": [store.run_id] * len(seqs), "seq_id": seqs,
                                       "prompt_len": [3] * len(seqs), "response_len": lengths})
    tokens = to_arrow("tokens", {"run_id": [store.run_id] * len(store.keys), "seq_id": [s for s, _ in store.keys],
                                 "pos": [p for _, p in store.keys], "token_id": [7] * len(store.keys),
                                 "logp_rollout": store.logp_rollout.tolist()})
    scores = {c: [] for c in ("run_id", "seq_id", "pos", "scorer", "logp", "nonfinite")}
    routing = routing_rows(store.run_id, store.keys, "rollout", store.rollout)
    for label, lp in store.logp.items():
        for (s, p), v in zip(store.keys, lp):
            for c, x in zip(scores, (store.run_id, s, p, label, float(v), not np.isfinite(v))):
                scores[c].append(x)
        for c, x in routing_rows(store.run_id, store.keys, label, store.sides[label], margin=False).items():
            routing[c].extend(x)
    writer.write_chunk(store.run_id, 0, sequences=sequences, tokens=tokens, scores=to_arrow("scores", scores),
                       seconds=0.0, routing=to_arrow("routing", routing))
    writer.set_status(store.run_id, "done")
    writer.close()
