"""Stores with planted values for the doctor tests (a module of its own: `conftest` is not a unique name), written with the contract's DDL into real DuckDB files.

`planted(path, *pairs)` writes one collect run per `Pair`: `n_seq` sequences of `length` tokens, every
token with log mu = log(mu) and log pi = log(pi) (overrides per (sequence, position) through `pi_at`), so
every number of measure.py is known in closed form.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import pandas as pd

from mismatch_lab.store.synthetic import write_store


@dataclass
class Pair:
    rollout: str = "vllm:bf16"
    scorer: str = "hf:fp32"
    mu: float = 0.5
    pi: float = 0.5
    n_seq: int = 8
    length: int = 10
    pi_at: Callable[[int, int], float] | None = None  # (sequence, position) -> pi, overriding `pi`
    lengths: list[int] | None = None  # per sequence, overriding n_seq x length
    nonfinite: int = 0  # score rows stored as NULL with nonfinite = true (the first positions of sequence 0)
    config: dict = field(default_factory=dict)
    run_id: str = ""
    tokens: Callable[[int, int], int] | None = None  # (sequence, position) -> token id (default: position)


def pair_frames(p: Pair, index: int) -> dict[str, pd.DataFrame]:
    engine, dtype = p.rollout.split(":")
    run_id = p.run_id or f"planted-{index}-{engine}-{dtype}"
    lengths = p.lengths or [p.length] * p.n_seq
    runs = pd.DataFrame([{"run_id": run_id, "study": "planted", "kind": "collect", "status": "complete",
                          "created_at": pd.Timestamp("2026-01-01"), "model": "planted", "weights_sha256": "0" * 64,
                          "engine": engine, "engine_dtype": dtype, "device": "cpu", "versions": "{}",
                          "config": json.dumps(p.config)}])
    seqs, toks, scores = [], [], []
    for s, n in enumerate(lengths):
        seqs.append({"run_id": run_id, "seq_id": s, "prompt_id": f"p{s}", "sample_idx": 0, "response_len": n})
        for pos in range(n):
            tok = p.tokens(s, pos) if p.tokens else pos
            toks.append({"run_id": run_id, "seq_id": s, "pos": pos, "token_id": tok, "logp_rollout": math.log(p.mu)})
            bad = s == 0 and pos < p.nonfinite
            pi = p.pi_at(s, pos) if p.pi_at else p.pi
            scores.append({"run_id": run_id, "seq_id": s, "pos": pos, "scorer": p.scorer,
                           "logp": None if bad else math.log(pi), "nonfinite": bad})
    return {"runs": runs, "sequences": pd.DataFrame(seqs), "tokens": pd.DataFrame(toks), "scores": pd.DataFrame(scores)}


def planted(path, *pairs: Pair, skipped: list[tuple[str, str]] = ()) -> str:
    """Write every pair's run into one DuckDB store at `path`; `skipped` adds (run index, prompt id) rows."""
    parts = [pair_frames(p, i) for i, p in enumerate(pairs)]
    frames = {t: pd.concat([f[t] for f in parts], ignore_index=True) for t in ("runs", "sequences", "tokens", "scores")}
    if skipped:
        ids = list(frames["runs"]["run_id"])
        frames["skipped_prompts"] = pd.DataFrame([{"run_id": ids[i], "prompt_id": pid, "reason": "too long"}
                                                  for i, pid in skipped])
    write_store(path, frames)
    return str(path)
