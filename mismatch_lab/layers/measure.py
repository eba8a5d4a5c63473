"""Both models on the same tokens: the fp32 reference and the `--dtype` model, one sequence at a time.

Tokens: each prompt chat-templated as `collect` encodes it (`runtime.encode_prompts`), then a fixed greedy
continuation of `continuation` tokens chosen by the fp32 model (argmax, stops at EOS). Both models then run
one teacher-forced forward over the whole sequence (prompt + continuation, batch of one: no padding), and
every measured layer's output is compared over all T positions of every sequence (metrics.py).
"""

from __future__ import annotations

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
            h = outputs[name].cpu().numpy()
            d, r = metrics.squared_norms(h, ref.cpu().numpy())
            s = self.sums.setdefault(name, Sums())
            s.diff_sq, s.ref_sq = s.diff_sq + d, s.ref_sq + r
        tv, kl = metrics.token_tv_kl(outputs["logits"].cpu().numpy(), ref_outputs["logits"].cpu().numpy())
        self.tv += tv.tolist()
        self.kl += kl.tolist()
        self.tokens += int(tv.shape[0])
        self.sequences += 1


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


def measure_hf(model: str, dtype: str, prompts: list[dict], continuation: int = DEFAULT_CONTINUATION,
               device: str | None = None) -> tuple[list, Accumulator]:
    """HF at `dtype` against HF fp32 on the same tokens: (the layers, the accumulated sums)."""
    from mismatch_lab.engines.hf_engine import HFEngine
    from mismatch_lab.layers.hooks import find_layers

    ref = HFEngine(model, REFERENCE, device=device)
    low = HFEngine(model, check_dtype(dtype), device=ref.device)
    ref_layers, low_layers = find_layers(ref.model), find_layers(low.model)
    acc = Accumulator()
    for ids in sequences(ref, prompts, continuation):
        acc.add(forward(low, ids, low_layers), forward(ref, ids, ref_layers))
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
