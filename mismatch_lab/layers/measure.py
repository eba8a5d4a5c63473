"""Both models on the same tokens: the fp32 reference and the `--dtype` model, one sequence at a time.

Tokens: each prompt chat-templated as `collect` encodes it (`runtime.encode_prompts`), then a fixed greedy
continuation of `continuation` tokens chosen by the fp32 model (argmax, stops at EOS). Both models then run
one teacher-forced forward over the whole sequence (prompt + continuation, batch of one: no padding), and
every measured layer's output is compared over all T positions of every sequence (metrics.py).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

from mismatch_lab.errors import UserError
from mismatch_lab.layers import metrics

DTYPES = ("bf16", "fp16", "fp32")
"""--dtype values; fp32 is the null check (the same computation on both sides: every rel_err is 0)."""
REFERENCE = "fp32"
DEFAULT_CONTINUATION = 8


@dataclass
class Sums:
    """What one layer accumulates over sequences: ||h − ref||² and ||ref||² (metrics.squared_norms)."""

    diff_sq: float = 0.0
    ref_sq: float = 0.0


@dataclass
class Accumulator:
    """Per-layer sums, and per-token TV / KL at the logits, over every sequence."""

    sums: dict[str, Sums] = field(default_factory=dict)
    tv: list[float] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    tokens: int = 0
    sequences: int = 0

    def add(self, outputs: dict, ref_outputs: dict) -> None:
        for name, ref in ref_outputs.items():
            d, r = metrics.squared_norms(_numpy(outputs[name]), _numpy(ref))
            s = self.sums.setdefault(name, Sums())
            s.diff_sq, s.ref_sq = s.diff_sq + d, s.ref_sq + r
        tv, kl = metrics.token_tv_kl(_numpy(outputs["logits"]), _numpy(ref_outputs["logits"]))
        self.tv += tv.tolist()
        self.kl += kl.tolist()
        self.tokens += int(tv.shape[0])
        self.sequences += 1


def _numpy(t):
    """A captured [T, D] tensor as float64 numpy (exact: every float dtype here converts to float64 exactly)."""
    return t.double().cpu().numpy()


def check_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype}: use one of {', '.join(DTYPES)} (fp32 is the null check)")
    return dtype


def greedy_continuation(model, prompt_ids: list[int], n: int, eos: set[int]) -> list[int]:
    """prompt_ids + up to n tokens, each the argmax of `model`'s logits at the last position (stops at EOS)."""
    import torch

    ids = list(prompt_ids)
    device = next(model.parameters()).device
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids], device=device)).logits[0, -1]
            ids.append(int(torch.argmax(logits)))
            if ids[-1] in eos:
                break
    return ids


def sequences(engine, prompts: list[dict], continuation: int) -> list[list[int]]:
    """The token ids every layer is compared on (module doc), from the fp32 engine."""
    from mismatch_lab.runtime import encode_prompts

    prompt_ids, _ = encode_prompts(engine.tokenizer, prompts)
    eos = _eos_ids(engine)
    return [greedy_continuation(engine.model, p, continuation, eos) for p in prompt_ids]


def _eos_ids(engine) -> set[int]:
    """The tokenizer's EOS and the generation config's (an int or a list)."""
    found = getattr(getattr(engine.model, "generation_config", None), "eos_token_id", None)
    found = found if isinstance(found, list) else [found]
    return {int(t) for t in [engine.tokenizer.eos_token_id, *found] if t is not None}


def forward(engine, ids: list[int], layers) -> dict:
    """One teacher-forced forward of `ids` through `engine.model` with `layers` hooked: name -> [T, D]."""
    import torch

    from mismatch_lab.layers.hooks import Capture

    device = next(engine.model.parameters()).device
    with Capture(layers) as cap, torch.no_grad():
        engine.model(torch.tensor([ids], device=device))
    return cap.outputs


@contextmanager
def hf_side(model: str, dtype: str, device: str, seqs: list[list[int]]):
    """Yield ids -> {layer name: [T, D]} of the HF model at `dtype` (forward hooks, one forward per sequence)."""
    from mismatch_lab.engines.hf_engine import HFEngine
    from mismatch_lab.layers.hooks import find_layers

    engine = HFEngine(model, dtype, device=device)
    layers = find_layers(engine.model)
    yield lambda ids: forward(engine, ids, layers)


@contextmanager
def vllm_side(model: str, dtype: str, device: str, seqs: list[list[int]]):
    """Yield ids -> {layer name: [T, D]} of the in-process vLLM engine at `dtype`: forward hooks on the engine's
    own model (`LLM.apply_model`), one prefill per sequence (`max_tokens=1`, prefix cache reset first so every
    position is computed), the logits by the model's own `compute_logits` on the captured norm output."""
    import os

    import torch

    from mismatch_lab.engines.vllm_engine import VLLMEngine
    from mismatch_lab.layers.hooks import Capture, find_vllm_layers

    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
        raise UserError("--engine vllm hooks the engine's model in this process: unset "
                        "VLLM_ENABLE_V1_MULTIPROCESSING or set it to 0")
    engine = VLLMEngine(model, dtype, device=device, max_model_len=max(512, max(map(len, seqs)) + 1),
                        kv_cache_bytes=256 << 20)
    net = engine.llm.apply_model(lambda m: m)[0]
    layers = find_vllm_layers(net)

    def run(ids: list[int]) -> dict:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        engine.llm.reset_prefix_cache()
        with Capture(layers) as cap:
            engine.llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=1, temperature=0),
                                use_tqdm=False)
        out = cap.outputs
        with torch.no_grad():
            out["logits"] = net.compute_logits(out["norm"])
        if any(v.shape[0] != len(ids) for v in out.values()):
            raise RuntimeError(f"vLLM hooks captured {[v.shape[0] for v in out.values()]} rows for {len(ids)} tokens")
        return out

    try:
        yield run
    finally:
        engine.close()


SIDES = {"hf": hf_side, "vllm": vllm_side}
"""--engine -> the context manager running the `--dtype` side (the reference is always HF fp32)."""


def measure(model: str, dtype: str, prompts: list[dict], continuation: int = DEFAULT_CONTINUATION,
            engine: str = "hf", device: str | None = None) -> tuple[list, Accumulator]:
    """`engine` at `dtype` against HF fp32 on the same tokens: (the reference's layers, the accumulated sums)."""
    from mismatch_lab.engines.hf_engine import HFEngine
    from mismatch_lab.layers.hooks import find_layers

    ref = HFEngine(model, REFERENCE, device=device)
    ref_layers = find_layers(ref.model)
    seqs = sequences(ref, prompts, continuation)
    acc = Accumulator()
    with SIDES[engine](model, check_dtype(dtype), ref.device, seqs) as low:
        for ids in seqs:
            out = low(ids)
            if set(out) != {la.name for la in ref_layers}:
                raise RuntimeError(f"{engine}:{dtype} has the layers {sorted(out)}, the fp32 reference "
                                   f"{[la.name for la in ref_layers]}")
            acc.add(out, forward(ref, ids, ref_layers))
    return ref_layers, acc


def rows(layers, acc: Accumulator) -> list[dict]:
    """One JSON row per layer, input-to-output order: layer, kind, index, module, rel_err, growth (rel_err over
    the previous row's); the logits row adds tv_mean and kl_mean (means over tokens)."""
    import numpy as np

    errors = [metrics.rel_err_from_sums(acc.sums[la.name].diff_sq, acc.sums[la.name].ref_sq) for la in layers]
    out = [{"layer": la.name, "kind": la.kind, "index": la.index, "module": la.path, "rel_err": e, "growth": g}
           for la, e, g in zip(layers, errors, metrics.growth_ratios(errors))]
    out[-1].update(tv_mean=float(np.mean(acc.tv)), kl_mean=float(np.mean(acc.kl)))
    return out
