"""Rollout-side weight rounding: the trainer keeps its weights, the rollout engine gets rounded ones.

    fp8   every 2-D weight rounded to the float8 e4m3 grid with one scale per output channel (row):
          s = max|W_row| / 448 (e4m3's largest finite value), W' = fp8(W / s) · s, stored back in W's dtype;
          1-D tensors (norms, biases) and rows of zeros pass through unchanged.
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


def round_state(state: dict, kind: str) -> dict:
    """The state dict as the rollout engine should see it ('none': unchanged)."""
    if kind == "none":
        return state
    if kind != "fp8":
        raise ValueError(f"rollout weights {kind!r}: use none or fp8")
    return {k: fp8_per_channel(v) for k, v in state.items()}
