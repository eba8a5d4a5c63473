"""mismatch_lab: measure the training-inference mismatch of LLM reinforcement learning.

The rollout engine (vLLM) and the trainer (HF transformers) hold identical weights and still disagree
on token probabilities. This package collects both sides token by token into DuckDB, analyses the
disagreement, and runs a reference DPPO training loop. See README.md for the file tree.
"""

__version__ = "0.1.0"

DTYPES = ("bf16", "fp16", "fp32")
