"""The trainer-side scorer against naive references, and against vLLM at fp32."""

from __future__ import annotations

import math

import numpy as np
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
    for s, it in enumerate(items):
        full = torch.tensor([it.prompt_ids + it.response_ids])
        with torch.no_grad():
            lp = torch.log_softmax(model(full).logits.float(), -1)[0]
        want = [lp[len(it.prompt_ids) + j - 1, t].item() for j, t in enumerate(it.response_ids)]
        assert_close(torch.from_numpy(res.logp[res.rows(s)]), torch.tensor(want, dtype=torch.float64), atol=1e-5, rtol=1e-5)
        assert not res.nonfinite[res.rows(s)].any()


def test_vllm_fp32_and_hf_fp32_agree_on_the_same_tokens(tiny_model, vllm_tiny_fp32):
    from mismatch_lab.engines.base import GenRequest

    reqs = [GenRequest(prompt_ids=[1, 100 + i, 200 + i, 300], seed=i) for i in range(6)]
    samples = vllm_tiny_fp32.generate(reqs, max_tokens=24, top_k=5)
    assert all(len(s.token_ids) > 0 for s in samples)
    scorer = HFScorer(tiny_model, ["fp32"], top_k=5)
    res = scorer.score([ScoreItem(r.prompt_ids, s.token_ids, s.topk_ids) for r, s in zip(reqs, samples)])["hf:fp32"]
    mu = torch.tensor([x for s in samples for x in s.logps], dtype=torch.float64)
    pi = torch.from_numpy(res.logp)
    assert float((pi - mu).abs().mean()) < 1e-4
    # the rollout's top-K, re-scored by HF at the same ids, agrees as well
    a = torch.tensor([x for s in samples for row in s.topk_logps for x in row], dtype=torch.float64)
    at = res.logps_at_rollout_topk
    b = torch.from_numpy(np.concatenate([at.row(r) for r in range(len(res.logp))]))
    assert float((a - b).abs().mean()) < 1e-4


def test_vllm_prefill_scorer_equals_hf_at_fp32(tiny_model, vllm_tiny_fp32):
    seqs = [([1, 2, 3], [40, 41, 42, 43]), ([5, 6], [50, 51])]
    pre = vllm_tiny_fp32.prefill_logprobs(seqs, top_k=3)
    res = HFScorer(tiny_model, ["fp32"], top_k=3).score([ScoreItem(p, r) for p, r in seqs])["hf:fp32"]
    for s, (logps, tk_ids, _) in enumerate(pre):
        rows = range(res.rows(s).start, res.rows(s).stop)
        assert_close(torch.tensor(logps, dtype=torch.float64), torch.from_numpy(res.logp[res.rows(s)]), atol=1e-4, rtol=1e-4)
        assert [row[:3] for row in tk_ids] == [list(res.topk_ids.row(r)[:3]) for r in rows]


def test_the_prefill_scorer_table_path_keeps_vllms_values_and_order(tiny_model, vllm_tiny_fp32):
    from mismatch_lab.collect.tables import prefill_scores

    items = [ScoreItem([1, 2, 3], [40, 41, 42, 43], None), ScoreItem([5, 6], [50, 51], None)]
    raw = vllm_tiny_fp32.prefill_logprobs([(it.prompt_ids, it.response_ids) for it in items], top_k=3)
    got = prefill_scores(vllm_tiny_fp32, items, 3)
    assert got.logp.tolist() == [x for r in raw for x in r[0]]
    assert [list(got.topk_ids.row(r)) for r in range(6)] == [row for r in raw for row in r[1]]
    assert [list(got.topk_logps.row(r)) for r in range(6)] == [row for r in raw for row in r[2]]


def test_fp16_overflow_is_stored_as_null_and_flagged_never_zeroed(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mismatch_lab.collect.tables import build_tables
    from mismatch_lab.engines.base import Sample
    from mismatch_lab.record.flat import TextLookup
    from mismatch_lab.store.writer import StoreWriter

    m16 = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float16).eval()
    with torch.no_grad():  # logits far beyond fp16's 65504: inf - inf = nan in the softmax
        m16.get_output_embeddings().weight.mul_(1e4)
    scorer = HFScorer(tiny_model, ["fp32", "fp16"], top_k=2, models={"fp16": m16})
    items = [ScoreItem([1, 2, 3], [10, 11, 12])]
    res = scorer.score(items)
    sc = res["hf:fp16"]
    assert sc.nonfinite.tolist() == [True, True, True]
    assert not np.isfinite(sc.logp).any()
    assert res["hf:fp32"].nonfinite.tolist() == [False, False, False]
    sample = Sample(token_ids=[10, 11, 12], logps=[-1.0, math.nan, -2.0], text="x", finish_reason="length")
    seqs, toks, scs = build_tables("r", [{"seq_id": 0, "prompt_id": "p", "sample_idx": 0, "prompt_len": 3}], [sample],
                                   res, TextLookup(AutoTokenizer.from_pretrained(tiny_model)))
    w = StoreWriter(tmp_path / "s.duckdb")
    w.write_chunk("r", 0, sequences=seqs, tokens=toks, scores=scs, seconds=0.0)
    rows = w.con.execute("SELECT count(*), count(logp), sum(nonfinite::INT) FROM scores WHERE scorer = 'hf:fp16'").fetchone()
    assert rows == (3, 0, 3)
    assert w.con.execute("SELECT count(logp_rollout) FROM tokens").fetchone()[0] == 2  # nan mu -> NULL
    # the fp32 rows keep their values, top-K lists included (K or K+1 entries per row)
    got = w.con.execute("SELECT logp, topk_ids FROM scores WHERE scorer = 'hf:fp32' ORDER BY pos").fetchall()
    fp32 = res["hf:fp32"]
    assert [g[0] for g in got] == fp32.logp.tolist()
    assert [g[1] for g in got] == [fp32.topk_ids.row(r).tolist() for r in range(3)]
    w.close()


# ----------------------------------------------------------- the per-dtype scorer against the former lockstep one
def _items(vocab: int, n: int = 9, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    items = []
    for i in range(n):
        p = torch.randint(0, vocab, (3 + i,), generator=g).tolist()
        r = torch.randint(0, vocab, (5 + 2 * i,), generator=g).tolist()
        tk = [[t] + torch.randint(0, vocab, (3,), generator=g).tolist() for t in r] if i % 2 else None
        items.append(ScoreItem(p, r, tk))
    return items + [ScoreItem([1, 2], [])]  # an empty response scores nothing


def _assert_same_as_lockstep(model, items, dtypes, **kw):
    from lockstep_reference import LockstepScorer

    old = LockstepScorer(model, dtypes, **kw).score(items)
    new = HFScorer(model, dtypes, **kw).score(items)
    assert sorted(old) == sorted(new)
    same = lambda a, b: np.array_equal(np.array(a, dtype=np.float64), np.asarray(b, dtype=np.float64), equal_nan=True)
    for name in old:
        o, n = old[name], new[name]
        for s in range(len(items)):
            r = n.rows(s)
            assert same(o[s].logp, n.logp[r]) and same(o[s].entropy, n.entropy[r]), name
            assert o[s].nonfinite == n.nonfinite[r].tolist()
            if o[s].tv_exact_vs_ref is not None:
                assert same(o[s].tv_exact_vs_ref, n.tv_exact_vs_ref[r]) and same(o[s].kl_exact_vs_ref, n.kl_exact_vs_ref[r])
            for j, k in enumerate(range(r.start, r.stop)):
                assert n.topk_ids.row(k).tolist() == o[s].topk_ids[j]
                assert same(o[s].topk_logps[j], n.topk_logps.row(k))
                assert same(o[s].logps_at_ref_topk[j], n.logps_at_ref_topk.row(k))
                ro = n.logps_at_rollout_topk.row(k)
                assert (ro is None) == (o[s].logps_at_rollout_topk is None)
                assert ro is None or same(o[s].logps_at_rollout_topk[j], ro)


def test_the_per_dtype_scorer_gives_the_lockstep_scorers_numbers_on_the_tiny_model(tiny_model):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    # micro-batches of a few sequences, vocabulary chunks of 7 rows: every boundary is crossed
    _assert_same_as_lockstep(tiny_model, _items(5000), ["bf16", "fp16", "fp32"], top_k=4, chunk_rows=7, batch_tokens=60)


@pytest.mark.slow
def test_the_per_dtype_scorer_gives_the_lockstep_scorers_numbers_on_the_embedded_model(embedded_model):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    _assert_same_as_lockstep(embedded_model, _items(49152, n=5, seed=1), ["bf16", "fp16", "fp32"], top_k=20,
                             chunk_rows=64, batch_tokens=256)


def test_in_turn_placement_on_cpu_is_the_resident_path(tiny_model):
    # on a CPU the models already live in host memory: moving a dtype "to the device" would be a no-op
    assert HFScorer(tiny_model, ["fp32"], device="cpu", placement="in_turn").placement == "resident"


def test_auto_placement_loads_through_accelerate_and_scores_the_same_numbers(tiny_model):
    # placement 'auto' is device_map="auto" (accelerate dispatches the layers over the visible devices). On
    # this CPU machine every layer lands on the CPU, so this checks the load path and accelerate's hooks,
    # not a split across GPUs (that needs two GPUs: docs/collect.md says it is not measured)
    items = _items(5000, n=4)
    auto = HFScorer(tiny_model, ["fp32", "bf16-wfp8"], device="cpu", placement="auto")
    assert auto.placement == "auto"
    got, want = auto.score(items), HFScorer(tiny_model, ["fp32", "bf16-wfp8"], device="cpu").score(items)
    for name in want:
        for field in ("logp", "entropy", "tv_exact_vs_ref"):
            a, b = getattr(got[name], field), getattr(want[name], field)
            if b is not None:
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_strict_weight_loading_names_the_first_mismatched_tensors(tiny_model):
    scorer = HFScorer(tiny_model, ["fp32"])
    sd = dict(scorer.models["fp32"].state_dict())
    sd["model.layers.0.self_attn.q_proj.weight"] = sd["model.layers.0.self_attn.q_proj.weight"] * 2
    scorer.load_state_dict(sd)  # same names: accepted, and the new values are in place
    assert torch.equal(scorer.models["fp32"].state_dict()["model.layers.0.self_attn.q_proj.weight"],
                       sd["model.layers.0.self_attn.q_proj.weight"])
    sd["model.layers.0.self_attn.q_proj.wieght"] = sd.pop("model.layers.0.self_attn.q_proj.weight")
    with pytest.raises(ValueError, match=r"missing \['model.layers.0.self_attn.q_proj.weight'\].*unexpected "
                                         r"\['model.layers.0.self_attn.q_proj.wieght'\]"):
        scorer.load_state_dict(sd)


def test_the_position_shift_is_one_definition():
    from mismatch_lab.scoring import predicting_positions, response_rows

    assert predicting_positions(3, 2).tolist() == [2, 3]  # prompt of 3: position 2 predicts the first response token
    b, t = response_rows([3, 1], [2, 3])
    assert b.tolist() == [0, 0, 1, 1, 1] and t.tolist() == [2, 3, 0, 1, 2]
    with pytest.raises(ValueError, match="at least one prompt token"):
        predicting_positions(0, 2)
