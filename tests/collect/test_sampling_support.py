"""Sampling rules in collect (--temperature, --top-p, --sample-top-k, --logprobs-mode) and log S per token.

log S (scoring/support.py) is checked against a naive numpy reference and against vLLM's own top-k/top-p
masking; then real collects (vLLM CPU and HF engines, HF fp32 scorer, the tiny model) show the bias it
explains: with processed log-probs mean log r = mean log S, with raw log-probs mean log r stays ~0.
"""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import numpy as np
import pytest
import torch

from mismatch_lab.cli import main
from mismatch_lab.scoring.support import SamplingRule, support_stats

V, N = 500, 64
RULES = [SamplingRule(top_p=0.9), SamplingRule(top_k=40), SamplingRule(top_k=40, top_p=0.8),
         SamplingRule(temperature=0.7, top_p=0.95), SamplingRule(temperature=1.3), SamplingRule(top_k=1)]
FP32_TOL = 64 * np.finfo(np.float32).eps  # logsumexp over V terms in fp32: a few dozen ULPs, relative


def _naive(lp: np.ndarray, rule: SamplingRule, tgt: int) -> tuple[float, float]:
    """One row, float64, by the rule as written: sort ascending, top-k keeps >= the k-th largest, top-p
    drops where the cumulative sum (of what top-k kept, renormalised) <= 1 - p, never the largest."""
    z = lp.astype(np.float64) / rule.temperature
    order = np.argsort(z, kind="stable")
    zs = z[order]
    keep = np.ones(len(z), dtype=bool)
    if rule.top_k:
        keep &= zs >= zs[len(z) - rule.top_k]
    if rule.top_p < 1:
        w = np.where(keep, np.exp(zs - zs.max()), 0.0)
        drop = np.cumsum(w / w.sum()) <= 1 - rule.top_p
        drop[-1] = False
        keep &= ~drop
    lse = lambda x: x.max() + np.log(np.exp(x - x.max()).sum())
    kept_lse = lse(zs[keep])
    inside = keep[np.where(order == tgt)[0][0]]
    return kept_lse - lse(z), (z[tgt] - kept_lse) if inside else -np.inf


@pytest.fixture(scope="module")
def rows():
    g = torch.Generator().manual_seed(0)
    # peaked rows (their support within support.CANDIDATES) and flat ones (sorted whole)
    logits = torch.randn(N, V, generator=g) * torch.where(torch.arange(N) % 2 == 0, 3.0, 0.3).view(-1, 1)
    lp = torch.log_softmax(logits, dim=-1)
    tgt = torch.multinomial(lp.exp(), 1, generator=g).view(-1)
    tgt[:8] = lp.argsort(dim=-1)[:8, 0]  # the least likely token: outside every support that restricts
    return lp, tgt


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.label())
def test_log_s_and_renormalised_log_pi_equal_a_naive_numpy_reference(rows, rule):
    lp, tgt = rows
    log_s, logp_s = support_stats(lp, rule, tgt, rows=16)  # several sub-chunks of rows
    ref = np.array([_naive(lp[i].numpy(), rule, int(tgt[i])) for i in range(N)])
    np.testing.assert_allclose(log_s.numpy(), ref[:, 0], rtol=FP32_TOL, atol=FP32_TOL)
    assert np.array_equal(np.isfinite(logp_s.numpy()), np.isfinite(ref[:, 1]))
    inside = np.isfinite(ref[:, 1])
    np.testing.assert_allclose(logp_s.numpy()[inside], ref[inside, 1], rtol=FP32_TOL, atol=FP32_TOL)
    if rule.top_p < 1 or rule.top_k:
        assert (log_s.numpy() < 0).all() and not inside[:8].any()  # the least likely tokens are cut


@pytest.mark.parametrize("rule", [r for r in RULES if r.top_p < 1 or r.top_k], ids=lambda r: r.label())
def test_the_candidates_decide_the_peaked_rows_and_the_flat_ones_fall_back_to_the_full_sort(rows, rule):
    from mismatch_lab.scoring.support import CANDIDATES, _candidates

    lp, tgt = rows
    z = lp / rule.temperature
    *_, ok = _candidates(z, torch.logsumexp(z, dim=-1), rule, tgt, CANDIDATES[0])
    if rule.top_k == 0:
        assert ok[0::2].float().mean() > 0.5 and not ok[1::2].any(), ok
    else:  # the top-k confines the support to the candidates (no ties here)
        assert ok.all()


def test_top_k_keeps_every_token_tied_at_its_boundary():
    lp = torch.log_softmax(torch.tensor([[3.0, 1.0, 1.0, 1.0, 0.0]]), dim=-1)
    log_s, logp_s = support_stats(lp, SamplingRule(top_k=2), torch.tensor([3]))
    kept = torch.logsumexp(lp[0, :4], dim=0)  # the three tied at the 2nd largest all stay
    assert torch.equal(log_s, kept.view(1)) and torch.isfinite(logp_s).all()
    flat = torch.log_softmax(torch.cat([torch.tensor([2.0]), torch.zeros(199)]).view(1, -1), dim=-1)
    log_s, logp_s = support_stats(flat, SamplingRule(top_k=3), torch.tensor([150]))  # ties past the candidates
    assert abs(float(log_s)) <= FP32_TOL and torch.isfinite(logp_s).all()


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.label())
def test_the_support_is_the_one_vllm_masks_and_its_processed_log_probs_are_ours(rows, rule):
    from mismatch_lab.engines.vllm_engine import _import_vllm

    _import_vllm()
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    lp, tgt = rows
    z = lp / rule.temperature  # vLLM: logits in fp32, divided by T in place, then top-k / top-p
    k = torch.full((N,), rule.top_k, dtype=torch.int32) if rule.top_k else None
    p = torch.full((N,), rule.top_p) if rule.top_p < 1 else None
    processed = torch.log_softmax(apply_top_k_top_p(z.clone(), k, p), dim=-1)  # vLLM's processed_logprobs
    _, logp_s = support_stats(lp, rule, tgt)
    want = processed.gather(1, tgt.view(-1, 1)).view(-1)
    assert torch.equal(torch.isfinite(want), torch.isfinite(logp_s))
    inside = torch.isfinite(want)
    torch.testing.assert_close(logp_s[inside], want[inside], rtol=FP32_TOL, atol=FP32_TOL)


# ----------------------------------------------------------------------------------------- collect
def _collect(model, prompts: Path, db: Path, *extra) -> None:
    assert main(["collect", "--model", str(model), "--prompts", str(prompts), "--db", str(db), "--samples", "2",
                 "--max-tokens", "16", "--rollout-dtypes", "fp32", "--scorer-dtypes", "fp32", "--top-k", "3",
                 "--max-model-len", "128", "--no-progress", "--memory-plan", "off", *extra]) == 0


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_model):
    tmp = tmp_path_factory.mktemp("support")
    prompts = tmp / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"What is {i} + {i + 1}?"}) + "\n"
                               for i in range(3)))
    db = tmp / "s.duckdb"
    _collect(tiny_model, prompts, db)
    _collect(tiny_model, prompts, db, "--top-p", "0.9", "--logprobs-mode", "processed")
    _collect(tiny_model, prompts, db, "--top-p", "0.9")
    _collect(tiny_model, prompts, db, "--engine", "hf", "--top-p", "0.9", "--logprobs-mode", "processed")
    return db


def _means(db: Path) -> dict:
    con = duckdb.connect(str(db), read_only=True)
    rows = con.execute("""
        SELECT r.engine || ':' || r.engine_dtype, count(*), count(s.log_support), avg(s.logp - t.logp_rollout),
               avg(s.log_support), avg(s.logp_support - t.logp_rollout), any_value(r.config)
        FROM tokens t JOIN scores s USING (run_id, seq_id, pos) JOIN runs r USING (run_id)
        GROUP BY ALL""").fetchall()
    con.close()
    return {r[0]: {"n": r[1], "n_s": r[2], "dlogp": r[3], "log_s": r[4], "residual": r[5], "config": json.loads(r[6])}
            for r in rows}


def test_each_sampling_rule_is_its_own_rollout_recorded_in_runs_config(store):
    m = _means(store)
    assert set(m) == {"vllm:fp32", "vllm:fp32-p0.9-processed", "vllm:fp32-p0.9", "hf:fp32-p0.9-processed"}
    assert m["vllm:fp32"]["n_s"] == 0 and "top_p" not in m["vllm:fp32"]["config"]  # defaults: as before
    cfg = m["vllm:fp32-p0.9-processed"]["config"]
    assert cfg["top_p"] == 0.9 and cfg["logprobs_mode"] == "processed"
    assert cfg["sampling"]["logprobs_mode"] == "processed_logprobs" and cfg["scorer"]["support"]["top_p"] == 0.9


@pytest.mark.parametrize("rollout", ["vllm:fp32-p0.9-processed", "hf:fp32-p0.9-processed"])
def test_with_processed_log_probs_at_fp32_mean_log_r_is_mean_log_s(store, rollout):
    m = _means(store)[rollout]
    assert m["n_s"] == m["n"] >= 48
    assert m["log_s"] < -0.01  # the rule cuts real mass (else the relation below is vacuous)
    assert abs(m["dlogp"] - m["log_s"]) <= 0.01 * abs(m["log_s"]), m
    assert abs(m["residual"]) <= 0.01 * abs(m["log_s"]), m


def test_with_raw_log_probs_mean_log_r_stays_near_zero_while_log_s_is_stored(store):
    m = _means(store)["vllm:fp32-p0.9"]
    assert m["n_s"] == m["n"] and m["log_s"] < -0.01
    assert abs(m["dlogp"]) <= 0.01 * abs(m["log_s"]), m


def test_processed_log_probs_with_min_tokens_are_refused(tmp_path, tiny_model, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "p", "prompt": "hi"}) + "\n")
    rc = main(["collect", "--model", str(tiny_model), "--prompts", str(prompts), "--db", str(tmp_path / "x.duckdb"),
               "--logprobs-mode", "processed", "--min-tokens", "2", "--max-tokens", "4"])
    assert rc == 2 and "--min-tokens 0" in capsys.readouterr().err
    assert not (tmp_path / "x.duckdb").exists()
