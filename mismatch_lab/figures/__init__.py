"""Paper-style figures regenerated from a stored study (matplotlib, Agg backend; no vLLM; figure 8 runs the
corrections registry on torch, CPU).

    figures.py   FIGURES: figure number -> function (tokens.py 1-5, training.py 6 and 9, batch.py 7,
                 corrections.py 8, support.py 10, routing.py 11; base.py what they share), each reading an `open_store` connection and returning
                 [(file stem, matplotlib Figure)] or raising Skip when the store lacks its data
    command.py   `mismatch-lab figures studies/<name>` | `mismatch-lab figures --all`

docs/figures.md lists the figures and the claim each one checks.
"""

from __future__ import annotations


def __getattr__(name: str):
    """`from mismatch_lab.figures import FIGURES, Skip` without importing matplotlib at package import (the
    `figures` command's parser imports this package)."""
    if name in ("FIGURES", "Skip"):
        from mismatch_lab.figures import figures

        return getattr(figures, name)
    raise AttributeError(f"module 'mismatch_lab.figures' has no attribute {name!r}")


__all__ = ["FIGURES", "Skip"]
