"""One recorded step's [B, T] arrays (`StepArrays`) and the contract rows they become (`step_tables`,
through `record.flat`, where the row rules live); numpy in, Arrow out, no per-token Python lists.

Shapes: B sequences, T positions, K top-K entries. A position is stored when its mask is true (the loss
mask: response tokens the trainer trains on); `pos` counts from the sequence's first masked position, so
a hole in the mask (tool output in a multi-turn reply) keeps its place and is simply absent.

    logp_rollout  [B, T]  log mu: the rollout engine's log-prob of token_ids[b, t]
    logp_trainer  [B, T]  log pi: the trainer's log-prob of the same token
A value that is NaN or +-inf is stored as NULL; its score row gets `nonfinite = true` (never zeroed).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from mismatch_lab.record.arrow import (
    MAX_RANKS,
    MAX_SEQUENCES,
    check_token_ids,
    describe_bad_ids,
    floats,
    lists,
    repeat,
    seq_ids,
)
from mismatch_lab.record.flat import FlatBatch, batch_tables
from mismatch_lab.store.writer import METRIC_TYPES, SEQUENCE_TYPES, TOKEN_TYPES

__all__ = ["MAX_RANKS", "MAX_SEQUENCES", "StepArrays", "metric_table", "seq_ids", "step_tables"]

@dataclass
class StepArrays:
    """One step's inputs as numpy arrays (see the module docstring for the shapes)."""

    token_ids: np.ndarray | None  # [B, T] integer; None where the loop does not have them (stored as NULL)
    mask: np.ndarray  # [B, T] bool
    logp_rollout: np.ndarray  # [B, T] float
    logp_trainer: np.ndarray  # [B, T] float
    advantages: np.ndarray | None = None  # [B] per sequence, or [B, T] per token
    rewards: np.ndarray | None = None  # [B]
    rollout_topk_ids: np.ndarray | None = None  # [B, T, K]; ragged lists padded with id -1
    rollout_topk_logps: np.ndarray | None = None  # [B, T, K]
    entropy: np.ndarray | None = None  # [B, T] the trainer's entropy, nats
    group_ids: np.ndarray | None = None  # [B] prompt group of each sequence (GRPO groups)
    sequence_columns: dict | None = None  # further sequences columns, name -> [B] values

    def check(self) -> None:
        """Shapes agree, the mask is 0/1 and the ids at response positions are token ids; a ValueError names
        the field that is not."""
        ref = "token_ids" if self.token_ids is not None else "mask"
        B, T = np.shape(getattr(self, ref)) if np.ndim(getattr(self, ref)) == 2 else (None, None)
        if B is None:
            raise ValueError(f"{ref} must be [B, T], got shape {np.shape(getattr(self, ref))}")
        want = {"mask": (B, T), "logp_rollout": (B, T), "logp_trainer": (B, T), "rewards": (B,),
                "entropy": (B, T), "group_ids": (B,)}  # fmt: skip
        for name, shape in want.items():
            v = getattr(self, name)
            if v is not None and np.shape(v) != shape:
                raise ValueError(f"{name} has shape {np.shape(v)}, expected {shape} like {ref}")
        if self.advantages is not None and np.shape(self.advantages) not in ((B,), (B, T)):
            raise ValueError(f"advantages has shape {np.shape(self.advantages)}, expected ({B},) or ({B}, {T})")
        if (self.rollout_topk_ids is None) != (self.rollout_topk_logps is None):
            raise ValueError("rollout_topk_ids and rollout_topk_logps go together: pass both or neither")
        if self.rollout_topk_ids is not None:
            a, b = np.shape(self.rollout_topk_ids), np.shape(self.rollout_topk_logps)
            if len(a) != 3 or a[:2] != (B, T) or a != b:
                raise ValueError(f"rollout_topk_ids / rollout_topk_logps have shapes {a} / {b}, expected [B, T, K]")
        for name, values in (self.sequence_columns or {}).items():
            if len(values) != B:
                raise ValueError(f"sequence column {name} has {len(values)} values, expected {B}")
        mask = np.asarray(self.mask)
        if mask.dtype != bool and not (mask.dtype.kind in "iuf" and np.isin(mask, (0, 1)).all()):
            raise ValueError(f"mask must be bool (or 0/1): True on the response (loss-mask) tokens; got dtype "
                             f"{mask.dtype} with values such as {describe_bad_ids(mask, ~np.isin(mask, (0, 1)))}")
        # ids are stored as INTEGER (no wrap, no truncation), and only at response positions: padding is free
        response = mask.astype(bool)
        if self.rollout_topk_ids is not None:
            k_ids = np.asarray(self.rollout_topk_ids)[response]
            check_token_ids(k_ids[k_ids != -1], "rollout_topk_ids at response positions", ", or -1 for padding")
        if self.token_ids is not None:
            check_token_ids(np.asarray(self.token_ids)[response], "token_ids at response positions")

    def first_rows(self, n: int) -> StepArrays:
        """The first n sequences (max_sequences_per_step)."""
        cut = {k: (None if v is None else v[:n]) for k, v in vars(self).items() if k != "sequence_columns"}
        extra = {k: list(v)[:n] for k, v in (self.sequence_columns or {}).items()} or None
        return StepArrays(**cut, sequence_columns=extra)


def step_tables(run_id: str, step: int, ids: np.ndarray, a: StepArrays, scorer: str, texts=None) -> dict[str, pa.Table]:
    """The sequences, tokens and scores rows of one step: `a` laid out flat and built by
    `flat.batch_tables` (the one definition of the row rules), every sequence kept (a fully masked one
    with response_len 0). `ids` [B] are the sequences' seq_id values; `texts` (a `flat.TextLookup`) fills
    token_text / category when given."""
    a.check()
    B, T = np.shape(a.mask)
    K = None if a.rollout_topk_ids is None else np.shape(a.rollout_topk_ids)[2]
    flat = {name: (None if v is None else np.asarray(v).reshape(B * T)) for name, v in
            (("token_ids", a.token_ids), ("mask", a.mask), ("logp_rollout", a.logp_rollout),
             ("logp_trainer", a.logp_trainer), ("entropy", a.entropy))}  # fmt: skip
    adv = None if a.advantages is None else np.asarray(a.advantages, dtype=np.float64)
    topk = {}
    if K is not None:
        k_ids = np.asarray(a.rollout_topk_ids).reshape(B * T, K)
        keep = k_ids >= 0  # ragged top-K lists come padded with id -1
        topk = {"topk_ids": lists(k_ids, keep, TOKEN_TYPES["topk_ids_rollout"]),
                "topk_logps": lists(np.asarray(a.rollout_topk_logps).reshape(B * T, K), keep,
                                    TOKEN_TYPES["topk_logps_rollout"])}  # fmt: skip
    batch = FlatBatch(
        step=int(step), rank=0, offsets=np.arange(B + 1, dtype=np.int64) * T, **flat,  # T may be 0
        advantage=None if adv is None or adv.ndim == 1 else adv.reshape(B * T),
        seq_advantage=adv if adv is not None and adv.ndim == 1 else None,
        reward=a.rewards,
        prompt_id=None if a.group_ids is None else np.array([str(g) for g in np.asarray(a.group_ids)], dtype=object),
        extra={name: pa.array(list(v), type=SEQUENCE_TYPES.get(name)) for name, v in (a.sequence_columns or {}).items()},
        **topk,
    )
    tables, _ = batch_tables(run_id, batch, 0, scorer, texts, ids=np.asarray(ids, dtype=np.int64), keep_empty=True)
    return tables


def metric_table(run_id: str, step: int, metrics: dict[str, float]) -> pa.Table:
    """train_metrics rows (run_id, step, name, value) of one step."""
    names = sorted(metrics)
    vals = np.array([float(metrics[k]) for k in names], dtype=np.float64)
    value, _ = floats(vals)
    return pa.table({"run_id": repeat(run_id, len(names), pa.string()), "step": repeat(int(step), len(names), pa.int32()),
                     "name": pa.array(names, type=pa.string()), "value": value}, schema=pa.schema(METRIC_TYPES))

