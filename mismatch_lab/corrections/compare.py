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

from collections.abc import Callable, Collection, Mapping
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
    if "tis" in overrides:
        raise ValueError("tis is not compared (it is pg_is + token_tis at cap 3): set token_tis.cap instead")
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
            out.append(Variant("grpo_clip_higher", m, m.resolve(extra, label="grpo_clip_higher")))
    return out


def compare(con, *, overrides=None, chunk_tokens: int = 1 << 20,
            progress: Callable[[int, int], None] | None = None,
            methods: Collection[str] | None = None) -> dict[str, pd.DataFrame]:
    """Tables `corrections` (one row per method and pair) and `by_adv_sign`, `by_mu_bucket`,
    `by_category` (the same per split value) of the store on `con`. progress(tokens done, total).
    `methods`: only these labels (each row is computed alone, so it equals the full comparison's row)."""
    from mismatch_lab.corrections.layout import pair_info

    vs = [v for v in variants(overrides) if methods is None or v.label in methods]
    info = pair_info(con)
    return accumulate(con, vs, info, chunk_tokens=chunk_tokens, progress=progress).tables(info)


def accumulate(con, vs: list[Variant], info: pd.DataFrame, *, record=None, chunk_tokens: int = 1 << 20,
               progress: Callable[[int, int], None] | None = None) -> _Accumulator:
    """The sums of variants `vs` over the pairs of `info` (layout.pair_info), chunk by chunk. `record`: a
    dropped.DropRecorder, given every variant's keep flag of every token on the way."""
    acc = _Accumulator(vs, record)
    for chunk in chunks(con, info, chunk_tokens=chunk_tokens, progress=progress):
        acc.add(chunk)
    return acc


@dataclass
class Sums:
    """An _Accumulator's sums without its variants (what a results cache keeps): per entry, its chunk."""

    tokens: list
    seqs: list
    at: list[int]
    sizes: list[int]  # tokens of each chunk


class _Accumulator:
    """Additive sums per (variant, pair, sign, μ bucket, category) and sequence counts per (variant, pair, sign):
    per chunk and variant, np.bincount over group ids (maxima by reduceat); frames built once at the end."""

    def __init__(self, vs: list[Variant], record: Callable[[Chunk], Callable[[str], np.ndarray]] | None = None):
        self.vs = vs
        self.record = record  # chunk -> (variant label -> the [n] array its keep flags go into): dropped.py
        self.tokens: list[tuple[pd.DataFrame, dict]] = []
        self.seqs: list[tuple[pd.DataFrame, dict]] = []
        self.at: list[int] = []  # the chunk of each entry
        self.sizes: list[int] = []  # tokens of each chunk

    def sums(self) -> Sums:
        return Sums(self.tokens, self.seqs, self.at, self.sizes)

    def spliced(self, base: Sums, vs: list[Variant]) -> _Accumulator | None:
        """The sums of a run of `vs` on the same chunks as `base` (a run of variants with the same labels): this
        accumulator's variants' entries in place of base's, in base's order (chunk, then variant), so that the
        tables built from them are those of one run of `vs`, bit for bit (sums of floats depend on order).
        None when this run's chunks are not base's."""
        mine = {(i, t[1]["label"]): (t, q) for i, t, q in zip(self.at, self.tokens, self.seqs)}
        labels = {v.label for v in self.vs}
        if self.sizes != base.sizes or len(mine) != sum(t[1]["label"] in labels for t in base.tokens):
            return None
        out = _Accumulator(vs)
        for i, t, q in zip(base.at, base.tokens, base.seqs):
            t, q = mine.pop((i, t[1]["label"])) if t[1]["label"] in labels else (t, q)
            out.tokens.append(t)
            out.seqs.append(q)
            out.at.append(i)
        out.sizes = self.sizes
        return out

    def add(self, chunk: Chunk) -> None:
        tok, gid = _groups(chunk.token_keys())
        seq, sid = _groups(chunk.seq_keys())
        parts = list(chunk.parts(gid, len(tok), sid))  # laid out once, read by every variant
        n_tokens = np.bincount(gid, minlength=len(tok))
        n_seqs = np.bincount(sid, minlength=len(seq))
        keep_of = self.record(chunk) if self.record is not None else None
        for v in self.vs:
            if "topk" in v.method.needs and chunk.topk is None:
                continue
            sums, x_w, dropped = _run(v, parts, len(tok), len(seq), None if keep_of is None else keep_of(v.label))
            self.tokens.append((tok, {"label": v.label, "n_tokens": n_tokens, **sums, "x_w": x_w}))
            self.seqs.append((seq, {"label": v.label, "n_seqs": n_seqs, "n_seqs_masked": dropped}))
            self.at.append(len(self.sizes))
        self.sizes.append(chunk.n)

    def tables(self, info) -> dict[str, pd.DataFrame]:
        from mismatch_lab.corrections.report import tables

        return tables(self.vs, entries_frame(self.tokens), entries_frame(self.seqs), info)


def entries_frame(parts: list) -> pd.DataFrame | None:
    """One frame from an accumulator's (keys, {column: array or scalar}) entries, concatenated column by column
    (None without entries)."""
    if not parts:
        return None
    keys = pd.concat([k for k, _ in parts], ignore_index=True)
    sizes = [len(k) for k, _ in parts]
    for col in parts[0][1]:
        keys[col] = np.concatenate([np.broadcast_to(c[col], n) for (_, c), n in zip(parts, sizes)])
    return keys


def _groups(keys: pd.DataFrame) -> tuple[pd.DataFrame, np.ndarray]:
    """(the distinct key rows, the group id [n] of each row into them)."""
    g = keys.groupby(list(keys.columns), sort=False, observed=True, dropna=False)
    return g.size().reset_index()[list(keys.columns)], g.ngroup().to_numpy()


def _run(v: Variant, parts: list, n_groups: int, n_seq_groups: int,
         keep_out: np.ndarray | None = None) -> tuple[dict, np.ndarray, np.ndarray]:
    """Variant v on every part of a chunk, counted on the padded tensors per token group: n_masked, n_changed
    (kept with w ≠ r), s_w, s_w2 (kept); x_w the kept maximum per group; and sequences dropped whole per
    sequence group. Padding cells fall in the extra group n_groups, dropped at the end. `keep_out` [n]: filled
    with each token's keep flag M, in the chunk's flat order."""
    import torch

    sums = {k: torch.zeros(n_groups + 1, dtype=torch.float64) for k in ("n_masked", "n_changed", "s_w", "s_w2")}
    x_w = torch.full((n_groups + 1,), -np.inf, dtype=torch.float64)
    dropped = torch.zeros(n_seq_groups, dtype=torch.float64)
    for part in parts:
        b = part.batch
        with torch.no_grad():
            d = v.method.rule(b, v.params)
        keep = d.keep
        if keep_out is not None:
            keep_out[part.index] = keep[b.mask].numpy()
        w = torch.where(keep, d.weight, 0.0)
        cells = {"n_masked": b.mask & ~keep, "n_changed": keep & (d.weight != b.r), "s_w": w, "s_w2": w * w}
        for k, x in cells.items():
            sums[k] += torch.bincount(part.gid, weights=x.reshape(-1).to(torch.float64), minlength=n_groups + 1)
        x_w.scatter_reduce_(0, part.gid, torch.where(keep, d.weight, -np.inf).reshape(-1), "amax")
        dropped += torch.bincount(part.sid, weights=(~keep.any(-1)).to(torch.float64), minlength=n_seq_groups)
    return {k: t[:n_groups].numpy() for k, t in sums.items()}, x_w[:n_groups].numpy(), dropped.numpy()
