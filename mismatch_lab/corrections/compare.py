"""Every registered method on the same tokens of a store: what each would mask, drop and reweight, per
(rollout, scorer) pair, with splits by advantage sign, μ bucket and token category.

The store is read once, ordered by pair and sequence, in chunks of whole sequences (bounded memory); each
chunk is laid out [B, T] by response-length bucket and every method's rule (registry.py, the same code
the loss trains with) runs on it. A store holds no π_old: the anchor and π_ref are the store's own π and
μ, i.e. what each method would do at the first mini-batch of the step that produced the tokens.

Advantages: `sequences.advantage` where stored, else reward minus the prompt group's mean
(analysis.definitions.group_advantage_sql), else unknown: sign-dependent rules then fire for either sign
(two-sided). `advantage_source` of each row says which. Only finite tokens (analysis.definitions.finite_sql)
enter the rules; the others are counted in `n_nonfinite`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import pandas as pd

from mismatch_lab.corrections.layout import Chunk, chunks
from mismatch_lab.corrections.registry import CORRECTIONS, OBJECTIVES, Method


@dataclass(frozen=True)
class Variant:
    """One row kind of the comparison: a method at a parameter set, under a label."""

    label: str
    method: Method
    params: Mapping[str, float]


def variants(overrides: Mapping[str, Mapping[str, float]] | None = None) -> list[Variant]:
    """Every base objective (grpo twice: ε_high 0.2 and Clip-Higher 0.28; the legacy `tis` left out: it is
    pg_is + token_tis at cap 3) and every rollout correction, at their published defaults updated by
    `overrides` (label -> {parameter: value})."""
    overrides = dict(overrides or {})
    unknown = set(overrides) - {m.name for m in (*OBJECTIVES.values(), *CORRECTIONS.values())} - {"grpo_clip_higher"}
    if unknown:
        raise ValueError(f"no method named {', '.join(sorted(unknown))}; methods: "
                         f"{', '.join([*OBJECTIVES, 'grpo_clip_higher', *CORRECTIONS])}")
    out = []
    for m in (*OBJECTIVES.values(), *CORRECTIONS.values()):
        if m.name == "tis":
            continue
        out.append(Variant(m.name, m, m.resolve(overrides.get(m.name))))
        if m.name == "grpo":
            from mismatch_lab.corrections.defaults import CLIP_HIGHER_EPS

            extra = {"eps_high": CLIP_HIGHER_EPS} | dict(overrides.get("grpo_clip_higher", {}))
            out.append(Variant("grpo_clip_higher", m, m.resolve(extra)))
    return out


def compare(con, *, overrides=None, chunk_tokens: int = 1 << 20,
            progress: Callable[[int, int], None] | None = None) -> dict[str, pd.DataFrame]:
    """Tables `corrections` (one row per method and pair) and `by_adv_sign`, `by_mu_bucket`,
    `by_category` (the same per split value) of the store on `con`. progress(tokens done, total)."""
    from mismatch_lab.corrections.layout import pair_info

    vs = variants(overrides)
    info = pair_info(con)
    acc = _Accumulator(vs)
    for chunk in chunks(con, info, chunk_tokens=chunk_tokens, progress=progress):
        acc.add(chunk)
    return acc.tables(info)


class _Accumulator:
    """Additive sums per (variant, pair, sign, μ bucket, category) and sequence counts per (variant, pair, sign):
    per chunk and variant, np.bincount over group ids (maxima by reduceat); frames built once at the end."""

    def __init__(self, vs: list[Variant]):
        self.vs = vs
        self.tokens: list[tuple[pd.DataFrame, dict]] = []
        self.seqs: list[tuple[pd.DataFrame, dict]] = []

    def add(self, chunk: Chunk) -> None:
        tok, gid = _groups(chunk.token_keys())
        seq, sid = _groups(chunk.seq_keys())
        order = np.argsort(gid, kind="stable")
        starts = np.searchsorted(gid[order], np.arange(len(tok)))
        parts = list(chunk.parts())  # laid out once, read by every variant
        r = _gathered(chunk.n, parts, lambda b: b.r)  # r exactly as the rules compute it

        def count(x, ids=gid, n=None):
            return np.bincount(ids, weights=x, minlength=len(tok) if n is None else n)

        n_tokens, n_seqs = count(None), count(None, sid, len(seq))
        for v in self.vs:
            if "topk" in v.method.needs and chunk.topk is None:
                continue
            keep, weight = _run(v, chunk.n, parts)
            w = np.where(keep, weight, 0.0)
            self.tokens.append((tok, {
                "label": v.label, "n_tokens": n_tokens, "n_masked": count(~keep),
                "n_changed": count(keep & (weight != r)), "s_w": count(w), "s_w2": count(w * w),
                "x_w": np.maximum.reduceat(np.where(keep, weight, -np.inf)[order], starts)}))
            kept_any = np.logical_or.reduceat(keep, chunk.seq_start)
            self.seqs.append((seq, {"label": v.label, "n_seqs": n_seqs, "n_seqs_masked": count(~kept_any, sid, len(seq))}))

    def tables(self, info) -> dict[str, pd.DataFrame]:
        from mismatch_lab.corrections.report import tables

        def frame(parts):
            """One frame from (keys, {column: array or scalar}) parts, concatenated column by column."""
            if not parts:
                return None
            keys = pd.concat([k for k, _ in parts], ignore_index=True)
            sizes = [len(k) for k, _ in parts]
            for col in parts[0][1]:
                keys[col] = np.concatenate([np.broadcast_to(c[col], n) for (_, c), n in zip(parts, sizes)])
            return keys

        return tables(self.vs, frame(self.tokens), frame(self.seqs), info)


def _groups(keys: pd.DataFrame) -> tuple[pd.DataFrame, np.ndarray]:
    """(the distinct key rows, the group id [n] of each row into them)."""
    g = keys.groupby(list(keys.columns), sort=False, observed=True, dropna=False)
    return g.size().reset_index()[list(keys.columns)], g.ngroup().to_numpy()


def _gathered(n: int, parts: list, fn) -> np.ndarray:
    """fn(batch) [B, T] of every part, back in the chunk's flat order: [n]."""
    out = np.empty(n, dtype=np.float64)
    for part in parts:
        out[part.index] = part.gather(fn(part.batch))
    return out


def _run(v: Variant, n: int, parts: list) -> tuple[np.ndarray, np.ndarray]:
    """keep [n] bool and weight [n] of variant v on every token of a chunk (its parts), in flat order."""
    import torch

    keep = np.empty(n, dtype=bool)
    weight = np.empty(n, dtype=np.float64)
    for part in parts:
        with torch.no_grad():
            d = v.method.rule(part.batch, v.params)
        keep[part.index] = part.gather(d.keep)
        weight[part.index] = part.gather(d.weight)
    return keep, weight
