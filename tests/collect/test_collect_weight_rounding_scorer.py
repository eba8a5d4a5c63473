"""The scorer variant `hf:<dtype>-w<rounding>` (e.g. hf:fp32-wbf16): compute in <dtype> on rounded weights.

Checked against a naive reference (a fresh fp32 HF model loaded with the rounded state dict, its own full
forward and full-vocabulary log-softmax), and end to end through `collect` into the store and the analyses.
"""

from __future__ import annotations

import json

import duckdb
import numpy as np
import pytest
import torch

from mismatch_lab.engines.weights import ROUNDERS, round_state
from mismatch_lab.scoring import HFScorer, ScoreItem, parse_scorers, split_dtype

ITEMS = [ScoreItem([1, 2, 3, 4, 5], [10, 11, 12]), ScoreItem([7, 8], [20, 21, 22, 23, 24, 25]), ScoreItem([9], [30])]


def test_the_scorer_specs_parse_and_bad_ones_are_refused():
    assert parse_scorers(["fp32", "hf:fp32-wbf16", "fp32-wfp16", "bf16-wfp8", "vllm:bf16"]) == (
        ["fp32", "fp32-wbf16", "fp32-wfp16", "bf16-wfp8"], ["bf16"])
    assert split_dtype("fp32-wbf16") == ("fp32", "bf16") and split_dtype("bf16") == ("bf16", "none")
    for bad in ("fp32-wint4", "fp32-w", "fp64-wbf16", "vllm:fp32-wbf16", "hf:fp32-wnone"):
        with pytest.raises(ValueError, match="unknown scorer"):
            parse_scorers([bad])


EPS32 = float(np.finfo(np.float32).eps)
HIDDEN = 128  # models.make_tiny_model's default hidden size
REL = 4 * EPS32 * HIDDEN**0.5
"""Relative tolerance of two fp32 forwards of the same model. The scorer and the naive model reduce in
different orders (other batch shapes, h @ W.T against the lm_head module, and other GEMM kernels on other
CPUs, e.g. AMX-BF16 Xeons against AVX2): a dot product over the hidden size H then differs by about
sqrt(H) · eps_fp32 relative to the size of its terms (the random-walk growth of rounding errors; H · eps
is the worst case), and a few such products stack up through the layers (4×). A log-prob logit − logsumexp
therefore moves by up to REL · (|logit| + |logsumexp|): `scale` below. Measured: 1.9e-6 on a log-prob of
12 on an Intel Xeon with AMX-BF16, ≤ 9.5e-7 on an AMD EPYC; REL · scale is ~8e-5 for this model (scale
~13), while rounding the weights to fp16 (the finest rounding) moves log-probs by up to 15× that (asserted
per item below, so the comparison can fail)."""


def _naive_logps(model_dir: str, state: dict | None):
    """Per item, (the full [T, V] fp32 log-softmax of a fresh fp32 model (loaded with `state` when given),
    scale [T] = max_v |logit| + |logsumexp|: the size of the terms every log-prob of the row is made of)."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if state is not None:
        m.load_state_dict(state)
    out = []
    with torch.no_grad():
        for it in ITEMS:
            logits = m(torch.tensor([it.prompt_ids + it.response_ids])).logits.float()[0]
            rows = slice(len(it.prompt_ids) - 1, len(it.prompt_ids) + len(it.response_ids) - 1)
            logits = logits[rows]
            scale = logits.abs().amax(-1) + torch.logsumexp(logits, -1).abs()
            out.append((torch.log_softmax(logits, -1).double(), scale.double().numpy()))
    return out


def test_rounded_weight_scorers_equal_a_fresh_fp32_model_on_the_rounded_state_dict(tiny_model):
    from transformers import AutoModelForCausalLM

    kinds = list(ROUNDERS)  # fp8, bf16, fp16: the one registry of roundings
    scorer = HFScorer(tiny_model, ["fp32", "bf16", *[f"fp32-w{k}" for k in kinds]], top_k=3, chunk_rows=5,
                      batch_tokens=40)
    assert scorer.names() == ["hf:fp32", "hf:bf16", "hf:fp32-wfp8", "hf:fp32-wbf16", "hf:fp32-wfp16"]
    res = scorer.score(ITEMS)
    state = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).state_dict()
    ref = _naive_logps(tiny_model, None)
    vocab = ref[0][0].shape[-1]
    for k in kinds:
        got = res[f"hf:fp32-w{k}"]
        naive = _naive_logps(tiny_model, round_state(state, k))
        for s, it in enumerate(ITEMS):
            (lp, scale), (lp_ref, scale_ref) = naive[s], ref[s]
            picked = (torch.arange(len(it.response_ids)), torch.tensor(it.response_ids))
            want = lp[picked].numpy()
            tol = REL * np.maximum(scale, scale_ref)  # per position, module doc of REL
            assert (np.abs(got.logp[got.rows(s)] - want) <= tol).all(), k
            # the rounding moves this log-prob by more than the tolerance: the comparison above has teeth
            assert (np.abs(want - lp_ref[picked].numpy()) > tol).any(), k
            tv = 0.5 * (lp.exp() - lp_ref.exp()).abs().sum(-1).numpy()  # exact TV against the fp32 reference
            kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1).numpy()
            # TV and KL are p-weighted sums of log-prob differences: each side's error is at most its
            # log-probs' (tol); KL also carries the scorer's two fp32 sums over the vocabulary, each of size
            # ≤ log V and good to log2(V) · eps_fp32 relative (torch's blocked summation)
            assert (np.abs(got.tv_exact_vs_ref[got.rows(s)] - tv) <= 2 * tol).all(), k
            kl_tol = 2 * tol + 2 * np.log2(vocab) * EPS32 * np.log(vocab)
            assert (np.abs(got.kl_exact_vs_ref[got.rows(s)] - kl) <= kl_tol).all(), k
        assert not got.nonfinite.any()
    # the rounding moves the scores: neither the fp32 reference nor the bf16-compute scorer
    w = res["hf:fp32-wbf16"]
    assert np.abs(w.logp - res["hf:fp32"].logp).max() > 1e-5
    assert np.abs(w.logp - res["hf:bf16"].logp).max() > 1e-5
    assert w.tv_exact_vs_ref.min() > 0.0 and res["hf:fp32"].tv_exact_vs_ref.max() == 0.0


def test_new_weights_reach_the_rounded_copy_rounded(tiny_model):
    from mismatch_lab.engines.weights import bf16_grid

    scorer = HFScorer(tiny_model, ["fp32", "fp32-wbf16"], top_k=0)
    state = {k: v.detach().clone() + 1e-4 for k, v in scorer.models["fp32"].state_dict().items()}
    scorer.load_state_dict(state)
    for name, p in scorer.models["fp32-wbf16"].state_dict().items():
        assert p.dtype == torch.float32
        assert torch.equal(p, bf16_grid(state[name])), name
    assert torch.equal(scorer.models["fp32"].state_dict()["model.norm.weight"], state["model.norm.weight"])


def test_the_memory_plan_counts_a_rounded_weight_scorer_at_its_compute_dtype():
    from mismatch_lab.collect.memory import _bytes

    assert _bytes("fp32-wbf16") == 4 and _bytes("bf16-wfp8") == 2 and _bytes("fp16") == 2


def test_collect_stores_the_variant_under_its_label_and_the_analyses_read_it(tmp_path, tiny_model):
    from mismatch_lab.analysis.precision import precision_table
    from mismatch_lab.cli import main
    from mismatch_lab.figures.base import dtype_of

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"What is {i} + 1?"}) + "\n" for i in range(2)))
    db = tmp_path / "w.duckdb"
    assert main(["collect", "--model", tiny_model, "--prompts", str(prompts), "--db", str(db), "--samples", "2",
                 "--max-tokens", "6", "--engine", "hf", "--rollout-dtypes", "bf16",
                 "--scorer-dtypes", "fp32,bf16,hf:fp32-wbf16", "--top-k", "3", "--max-model-len", "128",
                 "--no-progress"]) == 0
    con = duckdb.connect(str(db), read_only=True)
    rows = dict(con.execute("SELECT scorer, count(tv_exact_vs_ref) FROM scores GROUP BY scorer").fetchall())
    n = con.execute("SELECT count(*) FROM tokens").fetchone()[0]
    assert rows == {"hf:fp32": n, "hf:bf16": n, "hf:fp32-wbf16": n} and n > 0
    df = precision_table(con).set_index("scorer")
    assert set(df.index) == {"hf:fp32", "hf:bf16", "hf:fp32-wbf16"}
    assert df.loc["hf:fp32-wbf16", "n_tokens"] == n
    assert dtype_of("hf:fp32-wbf16") == "fp32"
