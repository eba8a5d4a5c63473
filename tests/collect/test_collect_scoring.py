"""The trainer-side scorer against naive references, and against vLLM at fp32."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from mismatch_lab.scoring import HFScorer, ScoreItem
from mismatch_lab.scoring.logsoftmax import chunked_row_stats


def _naive(h, w, targets, ref_h=None, ref_w=None):
    lp = torch.log_softmax((h @ w.T).float(), dim=-1)  # the full [N, V] tensor the chunked code avoids
    out = {"lp": lp, "logp": lp[torch.arange(len(targets)), targets], "entropy": -(lp.exp() * lp).sum(-1)}
    if ref_h is not None:
        lr = torch.log_softmax((ref_h @ ref_w.T).float(), dim=-1)
        out["tv"] = 0.5 * (lp.exp() - lr.exp()).abs().sum(-1)
        out["kl"] = (lr.exp() * (lr - lp)).sum(-1)
        out["lr"] = lr
    return out


@pytest.mark.parametrize("chunk_rows", [1, 7, 1024])
def test_chunked_scoring_equals_a_naive_full_log_softmax(chunk_rows):
    g = torch.Generator().manual_seed(0)
    n, hdim, vocab, k = 37, 16, 300, 5
    w32 = torch.randn(vocab, hdim, generator=g)
    h32 = torch.randn(n, hdim, generator=g) * 2
    targets = torch.randint(0, vocab, (n,), generator=g)
    gather_ids = torch.randint(0, vocab, (n, 4), generator=g)
    hidden = {"fp32": h32, "bf16": h32.bfloat16()}
    weight = {"fp32": w32, "bf16": w32.bfloat16()}
    res = chunked_row_stats(hidden, weight, targets, top_k=k, ref="fp32", gather={"r": gather_ids}, chunk_rows=chunk_rows)
    for name in ("fp32", "bf16"):
        nv = _naive(hidden[name], weight[name], targets, h32, w32)
        st = res[name]
        assert_close(st.logp, nv["logp"])
        assert_close(st.entropy, nv["entropy"])
        # bf16: a CPU with native bf16 kernels (avx512_bf16) may round a logit of a one-row chunk (gemv) one
        # bf16 ulp away from the whole-matrix product (gemm): ~1e-6 in TV, the logp tolerance above
        atol = 1e-6 if name == "fp32" else 1e-5
        assert_close(st.tv, nv["tv"], atol=atol, rtol=1e-5)
        assert_close(st.kl, nv["kl"], atol=atol, rtol=1e-5)
        assert_close(st.at_ids["r"], nv["lp"].gather(1, gather_ids))
        top_v, _ = nv["lp"].topk(k, dim=-1)
        assert_close(st.topk_logps[:, :k], top_v)
        assert_close(st.topk_logps[:, k], nv["logp"])  # the sampled token rides along as column K
        in_top = (st.topk_ids[:, :k] == targets.view(-1, 1)).any(1)
        assert torch.equal(st.topk_len, k + (~in_top).long())
        ref_ids = res["fp32"].topk_ids
        assert_close(st.at_ref_topk, nv["lp"].gather(1, ref_ids))
    assert float(res["fp32"].tv.abs().max()) == 0.0  # the reference against itself
    assert float(res["bf16"].tv.min()) > 0.0  # bf16 rounding moves every row a little


def test_scorer_equals_the_models_own_forward_at_fp32(tiny_model):
    from transformers import AutoModelForCausalLM

    scorer = HFScorer(tiny_model, ["fp32"], top_k=3, chunk_rows=5, batch_tokens=40)
    items = [ScoreItem([1, 2, 3, 4, 5], [10, 11, 12]), ScoreItem([7, 8], [20, 21, 22, 23, 24, 25]), ScoreItem([9], [30])]
    res = scorer.score(items)["hf:fp32"]
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    for it, got in zip(items, res):
        full = torch.tensor([it.prompt_ids + it.response_ids])
        with torch.no_grad():
            lp = torch.log_softmax(model(full).logits.float(), -1)[0]
        want = [lp[len(it.prompt_ids) + j - 1, t].item() for j, t in enumerate(it.response_ids)]
        assert_close(torch.tensor(got.logp), torch.tensor(want), atol=1e-5, rtol=1e-5)
        assert got.nonfinite == [False] * len(want)


def test_vllm_fp32_and_hf_fp32_agree_on_the_same_tokens(tiny_model, vllm_tiny_fp32):
    from mismatch_lab.engines.base import GenRequest

    reqs = [GenRequest(prompt_ids=[1, 100 + i, 200 + i, 300], seed=i) for i in range(6)]
    samples = vllm_tiny_fp32.generate(reqs, max_tokens=24, top_k=5)
    assert all(len(s.token_ids) > 0 for s in samples)
    scorer = HFScorer(tiny_model, ["fp32"], top_k=5)
    res = scorer.score([ScoreItem(r.prompt_ids, s.token_ids, s.topk_ids) for r, s in zip(reqs, samples)])["hf:fp32"]
    mu = torch.tensor([x for s in samples for x in s.logps])
    pi = torch.tensor([x for r in res for x in r.logp])
    assert float((pi - mu).abs().mean()) < 1e-4
    # the rollout's top-K, re-scored by HF at the same ids, agrees as well
    a = torch.tensor([x for s in samples for row in s.topk_logps for x in row])
    b = torch.tensor([x for r in res for row in r.logps_at_rollout_topk for x in row])
    assert float((a - b).abs().mean()) < 1e-4


def test_vllm_prefill_scorer_equals_hf_at_fp32(tiny_model, vllm_tiny_fp32):
    seqs = [([1, 2, 3], [40, 41, 42, 43]), ([5, 6], [50, 51])]
    pre = vllm_tiny_fp32.prefill_logprobs(seqs, top_k=3)
    res = HFScorer(tiny_model, ["fp32"], top_k=3).score([ScoreItem(p, r) for p, r in seqs])["hf:fp32"]
    for (logps, tk_ids, _), hf in zip(pre, res):
        assert_close(torch.tensor(logps), torch.tensor(hf.logp), atol=1e-4, rtol=1e-4)
        assert [row[:3] for row in tk_ids] == [row[:3] for row in hf.topk_ids]


def test_fp16_overflow_is_stored_as_null_and_flagged_never_zeroed(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    from mismatch_lab.collect import TokenTexts, build_tables
    from mismatch_lab.engines.base import Sample
    from mismatch_lab.store.writer import StoreWriter

    m16 = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float16).eval()
    with torch.no_grad():  # logits far beyond fp16's 65504: inf - inf = nan in the softmax
        m16.get_output_embeddings().weight.mul_(1e4)
    scorer = HFScorer(tiny_model, ["fp32", "fp16"], top_k=2, models={"fp16": m16})
    items = [ScoreItem([1, 2, 3], [10, 11, 12])]
    res = scorer.score(items)
    sc = res["hf:fp16"][0]
    assert sc.nonfinite == [True, True, True]
    assert all(x is None for x in sc.logp)
    assert res["hf:fp32"][0].nonfinite == [False, False, False]
    sample = Sample(token_ids=[10, 11, 12], logps=[-1.0, math.nan, -2.0], text="x", finish_reason="length")
    from transformers import AutoTokenizer

    seqs, toks, scs = build_tables("r", [{"seq_id": 0, "prompt_id": "p", "sample_idx": 0, "prompt_len": 3}], [sample],
                                   res, TokenTexts(AutoTokenizer.from_pretrained(tiny_model)))
    w = StoreWriter(tmp_path / "s.duckdb")
    w.write_chunk("r", 0, sequences=seqs, tokens=toks, scores=scs, seconds=0.0)
    rows = w.con.execute("SELECT count(*), count(logp), sum(nonfinite::INT) FROM scores WHERE scorer = 'hf:fp16'").fetchone()
    assert rows == (3, 0, 3)
    assert w.con.execute("SELECT count(logp_rollout) FROM tokens").fetchone()[0] == 2  # nan mu -> NULL
    w.close()


def test_non_finite_values_become_none_and_finite_ones_stay_exact():
    from mismatch_lab.scoring.hf_scorer import _finite_list

    t = torch.tensor([[-1.5, float("nan")], [float("-inf"), -0.25]])
    assert _finite_list(t) == [[-1.5, None], [None, -0.25]]  # the slow path, only when something is non-finite
    assert _finite_list(t[:, 1]) == [None, -0.25]
    assert _finite_list(t[:1, :1]) == [[-1.5]]
    assert _finite_list(None) is None
