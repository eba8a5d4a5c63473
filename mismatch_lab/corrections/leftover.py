"""The 'other' bucket of the top-K divergences (DPPO Eqs. 15-16): the leftover mass 1 − Σ_{v∈S} p(v) of
each side, and the floor below which two leftovers count as equal. One definition for the torch rules
(divergences.py) and the analyses' SQL (analysis.definitions.topk_sql); no torch here.

Why a floor: each side's leftover is 1 minus a sum of |S| probabilities (S = the anchor's top-K ids plus
the sampled token), and every engine and scorer of this project produces its log-probs by a float32
log-softmax, also for bf16 / fp16 models (vLLM's sampler, HF's `log_softmax(logits.float())`,
scoring/logsoftmax.py). Each of the |S| probabilities then carries up to one float32 rounding relative
to itself, and so does each partial sum of a float32 summation; with Σ p ≤ 1 the sum is known only to
about |S| · eps_fp32 (the textbook bound for a recursive sum of n terms, (n − 1) · u plus the terms' own
n · u, u = eps / 2). A leftover below that is rounding, not mass: two sides whose leftovers both lie below
|S| · eps_fp32 are treated as equal, and their 'other' term is 0 in top-K TV and top-K KL alike. Without
it, a rollout leftover of 1e-9 against a trainer leftover clamped to 0 (Σ p a hair above 1) made top-K KL
+∞ (a · log(a / 0)) and masked tokens on which vLLM fp32 and HF fp32 agree to 1e-5: in
studies/precision-sweep every +∞ came from a leftover of 3e-10 to 1.5e-7 against 0, while the floor at
K = 20 is 2.5e-6. Where only one leftover lies below the floor the term is unchanged (a finite large KL
for a small nonzero trainer leftover, +∞ for an exact 0): that is mass one side gives and the other does
not.
"""

from __future__ import annotations

FP32_EPS = 2.0**-23
"""float32 machine epsilon (torch.finfo(torch.float32).eps): the spacing of float32 numbers at 1."""


def leftover_floor(n_slots):
    """|S| · eps_fp32: below this a leftover mass is indistinguishable from 0 (module doc). `n_slots` is
    the number of probabilities summed (a number, a tensor or array of them)."""
    return n_slots * FP32_EPS


def leftover_floor_sql(n_slots: str) -> str:
    """The same floor as SQL over the expression `n_slots`."""
    return f"(({n_slots}) * {FP32_EPS!r})"
