"""Verifiable tasks for the RL loop: prompts with known answers and a reward function per task.

    arithmetic   seeded a+b / a×b / a−b problems, splits 'sanity' (learnable) and 'hard'; last-number parser

A task module offers `generate(split, n, *, seed) -> list[Problem]`, `reward(text, answer) -> float`
and `write_jsonl` / `read_jsonl` for the `{"id", "prompt", "answer"}` prompt files. Standard library only.
"""

from mismatch_lab.rl.tasks import arithmetic

TASKS = {"arithmetic": arithmetic}

__all__ = ["TASKS", "arithmetic"]
