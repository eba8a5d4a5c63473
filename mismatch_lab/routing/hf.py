"""Routing of a transformers Qwen3-MoE model (`Qwen3MoeSparseMoeBlock`) on one token sequence, and R3 replay.

transformers 5.19 `models/qwen3_moe/modeling_qwen3_moe.py`: the block calls `self.gate(h)` (a
`Qwen3MoeTopKRouter`) which returns `(router_logits, router_scores, router_indices)`: softmax in fp32 over
all experts, `torch.topk` (rank order), renormalized when `norm_topk_prob`; then `self.experts(h, indices,
scores)`. Capture reads the logits at the gate and the ids and weights at the experts' input (what the
experts really received). Replay is a forward hook on the gate that returns the rollout's ids in place of
the router's, with the rollout's weights when given, else the model's own softmax gathered at those ids and
renormalized as the router would (how verl and slime replay: the indices are forced, the weights stay the
trainer's own and differentiable).
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager

import numpy as np

from mismatch_lab.errors import UserError
from mismatch_lab.routing.compare import Routing, margins


def moe_blocks(model) -> list:
    """The MoE blocks (modules holding a `gate` and `experts`) of a transformers model, in layer order."""
    blocks = [m for _, m in model.named_modules() if hasattr(m, "gate") and hasattr(m, "experts")]
    if not blocks:
        raise UserError(f"{type(model).__name__} has no MoE block (a module with .gate and .experts); "
                        "pass a Qwen3-MoE checkpoint, e.g. `mismatch-lab model tiny-moe --out DIR`")
    return blocks


@contextmanager
def _captured(blocks):
    """Yield (logits, used): per block, the router logits [N, E] and the (ids, weights) the experts got."""
    logits, used = [[] for _ in blocks], [[] for _ in blocks]
    with ExitStack() as stack:
        for i, block in enumerate(blocks):
            def on_gate(mod, args, out, i=i):
                logits[i].append(out[0].detach().float())

            def on_experts(mod, args, kwargs, i=i):
                ids = args[1] if len(args) > 1 else kwargs["top_k_index"]
                w = args[2] if len(args) > 2 else kwargs["top_k_weights"]
                used[i].append((ids.detach().clone(), w.detach().float().clone()))

            stack.callback(block.gate.register_forward_hook(on_gate).remove)
            stack.callback(block.experts.register_forward_pre_hook(on_experts, with_kwargs=True).remove)
        yield logits, used


@contextmanager
def _replayed(blocks, replay: Routing, use_weights: bool):
    """Every block's gate returns `replay`'s ids of its layer (and its weights when `use_weights`)."""
    import torch

    with ExitStack() as stack:
        for i, block in enumerate(blocks):
            def forced(mod, args, out, i=i):
                logits = out[0]
                ids = torch.as_tensor(replay.ids[:, i], device=logits.device)
                if use_weights:
                    w = torch.as_tensor(replay.weights[:, i], dtype=torch.float32, device=logits.device)
                else:
                    w = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(1, ids)
                    if getattr(mod, "norm_topk_prob", False):
                        w = w / w.sum(dim=-1, keepdim=True)
                return logits, w.to(out[1].dtype), ids.to(out[2].dtype)

            stack.callback(block.gate.register_forward_hook(forced).remove)
        yield


def hf_routing(model, token_ids: list[int], *, replay: Routing | None = None,
               use_weights: bool = False) -> tuple[Routing, np.ndarray]:
    """One teacher-forced forward of `token_ids`: the routing of each token in each MoE layer and the
    log-probability of each next token (float64 [N-1]). With `replay`, the experts get `replay`'s ids (and
    weights with `use_weights`) instead of the router's."""
    import torch

    blocks = moe_blocks(model)
    if replay is not None and replay.ids.shape[:2] != (len(token_ids), len(blocks)):
        raise ValueError(f"replay routing {replay.ids.shape} does not fit {len(token_ids)} tokens x "
                         f"{len(blocks)} MoE layers")
    with ExitStack() as stack:
        logits, used = stack.enter_context(_captured(blocks))
        if replay is not None:  # the experts-input capture then sees the forced routing
            stack.enter_context(_replayed(blocks, replay, use_weights))
        with torch.no_grad():
            out = model(torch.tensor([token_ids], device=model.device)).logits[0].float()
    lp = torch.log_softmax(out[:-1], dim=-1).gather(1, torch.tensor(token_ids[1:], device=out.device)[:, None])
    k = used[0][0][0].shape[-1]
    routing = Routing(
        ids=np.stack([u[-1][0].cpu().numpy() for u in used], axis=1),
        weights=np.stack([u[-1][1].cpu().numpy() for u in used], axis=1),
        margin=np.stack([margins(g[-1].cpu().numpy(), k) for g in logits], axis=1),
    )
    return routing, lp[:, 0].double().cpu().numpy()


def load_hf(model_dir: str, dtype: str = "fp32"):
    """The transformers model of `model_dir` at `dtype`, on CPU, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    from mismatch_lab.engines.base import TORCH_DTYPES

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, TORCH_DTYPES[dtype]))
    return model.eval()


@contextmanager
def captured_rows(model):
    """Capture the routing of the model's forwards in the context; yields `take(rows)`: the Routing of the flat
    rows `rows` (batch index * padded length + position, the rows the MoE blocks see) of the last forward, which
    it then forgets (a scorer keeps only its response rows, micro-batch after micro-batch)."""
    blocks = moe_blocks(model)
    with _captured(blocks) as (logits, used):
        def take(rows: np.ndarray) -> Routing:
            k = used[0][-1][0].shape[-1]
            routing = Routing(ids=np.stack([u[-1][0].cpu().numpy()[rows] for u in used], axis=1),
                              weights=np.stack([u[-1][1].cpu().numpy()[rows] for u in used], axis=1),
                              margin=np.stack([margins(g[-1].cpu().numpy()[rows], k) for g in logits], axis=1))
            for calls in (*logits, *used):
                calls.clear()
            return routing

        yield take


@contextmanager
def replayed_batch(model, routings: list[Routing], width: int):
    """R3 replay on a right-padded batch: row b * width + t gets `routings[b]`'s expert ids of token t (every token
    of the sequence, prompt included); a padding row gets its sequence's first token's ids (it is never read).
    The weights are the model's own router softmax gathered at those ids (`_replayed`, use_weights=False)."""
    rows = []
    for r in routings:
        pad = np.repeat(r.ids[:1], width - r.ids.shape[0], axis=0)
        rows.append(np.concatenate([r.ids, pad]))
    ids = np.concatenate(rows)
    replay = Routing(ids=ids, weights=np.zeros(ids.shape), margin=np.zeros(ids.shape[:2]))
    with _replayed(moe_blocks(model), replay, use_weights=False):
        yield
