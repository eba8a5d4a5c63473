"""Paper-style figures regenerated from a stored study (matplotlib, Agg backend; no vLLM; figure 8 runs the
corrections registry on torch, CPU).

    figures.py   FIGURES: figure number -> function (tokens.py 1-5, training.py 6 and 9, batch.py 7,
                 corrections.py 8; base.py what they share), each reading an `open_store` connection and returning
                 [(file stem, matplotlib Figure)] or raising Skip when the store lacks its data
    command.py   `mismatch-lab figures studies/<name>` | `mismatch-lab figures --all`

docs/figures.md lists the figures and the claim each one checks.
"""

from mismatch_lab.figures.figures import FIGURES, Skip

__all__ = ["FIGURES", "Skip"]
