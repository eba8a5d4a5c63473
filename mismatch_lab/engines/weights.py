"""Rollout-side weight rounding: the trainer keeps its weights, the rollout engine gets rounded ones.

    fp8   every 2-D weight rounded to the float8 e4m3 grid with one scale per output channel (row):
          s = max|W_row| / 448 (e4m3's largest finite value), W' = fp8(W / s) · s, stored back in W's dtype;
          1-D tensors (norms, biases) and rows of zeros pass through unchanged.
    bf16  every floating tensor rounded to the nearest bfloat16 (ties to even), stored back in its dtype:
          the weights a bf16 checkpoint holds, computed on at the engine's own dtype (e.g. fp32).
    fp16  every floating tensor rounded to the nearest float16 (ties to even; beyond its range: ±inf), stored
          back in its dtype.

`train --rollout-weights` and `collect --rollout-weights` push `round_state(...)` into the engine;
`mismatch-lab model prepare --grid bf16` writes the embedded model through the same `round_state`, and the
HF scorer variant `hf:<dtype>-w<rounding>` (e.g. `hf:fp32-wbf16`) scores on `round_state(...)` of the checkpoint.
"""

from __future__ import annotations

E4M3_MAX = 448.0


def fp8_per_channel(w):
    """W rounded to the e4m3 grid with a per-output-channel scale, in W's dtype."""
    import torch

    if w.dim() != 2 or not w.is_floating_point():
        return w
    x = w.float()
    scale = x.abs().amax(dim=1, keepdim=True) / E4M3_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return ((x / scale).to(torch.float8_e4m3fn).float() * scale).to(w.dtype)


def bf16_grid(w):
    """W rounded to the nearest bfloat16 (round to nearest, ties to even), in W's dtype."""
    import torch

    if not w.is_floating_point():
        return w
    return w.to(torch.bfloat16).to(w.dtype)


def fp16_grid(w):
    """W rounded to the nearest float16 (round to nearest, ties to even), in W's dtype."""
    import torch

    if not w.is_floating_point():
        return w
    return w.to(torch.float16).to(w.dtype)


ROUNDERS = {"fp8": fp8_per_channel, "bf16": bf16_grid, "fp16": fp16_grid}
"""The one definition of each rounding, by name (rollout weights, `model prepare --grid`, `hf:fp32-w<name>`)."""
ROUNDINGS = ("none", *ROUNDERS)
"""What `round_state` accepts; 'none' is the state unchanged."""


def round_state(state: dict, kind: str) -> dict:
    """The state dict as the rollout engine (or a `-w<kind>` scorer) should see it ('none': unchanged)."""
    if kind == "none":
        return state
    if kind not in ROUNDERS:
        raise ValueError(f"rollout weights {kind!r}: use one of {', '.join(ROUNDINGS)}")
    fn = ROUNDERS[kind]
    return {k: fn(v) for k, v in state.items()}


def weights_label(dtype: str, kind: str) -> str:
    """`runs.engine_dtype` of a rollout at compute dtype `dtype` on weights rounded as `kind`: the dtype
    itself for 'none', else '<dtype>-w<kind>' (e.g. 'bf16-wfp8'), so the rollout label ('vllm:bf16-wfp8')
    keeps such a run apart from the plain 'vllm:bf16' in every table."""
    return dtype if kind == "none" else f"{dtype}-w{kind}"
