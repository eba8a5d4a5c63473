"""HF transformers rollout engine: `generate` with KV cache, T=1, top_p=1, no top-k (by default).

A sampling rule (`scoring.support.SamplingRule`) passes temperature / top_k / top_p to `generate`, whose
warpers apply them in vLLM's order and with its boundary rule (transformers' TemperatureLogitsWarper, then
TopKLogitsWarper: keep >= the k-th largest; then TopPLogitsWarper: ascending sort, drop where the cumulative
sum <= 1 - p, keep the largest). With `logprobs_mode='processed'` μ is the log-softmax of `generate`'s
processed scores (`output_scores=True`) instead of its raw logits.

The fallback where vLLM is absent and the path for a CUDA machine without vLLM. μ is the log-softmax
(in fp32) of the raw logits returned by `generate(output_logits=True)` at the engine dtype, i.e. the
exact distribution it sampled from. Sampling is seeded per batch (`torch.manual_seed(seed of the first
request)`): HF `generate` has no per-request seed, so a sample depends on its batch. The collector's
batches are fixed by prompt order, so a resumed run still regenerates the same samples.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from mismatch_lab.engines.base import TORCH_DTYPES, GenRequest, Sample, check_samples

LOGPROBS_MODES = {"raw": "log_softmax(raw logits) in fp32",
                  "processed": "log_softmax(processed scores: after temperature, top-k, top-p) in fp32"}
"""--logprobs-mode -> what μ is here (runs.config sampling.logprobs_mode)."""


class HFEngine:
    name = "hf"

    def __init__(self, model: str, dtype: str, *, device: str | None = None, seed: int = 0, max_model_len: int = 2048,
                 verbose: bool = False, sampling=None):
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from mismatch_lab.scoring.support import SamplingRule

        self.sampling = sampling or SamplingRule()
        self.logprobs_mode = LOGPROBS_MODES[self.sampling.logprobs_mode]

        if not verbose:  # the per-load progress bar is engine log: shown with --verbose only
            transformers.utils.logging.disable_progress_bar()
        self.dtype = dtype
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.seed = seed
        self.max_model_len = max_model_len
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, TORCH_DTYPES[dtype])).to(self.device)
        self.model.eval()
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id

    def sampling_config(self) -> dict:
        import transformers

        return {
            "engine": "hf", **self.sampling.config(), "n": 1,
            "seed": "torch.manual_seed per batch", "logprobs_mode": self.logprobs_mode,
            "mu_definition": f"{self.logprobs_mode} of generate() at the engine dtype",
            "versions": {"transformers": transformers.__version__},
        }

    def generate(self, requests: Sequence[GenRequest], *, max_tokens: int, top_k: int,
                 min_tokens: int = 0) -> list[Sample]:
        import torch

        if not requests:
            return []
        torch.manual_seed(requests[0].seed)
        width = max(len(r.prompt_ids) for r in requests)
        ids = torch.full((len(requests), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, r in enumerate(requests):  # left padding: generation continues from the right edge
            ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
            attn[i, width - len(r.prompt_ids):] = 1
        eos = self.tokenizer.eos_token_id
        with torch.no_grad():
            out = self.model.generate(
                input_ids=ids.to(self.device), attention_mask=attn.to(self.device), do_sample=True,
                temperature=self.sampling.temperature, top_p=self.sampling.top_p, top_k=self.sampling.top_k,
                max_new_tokens=max_tokens, min_new_tokens=min_tokens or None, pad_token_id=self.pad_id,
                eos_token_id=eos, output_logits=True, output_scores=self.sampling.logprobs_mode == "processed",
                return_dict_in_generate=True,
            )
        gen = out.sequences[:, width:].cpu()
        steps = out.scores if self.sampling.logprobs_mode == "processed" else out.logits
        logits = torch.stack(steps, dim=1).float()  # [B, steps, V]
        logp_all = torch.log_softmax(logits, dim=-1).cpu()
        samples = []
        for i in range(len(requests)):
            toks = gen[i].tolist()
            n = len(toks)
            if eos in toks:
                n = toks.index(eos) + 1
            toks = toks[:n]
            lp_rows = logp_all[i, :n]
            sampled = lp_rows.gather(1, torch.tensor(toks).view(-1, 1)).view(-1)
            logps = [float(x) if math.isfinite(float(x)) else math.nan for x in sampled]
            tk_ids = tk_lps = None
            if top_k > 0:
                vals, idx = lp_rows.topk(top_k, dim=-1)
                tk_ids, tk_lps = [], []
                for j, t in enumerate(toks):
                    row_ids, row_lps = idx[j].tolist(), vals[j].tolist()
                    if t not in row_ids:
                        row_ids.append(t)
                        row_lps.append(logps[j])
                    tk_ids.append(row_ids)
                    tk_lps.append(row_lps)
            finish = "stop" if toks and toks[-1] == eos else "length"
            samples.append(Sample(token_ids=toks, logps=logps, text=self.tokenizer.decode(toks, skip_special_tokens=True),
                                  finish_reason=finish, topk_ids=tk_ids, topk_logps=tk_lps))
        return check_samples(samples, f"hf:{self.dtype}")

    def load_state_dict(self, state_dict: dict) -> None:
        from mismatch_lab.models import load_state_dict_checked

        load_state_dict_checked(self.model, state_dict)

    def close(self) -> None:
        del self.model
