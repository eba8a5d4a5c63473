"""Routing recorded by `collect`: whether a checkpoint is MoE, the rollout engine's routing of each sampled
sequence, and the contract's `routing` rows (store.schema COLUMNS["routing"]).

The rollout side is the rollout engine's own PREFILL of the sampled tokens (prompt + response, prefix cache reset
so every token is computed; batched, rows mapped back and checked), not its decode steps: vLLM's `enable_return_routed_experts` (the routing of the
decode steps themselves) needs the GPU model runner, and the in-process CPU engine exposes its MoE blocks only to
hooks (`vllm_side.py`). A prefill routes the same tokens with the same weights and kernels at the engine's dtype,
but in a different batch shape than the decode steps, so it is the engine's routing of these tokens, not
necessarily the routing the sampler saw token by token. The HF rollout engine is read the same way (`hf.py`).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from mismatch_lab.routing.compare import Routing

MOE_CONFIG_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
"""config.json keys of a checkpoint with routed experts (Qwen-MoE, Mixtral, DeepSeek)."""


def is_moe(model_config: dict) -> bool:
    """Whether the checkpoint's config declares routed experts (text_config of a multimodal config included)."""
    cfgs = [model_config, model_config.get("text_config") or {}]
    return any(c.get(k) for c in cfgs for k in MOE_CONFIG_KEYS)


def _vllm(engine, sequences: list[list[int]]) -> list[Routing]:
    from mismatch_lab.routing.vllm_side import vllm_routings

    return vllm_routings(engine, sequences)


def _hf(engine, sequences: list[list[int]]) -> list[Routing]:
    from mismatch_lab.routing.hf import hf_routing

    return [hf_routing(engine.model, ids)[0] for ids in sequences]


ROLLOUT_CAPTURE = {"vllm": _vllm, "hf": _hf}
"""rollout engine name -> (engine, [prompt + response ids]) -> the engine's routing of every token of each."""


def rollout_routings(engine_name: str, engine, sequences: list[list[int]]) -> list[Routing]:
    """The rollout engine's routing of every token of each sequence (prompt + response): vLLM by batched
    prefills whose rows are mapped back and checked (`vllm_side.vllm_routings`), HF one forward a sequence."""
    return ROLLOUT_CAPTURE[engine_name](engine, sequences)


def routing_table(run_id: str, side: str, seq_ids, routings: list[Routing], starts, lengths) -> pa.Table:
    """Contract `routing` rows of one side: sequence i's response positions 0..lengths[i]-1 are `routings[i]`'s
    tokens from `starts[i]` on (prompt_len - 1 for a routing of every token, `scoring.positions`; 0 for a
    scorer's routing of its response rows); `seq_ids[i]` its seq_id. Rows ordered (seq, pos, layer)."""
    from mismatch_lab.store.writer import ROUTING_TYPES, to_arrow

    cols: dict[str, list] = {k: [] for k in ("seq_id", "pos", "layer", "ids", "weights", "margin")}
    for seq_id, r, start, length in zip(seq_ids, routings, starts, lengths):
        r = Routing(r.ids[start:start + length], r.weights[start:start + length], r.margin[start:start + length])
        n, layers, k = r.ids.shape
        cols["seq_id"].append(np.full(n * layers, seq_id, np.int64))
        cols["pos"].append(np.repeat(np.arange(n, dtype=np.int32), layers))
        cols["layer"].append(np.tile(np.arange(layers, dtype=np.int16), n))
        cols["ids"].append(r.ids.reshape(-1, k))
        cols["weights"].append(r.weights.reshape(-1, k))
        cols["margin"].append(r.margin.reshape(-1))
    if not cols["seq_id"]:
        return to_arrow("routing", {})
    flat = {key: np.concatenate(v) for key, v in cols.items()}
    rows = len(flat["seq_id"])
    k = flat["ids"].shape[1]
    offsets = pa.array(np.arange(rows + 1, dtype=np.int32) * k)
    table = {"run_id": pa.array([run_id] * rows, pa.string()), "seq_id": pa.array(flat["seq_id"]),
             "pos": pa.array(flat["pos"]), "side": pa.array([side] * rows, pa.string()),
             "layer": pa.array(flat["layer"]),
             "expert_ids": pa.ListArray.from_arrays(offsets, pa.array(flat["ids"].reshape(-1).astype(np.int16))),
             "expert_weights": pa.ListArray.from_arrays(offsets, pa.array(
                 flat["weights"].reshape(-1).astype(np.float32))),
             "margin": pa.array(flat["margin"].astype(np.float32))}
    return pa.table({name: table[name].cast(typ) for name, typ in ROUTING_TYPES.items()})
