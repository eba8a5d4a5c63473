"""Every correction method in one registry, used both to train (rl/losses.py) and to compare methods on
the same tokens (`mismatch-lab corrections`).

    defaults.py     published thresholds with their sources (no torch: the analyses read them too)
    batch.py        Batch (the rules' inputs, [B, T]), Decision (keep mask M, weight w), per-sequence reductions
    divergences.py  binary / top-K TV and KL (DPPO Eqs. 13-16), TopK
    rules.py        one pure function per objective and per rollout correction
    registry.py     Method specs: OBJECTIVES, CORRECTIONS (defaults, source, framework option)
    compare.py      every method on a store's tokens, per (rollout, scorer) pair
    command.py      `mismatch-lab corrections`

Importing this package imports nothing heavy; the modules that need torch import it themselves.
"""
