"""Routing inside the in-process vLLM engine (vLLM 0.32, CPU).

vLLM 0.32 `model_executor/models/qwen3_moe.py`: `Qwen3MoeSparseMoeBlock` holds `gate` (a `GateLinear`,
returning `(logits, bias)`) and `experts` (a `MoERunner` that calls the gate and then
`self.router.select_experts(...)`, `layers/fused_moe/runner/moe_runner.py`). On CPU the router is a
`CPURouter` whose softmax top-k takes `torch.topk(logits, k, sorted=False)` and renormalizes with a softmax
over the k logits (`layers/fused_moe/router/cpu_router.py::_softmax_topk`). We read the logits with a
forward hook on `gate` and the (weights, ids) the experts get by wrapping that router's `select_experts` on
the instance, for the duration of one call; ids are put in rank order (descending weight). vLLM's own
`enable_return_routed_experts` needs the GPU model runner and is not used.

The model is reached with `LLM.apply_model` (runs in this process under VLLM_ENABLE_V1_MULTIPROCESSING=0).
"""

from __future__ import annotations

import itertools
import os
from contextlib import ExitStack, contextmanager

import numpy as np

from mismatch_lab.errors import UserError
from mismatch_lab.routing.compare import Routing, margins


def vllm_moe_blocks(engine) -> list:
    """The MoE blocks of the engine's model (modules with `gate` and `experts.router`), in layer order."""
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":  # hooks on a pickled copy would see nothing
        raise UserError("routing capture needs vLLM's in-process engine: set VLLM_ENABLE_V1_MULTIPROCESSING=0")
    models = engine.llm.apply_model(lambda m: m)
    blocks = [m for _, m in models[0].named_modules()
              if hasattr(m, "gate") and hasattr(getattr(m, "experts", None), "router")]
    if not blocks:
        raise UserError(f"{engine.model}: vLLM built no MoE block with a router; pass a Qwen3-MoE checkpoint")
    return blocks


@contextmanager
def _captured(blocks):
    """Yield (logits, chosen): per block, every call's router logits and the router's (weights, ids)."""
    logits, chosen = [[] for _ in blocks], [[] for _ in blocks]
    with ExitStack() as stack:
        for i, block in enumerate(blocks):
            router = block.experts.router
            original = router.select_experts

            def select_experts(*args, _original=original, i=i, **kwargs):
                w, ids = _original(*args, **kwargs)
                chosen[i].append((w.detach().float().clone(), ids.detach().clone()))
                return w, ids

            def on_gate(mod, args, out, i=i):
                logits[i].append(out[0].detach().float().clone())

            router.select_experts = select_experts
            stack.callback(vars(router).pop, "select_experts")
            stack.callback(block.gate.register_forward_hook(on_gate).remove)
        yield logits, chosen


def _rank_ordered(weights: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    order = np.argsort(-weights, axis=-1, kind="stable")
    return np.take_along_axis(ids, order, -1), np.take_along_axis(weights, order, -1)


def vllm_routing(engine, token_ids: list[int]) -> tuple[Routing, np.ndarray]:
    """vLLM's prefill of `token_ids` (prefix cache reset first, so every token is computed): the routing of
    each token in each MoE layer and the log-probability of each next token (float64 [N-1])."""
    blocks = vllm_moe_blocks(engine)
    n = len(token_ids)
    engine.llm.reset_prefix_cache()
    with _captured(blocks) as (logits, chosen):
        logps, _, _ = engine.prefill_logprobs([(token_ids[:1], token_ids[1:])])[0]
    for i in range(len(blocks)):  # the prefill is the one call that routed all n tokens
        logits[i] = [g for g in logits[i] if g.shape[0] == n]
        chosen[i] = [c for c in chosen[i] if c[1].shape[0] == n]
        if len(logits[i]) != 1 or len(chosen[i]) != 1:
            raise RuntimeError(f"vLLM routed {n} tokens in {len(chosen[i])} calls of layer {i} (want 1): chunked "
                               "prefill or a cached prefix; shorten the sequence or raise max_num_batched_tokens")
    k = chosen[0][0][1].shape[-1]
    ids, weights = zip(*(_rank_ordered(c[0][0].numpy(), c[0][1].numpy()) for c in chosen))
    routing = Routing(ids=np.stack(ids, axis=1), weights=np.stack(weights, axis=1),
                      margin=np.stack([margins(g[0].numpy(), k) for g in logits], axis=1))
    return routing, np.asarray(logps, dtype=np.float64)


@contextmanager
def _input_ids(engine):
    """Yield a list receiving the input ids [T] of every forward of the engine's decoder (its token rows in order),
    read at its token embedding (the decoder module itself is wrapped by vLLM's compile support: no hooks)."""
    embedding = engine.llm.apply_model(lambda m: m)[0].model.embed_tokens
    seen: list = []

    def pre(mod, args, kwargs):
        ids = args[0] if args else kwargs.get("input_")
        if ids is not None:
            seen.append(ids.detach().cpu().clone())

    handle = embedding.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()


def _group_routing(engine, blocks, seqs: list[list[int]]) -> list[Routing] | None:
    """One prefill of all `seqs` together; their routings, or None when no single forward routed exactly their
    tokens in submission order (checked against the token ids that forward embedded)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    total, flat = sum(len(s) for s in seqs), [t for s in seqs for t in s]
    engine.llm.reset_prefix_cache()
    with _input_ids(engine) as seen, _captured(blocks) as (logits, chosen):
        engine.llm.generate([TokensPrompt(prompt_token_ids=s) for s in seqs], SamplingParams(max_tokens=1),
                            use_tqdm=False)
    if [x.shape[0] for x in seen].count(total) != 1 or next(x for x in seen if x.shape[0] == total).tolist() != flat:
        return None
    logits = [[g for g in calls if g.shape[0] == total] for calls in logits]
    chosen = [[c for c in calls if c[1].shape[0] == total] for calls in chosen]
    if any(len(x) != 1 for x in logits + chosen):
        return None
    k = chosen[0][0][1].shape[-1]
    ids, weights = zip(*(_rank_ordered(c[0][0].numpy(), c[0][1].numpy()) for c in chosen))
    whole = Routing(ids=np.stack(ids, axis=1), weights=np.stack(weights, axis=1),
                    margin=np.stack([margins(g[0].numpy(), k) for g in logits], axis=1))
    cuts = np.cumsum([0] + [len(s) for s in seqs])
    return [Routing(whole.ids[a:b], whole.weights[a:b], whole.margin[a:b]) for a, b in itertools.pairwise(cuts)]


def vllm_routings(engine, seqs: list[list[int]], max_batch_tokens: int = 2048) -> list[Routing]:
    """The engine's routing of every token of each sequence, by batched prefills of up to `max_batch_tokens`
    tokens (vLLM packs a group into one forward; rows mapped back in submission order, checked against the
    embedded token ids, `_group_routing`); a group that does not map is prefilled one sequence per call."""
    blocks = vllm_moe_blocks(engine)
    groups, group, size = [], [], 0
    for i, s in enumerate(seqs):
        if group and size + len(s) > max_batch_tokens:
            groups.append(group)
            group, size = [], 0
        group.append(i)
        size += len(s)
    groups += [group] if group else []
    out: list = [None] * len(seqs)
    for g in groups:
        got = _group_routing(engine, blocks, [seqs[i] for i in g]) if len(g) > 1 else None
        for i, r in zip(g, got or [vllm_routing(engine, seqs[i])[0] for i in g]):
            out[i] = r
    return out
