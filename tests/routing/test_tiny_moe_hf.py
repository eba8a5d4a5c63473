"""`model tiny-moe`: deterministic bytes, a real Qwen3-MoE that transformers loads and runs, a router that is
not a coin toss, and R3 replay on the HF side."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from mismatch_lab.models import TINY_MOE, make_tiny_moe_model


def _files(d: str | Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Path(d).iterdir()) if p.is_file()}


def test_the_same_seed_writes_the_same_bytes_and_another_seed_other_weights(tmp_path, tiny_moe, embedded_model):
    again = make_tiny_moe_model(tmp_path / "again", base=embedded_model, seed=0)
    other = make_tiny_moe_model(tmp_path / "other", base=embedded_model, seed=1)
    assert _files(again) == _files(tiny_moe)
    assert _files(other)["model.safetensors"] != _files(tiny_moe)["model.safetensors"]


def test_the_checkpoint_is_a_qwen3_moe_with_the_declared_shape(tiny_moe):
    cfg = json.loads((Path(tiny_moe) / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    assert cfg["num_hidden_layers"] == TINY_MOE["layers"]
    assert cfg["num_local_experts"] == TINY_MOE["experts"] and cfg["num_experts_per_tok"] == TINY_MOE["top_k"]


def test_transformers_loads_it_and_generates_new_tokens(hf_fp32, token_seqs):
    import torch

    out = hf_fp32.generate(torch.tensor([token_seqs[0]]), max_new_tokens=5, do_sample=False)
    assert out.shape[1] == len(token_seqs[0]) + 5


def test_router_margins_are_not_near_ties_and_every_expert_is_used(hf_fp32, token_seqs):
    from mismatch_lab.routing.hf import hf_routing

    routings = [hf_routing(hf_fp32, ids)[0] for ids in token_seqs]
    margin = np.concatenate([r.margin for r in routings])
    ids = np.concatenate([r.ids for r in routings])
    # three quarters of the (token, layer) cells sit 0.1 logit or more from a change of the expert set
    assert np.quantile(margin, 0.25) > 0.1, np.quantile(margin, [0.1, 0.25, 0.5])
    assert (np.bincount(ids.ravel(), minlength=TINY_MOE["experts"]) > 0).all()
    top1 = np.concatenate([r.weights[..., 0] for r in routings])
    assert 0.5 <= np.median(top1) < 0.95  # the second expert matters: no one-hot router


def test_replay_routes_every_token_to_the_given_experts_with_the_given_weights(hf_fp32, token_seqs):
    from mismatch_lab.routing.compare import Routing
    from mismatch_lab.routing.hf import hf_routing

    ids = token_seqs[0]
    own, _ = hf_routing(hf_fp32, ids)
    rng = np.random.default_rng(0)  # a routing the router would never choose: random distinct experts
    forced_ids = np.argsort(rng.random(own.ids.shape[:2] + (TINY_MOE["experts"],)), axis=-1)[..., :TINY_MOE["top_k"]]
    forced_w = rng.dirichlet(np.ones(TINY_MOE["top_k"]), size=own.ids.shape[:2])
    forced = Routing(ids=forced_ids, weights=forced_w, margin=own.margin)
    got, _ = hf_routing(hf_fp32, ids, replay=forced, use_weights=True)
    assert (got.ids == forced_ids).all()
    np.testing.assert_allclose(got.weights, forced_w, rtol=2 ** -23)  # fp32 rounding of the given weights
    ids_only, _ = hf_routing(hf_fp32, ids, replay=forced)
    assert (ids_only.ids == forced_ids).all()
    np.testing.assert_allclose(ids_only.weights.sum(-1), 1.0, rtol=4 * 2 ** -23)  # renormalized own softmax


def test_replaying_the_models_own_routing_changes_no_log_prob(hf_fp32, token_seqs):
    from mismatch_lab.routing.hf import hf_routing

    own, logp = hf_routing(hf_fp32, token_seqs[1])
    replayed, logp_replayed = hf_routing(hf_fp32, token_seqs[1], replay=own)
    assert (replayed.ids == own.ids).all()
    np.testing.assert_array_equal(logp_replayed, logp)  # same ids, same recomputed weights: bitwise
