"""The scorer as it was before the per-dtype rewrite (lockstep: every dtype's model resident, all scoring each
micro-batch together), kept verbatim as the reference the new `scoring.HFScorer` is tested against
(test_collect_scoring.py). Not used by the package.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from mismatch_lab.engines.base import TORCH_DTYPES

REF_DTYPE = "fp32"


@dataclass
class ScoreItem:
    """One sequence to score: prompt ids, response ids, and the rollout's top-K ids per response token."""

    prompt_ids: list[int]
    response_ids: list[int]
    rollout_topk_ids: list[list[int]] | None = None


@dataclass
class SeqScores:
    """Per-token results for one sequence and one scorer; lists of length len(response_ids).

    Non-finite values are None (stored as NULL) and flagged in `nonfinite`; never replaced by numbers.
    """

    logp: list
    entropy: list
    nonfinite: list
    topk_ids: list | None = None
    topk_logps: list | None = None
    tv_exact_vs_ref: list | None = None
    kl_exact_vs_ref: list | None = None
    logps_at_rollout_topk: list | None = None
    logps_at_ref_topk: list | None = None
    extra: dict = field(default_factory=dict)


def _finite_or_none(x):
    if isinstance(x, list):
        return [_finite_or_none(v) for v in x]
    return x if math.isfinite(x) else None


def _finite_list(t) -> list | None:
    """`t.tolist()` with non-finite entries as None. The per-element pass runs only when the tensor holds a
    non-finite value: converting every top-K entry one by one dominated the scorer's time on GPU."""
    import torch

    if t is None:
        return None
    vals = t.cpu().tolist()
    return vals if bool(torch.isfinite(t).all()) else _finite_or_none(vals)


class LockstepScorer:
    """Teacher-forced HF scoring at several dtypes, chunked over rows of the vocabulary projection."""

    def __init__(self, model: str, dtypes: Sequence[str], *, device: str | None = None, top_k: int = 20,
                 chunk_rows: int = 1024, batch_tokens: int = 8192, models: dict | None = None):
        import torch
        from transformers import AutoModelForCausalLM

        for d in dtypes:
            if d not in TORCH_DTYPES:
                raise ValueError(f"unknown scorer dtype {d!r}; use bf16, fp16 or fp32")
        self.dtypes = list(dict.fromkeys(dtypes))
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.top_k = top_k
        self.chunk_rows = chunk_rows
        self.batch_tokens = batch_tokens
        self.ref = REF_DTYPE if REF_DTYPE in self.dtypes else None
        self.models = {}
        for d in self.dtypes:
            m = (models or {}).get(d)
            if m is None:
                m = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, TORCH_DTYPES[d]))
                m = m.to(self.device).eval()
            self._check_supported(m)
            self.models[d] = m

    @staticmethod
    def _check_supported(m) -> None:
        head = m.get_output_embeddings()
        if getattr(head, "bias", None) is not None or getattr(m.config, "final_logit_softcapping", None):
            from mismatch_lab.errors import UserError

            raise UserError(f"{type(m).__name__}: lm_head bias / logit soft-capping is not supported by the "
                            "chunked scorer; use a model whose logits are h @ W.T")

    def names(self) -> list[str]:
        return [f"hf:{d}" for d in self.dtypes]

    def config(self) -> dict:
        return {"scorer_dtypes": self.dtypes, "ref": f"hf:{self.ref}" if self.ref else None,
                "chunk_rows": self.chunk_rows, "batch_tokens": self.batch_tokens, "device": self.device,
                "pi_definition": "log_softmax in fp32 of (h @ W.T) computed in the scorer dtype"}

    def load_state_dict(self, state_dict: dict) -> None:
        """Copy new weights into every scorer copy (training: the scorers follow the trained policy)."""
        for m in self.models.values():
            m.load_state_dict(state_dict, strict=False)

    # ------------------------------------------------------------------------------------------------
    def score(self, items: Sequence[ScoreItem]) -> dict[str, list[SeqScores]]:
        """Score every item with every dtype; returns scorer name ('hf:<dtype>') -> one SeqScores per item."""
        results: dict[str, list] = {n: [None] * len(items) for n in self.names()}
        order = sorted(range(len(items)), key=lambda i: len(items[i].prompt_ids) + len(items[i].response_ids))
        batch: list[int] = []
        width = 0
        for i in order:
            L = len(items[i].prompt_ids) + len(items[i].response_ids)
            if batch and max(width, L) * (len(batch) + 1) > self.batch_tokens:
                self._score_batch(items, batch, results)
                batch, width = [], 0
            batch.append(i)
            width = max(width, L)
        if batch:
            self._score_batch(items, batch, results)
        return results

    def hidden_states(self, dtype: str, input_ids, attention_mask):
        """Final hidden states [B, L, H] of the decoder (after its last norm) at `dtype`."""
        return self.models[dtype].get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    def _score_batch(self, items, idx: list[int], results) -> None:
        import torch

        from mismatch_lab.scoring.logsoftmax import chunked_row_stats

        seqs = [items[i] for i in idx]
        width = max(len(s.prompt_ids) + len(s.response_ids) for s in seqs)
        ids = torch.zeros((len(seqs), width), dtype=torch.long)
        attn = torch.zeros_like(ids)
        rows_b, rows_t, targets = [], [], []
        for b, s in enumerate(seqs):  # right padding: positions of real tokens are 0..L-1
            full = list(s.prompt_ids) + list(s.response_ids)
            ids[b, : len(full)] = torch.tensor(full)
            attn[b, : len(full)] = 1
            for j, tok in enumerate(s.response_ids):  # position p predicts token p + 1
                rows_b.append(b)
                rows_t.append(len(s.prompt_ids) + j - 1)
                targets.append(tok)
        if not targets:
            for n in self.names():
                for i in idx:
                    results[n][i] = SeqScores(logp=[], entropy=[], nonfinite=[])
            return
        rb, rt = torch.tensor(rows_b), torch.tensor(rows_t)
        tgt = torch.tensor(targets, dtype=torch.long)
        hidden, weight = {}, {}
        with torch.no_grad():
            for d in self.dtypes:
                h = self.hidden_states(d, ids.to(self.device), attn.to(self.device))
                hidden[d] = h[rb.to(h.device), rt.to(h.device)]
                weight[d] = self.models[d].get_output_embeddings().weight
            gather = {}
            lens = None
            if any(s.rollout_topk_ids for s in seqs):
                flat = [row for s in seqs for row in (s.rollout_topk_ids or [[t] for t in s.response_ids])]
                m = max(len(r) for r in flat)
                lens = [len(r) for r in flat]
                gather["rollout"] = torch.tensor([r + [r[0]] * (m - len(r)) for r in flat], dtype=torch.long).to(self.device)
            stats = chunked_row_stats(hidden, weight, tgt.to(self.device), top_k=self.top_k, ref=self.ref,
                                      gather=gather, chunk_rows=self.chunk_rows)
        ref_len = stats[self.ref].topk_len.tolist() if (self.ref and self.top_k > 0) else None
        for d in self.dtypes:
            st = stats[d]
            # a row is non-finite when any value it stores is (the value itself is stored as NULL)
            bad = ~(torch.isfinite(st.logp) & torch.isfinite(st.entropy))
            if st.tv is not None:
                bad |= ~(torch.isfinite(st.tv) & torch.isfinite(st.kl))
            cols = {"logp": _finite_list(st.logp), "entropy": _finite_list(st.entropy), "tv": _finite_list(st.tv),
                    "kl": _finite_list(st.kl), "bad": bad.cpu().tolist()}
            tk_ids = st.topk_ids.cpu().tolist() if self.top_k > 0 else None
            tk_lps = _finite_list(st.topk_logps) if self.top_k > 0 else None
            tk_len = st.topk_len.tolist()
            g_roll = _finite_list(st.at_ids["rollout"]) if "rollout" in st.at_ids else None
            g_ref = _finite_list(st.at_ref_topk)
            r = 0
            for b, s in zip(idx, seqs):
                n = len(s.response_ids)
                sl = slice(r, r + n)
                out = SeqScores(logp=cols["logp"][sl], entropy=cols["entropy"][sl], nonfinite=cols["bad"][sl])
                if tk_ids is not None:
                    out.topk_ids = [tk_ids[k][: tk_len[k]] for k in range(r, r + n)]
                    out.topk_logps = [tk_lps[k][: tk_len[k]] for k in range(r, r + n)]
                if cols["tv"] is not None:
                    out.tv_exact_vs_ref = cols["tv"][sl]
                    out.kl_exact_vs_ref = cols["kl"][sl]
                if g_roll is not None and s.rollout_topk_ids:
                    out.logps_at_rollout_topk = [g_roll[k][: lens[k]] for k in range(r, r + n)]
                if g_ref is not None:
                    out.logps_at_ref_topk = [g_ref[k][: ref_len[k]] for k in range(r, r + n)]
                results[f"hf:{d}"][b] = out
                r += n

    def close(self) -> None:
        self.models.clear()
